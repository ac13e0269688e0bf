"""benchmarks/bench_moe.py runs end to end at tiny shapes on 2 fake CPU devices (--smoke --ep 2)."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_bench_moe_smoke_runs_every_section_and_ends_with_json(tmp_path):
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2"}
    output = tmp_path / "section.md"
    command = [sys.executable, "-m", "benchmarks.bench_moe", "--smoke", "--ep", "2",
               "--repeats", "1", "--output", str(output)]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(error < 1e-5 for error in report["check"].values()), report["check"]
    assert {f"EP2 {name} vs dense" for name in ("ragged", "padded", "capacity")} <= set(
        report["check"]
    )
    variants = {row["variant"] for row in report["rows"]}
    for name in ("dense matmul", "ragged_dot", "capacity einsum"):
        assert {f"{name} fwd", f"{name} fwd+bwd"} <= variants
    assert {"layer dropless fwd+bwd", "EP2 ragged fwd+bwd", "EP2 padded ×1.25 fwd+bwd"} <= variants
    assert "EP2 capacity fwd+bwd" in variants
    assert all(row.get("max_err", 0) < 2e-2 for row in report["rows"]), report["rows"]
    assert output.read_text().startswith("## MoE grouped matmul")

"""m3-plan: per-device bytes from the compiled step on fake devices, and the HLO collective count.

The suite runs on 4 fake devices (conftest.py); the command-line case plans on 8 in a subprocess.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import yaml
from conftest import REPO
from jax.sharding import PartitionSpec
from tiny import TINY, tiny_run

from m3jax import sharding
from pretrain import hlo_collectives, plan


def test_collective_bytes_count_each_trip_of_a_loop():
    """An all-gather of [2, 8] f32 shards into [8, 8] (256 bytes) inside a 5-step scan."""
    mesh = sharding.make_mesh({"fsdp": 4})

    def gathered_sum(x):
        def body(carry, _):
            whole = jax.lax.all_gather(x * carry, "fsdp", tiled=True)  # depends on the carry
            return carry + whole.sum(), None

        return jax.lax.scan(body, jnp.ones(()), None, length=5)[0]

    step = jax.jit(
        jax.shard_map(
            gathered_sum,
            mesh=mesh,
            in_specs=PartitionSpec("fsdp"),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
    )
    hlo = step.lower(jnp.ones((8, 8))).compile().as_text()
    assert hlo_collectives.collective_bytes(hlo)["all-gather"] == 5 * 8 * 8 * 4


@pytest.mark.slow
def test_plan_bytes_per_device_shrink_as_fsdp_grows():
    """4 devices: pure data parallel, then fsdp=4. Params and optimizer state are split 4 ways
    (the Adam moments sharded like their parameters), and the step as a whole holds less."""
    replicated = plan.plan(tiny_run(mesh={"data": 4}))
    sharded = plan.plan(tiny_run(mesh={"data": 1, "fsdp": 4}))
    assert sharded.params < replicated.params / 2
    assert sharded.opt_state < replicated.opt_state / 2
    assert sharded.total < replicated.total
    for result in (replicated, sharded):  # two moments like the params, plus a few scalars
        assert 2 * result.params <= result.opt_state <= 2 * result.params + 64
    assert sharded.collectives.get("all-gather", 0) > 0  # fsdp gathers weights
    assert sharded.notes and "capacity" in sharded.notes[0]  # the dropless stand-in is named


@pytest.mark.slow
def test_m3_plan_command_plans_8_fake_devices_growing_by_layers(tmp_path):
    config = tmp_path / "tiny.yaml"
    layers = {"num_layers": 5, "layer_types": ["full", "msa*4"],
              "mlp_layer_types": ["dense", "moe*4"]}  # fmt: skip
    config.write_text(yaml.safe_dump({**TINY, "model": {**TINY["model"], **layers}}))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.plan", "--config", str(config), "--devices", "8",
         "--mesh", "fsdp=4,expert=2", "--layers", "3", "--seq-len", "16"],
        env={**os.environ, "XLA_FLAGS": flags}, cwd=REPO, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grown linearly to all layers" in result.stdout
    planned = json.loads(result.stdout.strip().splitlines()[-1])
    assert planned["mesh"]["fsdp"] == 4 and planned["mesh"]["expert"] == 2
    assert planned["compiled_layers"] == [3, 4] and planned["seq_len"] == 16
    assert planned["batch_size"] == 8  # one row per data-parallel device
    assert planned["params"] > 0 and planned["temporaries"] > 0
    assert planned["collectives"]["all-to-all"] > 0  # the expert-parallel exchange

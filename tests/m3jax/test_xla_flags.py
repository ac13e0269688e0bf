"""Importing m3jax sets no XLA flags; the entry points add them, keeping the user's."""

import os
import subprocess
import sys

from conftest import REPO

from m3jax import xla_flags

DECOMPOSER = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"
SLICE_FUSION = "--xla_gpu_enable_dynamic_slice_fusion"
DEFAULTS = f"{DECOMPOSER}=true {SLICE_FUSION}=false"


def test_import_sets_no_flags_and_m3_train_adds_them():
    script = f"""
import os
import m3jax, m3jax.model, pretrain.train
assert "XLA_FLAGS" not in os.environ, os.environ["XLA_FLAGS"]
assert pretrain.train.main(["--config", "no/such.yaml"]) == 2
assert "{DEFAULTS}" in os.environ["XLA_FLAGS"], os.environ["XLA_FLAGS"]
assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
"""
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}  # no XLA_FLAGS
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_with_defaults_keeps_a_flag_the_user_set():
    assert xla_flags.with_defaults("") == DEFAULTS
    kept = f"{DECOMPOSER}=false {SLICE_FUSION}=true"
    assert xla_flags.with_defaults(kept) == kept
    assert xla_flags.with_defaults("--xla_dump_to=/tmp/x") == f"--xla_dump_to=/tmp/x {DEFAULTS}"


def test_apply_keeps_a_memory_fraction_the_user_set(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    xla_flags.apply()
    assert xla_flags.ENVIRONMENT["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"

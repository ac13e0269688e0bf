"""Test-wide settings: CPU only, 4 fake CPU devices so sharding tests can build real meshes, and a
persistent compilation cache shared by the whole run (training tests compile the same step many
times, in-process and in subprocesses).

These must be set before JAX is imported, hence here. Single-device code simply uses device 0.
A device count already in XLA_FLAGS wins: tests/m3jax/test_expert_parallel.py reruns its 8-device
cases in a subprocess with 8.
"""

import os
import pathlib
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="m3jax-test-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

REPO = pathlib.Path(__file__).resolve().parents[1]

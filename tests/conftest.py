"""Test-wide settings: CPU only, and 4 fake CPU devices so sharding tests can build real meshes.

XLA_FLAGS must be set before JAX is imported, hence here. Single-device code simply uses device 0.
A device count already in XLA_FLAGS wins: tests/m3jax/test_expert_parallel.py reruns its 8-device
cases in a subprocess with 8.
"""

import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

REPO = pathlib.Path(__file__).resolve().parents[1]

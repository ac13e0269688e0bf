"""Test-wide settings: CPU only, and 4 fake CPU devices so sharding tests can build real meshes.

XLA_FLAGS must be set before JAX is imported, hence here. Single-device code simply uses device 0.
"""

import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

REPO = pathlib.Path(__file__).resolve().parents[1]

"""XLA:GPU ahead of time, on a machine without a GPU: H200s for `m3-plan --target h200`.

JAX compiles for devices it does not have from a topology description
(`jax.experimental.topologies`), which jax's CUDA plugin builds from an XLA target config: the
device's properties, in the text format of XLA's `xla/tools/hlo_opt/gpu_specs` (values below:
compute capability 9.0 and 132 SMs as the H100 SXM, the H200's 143,771 MiB at 4.8 TB/s). The
plugin loads without a CUDA driver or runtime; `make plan-gpu` installs it (jax-cuda13-plugin and
-pjrt at the jax pin: CUDA 13 as on the GPU machine) into `.cache/plan-gpu`, beside the venv
rather than in it: installed in the venv, every jax process would try to start CUDA.

Compiled this way, the train step is the one a GPU run compiles (the Mosaic GPU and Triton
kernels, cuDNN attention, XLA:GPU's fusion and buffer assignment) except for what XLA tunes on
a device (GEMM autotuning, CUB's sort scratch sizes: defaults are taken). Its memory analysis
matched the measured peak of bench-h200 on an H200 (benchmarks/RESULTS.md, 2026-12-05).
"""

import contextlib
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence
from unittest import mock

import jax
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
from jax._src.pallas.triton import gpu_info as triton_gpu_info
from jax.experimental import topologies

from pallas_kernels import target

PLUGIN_DIR = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "plan-gpu"

H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""
CUDNN_VERSION = 91000  # what jax's cuDNN attention checks its features against (9.10)


def start_without_gpu() -> None:
    """Makes jax's CUDA plugin discoverable and keeps this process on the CPU backend. Call it
    before any jax backend starts (jax discovers plugins once, when the first one does)."""
    if not (PLUGIN_DIR / "jax_plugins").is_dir():
        raise RuntimeError(
            f"--target h200 needs jax's CUDA plugin in {PLUGIN_DIR}: run `make plan-gpu` "
            "(two wheels, ≈ 140 MB; no GPU, driver or CUDA runtime needed)"
        )
    sys.path.insert(0, str(PLUGIN_DIR))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # "no CUDA driver found", once a library
    # XLA links each Mosaic GPU kernel's host code against this library while compiling; jax
    # names it when its Mosaic GPU module is first imported, which happened before the plugin
    # was on the path
    for runtime in PLUGIN_DIR.glob("jax_cuda*_plugin/libmosaic_gpu_runtime.so"):
        os.environ.setdefault("MOSAIC_GPU_RUNTIME_LIB_PATH", str(runtime))
    jax.config.update("jax_platforms", "cpu")  # the plugin registers; no CUDA client starts


def h200_devices(count: int) -> list:
    """`count` H200s of one host (process 0), to compile for."""
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=H200, topology=f"1x1x{count}"
        )
    except Exception as error:  # jaxlib raises a bare RuntimeError/XlaRuntimeError here
        raise RuntimeError(
            f"no CUDA topology ({error}); was `start_without_gpu()` called before jax's first "
            "backend started?"
        ) from None
    return list(topology.devices)


@contextlib.contextmanager
def compiling_for(devices: Sequence) -> Iterator[None]:
    """Kernels and dispatch chosen for `devices` (pallas_kernels/target.py), and what jax asks a
    local GPU while lowering answered from them instead: the compute capability (cuDNN's
    attention features, Triton's target) and cuDNN's version."""
    capability = _version(devices[0].compute_capability)
    hopper = triton_gpu_info.get_gpu_info_from_version(triton_gpu_info.GpuVersion.H200)
    if capability != _version(hopper.arch_name):
        raise ValueError(f"compute capability {capability}: only H200s (9.0) are described")
    with (
        target.ahead_of_time(devices),
        mock.patch.object(cudnn_attention, "check_cudnn_version", lambda: CUDNN_VERSION),
        mock.patch.object(
            cudnn_attention, "check_compute_capability", lambda c: _version(c) <= capability
        ),
        mock.patch.object(triton_gpu_info, "get_gpu_info", lambda: hopper),
    ):
        yield


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))

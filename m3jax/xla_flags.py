"""XLA flags m3jax's GPU runs rely on, added to XLA_FLAGS by the entry points that run them
(`apply()` first thing in m3-train's and the training benchmarks' `main`, before any backend
starts); importing m3jax sets nothing.

- `--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true`: XLA:GPU's native
  ragged-all-to-all moved our dropless expert-parallel exchange at a small fraction of NVLink
  bandwidth (EP=2 at 0.09 of one H200's throughput; slow ragged-all-to-all on one host is
  reported upstream as openxla/xla#33386); the decomposer rewrites it into a dense all-to-all and
  slices (0.61–0.65 with the same benchmark, benchmarks/RESULTS.md). Other backends ignore it.
- `--xla_gpu_enable_dynamic_slice_fusion=false`: XLA:GPU wraps some Mosaic GPU kernels of the MSA
  layers (those reading a dynamic slice of the layer scan's stacks) in dynamic-slice fusions,
  which serialised one that otherwise ran asynchronously beside the compute: the step without
  conditionals was 1.1 % slower with them (H100, bench-h200 cut to 6 layers, real text: 677.7
  against 670.3 ms in one run; the tree before that step, 668.9 ms; benchmarks/RESULTS.md,
  2026-12-06). Slices are then copied out instead (≈ 2 GB more temporaries in the plan).

Environment beside XLA_FLAGS, same rule (a value the user set is kept):
- `XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`: jax's GPU client preallocates 75 % of device memory by
  default, and XLA's rematerialisation plans within that. On an H200 that is 106 of 141 GB: the
  small-gpu step at 128K tokens (123.4 GiB planned) failed to allocate under the default
  (benchmarks/RESULTS.md). 0.95 leaves ≈ 7 GB outside the pool for the CUDA context, cuDNN's
  handles and NCCL's buffers.

A flag the user already set in XLA_FLAGS (either value) is left as it is. XLA reads the variable
once, when the first backend starts: `apply()` after running a computation has no effect.
"""

import os

FLAGS = {
    "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": "true",
    "--xla_gpu_enable_dynamic_slice_fusion": "false",
}
ENVIRONMENT = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}


def with_defaults(xla_flags: str) -> str:
    """`xla_flags` plus each of FLAGS it does not set already."""
    missing = [f"{name}={value}" for name, value in FLAGS.items() if name not in xla_flags]
    return " ".join([xla_flags, *missing]).strip()


def apply() -> None:
    os.environ["XLA_FLAGS"] = with_defaults(os.environ.get("XLA_FLAGS", ""))
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)

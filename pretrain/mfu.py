"""Model FLOPs utilisation: MFU = model FLOPs / (window time × peak FLOP/s per device × devices).

Model FLOPs of a step = 3 × the forward FLOPs of its batch (m3jax/cost_model.py:
packed_forward_flops), the MaxText/Megatron/PaLM convention: the backward pass costs two forward
passes (gradients of activations and of weights), attention included. Counted from the batch on
the host: matmuls (2 per active parameter; routed experts k of E), attention causal within each
document piece of the packed rows (dense layers, MSA's kept keys and indexer, or dense during the
MSA warm-up), the ViT within each image/video chunk and the MTP modules. Not counted, as in that
convention: rematerialisation (model.remat), MSA's teacher/KL terms beyond the attention itself,
the block-recall measurement (logging.msa_recall_every), the optimizer.
With several processes each counts its own rows: the per-token figure is that of this process's
rows, applied to the global token count (exact on one process).

Peak: train.peak_tflops, else the device kind's bf16 dense Tensor Core / MXU peak from PEAKS (a
float32 run's own peak is lower: set train.peak_tflops). CPU, or a kind not in PEAKS: no MFU,
with a note saying so; tokens/s and model TFLOP/s are reported everywhere.
"""

import dataclasses
import re

import numpy as np

from batch_format.batch import Batch
from m3jax import cost_model
from m3jax.attention import ForwardMode
from m3jax.model import Functional

TRAINING_PER_FORWARD = 3  # forward + backward (activation and weight gradients), no recompute

# (device_kind pattern, bf16 dense TFLOP/s per device, public source); first match wins.
PEAKS = (
    ("H100 PCIe", 756, "NVIDIA H100 PCIe datasheet: BF16 1,513 TFLOPS with sparsity"),
    ("H100 NVL", 835, "NVIDIA H100 datasheet: H100 NVL BF16 1,671 TFLOPS with sparsity"),
    ("H100|H200", 989, "NVIDIA H100/H200 datasheets: SXM BF16 1,979 TFLOPS with sparsity"),
    ("A100", 312, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    (r"\bB200", 2250, "NVIDIA HGX B200 datasheet: BF16 36 PFLOPS per 8 GPUs with sparsity"),
    ("^TPU v5( lite|e)$", 197, "Google Cloud TPU v5e documentation: 197 TFLOPs bf16 per chip"),
    ("^TPU v5p?$", 459, "Google Cloud TPU v5p documentation: 459 TFLOPs bf16 per chip"),
    ("^TPU v6( lite|e)$", 918, "Google Cloud TPU v6e documentation: 918 TFLOPs bf16 per chip"),
)


@dataclasses.dataclass(frozen=True)
class Peak:
    tflops: float | None  # per device; None: MFU is not reported
    devices: int
    note: str  # where the figure comes from, or why there is none

    def describe(self) -> str:
        if self.tflops is None:
            return f"MFU {self.note}"
        return f"MFU against {self.tflops:g} TFLOP/s per device × {self.devices} ({self.note})"


def lookup_peak(device_kind: str) -> tuple[float, str] | None:
    """(bf16 dense TFLOP/s, source) of a jax `device_kind` ("NVIDIA H200", "TPU v5 lite")."""
    for pattern, tflops, source in PEAKS:
        if re.search(pattern, device_kind):
            return float(tflops), source
    return None


def device_peak(configured: float | None, devices: list) -> Peak:
    """The peak to divide by: `configured` (train.peak_tflops) or the table's for devices[0]."""
    device, count = devices[0], len(devices)
    if configured is not None:
        return Peak(configured, count, "train.peak_tflops")
    if device.platform == "cpu":
        return Peak(None, count, "n/a on CPU (set train.peak_tflops to divide by a figure)")
    found = lookup_peak(device.device_kind)
    if found is None:
        return Peak(
            None, count, f"not reported: no peak known for {device.device_kind!r} (set "
            "train.peak_tflops)",
        )  # fmt: skip
    return Peak(found[0], count, f"{device.device_kind}; {found[1]}")


class ModelFlops:
    """Training FLOPs per real token of host batches."""

    def __init__(self, model: Functional):
        self.config, self.weights = model.config, cost_model.active_weights(model)

    def per_token(self, batch: Batch, mode: ForwardMode) -> float:
        """batch: this process's rows (host arrays)."""
        patch_segment_ids = None if batch.vision is None else batch.vision.patch_segment_ids
        forward = cost_model.packed_forward_flops(
            self.config, self.weights, batch.segment_ids, patch_segment_ids,
            msa_dense=mode.msa_dense,
        )  # fmt: skip
        return TRAINING_PER_FORWARD * forward / max(np.count_nonzero(batch.segment_ids), 1)


def window_throughput(steps: list[dict], seconds: float, peak: Peak) -> dict:
    """Throughput of timed steps (metrics with "tokens" and "model_flops_per_token") that took
    `seconds`: tokens_per_s, model_flops_per_token (their mean per token), model_tflops_per_s
    (all devices), and with a peak mfu and peak_tflops. {} without steps."""
    if not steps:
        return {}
    seconds = max(seconds, 1e-9)
    tokens = sum(int(m["tokens"]) for m in steps)
    flops = sum(float(m["model_flops_per_token"]) * int(m["tokens"]) for m in steps)
    logged = {
        "tokens_per_s": tokens / seconds,
        "model_flops_per_token": flops / max(tokens, 1),
        "model_tflops_per_s": flops / seconds / 1e12,
    }
    if peak.tflops is not None:
        logged["mfu"] = flops / seconds / (peak.tflops * 1e12 * peak.devices)
        logged["peak_tflops"] = peak.tflops
    return logged

"""MFU: the peak table by device kind, the window arithmetic, and what a CPU m3-train run logs."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from tiny import tiny_run

from batch_format.batch import Batch, make_batch
from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.metrics import read_metrics
from pretrain.mfu import ModelFlops, device_peak, lookup_peak, window_throughput
from pretrain.train import train


def gpu(kind: str, platform: str = "gpu") -> SimpleNamespace:
    return SimpleNamespace(platform=platform, device_kind=kind)


@pytest.mark.parametrize(
    "kind, tflops",
    [
        ("NVIDIA H200", 989),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA B200", 2250),
        ("TPU v5 lite", 197),
        ("TPU v5e", 197),
        ("TPU v5", 459),
        ("TPU v5p", 459),
        ("TPU v6 lite", 918),
        ("NVIDIA GB200", None),  # not a B200: no guess
        ("NVIDIA L4", None),
        ("TPU v4", None),
    ],
)
def test_peak_lookup_by_device_kind(kind, tflops):
    found = lookup_peak(kind)
    assert (found and found[0]) == tflops
    peak = device_peak(None, [gpu(kind, "tpu" if kind.startswith("TPU") else "gpu")] * 8)
    assert peak.tflops == tflops and peak.devices == 8
    if tflops is None:
        assert peak.note.startswith("not reported") and "train.peak_tflops" in peak.note


def test_peak_is_n_a_on_cpu_unless_configured_and_the_configured_value_wins():
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
    assert device_peak(None, [cpu]).tflops is None
    assert device_peak(None, [cpu]).describe().startswith("MFU n/a on CPU")
    assert device_peak(2.5, [cpu, cpu]).tflops == 2.5
    assert device_peak(400.0, [gpu("NVIDIA H200")]).tflops == 400.0


def test_window_mfu_is_flops_per_token_times_tokens_per_s_over_the_peak():
    steps = [
        {"tokens": 100, "model_flops_per_token": 6e9},
        {"tokens": 300, "model_flops_per_token": 8e9},
    ]
    peak = device_peak(989.0, [gpu("NVIDIA H200")] * 2)
    logged = window_throughput(steps, 0.5, peak)
    assert logged["tokens_per_s"] == 800
    assert logged["model_flops_per_token"] == (100 * 6e9 + 300 * 8e9) / 400  # token-weighted
    np.testing.assert_allclose(logged["model_tflops_per_s"], 7.5e9 * 800 / 1e12)
    np.testing.assert_allclose(logged["mfu"], 7.5e9 * 800 / (989e12 * 2))
    assert logged["peak_tflops"] == 989
    unknown = window_throughput(steps, 0.5, device_peak(None, [gpu("NVIDIA L4")]))
    assert "mfu" not in unknown and "peak_tflops" not in unknown
    assert window_throughput([], 1.0, peak) == {}  # the compilation step alone: not timed


def text_rows(segment_ids: np.ndarray) -> Batch:
    """A text batch of these document pieces (the FLOP count reads nothing else)."""
    zeros = np.zeros_like(segment_ids)
    return make_batch(tokens=zeros, targets=zeros, positions=zeros, segment_ids=segment_ids,
                      loss_mask=zeros.astype(np.float32))  # fmt: skip


def test_model_flops_count_dense_attention_during_the_msa_warm_up():
    counter = ModelFlops(functional(tiny_run().model))  # seq 32 > top 2 blocks of 4
    batch = text_rows(np.ones((2, 32), np.int32))
    warm_up = counter.per_token(batch, ForwardMode(msa_dense=True, indexer_loss=True))
    sparse = counter.per_token(batch, ForwardMode(indexer_loss=True))
    assert warm_up > sparse > 0
    padded = text_rows(np.pad(np.ones((2, 16), np.int32), ((0, 0), (0, 16))))
    short = counter.per_token(padded, ForwardMode(indexer_loss=True))
    assert short < sparse  # per real token: padding does not count, 16-token pieces attend less


@pytest.mark.slow
def test_train_logs_mfu_only_with_a_peak_and_consistently(tmp_path, capsys):
    run_dir = tmp_path / "run"
    sections = {"logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False}}
    train(tiny_run(train={"steps": 2}, **sections), run_dir)  # CPU: no peak known
    out = capsys.readouterr().out
    assert "MFU n/a on CPU" in out and "| mfu n/a" in out
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[1]["model_flops_per_token"] > 0 and "mfu" not in records[1]
    # resumed with a peak: this session's first step compiles (untimed), its second is timed
    summary = train(tiny_run(train={"steps": 4, "peak_tflops": 1.0}, **sections), run_dir)
    out = capsys.readouterr().out
    devices = jax.device_count()  # 4 fake CPU devices (tests/conftest.py)
    assert f"MFU against 1 TFLOP/s per device × {devices} (train.peak_tflops)" in out
    records = read_metrics(run_dir / "metrics.jsonl")
    assert "mfu" not in records[2] and "tokens_per_s" not in records[2]
    timed = records[3]
    assert 0 < timed["mfu"] <= 1 and timed["peak_tflops"] == 1.0
    achieved = timed["model_flops_per_token"] * timed["tokens_per_s"] / 1e12  # TFLOP/s
    np.testing.assert_allclose(timed["model_tflops_per_s"], achieved, rtol=1e-9)
    np.testing.assert_allclose(timed["mfu"], achieved / (1.0 * devices), rtol=1e-9)
    assert summary["mfu"] == timed["mfu"]  # the mean over this session's one timed window
    assert f"{timed['mfu']:.2%} (mean over this session's timed windows" in out

"""Training-step throughput of a config and its variants, on one device or a mesh of several.

    python -m benchmarks.bench_train --config configs/small-gpu.yaml \
        --variants "" "model.attention_impl=xla" "model.layer_types=[full*12]"

Each variant is the config with `section.key=value` overrides (space-separated inside one
argument); a `kernels.<field>=value` token adds a setting of the MSA kernels' `pallas.Config` to
the variant's `model.msa_kernels` (e.g. `kernels.backward_kernel=triton`). A variant's step
is m3-train's (`pretrain.session.TrainingSession`: the state sharded over the `mesh.*` of the
config, over every device the process sees), on synthetic packed rows (random tokens; documents
of random lengths, so rows hold several) or, with `--rows corpus`, the first batch of the
config's own data (m3-train's loader: real documents, their lengths, the routing real text gets),
in the MSA sparse phase with the indexer loss, as
`m3-train` runs after the warm-up. Reports the median step time over `--steps` steps after two
warm-up steps, tokens/s (all devices, and per device), MFU per device (model FLOPs as m3-train
counts them, pretrain/mfu.py, against 989 TFLOP/s and against the bf16 matmul rate measured in
the same run), the devices' largest peak memory and the ratio of per-device tokens/s to the first
variant's in the same run; `--profile DIR` adds the first variant's device time by kernel (the
top 60, each XLA fusion with the JAX op names fused into it, from XLA's dump under DIR/hlo) and
its communication (NCCL kernels) per step (benchmarks/trace_summary.py). The last stdout line is
JSON.

Scaling: a `devices=N` token runs that variant in a process that sees N devices (the first N
GPUs, or N host devices on a CPU), e.g. at fixed rows per GPU on a machine of two:

    python -m benchmarks.bench_train --config configs/bench-h200.yaml \
        --variants "devices=1" "devices=2 mesh.data=2 data.batch_size=2" \
        "devices=2 mesh.expert=2 data.batch_size=2"

An `xla_…=value` token runs its variant in a process of its own that starts XLA with that flag
(`--xla_…=value` in XLA_FLAGS, which XLA reads once), so that one command compares XLA flags:

    python -m benchmarks.bench_train --config configs/bench-h200.yaml \
        --variants "" "xla_gpu_enable_dynamic_slice_fusion=false"

The device's peak-memory counter only grows within a process, so in one process a variant's peak
is the largest so far. `--isolate` runs each variant in a process of its own (this module, one
variant, one after the other on the same device): peaks of their own, and a variant that runs
out of memory leaves nothing behind for the next; each child measures the matmul rate again.
"""

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from batch_format.batch import Batch, make_batch
from benchmarks import trace_summary
from m3jax import xla_flags
from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.checkpointing import Checkpoints
from pretrain.config import RunConfig, load_run_config
from pretrain.data_loading import make_loader
from pretrain.session import TrainingSession

TRAIN = ForwardMode(indexer_loss=True)


def synthetic_batch(
    batch: int, seq: int, vocab: int, seed: int = 0, mean_document: int = 1500
) -> Batch:
    """Packed rows: documents of exponential lengths (mean `mean_document`), positions from 0;
    one document a row when `mean_document` >= `seq`."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        start, document = 0, 1
        while start < seq:
            length = seq if mean_document >= seq else int(rng.exponential(mean_document))
            length = max(1, min(seq - start, length))
            segments[row, start : start + length] = document
            positions[row, start : start + length] = np.arange(length)
            start, document = start + length, document + 1
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return make_batch(
        tokens=jnp.asarray(tokens[:, :-1]),
        targets=jnp.asarray(tokens[:, 1:]),
        positions=jnp.asarray(positions),
        segment_ids=jnp.asarray(segments),
        loss_mask=jnp.ones((batch, seq), jnp.float32),
    )


def host_rows(run: RunConfig, rows: str, document_tokens: int) -> Batch:
    """The batch a variant steps on: `synthetic_batch` ("synthetic"), or the first batch of the
    run's own data through m3-train's loader ("corpus")."""
    if rows == "synthetic":
        return synthetic_batch(run.data.batch_size, run.data.seq_len, run.model.vocab_size,
                               mean_document=document_tokens)  # fmt: skip
    if rows != "corpus":
        raise ValueError(f"rows={rows!r}: 'synthetic' or 'corpus'")
    loader = make_loader(run)
    try:
        return next(loader)
    finally:
        loader.close()


KERNELS = "kernels."
DEVICES = "devices="  # a variant's device count: its own process sees that many (`child_env`)
XLA_FLAG = "xla_"  # a variant's XLA flag, e.g. xla_gpu_enable_dynamic_slice_fusion=false: its
# own process starts XLA with --xla_gpu_enable_dynamic_slice_fusion=false (`child_env`)


def with_kernel_pins(run: RunConfig, pins: list[str]) -> RunConfig:
    """`run` with the `kernels.<field>=value` tokens added to its model's `msa_kernels` (after
    the config's own settings: a pin wins)."""
    settings = tuple(pin.removeprefix(KERNELS) for pin in pins)
    if not settings:
        return run
    model = dataclasses.replace(run.model, msa_kernels=run.model.msa_kernels + settings)
    return dataclasses.replace(run, model=model)


def time_variant(
    config_path: str,
    overrides: list[str],
    steps: int,
    trace_dir: str | None = None,
    document_tokens: int = 1500,
    rows: str = "synthetic",
) -> dict:
    kernels = [o for o in overrides if o.startswith(KERNELS)]
    overrides = [o for o in overrides if not o.startswith((KERNELS, DEVICES, XLA_FLAG))]
    run = with_kernel_pins(load_run_config(config_path, overrides), kernels)
    with tempfile.TemporaryDirectory() as scratch:  # the session's checkpoints: none are saved
        checkpoints = Checkpoints(pathlib.Path(scratch), run.checkpoint)
        session = TrainingSession(functional(run.model), run, checkpoints)
        session.initialize()
        host_batch = jax.tree.map(np.asarray, host_rows(run, rows, document_tokens))
        batch = session.put_batch(host_batch)
        mode = session.mode_for(host_batch, TRAIN)  # as m3-train's steps take it
        times, losses = [], []
        for i in range(steps + 2):
            start = time.perf_counter()
            metrics = session.step_on_devices(batch, mode)
            losses.append(float(jax.block_until_ready(metrics["loss"])))
            if i >= 2:
                times.append(time.perf_counter() - start)
        communication = None
        if trace_dir:  # where the device time of two more steps goes, kernel by kernel
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(2):
                    jax.block_until_ready(session.step_on_devices(batch, mode)["loss"])
            summary = trace_summary.summarize(trace_dir)
            sources = trace_summary.hlo_sources(hlo_dump(trace_dir))
            print(trace_summary.report(summary, steps=2, top=60, sources=sources), flush=True)
            communication = [p["communication_busy"] / 2e3 for p in summary.values()]
        flops_per_token = session.model_flops.per_token(host_batch, TRAIN)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()]
    seconds = float(np.median(times))
    tokens = run.data.batch_size * run.data.seq_len
    row = {"step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "tokens": tokens,
           "devices": jax.device_count(), "mesh": dict(session.mesh.shape),
           "model_tflops_per_s": flops_per_token * tokens / seconds / 1e12,
           "rows": rows, "first_loss": losses[0], "last_loss": losses[-1],
           "finite": bool(np.isfinite(losses).all()), "peak_gb": max(peaks) / 1e9}  # fmt: skip
    if communication:  # NCCL kernels' busy time a step, on the busiest device
        row["communication_ms"] = max(communication)
    return row


PEAK_TFLOPS = 989.0  # H100 SXM / H200 bf16 dense (pretrain/mfu.py PEAKS)


def matmul_tflops(size: int, repeats: int = 20) -> float:
    """The device's bf16 matmul rate measured here: the MFU denominator the hardware reaches."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    matmul = jax.jit(lambda a: a @ a)
    jax.block_until_ready(matmul(a))
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a)
    jax.block_until_ready(out)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def hlo_dump(profile: str) -> str:
    """Where a profiled run has XLA dump its optimised programs (`trace_summary.hlo_sources`)."""
    return os.path.join(profile, "hlo")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--variants", nargs="+", default=[""])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", metavar="DIR",
                        help="also trace two steps of the first variant and print its kernels")  # fmt: skip
    parser.add_argument("--document-tokens", type=int, default=1500,
                        help="mean document length of the synthetic rows (>= seq_len: one "
                             "document a row, as a long-context run has)")
    parser.add_argument("--rows", choices=("synthetic", "corpus"), default="synthetic",
                        help="synthetic packed rows, or the first batch of the config's own data")
    parser.add_argument("--stop-at-error", action="store_true",
                        help="skip the variants after the first that fails (e.g. longer "
                             "sequences after the first that does not fit)")
    parser.add_argument("--isolate", action="store_true",
                        help="each variant in a process of its own (its own peak memory)")
    # set by isolated_variant: time the variant here, whatever its tokens or --isolate
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile:  # the fusions' op names for the kernel list (before any backend starts)
        dump = f"--xla_dump_to={hlo_dump(args.profile)} --xla_dump_hlo_as_text"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump}".strip()
    xla_flags.apply()  # before the first backend starts
    rows = []
    for index, variant in enumerate(args.variants):
        own_process = variant_devices(variant) or variant_xla_flags(variant)
        isolate = (args.isolate or own_process) and not args.child
        measure = isolated_variant if isolate else variant_row
        row = measure(args, variant, profile=args.profile if index == 0 else None)
        if rows and "tokens_per_s" in row and "tokens_per_s" in rows[0]:
            row["vs_first"] = per_device(row) / per_device(rows[0])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "error" in row and args.stop_at_error:
            break
    print(f"\n{rows[0].get('device', '?')}, jax {jax.__version__}, {args.config}, "
          f"{args.rows} rows")
    print("| variant | devices | step ms | tokens/s | per device | MFU (989) | of matmul rate | "
          "peak GB | communication | vs first (per device) | loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['variant']} | | failed: {row['error'][:80]} | | | | | | | | |")
            continue
        communication = row.get("communication_ms")
        share = "" if communication is None else f"{communication / row['step_ms']:.1%}"
        print(
            f"| {row['variant']} | {row.get('devices', 1)} | {row['step_ms']:.1f} | "
            f"{row['tokens_per_s']:,.0f} | {per_device(row):,.0f} | {row['mfu_989']:.1%} | "
            f"{row['of_matmul_rate']:.1%} | {row['peak_gb']:.1f} | {share} | "
            f"{row.get('vs_first', 1.0):.2f}× | {row['first_loss']:.3f} → {row['last_loss']:.3f} |"
        )
    print(json.dumps(rows))


def variant_devices(variant: str) -> int | None:
    """The device count a variant's `devices=N` token asks for (None: the process's own)."""
    counts = [int(t.removeprefix(DEVICES)) for t in variant.split() if t.startswith(DEVICES)]
    return counts[-1] if counts else None


def variant_xla_flags(variant: str) -> list[str]:
    """The XLA flags a variant's `xla_…=value` tokens ask for, as XLA_FLAGS spells them."""
    return [f"--{t}" for t in variant.split() if t.startswith(XLA_FLAG)]


def per_device(row: dict) -> float:
    return row["tokens_per_s"] / row.get("devices", 1)


def child_env(variant: str) -> dict:
    """The environment of a variant's own process: with `devices=N` it sees the first N GPUs (or
    N host devices where there are none, CPU tests); its XLA flags join XLA_FLAGS, each in place
    of the same flag's value there; this one's otherwise."""
    env, flags = dict(os.environ), variant_xla_flags(variant)
    if count := variant_devices(variant):
        flags.append(f"--xla_force_host_platform_device_count={count}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(count))
    if flags:
        names = {flag.split("=")[0] for flag in flags}
        kept = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
        env["XLA_FLAGS"] = " ".join(kept + flags)
    return env


@functools.cache
def measured_matmul_rate() -> float:
    """This process's bf16 matmul rate (measured once, printed)."""
    rate = matmul_tflops(8192 if jax.default_backend() == "gpu" else 512)
    print(json.dumps({"bf16 matmul TFLOP/s (measured)": rate}), flush=True)
    return rate


def variant_row(args: argparse.Namespace, variant: str, profile: str | None) -> dict:
    """One variant timed in this process: its row, or its error (e.g. out of memory)."""
    name, matmul = variant or "as configured", measured_matmul_rate()
    try:
        row = {"variant": name, **time_variant(args.config, variant.split(), args.steps, profile,
                                               args.document_tokens, args.rows)}  # fmt: skip
    except Exception as e:  # e.g. out of memory: record it, keep going
        return {"variant": name, "error": str(e).splitlines()[0][:300]}
    row["device"] = jax.devices()[0].device_kind
    row["mfu_989"] = row["model_tflops_per_s"] / (PEAK_TFLOPS * row["devices"])
    row["of_matmul_rate"] = row["model_tflops_per_s"] / (matmul * row["devices"])
    return row


def isolated_variant(args: argparse.Namespace, variant: str, profile: str | None) -> dict:
    """One variant timed by a child process of this module (in `child_env`: the devices its
    `devices=N` asks for, its XLA flags): its row (the child's last stdout line), or the child's
    last words when it died without one."""
    command = [sys.executable, "-m", "benchmarks.bench_train", "--config", args.config,
               "--steps", str(args.steps), "--document-tokens", str(args.document_tokens),
               "--rows", args.rows, "--child", "--variants", variant]  # fmt: skip
    command += ["--profile", profile] if profile else []
    env = child_env(variant)
    child = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = child.stdout.strip().splitlines()
    # its matmul rate and profile (its row comes back as this process's)
    print("\n".join(line for line in lines if line.startswith(('{"bf16', " ", "/"))), flush=True)
    try:
        return json.loads(lines[-1])[0]
    except (IndexError, ValueError):
        said = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return {"variant": variant or "as configured",
                "error": f"child exited {child.returncode}: {said[:250]}"}  # fmt: skip


if __name__ == "__main__":
    main()

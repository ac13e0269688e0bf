"""MSA on one TPU beside splash dense attention, at M3's head layout: the Mosaic TPU kernels
checked against the XLA path, then timed. Unmeasured so far: no TPU was at hand when it was
written (run it on a TPU host and append the table to benchmarks/RESULTS.md).

    python -m benchmarks.bench_msa_tpu [--lengths 32768 131072] [--repeats 5]
    python -m benchmarks.bench_msa_tpu --interpret --lengths 384 --repeats 1  # CPU smoke run

Check first: the kernels against the XLA path in bfloat16 on a row of two documents, the second
starting mid-block (the share of (query, head) rows selecting the same blocks; output, KL and the
gradients of all five inputs, as relative errors). Then per length: splash causal dense attention
(forward; forward+backward) and the TPU MSA layer's selection (its kernel), forward (selection +
sparse attention + indexer KL) and forward+backward — bf16,
batch 1, 64 query / 4 kv heads of 128, 4 index heads of 128, blocks of 128, top-16 (bench_msa's
shapes). Median time, TFLOP/s by the spec/msa.md §3 cost model, and the ratio to splash measured
in the same run. The last stdout line is JSON.
"""

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from benchmarks.bench_msa import (
    flops,
    make_inputs,
    median_seconds,
    msa_functions,
    relative,
    same_sets,
)
from pallas_kernels.attention import splash
from pallas_kernels.msa import tpu, xla


def splash_functions(interpret: bool) -> dict:
    def dense(q, k, v, segment_ids, **_):
        return splash.dense_attention(q, k, v, segment_ids, interpret=interpret)

    def dense_train(q, k, v, segment_ids, **_):
        def loss(q, k, v):
            return dense(q, k, v, segment_ids).astype(jnp.float32).sum()

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    return {"splash fwd": dense, "splash fwd+bwd": dense_train}


def time_variant(fn, inputs: dict, repeats: int) -> float:
    """Median seconds after a warm-up call. Plain `jax.jit`, not bench_msa's ahead-of-time
    compile: splash's gradient closes over its mask tables, which the compiled call then lacks
    (jax 0.11.2: "compiled for 12 inputs but called with 7")."""
    run = jax.jit(lambda x: fn(**x))
    return median_seconds(lambda: run(inputs), repeats)


def check(seq: int, interpret: bool) -> dict:
    """The TPU kernels against the XLA path (bf16, two documents): the share of rows selecting
    the same blocks, and relative errors."""
    inputs = make_inputs(seq, documents=2)
    got = msa_functions("tpu", tpu, interpret=interpret)
    expected = msa_functions("xla", xla)

    def run(fn):
        return jax.jit(lambda x: fn(**x))(inputs)

    blocks = run(got["tpu select"]), run(expected["xla select"])
    result = {"seq": seq, "selection_agree": same_sets(*blocks)}
    for phase in ("fwd", "fwd+bwd"):
        outputs, wanted = run(got[f"tpu {phase}"]), run(expected[f"xla {phase}"])
        if phase == "fwd+bwd":  # (the loss, its gradients)
            outputs, wanted = outputs[1], wanted[1]
        names = ("out", "kl") if phase == "fwd" else ("dq", "dk", "dv", "d_index_q", "d_index_k")
        result |= {name: relative(a, b) for name, a, b in zip(names, outputs, wanted)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-length", type=int, default=2048 + 77)
    parser.add_argument("--interpret", action="store_true", help="no TPU: Pallas' interpreter")
    args = parser.parse_args()
    if jax.default_backend() != "tpu" and not args.interpret:
        raise SystemExit(f"needs a TPU (backend is {jax.default_backend()}); or --interpret")
    interpret = args.interpret
    checked = check(min(args.check_length, min(args.lengths)), interpret)
    print("check:", json.dumps(checked), flush=True)

    rows, table = [], []
    for seq in args.lengths:
        inputs = make_inputs(seq)
        variants = splash_functions(interpret) | msa_functions("tpu", tpu, interpret=interpret)
        baseline = {}
        for variant, fn in variants.items():
            seconds = time_variant(fn, inputs, args.repeats)
            phase = variant.split()[-1]
            if variant.startswith("splash"):
                baseline[phase] = seconds
            ratio = baseline["fwd" if phase == "select" else phase] / seconds
            work = flops(variant.replace("splash", "cudnn"), seq)  # the same dense cost model
            row = {"variant": variant, "seq": seq, "ms": seconds * 1e3,
                   "tflops": work / seconds / 1e12, "speedup_vs_splash": ratio}  # fmt: skip
            rows.append(row)
            table.append(f"| {variant} | {seq} | {row['ms']:.1f} | {row['tflops']:.1f} | "
                         f"{ratio:.2f}× |")  # fmt: skip
            print(table[-1], flush=True)

    mode = "interpreted on CPU: not a speed" if interpret else jax.devices()[0].device_kind
    print(f"\n## MSA TPU kernels vs splash dense — {datetime.date.today()}\n\n{mode}, jax "
          f"{jax.__version__}; bench_msa's shapes; median of {args.repeats} after a warm-up.\n\n"
          "| variant | S | ms | TFLOP/s | vs splash |\n|---|---|---|---|---|\n"
          + "\n".join(table))  # fmt: skip
    print(json.dumps({"check": checked, "rows": rows, "interpret": interpret}))


if __name__ == "__main__":
    main()

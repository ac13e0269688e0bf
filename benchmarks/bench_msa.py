"""MSA's query-tiled XLA path beside cuDNN dense flash attention, at M3's head layout, on one GPU.

    python -m benchmarks.bench_msa [--lengths 32768 131072] [--output results.md]

Per length: cuDNN causal attention (forward; forward+backward) and the XLA MSA layer (selection;
selection + sparse attention + indexer KL forward; the same with backward into q, k, v and the
index projections, i.e. one training step's attention work), bf16 inputs, batch 1, 64 query / 4 kv
heads, head dim 128, 4 index heads of 128, blocks of 128, top-16. Reports the median time, the
compiled memory (arguments + outputs + temporaries), TFLOP/s by the spec/msa.md §3 cost model and
the ratio to cuDNN measured in the same run. A correctness check against the O(S²) reference runs
first at a short length. The last stdout line is JSON.
"""

import argparse
import datetime
import json
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.reference import document_causal_mask
from pallas_kernels.msa import reference, xla

HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM, BLOCK, TOPK = 64, 4, 128, 128, 128, 16
VARIANTS = ("cudnn fwd", "cudnn fwd+bwd", "msa select", "msa fwd", "msa fwd+bwd")


def make_inputs(seq: int, dtype=jnp.bfloat16, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)  # noqa: E731
    return dict(
        q=normal(keys[0], (1, seq, HEADS, HEAD_DIM)),
        k=normal(keys[1], (1, seq, KV_HEADS, HEAD_DIM)),
        v=normal(keys[2], (1, seq, KV_HEADS, HEAD_DIM)),
        index_q=normal(keys[3], (1, seq, KV_HEADS, INDEX_DIM)),
        index_k=normal(keys[4], (1, seq, INDEX_DIM)),
        segment_ids=jnp.ones((1, seq), jnp.int32),
        positions=jnp.arange(seq, dtype=jnp.int32)[None],
    )


def msa_layer(q, k, v, index_q, index_k, segment_ids, positions):
    blocks = xla.top_blocks(index_q, index_k, segment_ids, positions, block_size=BLOCK,
                            topk_blocks=TOPK, local_blocks=1)  # fmt: skip
    out, kl = xla.sparse_attention(q, k, v, blocks, segment_ids, block_size=BLOCK,
                                   student=(index_q, index_k))  # fmt: skip
    return out, kl


def functions():
    def cudnn(q, k, v, **_):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def cudnn_train(q, k, v, **_):
        return jax.grad(lambda q, k, v: cudnn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))(
            q, k, v
        )

    def select(index_q, index_k, segment_ids, positions, **_):
        return xla.top_blocks(index_q, index_k, segment_ids, positions, block_size=BLOCK,
                              topk_blocks=TOPK, local_blocks=1)  # fmt: skip

    def msa_forward(**x):
        return msa_layer(**x)

    def msa_train(q, k, v, index_q, index_k, segment_ids, positions):
        def loss(q, k, v, index_q, index_k):
            out, kl = msa_layer(q, k, v, index_q, index_k, segment_ids, positions)
            return out.astype(jnp.float32).sum() + kl.sum()

        return jax.grad(loss, argnums=range(5))(q, k, v, index_q, index_k)

    return dict(zip(VARIANTS, (cudnn, cudnn_train, select, msa_forward, msa_train)))


def flops(variant: str, seq: int) -> float:
    """spec/msa.md §3: dense causal 2·H·Dh·N per token fwd; MSA 4·H·Dh·k·B + indexer Hi·Di·N."""
    dense = 2 * HEADS * HEAD_DIM * seq * seq
    indexer = KV_HEADS * INDEX_DIM * seq * seq
    sparse = 4 * HEADS * HEAD_DIM * TOPK * BLOCK * seq
    return {
        "cudnn fwd": dense,
        "cudnn fwd+bwd": 3.5 * dense,  # backward ≈ 2.5× forward (FlashAttention-2 convention)
        "msa select": indexer,
        "msa fwd": indexer + sparse + KV_HEADS * INDEX_DIM * TOPK * BLOCK * seq * 2,
        "msa fwd+bwd": indexer + 3.5 * sparse + 3 * KV_HEADS * INDEX_DIM * TOPK * BLOCK * seq * 2,
    }[variant]


def time_variant(fn, inputs: dict, repeats: int) -> tuple[float, float]:
    """(median seconds, compiled bytes) after one warm-up call."""
    jitted = jax.jit(lambda x: fn(**x))
    compiled = jitted.lower(inputs).compile()
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    jax.block_until_ready(compiled(inputs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(inputs))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(used)


def check_against_reference(seq: int = 4096) -> dict:
    """Relative error of the XLA MSA layer vs the O(S²) reference, fp32 inputs, on this device."""
    x = make_inputs(seq, jnp.float32, seed=1)
    out, kl = jax.jit(lambda x: msa_layer(**x))(x)
    blocks = reference.top_blocks(x["index_q"], x["index_k"], x["segment_ids"], x["positions"],
                                  block_size=BLOCK, topk_blocks=TOPK, local_blocks=1)  # fmt: skip
    expected = reference.sparse_attention(
        x["q"], x["k"], x["v"], blocks, x["segment_ids"], block_size=BLOCK
    )
    expected_kl = reference.indexer_kl(x["q"], x["k"], x["index_q"], x["index_k"], blocks,
                                       x["segment_ids"], block_size=BLOCK)  # fmt: skip
    dense = jax.nn.dot_product_attention(
        x["q"], x["k"], x["v"], mask=document_causal_mask(x["segment_ids"])[:, None]
    )
    relative = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    return {
        "seq": seq,
        "out_rel_err": relative(out, expected),
        "kl_rel_err": relative(kl, expected_kl),
        "sparse_vs_dense_rel_diff": relative(out, dense),  # S > k·B: selection active, clearly > 0
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="also write the markdown section here")
    args = parser.parse_args()

    check = check_against_reference()
    print("check vs reference:", check, flush=True)
    rows, table = [], []
    for seq in args.lengths:
        inputs = make_inputs(seq)
        baseline = {}
        for variant, fn in functions().items():
            try:
                seconds, used = time_variant(fn, inputs, args.repeats)
            except Exception as e:  # e.g. out of memory: record it, keep going
                print(f"{variant} @ {seq}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                rows.append({"variant": variant, "seq": seq, "error": str(e).splitlines()[0][:200]})
                continue
            if variant.startswith("cudnn"):
                baseline[variant.split()[1]] = seconds
            phase = "fwd+bwd" if variant.endswith("bwd") else "fwd"
            ratio = baseline.get(phase, float("nan")) / seconds
            row = {"variant": variant, "seq": seq, "ms": seconds * 1e3, "memory_gb": used / 1e9,
                   "tflops": flops(variant, seq) / seconds / 1e12, "speedup_vs_cudnn": ratio}  # fmt: skip
            rows.append(row)
            line = (f"| {variant} | {seq} | {row['ms']:.1f} | {row['memory_gb']:.2f} | "
                    f"{row['tflops']:.0f} | {ratio:.2f}× |")  # fmt: skip
            table.append(line)
            print(line, flush=True)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    header = [
        f"## MSA XLA path vs cuDNN dense — {datetime.date.today()}, commit {commit or 'unknown'}",
        "",
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; batch 1, {HEADS} q / {KV_HEADS} kv heads, "
        f"head dim {HEAD_DIM}, index {KV_HEADS}×{INDEX_DIM}, block {BLOCK}, top-{TOPK}, bf16; median of "
        f"{args.repeats} after a warm-up; memory = compiled arguments + outputs + temporaries; TFLOP/s by "
        "the spec/msa.md §3 cost model; speedup = cuDNN time (same phase, same run) / this time.",
        f"Check (fp32, S={check['seq']}): out rel. err {check['out_rel_err']:.1e}, KL rel. err "
        f"{check['kl_rel_err']:.1e}; sparse vs dense rel. diff {check['sparse_vs_dense_rel_diff']:.2f}.",
        "",
        "| variant | S | ms | memory GB | TFLOP/s | vs cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    section = "\n".join(header + table) + "\n"
    print("\n" + section)
    if args.output:
        with open(args.output, "w") as f:
            f.write(section)
    print(json.dumps({"check": check, "rows": rows}))


if __name__ == "__main__":
    main()

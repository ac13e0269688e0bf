"""Dense attention over packed rows on a GPU: cuDNN's packed flash attention against the query-tiled
XLA path, checked, then timed, in one process.

    python -m benchmarks.bench_attention [--shapes 4x4096x16x2x128 1x32768x64x4x128 ...]
                                         [--documents 1500] [--max-segments 16 64 256]

A shape is BxSxHxKxDh, with a trailing "v" for the ViT's bidirectional segments (e.g. one row
of 16,384 patches, 16 heads of 80). Rows are packed with documents (or images) of exponential
lengths (mean --documents tokens), the last one cut at the row's end. Checks: the cuDNN output
and the gradients of all three inputs against the XLA path in float32 on the same bf16 inputs
(one kv head's group), for these rows and for rows of ~S/30 documents (more than --limit:
the masked rows). Times: dense_attention, fixed layouts of --max-segments, forward and
forward+backward medians; TFLOP/s counts only the work inside documents (causal: 4·H·Dh·Σ
n(n+1)/2; bidirectional: 4·H·Dh·Σ n²; backward 2.5× forward), and "cudnn whole-row causal"
(one segment per row: more work, not the same result) shows what packing costs. The last stdout
line is JSON.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_train import synthetic_batch
from pallas_kernels.attention import cudnn, xla


def packed_row_segments(batch: int, seq: int, mean: int, seed: int = 0) -> jax.Array:
    """bench_train's packed rows: documents of exponential lengths (mean `mean`)."""
    return synthetic_batch(batch, seq, vocab=2, seed=seed, mean_document=mean).segment_ids


def useful_flops(segments: np.ndarray, heads: int, head_dim: int, causal: bool) -> float:
    lengths = np.concatenate([np.unique(row, return_counts=True)[1] for row in segments])
    pairs = (lengths * (lengths + 1) / 2) if causal else lengths.astype(np.float64) ** 2
    return 4.0 * heads * head_dim * pairs.sum()


def timed(fn, args, repeats: int) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def temp_bytes(fn, args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def relative(a, b) -> float:
    a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def with_grads(attend):
    def run(q, k, v, cotangent):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, *pullback(cotangent.astype(out.dtype))

    return run


def check(attend, reference, q, k, v) -> list[float]:
    """Relative errors of (out, dq, dk, dv) against the reference on float32 copies, on the query
    heads of the first kv head (the float32 XLA backward of all heads can outgrow the GPU)."""
    q, k, v = q[:, :, : q.shape[2] // k.shape[2]], k[:, :, :1], v[:, :, :1]
    cotangent = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    got = jax.jit(with_grads(attend))(q, k, v, cotangent)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(with_grads(reference))(*f32, cotangent)
    return [relative(g, w) for g, w in zip(got, want)]


def bench_shape(
    shape: str, mean: int, max_segments: list[int], limit: int | None, repeats: int
) -> list[dict]:
    causal = not shape.endswith("v")
    batch, seq, heads, kv_heads, head_dim = map(int, shape.rstrip("v").split("x"))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    segments = packed_row_segments(batch, seq, mean)
    runs = int(cudnn.segment_runs(segments, 1)[2].max())
    work = useful_flops(np.asarray(segments), heads, head_dim, causal)
    base = {"shape": shape, "causal": causal, "max_runs": runs}

    def on(segments):
        def xla_path(q, k, v):
            return xla.dense_attention(q, k, v, segments, causal=causal)[0].astype(q.dtype)

        def chosen(q, k, v):
            return cudnn.dense_attention(q, k, v, segments, causal=causal, max_segments=limit)

        return xla_path, chosen

    def fixed(limit):
        return lambda q, k, v: cudnn.packed_attention(
            q, k, v, segments, max_segments=limit, causal=causal
        )

    def whole_row(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    xla_path, chosen = on(segments)
    many = packed_row_segments(batch, seq, 30, seed=1)  # ~S/30 documents a row
    rows = []
    for name, (reference, attend), ids in [
        ("cudnn (packed or masked)", (xla_path, chosen), segments),
        ("cudnn, many documents", on(many), many),
    ]:
        errors = check(attend, reference, q, k, v)
        rows.append({**base, "check": name, "runs": int(cudnn.segment_runs(ids, 1)[2].max()),
                     "errors (out, dq, dk, dv)": errors})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    def masked(q, k, v):
        return cudnn.masked_attention(q, k, v, segments, causal=causal)

    variants = {"cudnn (packed or masked)": chosen}
    variants |= {f"cudnn M={m}": fixed(m) for m in max_segments if runs <= m <= seq}
    variants |= {"cudnn masked row": masked, "cudnn whole-row": whole_row}
    if seq <= 8192:  # longer rows: the float32 tiles of its backward outgrow the GPU
        variants["xla tiled"] = xla_path
    cotangent = jnp.ones(q.shape, jnp.bfloat16)
    for name, attend in variants.items():
        row = {**base, "variant": name}
        try:
            row["fwd_bwd_temp_gb"] = temp_bytes(with_grads(attend), (q, k, v, cotangent)) / 1e9
            row["fwd_ms"] = 1e3 * timed(attend, (q, k, v), repeats)
            row["fwd_tflops"] = work / row["fwd_ms"] * 1e-9
            row["fwd_bwd_ms"] = 1e3 * timed(with_grads(attend), (q, k, v, cotangent), repeats)
            row["fwd_bwd_tflops"] = 3.5 * work / row["fwd_bwd_ms"] * 1e-9
        except Exception as e:  # out of memory, an unsupported shape: record it, keep going
            row["error"] = str(e).splitlines()[0][:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+",
                        default=["4x4096x16x2x128", "1x32768x64x4x128", "1x16384x16x16x80v"])  # fmt: skip
    parser.add_argument("--documents", type=int, default=1500, help="mean document length")
    parser.add_argument("--max-segments", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--limit", type=int,
                        help="max_segments of dense_attention (default: by row length)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args.documents, args.max_segments, args.limit, args.repeats)
    print(
        f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, mean document {args.documents}"
    )
    print("| shape | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | temp GB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "variant" in row:
            cells = [f"{row[key]:.2f}" if key in row else "—"
                     for key in ("fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops", "fwd_bwd_temp_gb")]  # fmt: skip
            print(f"| {row['shape']} | {row['variant']} | " + " | ".join(cells) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

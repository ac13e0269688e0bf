"""MSA on one GPU beside cuDNN dense flash attention, at M3's head layout: the Pallas kernels (and
the XLA path) checked, then timed.

    python -m benchmarks.bench_msa [--lengths 32768 131072] [--xla-up-to 32768] [--output f.md]
        [--tilings rows=64,warps=4 ...] [--forward-kernels triton mosaic [--phases attn attn-kl]]
        [--backward-kernels triton mosaic]

Checks first (fresh random inputs, NaN-poisoned memory freed just before each run, so unwritten
outputs show): the kernels against the O(S²) reference in float32 at a short length, and against
the XLA path in bfloat16 at a longer one whose row holds two documents, the second starting
mid-block — selection, output, KL and the gradients of q, k, v and both index projections; those
again with the KL through a sink (`sink_*`: the training step's way, the KL from the backward).
Then per length: cuDNN causal attention (forward; forward+backward) and each MSA implementation's
selection, forward (selection + sparse attention + indexer KL) and forward+backward (one training
step's attention work, the KL's value through a sink as the step takes it), bf16, batch 1, 64
query / 4 kv heads, head dim 128, 4 index heads of 128, blocks of 128, top-16. Reports the median
time, compiled memory, TFLOP/s by the spec/msa.md §3 cost model and the ratio to cuDNN measured in
the same run. The last stdout line is JSON.

`--forward-kernels` adds the phases `attn` and `attn-kl` (unless `--phases` names one of them):
the sparse attention forward alone on a given selection, without the student (`attn`) and with it
(`attn-kl`: output and indexer KL, the forward of a training step in the sparse phase), once per
`Config.forward_kernel` (the Triton LSE + forward passes; the Mosaic GPU one-pass kernel, with the
student followed by its KL pass), each first checked against the XLA path (output, KL, and the
gradients of q, k, v and both index projections through the shared backward, which reads the
forward's LSE and LSE_z).

Then the kernels with context parallelism's query slots (`compare_query_runs`): each half of an
8192-token row as two runs of consecutive slots, a later one first, against the whole row's
call at those rows (selection, output, KL, dq, d(index_q)) and the halves' key-side gradients
added up against the whole row's (dk, dv, d(index_k)), all compiled for the GPU.

`--backward-kernels` adds the layer's forward+backward once per `Config.backward_kernel` (the
Triton backward; the Mosaic GPU one), each with the Mosaic forward and the student (variants
`pallas[bwd=...] fwd+bwd`), each first checked against the XLA path as the default tiling is
(selection, output, KL, gradients). `--tilings` with no value leaves out the default config's
variants and checks.
"""

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import trace_summary
from pallas_kernels.msa import pallas, reference, xla

HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM, BLOCK, TOPK = 64, 4, 128, 128, 128, 16
ATTENTION_PHASES = ("attn", "attn-kl")  # the sparse attention forward alone: without, with student
MSA = dict(block_size=BLOCK, topk_blocks=TOPK, local_blocks=1)


def make_inputs(seq: int, dtype=jnp.bfloat16, seed: int = 0, documents: int = 1):
    keys = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)  # noqa: E731
    starts = np.linspace(0, seq, documents + 1).astype(int)[:-1] + np.arange(documents) * 37
    segments = np.searchsorted(starts, np.arange(seq), side="right").astype(np.int32)
    positions = np.arange(seq) - starts[segments - 1]
    return dict(
        q=normal(keys[0], (1, seq, HEADS, HEAD_DIM)),
        k=normal(keys[1], (1, seq, KV_HEADS, HEAD_DIM)),
        v=normal(keys[2], (1, seq, KV_HEADS, HEAD_DIM)),
        index_q=normal(keys[3], (1, seq, KV_HEADS, INDEX_DIM)),
        index_k=normal(keys[4], (1, seq, INDEX_DIM)),
        segment_ids=jnp.asarray(segments)[None],
        positions=jnp.asarray(positions, jnp.int32)[None],
    )


def msa_layer(module, **kwargs):
    def layer(q, k, v, index_q, index_k, segment_ids, positions, kl_sink=None):
        blocks = module.top_blocks(index_q, index_k, segment_ids, positions, **MSA, **kwargs)
        return module.sparse_attention(q, k, v, blocks, segment_ids, positions, block_size=BLOCK,
                                       student=(index_q, index_k), kl_sink=kl_sink,
                                       **kwargs)  # fmt: skip

    return layer


def msa_functions(name: str, module, **kwargs) -> dict:
    layer = msa_layer(module, **kwargs)

    def select(index_q, index_k, segment_ids, positions, **_):
        return module.top_blocks(index_q, index_k, segment_ids, positions, **MSA, **kwargs)

    def train(q, k, v, index_q, index_k, segment_ids, positions):
        def loss(q, k, v, index_q, index_k, kl_sink):
            out, kl = layer(q, k, v, index_q, index_k, segment_ids, positions, kl_sink)
            return out.astype(jnp.float32).sum() + kl.sum()

        # the loss's value too, as a training step reports it, the KL's through a sink as the
        # step takes it (pretrain/train_step.py): under jax.grad alone XLA drops the work that
        # only the KL's value needs (runs before 2026-12-03 timed fwd+bwd without it)
        sink = jnp.zeros((*index_q.shape[:3],), jnp.float32)
        value, grads = jax.value_and_grad(loss, argnums=range(6))(q, k, v, index_q, index_k, sink)
        return value + grads[5].sum(), grads[:5]

    return {f"{name} select": select, f"{name} fwd": lambda **x: layer(**x),
            f"{name} fwd+bwd": train}  # fmt: skip


def attention_functions(kernels: list[str]) -> dict:
    """The sparse attention forward on `blocks` selected beforehand, per forward kernel, without
    the student (`attn`: the output) and with it (`attn-kl`: output and KL): the kernels' own
    work, without the selection's."""

    def forward_of(kernel: str, with_student: bool):
        config = pallas.Config(forward_kernel=kernel)

        def forward(q, k, v, index_q, index_k, blocks, segment_ids, positions):
            out, kl = pallas.sparse_attention(
                q, k, v, blocks, segment_ids, positions, block_size=BLOCK,
                student=(index_q, index_k) if with_student else None, config=config,
            )  # fmt: skip
            return (out, kl) if with_student else out

        return forward

    return {f"pallas[{kernel}] {phase}": forward_of(kernel, phase == "attn-kl")
            for kernel in kernels for phase in ATTENTION_PHASES}  # fmt: skip


def with_blocks(inputs: dict) -> dict:
    """`inputs` and the Pallas selection of their blocks (the `attn` variants' input)."""
    blocks = jax.jit(lambda x: pallas.top_blocks(x["index_q"], x["index_k"], x["segment_ids"],
                                                 x["positions"], **MSA))(inputs)  # fmt: skip
    return {**inputs, "blocks": blocks}


def compare_attention(
    kernels: list[str], phases: list[str], seq: int = 8192 + 77, documents: int = 2
) -> list:
    """Per attention phase and forward kernel: output (and KL) and the gradients of q, k, v (and
    both index projections) in bfloat16 vs the XLA path in float32, relative errors; the XLA
    path's own bfloat16 errors for scale."""
    x = with_blocks(make_inputs(seq, seed=seq + documents, documents=documents))
    x32 = {name: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for name, a in x.items()}
    weights = jax.random.normal(jax.random.key(1), x["q"].shape, jnp.float32)

    def values_and_grads(module, x, with_student, **kwargs):
        def loss(q, k, v, *index):
            rows = (x["blocks"], x["segment_ids"], x["positions"])
            out, kl = module.sparse_attention(q, k, v, *rows, block_size=BLOCK,
                                              student=index or None, **kwargs)  # fmt: skip
            value = (out.astype(jnp.float32) * weights).sum()
            return (value, out) if kl is None else (value + kl.sum(), (out, kl))

        names = ("q", "k", "v") + (("index_q", "index_k") if with_student else ())
        loss_grad = jax.value_and_grad(loss, range(len(names)), has_aux=True)
        (_, values), grads = jax.jit(loss_grad)(*(x[name] for name in names))
        return (*(values if with_student else (values,)), *grads)

    checks = []
    for phase in (phase for phase in ATTENTION_PHASES if phase in phases):
        with_student = phase == "attn-kl"
        names = ("out", "kl", "dq", "dk", "dv", "d_index_q", "d_index_k")
        names = names if with_student else ("out", "dq", "dk", "dv")
        expected = values_and_grads(xla, x32, with_student)
        xla_errors = {f"xla_{n}": relative(g, e) for n, g, e
                      in zip(names, values_and_grads(xla, x, with_student), expected)}  # fmt: skip
        for kernel in kernels:
            poison_memory()
            try:
                config = pallas.Config(forward_kernel=kernel)
                got = values_and_grads(pallas, x, with_student, config=config)
                check = {"phase": phase, "forward_kernel": kernel, "seq": seq,
                         "documents": documents,
                         "all_finite": all(bool(jnp.isfinite(a).all()) for a in got),
                         **{n: relative(g, e) for n, g, e in zip(names, got, expected)},
                         **xla_errors}  # fmt: skip
            except Exception as e:  # a kernel that does not compile: report, keep going
                check = {"phase": phase, "forward_kernel": kernel, "seq": seq,
                         "error": str(e).splitlines()[0][:300]}  # fmt: skip
            checks.append(check)
            print("check:", json.dumps(check), flush=True)
    return checks


def backward_configs(kernels: list[str]) -> dict[str, pallas.Config]:
    """Per backward kernel, the layer's config: the Mosaic forward and that backward."""
    return {f"pallas[bwd={kernel}]": pallas.Config(forward_kernel="mosaic", backward_kernel=kernel)
            for kernel in kernels}  # fmt: skip


def cudnn_functions() -> dict:
    def cudnn(q, k, v, **_):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def cudnn_train(q, k, v, **_):
        loss = lambda q, k, v: cudnn(q, k, v).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    return {"cudnn fwd": cudnn, "cudnn fwd+bwd": cudnn_train}


def flops(variant: str, seq: int) -> float:
    """spec/msa.md §3: dense causal 2·H·Dh·N per token fwd; MSA 4·H·Dh·k·B + indexer Hi·Di·N."""
    dense = 2 * HEADS * HEAD_DIM * seq * seq
    indexer = KV_HEADS * INDEX_DIM * seq * seq
    sparse = 4 * HEADS * HEAD_DIM * TOPK * BLOCK * seq
    student = 2 * KV_HEADS * INDEX_DIM * TOPK * BLOCK * seq
    phase = variant.split()[-1]
    if variant.startswith("cudnn"):
        return dense if phase == "fwd" else 3.5 * dense  # backward ≈ 2.5× forward (FA2 convention)
    return {"select": indexer, "attn": sparse, "attn-kl": sparse + student,
            "fwd": indexer + sparse + student,
            "fwd+bwd": indexer + 3.5 * sparse + 3 * student}[phase]  # fmt: skip


def poison_memory(gigabytes: float = 8.0) -> None:
    """Fill and free device memory with NaN so that an output the kernels fail to write shows."""
    jax.block_until_ready(jnp.full((int(gigabytes * 2**28),), jnp.nan, jnp.float32)).delete()


def time_variant(fn, inputs: dict, repeats: int) -> tuple[float, float]:
    """(median seconds, compiled bytes) after one warm-up call."""
    compiled = jax.jit(lambda x: fn(**x)).lower(inputs).compile()
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    return median_seconds(lambda: compiled(inputs), repeats), float(used)


def median_seconds(call, repeats: int) -> float:
    """Median wall time of `call()` to ready results, after one warm-up call."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def profile(fn, inputs: dict, trace_dir: str, steps: int = 2) -> None:
    """Where the device time of `fn` goes, kernel by kernel (benchmarks/trace_summary.py)."""
    compiled = jax.jit(lambda x: fn(**x)).lower(inputs).compile()
    jax.block_until_ready(compiled(inputs))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(compiled(inputs))
    print(trace_summary.report(trace_summary.summarize(trace_dir), steps), flush=True)


def relative(a, b) -> float:
    a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def same_sets(a, b) -> float:
    """Share of (query, head) rows whose selected block sets agree."""
    a, b = np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1)
    return float((a == b).all(-1).mean())


def compare(expected_module, seq: int, dtype, documents: int, config) -> dict:
    """The kernels on fresh `dtype` inputs vs `expected_module` on the same inputs in float32:
    selection (same dtype), values and gradients (relative errors); in bfloat16 also the XLA
    path's own errors, for scale."""
    x = make_inputs(seq, dtype, seed=seq + documents, documents=documents)
    x32 = {name: a.astype(jnp.float32) if a.dtype == dtype else a for name, a in x.items()}
    select = lambda module, x, **kw: jax.jit(lambda x: module.top_blocks(  # noqa: E731
        x["index_q"], x["index_k"], x["segment_ids"], x["positions"], **MSA, **kw))(x)  # fmt: skip
    blocks = select(expected_module, x)
    poison_memory()
    got = select(pallas, x, config=config)
    weights = jax.random.normal(jax.random.key(1), x["q"].shape, jnp.float32)

    def loss_and_grads(module, x, sink=False, **kwargs):
        """(out, KL, the five gradients); sink: the KL through a sink, its gradient."""

        def loss(q, k, v, index_q, index_k, kl_sink):
            out, kl = module.sparse_attention(q, k, v, blocks, x["segment_ids"], x["positions"],
                                              block_size=BLOCK, student=(index_q, index_k),
                                              kl_sink=kl_sink, **kwargs)  # fmt: skip
            return (out.astype(jnp.float32) * weights).sum() + kl.sum(), (out, kl)

        args = [x[name] for name in ("q", "k", "v", "index_q", "index_k")]
        kl_sink = jnp.zeros(x["index_q"].shape[:3], jnp.float32) if sink else None
        argnums = range(6 if sink else 5)
        (_, (out, kl)), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(
            *args, kl_sink
        )
        return (out, grads[5] if sink else kl, *grads[:5])

    names = ("out", "kl", "dq", "dk", "dv", "d_index_q", "d_index_k")
    expected = loss_and_grads(expected_module, x32)
    poison_memory()
    got_values = loss_and_grads(pallas, x, config=config)
    result = {
        "seq": seq,
        "dtype": jnp.dtype(dtype).name,
        "documents": documents,
        "selection_agree": same_sets(got, blocks),
        "all_finite": all(bool(jnp.isfinite(a).all()) for a in (got, *got_values)),
    }
    result.update({name: relative(g, e) for name, g, e in zip(names, got_values, expected)})
    poison_memory()  # the KL through a sink (a training step's way): computed in the backward
    sunk = loss_and_grads(pallas, x, sink=True, config=config)
    result.update({f"sink_{name}": relative(g, e) for name, g, e in zip(names, sunk, expected)})
    result["all_finite"] &= all(bool(jnp.isfinite(a).all()) for a in sunk)
    if dtype != jnp.float32:
        xla_values = loss_and_grads(xla, x)
        result.update({f"xla_{name}": relative(g, e)
                       for name, g, e in zip(names, xla_values, expected)})  # fmt: skip
    return result


def compare_query_runs(seq: int, config) -> dict:
    """The kernels on each half of a row given as query slots (runs of seq / 4: a context-parallel
    device's two chunks at mesh seq = 2) vs the whole row's kernel call: relative errors per
    query (selection, out, KL, dq, d(index_q)) and of the halves' key-side sums (dk, dv,
    d(index_k))."""
    x = make_inputs(seq, seed=seq + 3, documents=2)
    chunk = seq // 4
    halves = [np.stack([np.arange(2 * chunk, 3 * chunk), np.arange(0, chunk)]),
              np.stack([np.arange(chunk, 2 * chunk), np.arange(3 * chunk, 4 * chunk)])]  # fmt: skip
    weights = jax.random.normal(jax.random.key(2), x["q"].shape, jnp.float32)

    @jax.jit
    def run(q, index_q, k, v, index_k, rows, runs):
        def loss(q, index_q, k, v, index_k):
            blocks = pallas.top_blocks(index_q, index_k, x["segment_ids"], x["positions"], **MSA,
                                       query_slots=runs, config=config)  # fmt: skip
            out, kl = pallas.sparse_attention(
                q, k, v, blocks, x["segment_ids"], x["positions"], block_size=BLOCK,
                student=(index_q, index_k), query_slots=runs, config=config,
            )  # fmt: skip
            value = (out.astype(jnp.float32) * weights[:, rows]).sum() + kl.sum()
            return value, (blocks, out, kl)

        return jax.grad(loss, range(5), has_aux=True)(q, index_q, k, v, index_k)

    def on(runs):
        rows = jnp.asarray(runs.reshape(-1))
        poison_memory()
        return run(x["q"][:, rows], x["index_q"][:, rows], x["k"], x["v"], x["index_k"], rows,
                   jnp.asarray(runs, jnp.int32))  # fmt: skip

    whole = on(np.arange(seq)[None])  # (grads, (blocks, out, kl))
    parts = [on(runs) for runs in halves]
    # per query: (0 grads | 1 values, which) against the whole row's at the half's rows
    per_query = {"out": (1, 1), "kl": (1, 2), "dq": (0, 0), "d_index_q": (0, 1)}
    result = {"seq": seq, "query_runs": 2, "run_length": chunk}
    result["selection_agree"] = min(same_sets(part[1][0], whole[1][0][:, runs.reshape(-1)])
                                    for runs, part in zip(halves, parts))  # fmt: skip
    for name, (kind, i) in per_query.items():
        result[name] = max(relative(part[kind][i], whole[kind][i][:, runs.reshape(-1)])
                           for runs, part in zip(halves, parts))  # fmt: skip
    for name, i in (("dk", 2), ("dv", 3), ("d_index_k", 4)):  # the halves add up
        summed = parts[0][0][i].astype(jnp.float32) + parts[1][0][i].astype(jnp.float32)
        result[name] = relative(summed, whole[0][i])
    return result


def parse_tiling(text: str) -> pallas.Config:
    """'forward.rows=64,backward.num_warps=8,teacher_bytes=8589934592' -> a kernel Config (a
    tiling's field, or one of the Config's own integer fields)."""
    return pallas.Config().with_fields(filter(None, text.split(",")))


def wanted(variant: str, phases: list[str]) -> bool:
    """Whether to time `variant` for these phases (cuDNN's forward is the baseline of the
    selection, the forward and the attention forward alone)."""
    phase = variant.split()[-1]
    if variant == "cudnn fwd":
        return bool({"fwd", "select", *ATTENTION_PHASES} & set(phases))
    return phase in phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--xla-up-to", type=int, default=32768, help="time the XLA path up to here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tilings", nargs="*", default=[""], help="kernel configs to time")
    parser.add_argument(
        "--phases", nargs="+", default=["select", "fwd", "fwd+bwd"],
        help="time only these phases (e.g. fwd at 1M, where cuDNN's fwd+bwd takes minutes)",
    )  # fmt: skip
    parser.add_argument(
        "--forward-kernels", nargs="*", default=[], choices=["triton", "mosaic"],
        help="also time the attention forward alone per forward kernel (phases attn: without "
        "the student, attn-kl: with it)",
    )  # fmt: skip
    parser.add_argument(
        "--backward-kernels", nargs="*", default=[], choices=["triton", "mosaic"],
        help="also time the layer's fwd+bwd per backward kernel (Mosaic forward, with student)",
    )  # fmt: skip
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--profile", help="profile the kernels' fwd+bwd at the last length here")
    parser.add_argument("--output", help="also write the markdown section here")
    args = parser.parse_args()

    configs = {text or "default": parse_tiling(text) for text in args.tilings}
    phases = list(args.phases)
    if args.forward_kernels and not set(ATTENTION_PHASES) & set(phases):
        phases += ATTENTION_PHASES
    checks = []
    if args.forward_kernels and not args.skip_check:
        checks += compare_attention(args.forward_kernels, phases)
    if not args.skip_check and set(phases) - set(ATTENTION_PHASES):
        for text, config in list(configs.items())[:1]:  # the first tiling
            for expected, seq, dtype, documents in ((reference, 2000, jnp.bfloat16, 2),
                                                    (xla, 8192 + 77, jnp.bfloat16, 2)):  # fmt: skip
                try:
                    check = {"tiling": text, **compare(expected, seq, dtype, documents, config)}
                except Exception as e:  # a config that does not compile: report, keep going
                    check = {"tiling": text, "seq": seq, "error": str(e).splitlines()[0][:300]}
                checks.append(check)
                print("check:", json.dumps(check), flush=True)
    if not args.skip_check and set(phases) - set(ATTENTION_PHASES):
        try:
            config = next(iter(configs.values()), pallas.Config())  # the first tiling
            check = {"variant": "query runs", **compare_query_runs(8192, config)}
        except Exception as e:  # a kernel that does not compile: report, keep going
            check = {"variant": "query runs", "error": repr(e).splitlines()[0][:300]}
        checks.append(check)
        print("check:", json.dumps(check), flush=True)
    for name, config in backward_configs(args.backward_kernels).items():
        if args.skip_check:
            break
        try:
            check = {"variant": name, **compare(xla, 8192 + 77, jnp.bfloat16, 2, config)}
        except Exception as e:  # a kernel that does not compile: report, keep going
            check = {"variant": name, "error": str(e).splitlines()[0][:300]}
        checks.append(check)
        print("check:", json.dumps(check), flush=True)

    rows, table = [], []
    for seq in args.lengths:
        inputs = make_inputs(seq)
        attention = set(ATTENTION_PHASES) & set(phases)
        blocked = with_blocks(inputs) if attention else inputs  # the attn variants' inputs
        variants = dict(cudnn_functions())
        if seq <= args.xla_up_to:
            variants.update(msa_functions("xla", xla))
        for text, config in configs.items():
            name = "pallas" if len(configs) == 1 else f"pallas[{text}]"
            variants.update(msa_functions(name, pallas, config=config))
        variants.update(attention_functions(args.forward_kernels))
        for name, config in backward_configs(args.backward_kernels).items():
            train = f"{name} fwd+bwd"
            variants[train] = msa_functions(name, pallas, config=config)[train]
        baseline = {}
        for variant, fn in variants.items():
            if not wanted(variant, phases):
                continue
            try:
                x = blocked if variant.split()[-1] in ATTENTION_PHASES else inputs
                seconds, used = time_variant(fn, x, args.repeats)
            except Exception as e:  # e.g. out of memory: record it, keep going
                message = str(e).splitlines()[0][:300]
                print(f"{variant} @ {seq}: failed: {message}", flush=True)
                rows.append({"variant": variant, "seq": seq, "error": message})
                continue
            phase = variant.split()[-1]
            if variant.startswith("cudnn"):
                baseline[phase] = seconds
            base = "fwd" if phase in ("select", *ATTENTION_PHASES) else phase
            ratio = baseline.get(base, float("nan")) / seconds
            row = {
                "variant": variant,
                "seq": seq,
                "ms": seconds * 1e3,
                "memory_gb": used / 1e9,
                "tflops": flops(variant, seq) / seconds / 1e12,
                "speedup_vs_cudnn": ratio,
            }
            rows.append(row)
            line = (f"| {variant} | {seq} | {row['ms']:.1f} | {row['memory_gb']:.2f} | "
                    f"{row['tflops']:.0f} | {ratio:.2f}× |")  # fmt: skip
            table.append(line)
            print(line, flush=True)

    if args.profile:
        profile(
            msa_functions("pallas", pallas, config=next(iter(configs.values())))["pallas fwd+bwd"],
            make_inputs(args.lengths[-1]),
            args.profile,
        )
    header = [
        f"## MSA kernels vs cuDNN dense — {datetime.date.today()}",
        "",
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; batch 1, {HEADS} q / {KV_HEADS} "
        "kv "
        f"heads, head dim {HEAD_DIM}, index {KV_HEADS}×{INDEX_DIM}, block {BLOCK}, top-{TOPK}, "
        f"bf16; median of {args.repeats} after a warm-up; memory = compiled arguments + outputs + "
        "temporaries; TFLOP/s by the spec/msa.md §3 cost model; vs cuDNN = cuDNN's time (same "
        "phase, same run; `select` against the forward) / this time.",
        "",
        "| variant | S | ms | memory GB | TFLOP/s | vs cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    section = "\n".join(header + table) + "\n"
    print("\n" + section)
    if args.output:
        with open(args.output, "w") as f:
            f.write(section + "\nChecks:\n" + "\n".join(json.dumps(c) for c in checks) + "\n")
    print(json.dumps({"checks": checks, "rows": rows}))


if __name__ == "__main__":
    main()

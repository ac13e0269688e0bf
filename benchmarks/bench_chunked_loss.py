"""The LM loss at M3's head shape: plain [T, V] logits against the chunked cross-entropy.

    python -m benchmarks.bench_chunked_loss [--tokens 4096 16384] [--chunks 1024 2048 4096]
    python -m benchmarks.bench_chunked_loss --smoke   # tiny shapes: does everything run (CPU)
    python -m benchmarks.bench_chunked_loss --collectives   # 2+ devices: the lm_head gradient's
                                                            # all-reduces under data parallelism

Per token count T (one row), bf16 hidden states [1, T, 6144] and an fp32 lm_head [6144, 200064]:
nll + 1e-4 · z-loss and their gradients w.r.t. both, jitted, for the plain path (`token_losses` of
M3Model.head's logits) and `pretrain/chunked_loss.py` per chunk size. Columns: median ms of
--repeats after a warm-up, "vs plain" = plain ms / this row's ms, XLA's temporary bytes
(`memory_analysis`), and the largest error of the nll, d(hidden) and d(lm_head) relative to the
plain path's largest entry (d(lm_head): the plain path rounds it to bf16, the chunks do not).
FLOPs: 3 · 2TDV for both (logits, d(hidden), d(lm_head); the chunked path computes the gradient
with the forward, from the same logits). The last stdout line is JSON.

--collectives compiles the chunked loss + gradient with the batch over all devices (and, second,
the lm_head's D over them too, FSDP) and counts the collectives XLA leaves inside loop bodies:
each chunk's lm_head gradient is a partial sum over a device's tokens, so unless XLA moves the
reduction out of the loop (WhileLoopAllReduceCodeMotion) every chunk pays one.
"""

import argparse
import datetime
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pretrain.chunked_loss import chunked_lm_loss
from pretrain.loss import token_losses

FULL = {"dim": 6144, "vocab": 200_064, "tokens": [4096, 16384], "chunks": [1024, 2048, 4096]}
SMOKE = {"dim": 32, "vocab": 500, "tokens": [64, 100], "chunks": [16, 48]}


def plain_loss(hidden, lm_head, targets):
    """nll + 1e-4 · z-loss of M3Model.head's [T, V] logits, and the nll per position."""
    logits = jnp.einsum(
        "bsd,dv->bsv", hidden, lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32
    )
    nll, lse = token_losses(logits, targets)
    return nll.mean() + 1e-4 * jnp.square(lse).mean(), nll


def chunked_loss(chunk_tokens: int):
    """`plain_loss` by pretrain/chunked_loss.py in chunks of `chunk_tokens`."""

    def loss(hidden, lm_head, targets):
        weights = jnp.full(targets.shape, 1 / targets.size)
        lm = chunked_lm_loss(hidden, lm_head, targets, weights, 1e-4 * weights,
                             chunk_tokens=chunk_tokens)  # fmt: skip
        return lm.loss, lm.nll

    return loss


def loss_and_grad(loss):
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def inputs(tokens: int, dim: int, vocab: int):
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (1, tokens, dim), jnp.bfloat16)
    lm_head = jax.random.normal(keys[1], (dim, vocab)) * dim**-0.5
    targets = jax.random.randint(keys[2], (1, tokens), 0, vocab)
    return hidden, lm_head, targets


def measure(fn, args, repeats: int) -> tuple[float, int, object]:
    """(median ms, temporary bytes, result)."""
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    result = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times)), temp, result


def relative_errors(result, reference) -> list[float]:
    (_, nll), grads = result
    (_, nll_ref), grads_ref = reference
    pairs = [(nll, nll_ref), *zip(grads, grads_ref, strict=True)]
    return [
        float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() / jnp.abs(b).max())
        for a, b in pairs
    ]


def speed_table(shape: dict, repeats: int) -> list[dict]:
    rows = []
    for tokens in shape["tokens"]:
        args = inputs(tokens, shape["dim"], shape["vocab"])
        plain_ms, plain_temp, reference = measure(loss_and_grad(plain_loss), args, repeats)
        flops = 2 * tokens * shape["dim"] * shape["vocab"]
        variants = [("plain", plain_ms, plain_temp, [0.0, 0.0, 0.0], 3)]
        for chunk in shape["chunks"]:
            fn = loss_and_grad(chunked_loss(chunk))
            ms, temp, result = measure(fn, args, repeats)
            variants.append((f"chunked {chunk}", ms, temp, relative_errors(result, reference), 3))
            del result  # one lm_head gradient at a time (4.9 GB fp32 at M3's shape)
        for name, ms, temp, errors, products in variants:
            row = {"variant": name, "tokens": tokens, "ms": round(ms, 2)}
            row.update(vs_plain=round(plain_ms / ms, 3), temp_gb=round(temp / 1e9, 3))
            row["tflops"] = round(products * flops / ms / 1e9, 1)
            row.update(zip(("err_nll", "err_d_hidden", "err_d_lm_head"), errors, strict=True))
            rows.append(row)
        del reference
    return rows


def collectives(shape: dict) -> list[dict]:
    """Collectives in loop bodies vs outside, per sharding of (hidden, lm_head)."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    tokens, chunk = shape["tokens"][-1], shape["chunks"][0]
    rows = max(jax.device_count(), 2)
    hidden = jax.ShapeDtypeStruct((rows, tokens // rows, shape["dim"]), jnp.bfloat16)
    lm_head = jax.ShapeDtypeStruct((shape["dim"], shape["vocab"]), jnp.float32)
    targets = jax.ShapeDtypeStruct((rows, tokens // rows), jnp.int32)
    chunked = chunked_loss(chunk)
    out = []
    for name, head_spec in (("data parallel", PartitionSpec()), ("fsdp", PartitionSpec("data"))):
        shardings = [NamedSharding(mesh, s) for s in (PartitionSpec("data"), head_spec)]
        shardings.append(NamedSharding(mesh, PartitionSpec("data")))
        for variant, loss in (("plain", plain_loss), (f"chunked {chunk}", chunked)):
            jitted = jax.jit(loss_and_grad(loss), in_shardings=shardings)
            hlo = jitted.lower(hidden, lm_head, targets).compile().as_text()
            out.append({"sharding": name, "variant": variant, **count_collectives(hlo)})
    return out


def count_collectives(hlo: str) -> dict:
    """Collective ops in while-loop bodies and in all other computations of an HLO module."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    counts = {}
    for computation in re.split(r"\n(?=\S)", hlo):
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+)", computation)
        where = "in loop" if header and header.group(1) in bodies else "outside"
        for op in re.findall(
            r"= [^=]*? (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", computation
        ):
            counts[f"{op} {where}"] = counts.get(f"{op} {where}", 0) + 1
    return counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--chunks", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--collectives", action="store_true")
    args = parser.parse_args()
    shape = dict(SMOKE if args.smoke else FULL)
    shape.update({k: getattr(args, k) for k in ("tokens", "chunks") if getattr(args, k)})
    header = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind}
    header.update(devices=jax.device_count(), jax=jax.__version__, **shape)
    print(header)
    if args.collectives:
        report = collectives(shape)
        for row in report:
            print(row)
    else:
        report = speed_table(shape, args.repeats)
        keys = list(report[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for row in report:
            values = [f"{v:.1e}" if k.startswith("err") else str(v) for k, v in row.items()]
            print("| " + " | ".join(values) + " |")
    print(json.dumps({**header, "rows": report}))


if __name__ == "__main__":
    main()

"""Cross-entropy from the final-normed hidden states, computed in token chunks, so that neither the
forward nor the backward pass holds the [tokens, vocab] fp32 logits.

`chunked_lm_loss(hidden, lm_head, targets, nll_weights, lse_square_weights)` returns the LM term of
the objective, loss = Σ nll_weights·nll + Σ lse_square_weights·logsumexp² (the weights of
pretrain/loss.py: `lm_weights`: a masked mean and the z-loss), with the per-position
cross-entropy and logsumexp ([B, S] fp32) as values for metrics: no gradient flows through those
two. The logits are those of `M3Model.head(hidden)` (the weight cast to the hidden states' dtype,
fp32 accumulation), one chunk of tokens at a time.

The weights are known in the forward pass, so the loss's gradient is computed there, from the
same logits (a `jax.custom_vjp`): per chunk d(logits) = (w_nll + 2·w_lse²·lse)·softmax -
w_nll·onehot(target), d(hidden) = d(logits)·lm_headᵀ, d(lm_head) accumulated in fp32. The backward
only scales them by the loss's cotangent. Three [N, D] × [D, V] products, where a backward from
per-position cotangents recomputes each chunk's logits (a fourth: 35 of 747 ms of a bench-h200
step on an H200, benchmarks/RESULTS.md). Without differentiation (evaluation) the forward
computes the values alone.

Memory: the temporaries are two [chunk_tokens, V] fp32 arrays (a chunk's logits and their
softmax / gradient), whatever the number of tokens; between the passes the gradients wait as
residuals, d(hidden) [B, S, D] in the hidden states' dtype and d(lm_head) [D, V] in its own.
XLA's CPU buffer assignment at V = 200,064, D = 256 (tests/pretrain/test_chunked_loss.py): the
plain path holds two [N, V] fp32 arrays, 6.6 GB for 4096 tokens; the chunks a fraction of one.

bf16 numerics: bf16 products with fp32 accumulation, d(logits) rounded to bf16 before its two
products (fp32 d(logits) made both products fp32 GEMMs: 192 of 1,177 ms of a bench-h200 step,
RESULTS.md); d(lm_head) accumulates in fp32. In float32 the gradients are the plain path's.

bf16 logits (`logits_dtype`, `train.logits_dtype`; fp32 by default): the logits product
outputs bf16 (still accumulated in fp32), and the logsumexp, the softmax and d(logits) are computed
in fp32 from those bf16 values, as MaxText's default (`logits_dot_in_fp32: False`) computes its
loss. The [N, V] array the chunk's passes read and the product writes is half the bytes: at
bench-h200's 65,536 tokens a step, 26 GB less written and 52 GB less read. Each logit is rounded
to 8 significant bits before the softmax (a relative error ≤ 2^-9 of the logit).

Data parallelism: each chunk's d(lm_head) is a partial sum over a device's tokens. Where the
lm_head is split over the data-parallel axes (its `embed` dim over fsdp and expert), left to
itself XLA:GPU all-gathers the weight and reduce-scatters d(lm_head) in every chunk: at bench-h200
on `expert=2` (16 chunks), 26.2 GB of all-gathers and 52.5 GB of reduce-scatters a step where
the lm_head is 0.82 GB (`m3-plan --target h200`, benchmarks/RESULTS.md). Given `gathered` (the
lm_head's layout with only its tensor-parallel split: `lm_head_gathered`), the weight is
gathered once before the chunks and d(lm_head) accumulates in that layout, a sum XLA:GPU reduces
once after the loop (WhileLoopAllReduceCodeMotion hoists the all-reduce out of it); the
gradient then goes back to the lm_head's own layout locally. On CPU XLA keeps that all-reduce
inside the loop (`benchmarks/bench_chunked_loss.py --collectives` counts them).

Chunk j holds positions j, j + n, j + 2n, ... of every row (n chunks): each chunk keeps the batch
and sequence axes, so their sharding over the data-parallel and seq mesh axes carries over to every
chunk, where chunks of consecutive flattened tokens would put the scan on a sharded axis. A row
length that is not a multiple of n is padded (padded positions weigh 0). `chunk_tokens` counts
the tokens of the arrays given, all devices together: each device holds its share of a chunk
(chunk_tokens / data-parallel devices rows).

It lives in pretrain/, not m3jax/: it is a training loss (targets, a custom gradient); the model's
part is the normed hidden states and the lm_head (`Functional.apply_normed_with_mtp`).

Shapes: B batch, S sequence, D model width, V vocab, N tokens; `chunks` of `per_row` positions per
row.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from m3jax import sharding
from pretrain import loss


class LMLoss(NamedTuple):
    """`chunked_lm_loss`'s results."""

    loss: jax.Array  # scalar fp32: Σ nll_weights·nll + Σ lse_square_weights·logsumexp²
    nll: jax.Array  # [B, S] fp32 per-position cross-entropy (a value: no gradient)
    log_normalizer: jax.Array  # [B, S] fp32 per-position logsumexp (a value: no gradient)


def chunked_lm_loss(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    nll_weights: jax.Array,
    lse_square_weights: jax.Array | None = None,
    *,
    chunk_tokens: int,
    gathered: NamedSharding | None = None,
    logits_dtype=jnp.float32,
) -> LMLoss:
    """The weighted cross-entropy (+ z-loss) of the logits hidden @ lm_head, and its per-position
    terms.

    hidden: [B, S, D] final-normed hidden states (the model's dtype); lm_head: [D, V] (any float
    dtype; cast to hidden's, as M3Model.head does); targets: [B, S] int in [0, V);
    nll_weights, lse_square_weights: [B, S] (None: no z-loss). chunk_tokens: the most tokens
    whose logits exist at once (at least one per row: B). gathered: the layout the lm_head and
    its gradient take over the chunks (`lm_head_gathered`; None: XLA's choice, one device).
    logits_dtype: the products' output (fp32 accumulation either way); the reductions and the
    softmax run in fp32 on its values (module docstring: bf16 logits).
    """
    if chunk_tokens < 1:
        raise ValueError(f"{chunk_tokens=} must be >= 1")
    if lse_square_weights is None:
        lse_square_weights = jnp.zeros(nll_weights.shape, jnp.float32)
    batch, seq = targets.shape
    num_chunks = -(-seq // max(1, chunk_tokens // batch))
    per_row = -(-seq // num_chunks)  # the fewest positions per row that n chunks need
    pad = num_chunks * per_row - seq

    def chunked(x):  # [B, S, ...] -> [chunks, B, per_row, ...]: position c·n + j -> chunk j
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, per_row, num_chunks, *x.shape[2:])
        return jnp.moveaxis(x, 2, 0)

    def unchunked(x):  # [chunks, B, per_row] -> [B, S]
        return x.transpose(1, 2, 0).reshape(batch, per_row * num_chunks)[:, :seq]

    weights = [chunked(w.astype(jnp.float32)) for w in (nll_weights, lse_square_weights)]
    loss, nll, log_normalizer = _chunk_losses(
        (gathered, jnp.dtype(logits_dtype)), chunked(hidden), lm_head, chunked(targets), *weights
    )
    values = [jax.lax.stop_gradient(unchunked(x)) for x in (nll, log_normalizer)]
    return LMLoss(loss, *values)


def lm_head_gathered(
    axes: tuple[str, ...], shape: tuple[int, int], mesh: Mesh | None
) -> NamedSharding | None:
    """The lm_head's layout (its logical `axes`, sharding.RULES) without the data-parallel mesh
    axes (vocab over `tensor` only), for `chunked_lm_loss(gathered=...)`; None where none of
    them splits it."""
    if mesh is None:
        return None
    data_parallel = dict(sharding.RULES)["batch"]
    own = sharding.partition_spec(axes, shape, mesh)
    kept = [_without(entry, data_parallel) for entry in own]
    return None if kept == list(own) else NamedSharding(mesh, PartitionSpec(*kept))


def _without(entry: str | tuple | None, mesh_axes: tuple[str, ...]) -> str | tuple | None:
    """A PartitionSpec entry less `mesh_axes`."""
    names = entry if isinstance(entry, tuple) else (entry,)
    left = tuple(a for a in names if a is not None and a not in mesh_axes)
    return left[0] if len(left) == 1 else (left or None)


def _in_layout(x: jax.Array, layout: NamedSharding | None) -> jax.Array:
    return x if layout is None else jax.lax.with_sharding_constraint(x, layout)


def _logits(hidden: jax.Array, weight: jax.Array, dtype) -> jax.Array:
    """[B, per_row, D] x [D, V] -> [B, per_row, V] in `dtype` (fp32 accumulation): M3Model.head's
    product (weight cast)."""
    return jnp.einsum("bcd,dv->bcv", hidden, weight, preferred_element_type=dtype)


def _weighted(nll, log_normalizer, nll_weights, lse_square_weights) -> jax.Array:
    return (nll_weights * nll).sum() + (lse_square_weights * jnp.square(log_normalizer)).sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_losses(static, hidden, lm_head, targets, nll_weights, lse_square_weights):
    """static: (gathered, the logits' dtype); hidden [chunks, B, per_row, D], lm_head [D, V], targets
    and weights [chunks, B, per_row] -> (loss, nll, logsumexp [chunks, B, per_row]); the values
    alone."""
    gathered, logits_dtype = static
    weight = _in_layout(lm_head.astype(hidden.dtype), gathered)
    nll, log_normalizer = jax.lax.map(
        lambda c: _token_losses(_logits(c[0], weight, logits_dtype), c[1]), (hidden, targets)
    )
    return _weighted(nll, log_normalizer, nll_weights, lse_square_weights), nll, log_normalizer


def _chunk_losses_forward(static, hidden, lm_head, targets, nll_weights, lse_square_weights):
    """The values and, from the same logits, the loss's gradients w.r.t. hidden and lm_head."""
    gathered, logits_dtype = static
    weight = _in_layout(lm_head.astype(hidden.dtype), gathered)
    vocab = lm_head.shape[1]

    def one_chunk(d_weight, chunk):
        h, t, w_nll, w_lse_square = chunk
        logits = _logits(h, weight, logits_dtype)  # [B, per_row, V]
        nll, log_normalizer = _token_losses(logits, t)
        softmax = jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None])
        is_target = t[..., None] == jnp.arange(vocab)
        # nll = lse - logit[t]: d/dlogits = softmax - onehot; lse²: 2·lse·softmax
        scale = w_nll + 2 * w_lse_square * log_normalizer
        d_logits = scale[..., None] * softmax - jnp.where(is_target, w_nll[..., None], 0)
        # d_logits in the operands' dtype: bf16 products with fp32 accumulation on tensor cores
        d_logits = d_logits.astype(h.dtype)
        d_h = _dot(d_logits, weight, ((2,), (1,))).astype(h.dtype)  # [B, per_row, D]
        d_weight = d_weight + _dot(h, d_logits, ((0, 1), (0, 1)))  # [D, V]
        return d_weight, (nll, log_normalizer, d_h)

    d_weight = _in_layout(jnp.zeros(lm_head.shape, jnp.float32), gathered)
    d_weight, (nll, log_normalizer, d_hidden) = jax.lax.scan(
        one_chunk, d_weight, (hidden, targets, nll_weights, lse_square_weights)
    )
    loss = _weighted(nll, log_normalizer, nll_weights, lse_square_weights)
    d_weight = _in_layout(d_weight, gathered)  # the loop's sum in one layout: reduced after it
    residuals = (d_hidden, d_weight.astype(lm_head.dtype), nll, log_normalizer)
    return (loss, nll, log_normalizer), residuals


def _chunk_losses_backward(static, residuals, cotangents):
    """The forward's gradients times the loss's cotangent. The per-position values' cotangents
    are zero: `chunked_lm_loss` stops their gradient."""
    del static  # d(lm_head) goes back to the lm_head's layout wherever XLA places it
    d_hidden, d_weight, nll, log_normalizer = residuals
    g = cotangents[0]

    def scaled(x):
        return (g * x).astype(x.dtype)

    return scaled(d_hidden), scaled(d_weight), None, g * nll, g * jnp.square(log_normalizer)


_chunk_losses.defvjp(_chunk_losses_forward, _chunk_losses_backward)


def _token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 per-position terms of logits in any dtype (the convert fuses into their reads)."""
    return loss.token_losses(logits.astype(jnp.float32), targets, logsumexp=_logsumexp)


def _logsumexp(logits: jax.Array, axis: int = -1) -> jax.Array:
    """logsumexp over `axis` in one pass: a running (max, sum of exp(x - max)) pair per
    position, where `jax.nn.logsumexp` reads the fp32 logits twice (max, then the sum): 5.8 ms of
    a bench-h200 step each on an H200; with two exps a combine this pass took 10.2 ms, compute
    bound (benchmarks/RESULTS.md). Not differentiable (the forward's own gradient uses it)."""

    def combine(a, b):  # one exp a combine: the smaller max's sum is scaled down to the larger
        (max_a, sum_a), (max_b, sum_b) = a, b
        top, low = jnp.maximum(max_a, max_b), jnp.minimum(max_a, max_b)
        scale = jnp.where(top == -jnp.inf, 0.0, jnp.exp(low - top))  # two empty pairs: (-inf, 0)
        return top, jnp.where(max_a >= max_b, sum_a + sum_b * scale, sum_a * scale + sum_b)

    start = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0.0, logits.dtype))
    top, total = jax.lax.reduce((logits, jnp.ones_like(logits)), start, combine,
                                (axis % logits.ndim,))  # fmt: skip
    return top + jnp.log(total)


def _dot(x: jax.Array, y: jax.Array, contracting: tuple) -> jax.Array:
    """x · y over the `contracting` (x axes, y axes), fp32 accumulation, mixed input dtypes."""
    return jax.lax.dot_general(x, y, (contracting, ((), ())), preferred_element_type=jnp.float32)

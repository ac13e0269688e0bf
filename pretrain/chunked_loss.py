"""Cross-entropy from the final-normed hidden states, computed in token chunks, so that neither the
forward nor the backward pass holds the [tokens, vocab] fp32 logits.

`chunked_token_losses(hidden, lm_head, targets)` returns what `pretrain/loss.py: token_losses`
returns for `logits = M3Model.head(hidden)`: per-position cross-entropy and logsumexp, [B, S] fp32.
It multiplies by the lm_head itself, as `M3Model.head` does (the weight cast to the hidden states'
dtype, fp32 accumulation), one chunk of tokens at a time under `lax.map`. A `jax.custom_vjp`
keeps only each position's logsumexp for the backward pass, which recomputes a chunk's logits,
turns them into d(logits) = (g_nll + g_lse) · softmax - g_nll · onehot(target) and multiplies back:
d(hidden) per chunk, d(lm_head) accumulated over chunks in fp32. The gradients of both outputs are
exact (the z-loss differentiates the logsumexp).

Memory: the temporaries are two [chunk_tokens, V] fp32 arrays (a chunk's logits and their
softmax / gradient), whatever the number of tokens; the lm_head's fp32 gradient accumulates in the
output's buffer. XLA's CPU buffer assignment at V = 200,064, D = 256 (tests/pretrain/
test_chunked_loss.py): 0.42 GB with 256-token chunks for 4096 or 8192 tokens, 3.3 GB with 2048;
the plain path holds two [N, V] fp32 arrays, 6.6 GB for 4096 tokens.

bf16 numerics: bf16 products with fp32 accumulation forward and backward, d(logits) rounded to
bf16 before its two products (jax's transpose of the plain path multiplies fp32 d(logits) by the
bf16 operands: fp32 GEMMs, 192 of 1,177 ms of a bench-h200 step on an H200, benchmarks/
RESULTS.md); d(lm_head) accumulates in fp32. In float32 the gradients are the plain path's.

Data parallelism: each chunk's d(lm_head) is a partial sum over a device's tokens. On CPU (4 fake
devices) XLA keeps its all-reduce inside the backward loop, one [D, V] reduction per chunk instead
of one (`benchmarks/bench_chunked_loss.py --collectives` counts them); XLA's GPU pipeline runs
WhileLoopAllReduceCodeMotion, which exists to hoist such reductions (not yet measured on GPUs).

Chunk j holds positions j, j + n, j + 2n, ... of every row (n chunks): each chunk keeps the batch
and sequence axes, so their sharding over the data-parallel and seq mesh axes carries over to every
chunk, where chunks of consecutive flattened tokens would put the scan on a sharded axis. A row
length that is not a multiple of n is padded (padded positions get no gradient). `chunk_tokens`
counts the tokens of the arrays given, all devices together: each device holds its share of a
chunk (chunk_tokens / data-parallel devices rows).

It lives in pretrain/, not m3jax/: it is a training loss (targets, a custom gradient); the model's
part is the normed hidden states and the lm_head (`Functional.apply_normed_with_mtp`).

Shapes: B batch, S sequence, D model width, V vocab, N tokens; `chunks` of `per_row` positions per
row.
"""

import jax
import jax.numpy as jnp


def chunked_token_losses(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    chunk_tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-position (cross-entropy, logsumexp), each [B, S] fp32, of the logits hidden @ lm_head.

    hidden: [B, S, D] final-normed hidden states (the model's dtype); lm_head: [D, V] (any float
    dtype; cast to hidden's, as M3Model.head does); targets: [B, S] int in [0, V).
    chunk_tokens: the most tokens whose logits exist at once (at least one per row: B).
    """
    if chunk_tokens < 1:
        raise ValueError(f"{chunk_tokens=} must be >= 1")
    batch, seq, dim = hidden.shape
    num_chunks = -(-seq // max(1, chunk_tokens // batch))
    per_row = -(
        -seq // num_chunks
    )  # the fewest positions per row that n chunks need: padding < num_chunks
    pad = num_chunks * per_row - seq
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # position c·num_chunks + j -> chunk j, row entry c: [B, S] -> [chunks, B, per_row]
    hidden = hidden.reshape(batch, per_row, num_chunks, dim).transpose(2, 0, 1, 3)
    targets = targets.reshape(batch, per_row, num_chunks).transpose(2, 0, 1)
    nll, log_normalizer = _chunk_losses(hidden, lm_head, targets)

    def unchunked(x):  # [chunks, B, per_row] -> [B, S]
        return x.transpose(1, 2, 0).reshape(batch, per_row * num_chunks)[:, :seq]

    return unchunked(nll), unchunked(log_normalizer)


def _logits(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """[B, per_row, D] x [D, V] -> [B, per_row, V] fp32: M3Model.head's product (weight cast)."""
    return jnp.einsum("bcd,dv->bcv", hidden, weight, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _chunk_losses(hidden, lm_head, targets):
    """hidden [chunks, B, per_row, D], lm_head [D, V], targets [chunks, B, per_row] -> (nll,
    logsumexp) [chunks, B, per_row]."""
    weight = lm_head.astype(hidden.dtype)

    def one_chunk(chunk):
        h, t = chunk
        logits = _logits(h, weight)
        log_normalizer = jax.nn.logsumexp(logits, axis=-1)
        target_logits = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return log_normalizer - target_logits, log_normalizer

    return jax.lax.map(one_chunk, (hidden, targets))


def _chunk_losses_forward(hidden, lm_head, targets):
    nll, log_normalizer = _chunk_losses(hidden, lm_head, targets)
    return (nll, log_normalizer), (hidden, lm_head, targets, log_normalizer)


def _chunk_losses_backward(residuals, cotangents):
    hidden, lm_head, targets, log_normalizer = residuals
    d_nll, d_log_normalizer = cotangents
    weight = lm_head.astype(hidden.dtype)
    vocab = lm_head.shape[1]

    def one_chunk(d_weight, chunk):
        h, t, lse, g_nll, g_lse = chunk
        softmax = jnp.exp(_logits(h, weight) - lse[..., None])  # [B, per_row, V]
        is_target = t[..., None] == jnp.arange(vocab)
        # nll = lse - logit[t]: d/dlogits = softmax - onehot; lse: softmax
        d_logits = (g_nll + g_lse)[..., None] * softmax - jnp.where(is_target, g_nll[..., None], 0)
        # d_logits in the operands' dtype: bf16 products with fp32 accumulation on tensor cores
        # (fp32 d_logits made both products fp32 GEMMs: 16 % of a bench-h200 step on an H200)
        d_logits = d_logits.astype(h.dtype)
        d_h = _dot(d_logits, weight, ((2,), (1,))).astype(h.dtype)  # [B, per_row, D]
        d_weight = d_weight + _dot(h, d_logits, ((0, 1), (0, 1)))  # [D, V]
        return d_weight, d_h

    d_weight = jnp.zeros(lm_head.shape, jnp.float32)
    d_weight, d_hidden = jax.lax.scan(
        one_chunk, d_weight, (hidden, targets, log_normalizer, d_nll, d_log_normalizer)
    )
    return d_hidden, d_weight.astype(lm_head.dtype), None


_chunk_losses.defvjp(_chunk_losses_forward, _chunk_losses_backward)


def _dot(x: jax.Array, y: jax.Array, contracting: tuple) -> jax.Array:
    """x · y over the `contracting` (x axes, y axes), fp32 accumulation, mixed input dtypes."""
    return jax.lax.dot_general(x, y, (contracting, ((), ())), preferred_element_type=jnp.float32)

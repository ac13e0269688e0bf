"""Training losses: next-token cross-entropy on masked targets, z-loss, MoE load-balance loss, and
the per-document-kind breakdown of the LM loss that multimodal runs log."""

import jax
import jax.numpy as jnp


def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position cross-entropy and logsumexp, each [B, S], from logits [B, S, V] fp32."""
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - target_logits, log_normalizer


def masked_mean(values: jax.Array, weight: jax.Array, *, empty: float = 0.0) -> jax.Array:
    """Σ weight·values / Σ weight; `empty` when no weight is positive."""
    weight = weight.astype(jnp.float32)
    total = weight.sum()
    return jnp.where(total > 0, (values * weight).sum() / jnp.maximum(total, 1e-9), empty)


def document_kinds(segment_ids: jax.Array, modality: jax.Array) -> jax.Array:
    """[B, S]: 2 where the token's document (piece) in this row holds video tokens, else 1 where it
    holds image tokens, else 0 (text only). modality: [B, S], 0 text / 1 image / 2 video."""
    batch, seq = segment_ids.shape
    ids = (jnp.arange(batch)[:, None] * (seq + 1) + segment_ids).reshape(-1)
    kind = jax.ops.segment_max(
        modality.astype(jnp.int32).reshape(-1), ids, num_segments=batch * (seq + 1)
    )
    return kind[ids].reshape(batch, seq)


def load_balance_loss(load: jax.Array, score_share: jax.Array, experts_per_token: int) -> jax.Array:
    """E · Σ_e f_e · P_e averaged over layers (Switch/DeepSeek form; 1.0 when perfectly balanced).

    load, score_share: [layers, E]: tokens routed to e, and the sum over tokens of e's normalised
    router score. f_e = load_e / (k · tokens), P_e = score_share_e / tokens.
    """
    tokens = jnp.maximum(score_share.sum(-1, keepdims=True), 1.0)
    fraction = load / (experts_per_token * tokens)
    share = score_share / tokens
    return (load.shape[-1] * (fraction * share).sum(-1)).mean()

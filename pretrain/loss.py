"""Training losses: next-token cross-entropy on masked targets, z-loss, MoE load-balance loss."""

import jax
import jax.numpy as jnp


def next_token_loss(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and mean logsumexp² over positions where loss_mask > 0.

    logits: [B, S, V] fp32; targets: [B, S] int32; loss_mask: [B, S] (0 for padding, for the last
    token of a document and, in multimodal rows, for non-text targets).
    """
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weight = loss_mask.astype(jnp.float32)
    count = jnp.maximum(weight.sum(), 1.0)
    nll = ((log_normalizer - target_logits) * weight).sum() / count
    z_loss = (jnp.square(log_normalizer) * weight).sum() / count
    return nll, z_loss


def load_balance_loss(load: jax.Array, score_share: jax.Array, experts_per_token: int) -> jax.Array:
    """E · Σ_e f_e · P_e averaged over layers (Switch/DeepSeek form; 1.0 when perfectly balanced).

    load, score_share: [layers, E]: tokens routed to e, and the sum over tokens of e's normalised
    router score. f_e = load_e / (k · tokens), P_e = score_share_e / tokens.
    """
    tokens = jnp.maximum(score_share.sum(-1, keepdims=True), 1.0)
    fraction = load / (experts_per_token * tokens)
    share = score_share / tokens
    return (load.shape[-1] * (fraction * share).sum(-1)).mean()

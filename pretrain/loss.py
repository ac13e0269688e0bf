"""Training losses: next-token cross-entropy on masked targets, z-loss, MoE load-balance loss,
multi-token-prediction targets, the per-document-kind breakdown of the LM loss that multimodal runs
log, `loss_totals`: the denominators of these means over a whole batch, which lets a batch's
loss be computed in parts (gradient accumulation, evaluation) that add up to it exactly, and
`total_loss`: the one place the terms are weighted and added."""

import jax
import jax.numpy as jnp

from batch_format.batch import Batch
from batch_format.modality import MODALITIES
from m3jax.mtp import depth_segment_ids, shifted
from pretrain.config import RunConfig


def total_loss(run: RunConfig, *, lm, mtp_nll=0.0, balance=0.0, indexer_kl=0.0) -> jax.Array:
    """lm (LM cross-entropy + z_loss_weight · z-loss, as `lm_weights` weighs them) +
    mtp.loss_weight · mean MTP LM loss + moe.balance_loss_weight · balance loss + msa.kl_weight ·
    Σ indexer KL over MSA layers (whose gradient reaches only the indexers). A term a model lacks
    is 0.0."""
    model = run.model
    loss = lm + model.mtp.loss_weight * mtp_nll
    return loss + model.moe.balance_loss_weight * balance + model.msa.kl_weight * indexer_kl


def lm_weights(run: RunConfig, mask: jax.Array, total: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position weights of the cross-entropy and of the squared logsumexp in `total_loss`'s
    lm term (pretrain/chunked_loss.py): a masked mean over the batch's `total` targets, and
    z_loss_weight times it."""
    weights = mean_weights(mask, total)
    return weights, run.optimizer.z_loss_weight * weights


def mean_weights(mask: jax.Array, total: jax.Array) -> jax.Array:
    """w with Σ w·x = masked_mean(x, mask, total=total): mask / total, 0 where total is 0. A NaN
    in the mask stays NaN (so does a NaN total): a poisoned batch must make the loss non-finite
    and the step be skipped (pretrain/faults.py), not weigh nothing."""
    empty = total == 0
    return jnp.where(empty, 0.0, mask.astype(jnp.float32) / jnp.where(empty, 1.0, total))


def token_losses(
    logits: jax.Array, targets: jax.Array, logsumexp=jax.nn.logsumexp
) -> tuple[jax.Array, jax.Array]:
    """Per-position cross-entropy and logsumexp, each [B, S], from logits [B, S, V] fp32
    (`logsumexp` over the last axis: pretrain/chunked_loss.py passes its one-pass reduction)."""
    log_normalizer = logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - target_logits, log_normalizer


def masked_mean(
    values: jax.Array, weight: jax.Array, *, empty: float = 0.0, total: jax.Array | None = None
) -> jax.Array:
    """Σ weight·values / Σ weight; `empty` when no weight is positive. `total` replaces Σ weight
    by the weight of a whole batch this one is a part of (`loss_totals`)."""
    weight = weight.astype(jnp.float32)
    total = weight.sum() if total is None else total
    return jnp.where(total > 0, (values * weight).sum() / jnp.maximum(total, 1e-9), empty)


def mtp_targets(batch: Batch, depth: int) -> tuple[jax.Array, jax.Array]:
    """(targets, loss weight) [B, S] of MTP module `depth`: the target depth + 1 positions ahead,
    weighted where that target is in the same document piece and carries loss."""
    segment_ids = depth_segment_ids(batch.segment_ids, depth)
    weight = shifted(batch.loss_mask, depth + 1) * (segment_ids > 0)
    return shifted(batch.targets, depth + 1), weight


def modality_weights(batch: Batch) -> dict[str, jax.Array]:
    """Loss weights [B, S] of the LM loss's multimodal breakdown: "<kind>_docs" (targets in
    text-only documents, documents with images, with video) and "after_<modality>" (targets whose
    input token is text, an image's or a video frame's closing bracket)."""
    kinds = document_kinds(batch.segment_ids, batch.modality)
    weights = {}
    for code, name in enumerate(MODALITIES):
        weights[f"{name}_docs"] = batch.loss_mask * (kinds == code)
        weights[f"after_{name}"] = batch.loss_mask * (batch.modality == code)
    return weights


def loss_totals(batch: Batch, num_mtp_modules: int, parts: int) -> dict:
    """The denominators of the loss's means over `batch` (a whole step's or evaluation's rows),
    and `parts`: how many pieces of it are evaluated separately (their means then add up)."""
    real = batch.segment_ids > 0
    totals = {"loss_mask": batch.loss_mask.astype(jnp.float32).sum(), "tokens": real.sum()}
    if batch.modality is not None:
        totals.update({group: weight.sum() for group, weight in modality_weights(batch).items()})
    for depth in range(num_mtp_modules):
        totals[f"mtp{depth}"] = mtp_targets(batch, depth)[1].sum()
        totals[f"mtp{depth}_tokens"] = (depth_segment_ids(batch.segment_ids, depth) > 0).sum()
    return {**totals, "parts": jnp.float32(parts)}


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

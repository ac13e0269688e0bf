"""One optimizer step as a pure function of (state, batch), for `jax.jit`.

state = {"step", "params", "buffers", "opt_state"}: nested dicts of arrays, what Orbax saves.
loss = LM cross-entropy + z_loss_weight · z-loss + balance_loss_weight · MoE balance loss
       + msa.kl_weight · Σ_sparse layers indexer KL (whose gradient reaches only the indexers).
After the update, each router's correction bias moves toward balanced load (outside the optimizer).
A step whose loss or gradient norm is not finite changes nothing but `step` (pretrain/faults.py).
The loads are global, all tokens of the step on any mesh: routing statistics are computed outside
the expert-parallel shard_map (m3jax/moe.py).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from m3jax.attention import ForwardMode
from m3jax.model import Functional
from m3jax.vision_inputs import from_packed_rows
from pretrain.config import RunConfig
from pretrain.faults import keep_finite
from pretrain.loss import document_kinds, load_balance_loss, masked_mean, token_losses
from pretrain.optimizer import applied_updates

Batch = dict[str, jax.Array]  # tokens, targets, positions, segment_ids: [B, S] int32; loss_mask


def init_state(model: Functional, optimizer: optax.GradientTransformation, seed: int) -> dict:
    params, buffers = model.init(seed)
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "buffers": buffers,
        "opt_state": optimizer.init(params),
    }


def make_train_step(
    model: Functional,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    run: RunConfig,
) -> Callable[[dict, Batch, ForwardMode], tuple[dict, dict]]:
    """The step function; its ForwardMode argument is static (jit with static_argnums=2)."""
    config = run.model
    sparse_layers = [i for i, kind in enumerate(config.layer_types) if kind == "minimax_m3_sparse"]
    moe_layers = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]

    def loss_fn(params, buffers, batch, mode):
        vision = None
        if "patches" in batch:
            vision = from_packed_rows(
                batch["patches"], batch["patch_positions"], batch["patch_segment_ids"],
                batch["feature_index"], config.vision.spatial_merge_size,
            )  # fmt: skip
        logits, stats = model.apply(
            params, buffers, batch["tokens"], batch["positions"], batch["segment_ids"], vision,
            mode=mode,
        )  # fmt: skip
        token_nll, log_normalizer = token_losses(logits, batch["targets"])
        nll = masked_mean(token_nll, batch["loss_mask"])
        z_loss = masked_mean(jnp.square(log_normalizer), batch["loss_mask"])
        metrics = {"nll": nll, "z_loss": z_loss}
        if "modality" in batch:
            metrics.update(_modality_metrics(token_nll, batch))
        loss = nll + run.optimizer.z_loss_weight * z_loss
        moe_stats = [s["moe"] for s in stats if "moe" in s]
        if moe_stats:
            load = jnp.concatenate([s["load"] for s in moe_stats])  # [MoE layers, E]
            share = jnp.concatenate([s["score_share"] for s in moe_stats])
            balance = load_balance_loss(load, share, config.moe.experts_per_token)
            loss += config.moe.balance_loss_weight * balance
            metrics["balance_loss"] = balance
            # max/mean tokens per expert, averaged over MoE layers: 1.0 = perfectly balanced
            imbalance = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)  # [MoE layers]
            metrics["expert_imbalance"] = imbalance.mean()
            metrics.update({f"expert_imbalance_layer{i}": x for i, x in zip(moe_layers, imbalance)})
            # share of (MoE layer, expert) pairs that got no token this step
            metrics["moe_idle_experts"] = (load == 0).mean()
            if config.moe.dispatch == "capacity":
                dropped = jnp.concatenate([s["dropped_fraction"] for s in moe_stats])
                metrics["moe_dropped_fraction"] = dropped.mean()
            if config.moe.dispatch == "dropless" and config.moe.exchange == "padded":
                # share of MoE layers whose exchange needed worst-case blocks (expert parallel)
                worst_case = jnp.concatenate([s["exchange_worst_case"] for s in moe_stats])
                metrics["moe_exchange_worst_case"] = worst_case.mean()
        for name in ("kl", "recall"):
            per_layer = [s["msa"][name] for s in stats if name in s.get("msa", {})]
            if not per_layer:
                continue
            per_layer = jnp.concatenate(per_layer)  # [sparse layers], in layer order
            if name == "kl":
                loss += config.msa.kl_weight * per_layer.sum()
            metrics[f"msa_{name}"] = per_layer.mean()
            metrics.update({f"msa_{name}_layer{i}": x for i, x in zip(sparse_layers, per_layer)})
        return loss, (metrics, stats)

    def train_step(state: dict, batch: Batch, mode: ForwardMode) -> tuple[dict, dict]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (metrics, stats)), grads = grad_fn(state["params"], state["buffers"], batch, mode)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "buffers": model.rebalanced(state["buffers"], stats, config.moe.bias_update_rate),
            "opt_state": opt_state,
        }
        grad_norm = optax.tree.norm(grads)
        new_state, skipped = keep_finite(state, new_state, loss, grad_norm)
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            lr=schedule(applied_updates(state["opt_state"])),  # the LR this update used
            tokens=(batch["segment_ids"] > 0).sum(),
            skipped=skipped,
        )
        return new_state, metrics

    return train_step


MODALITIES = ("text", "image", "video")  # data.mm_loader's modality codes 0, 1, 2


def _modality_metrics(token_nll: jax.Array, batch: Batch) -> dict:
    """Tokens per modality, and the LM loss (text targets only) split by the kind of document the
    token belongs to: text-only, with images, with video. NaN where a batch has no such document."""
    real = batch["segment_ids"] > 0
    kinds = document_kinds(batch["segment_ids"], batch["modality"])
    metrics = {}
    for code, name in enumerate(MODALITIES):
        metrics[f"{name}_tokens"] = ((batch["modality"] == code) & real).sum()
        weight = batch["loss_mask"] * (kinds == code)
        metrics[f"nll_{name}_docs"] = masked_mean(token_nll, weight, empty=jnp.nan)
    return metrics

"""One optimizer step as a pure function of (state, batch), for `jax.jit`.

state = {"step", "params", "buffers", "opt_state"}: nested dicts of arrays, what Orbax saves.
loss = LM cross-entropy + z_loss_weight · z-loss + balance_loss_weight · MoE balance loss
       + msa.kl_weight · Σ_sparse layers indexer KL (whose gradient reaches only the indexers)
       + mtp.loss_weight · mean over MTP modules of their LM loss (m3jax/mtp.py).
After the update, each router's correction bias moves toward balanced load (outside the optimizer).
A step whose loss or gradient norm is not finite changes nothing but `step` (pretrain/faults.py).
The loads are global, all tokens of the step on any mesh: routing statistics are computed outside
the expert-parallel shard_map (m3jax/moe/layer.py). The LM losses (trunk and MTP modules) are computed
from the final-normed hidden states and the lm_head in chunks of `train.loss_chunk_tokens`
tokens (pretrain/chunked_loss.py): no [B, S, V] logits exist, forward or backward.

`make_loss_fn` is also the evaluation's forward (pretrain/evaluation.py). Its means are taken over
`totals`, the whole batch's denominators (pretrain/loss.py: loss_totals), so the loss of a batch
evaluated in parts — micro-batches (train.grad_accum_steps, pretrain/accumulation.py) or
evaluation batches — is the sum of the parts' losses, and so are its gradients and metrics.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from m3jax.attention import ForwardMode
from m3jax.model import Functional
from m3jax.vision_inputs import from_packed_rows
from pretrain.accumulation import accumulated
from pretrain.chunked_loss import chunked_token_losses
from pretrain.config import RunConfig
from pretrain.faults import keep_finite
from pretrain.loss import (
    MODALITIES,
    load_balance_loss,
    loss_totals,
    masked_mean,
    modality_weights,
    mtp_targets,
)
from pretrain.optimizer import applied_updates

Batch = dict[str, jax.Array]  # tokens, targets, positions, segment_ids: [B, S] int32; loss_mask
LossFn = Callable[[dict, dict, Batch, ForwardMode, dict], tuple[jax.Array, tuple[dict, list]]]


def init_state(model: Functional, optimizer: optax.GradientTransformation, seed: int) -> dict:
    params, buffers = model.init(seed)
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "buffers": buffers,
        "opt_state": optimizer.init(params),
    }


def make_loss_fn(model: Functional, run: RunConfig) -> LossFn:
    """loss_fn(params, buffers, batch, mode, totals) -> (loss, (metrics, loads)).

    loads: per layer stack, then per MTP module, the tokens routed to each expert ([layers, E];
    None without MoE). Every metric adds up over the parts of a batch (see the module docstring).
    """
    config = run.model
    labels = _layer_labels(config)

    def loss_fn(params, buffers, batch, mode, totals):
        vision = None
        if config.vision is not None and "patches" in batch:
            vision = from_packed_rows(
                batch["patches"], batch["patch_positions"], batch["patch_segment_ids"],
                batch["feature_index"], config.vision.spatial_merge_size,
            )  # fmt: skip
        normed, stats, mtp = model.apply_normed_with_mtp(
            params, buffers, batch["tokens"], batch["positions"], batch["segment_ids"], vision,
            mode=mode,
        )  # fmt: skip

        def lm_losses(hidden, targets):  # per position (nll, logsumexp) [B, S] of the lm_head
            return chunked_token_losses(
                hidden, params["lm_head"], targets, chunk_tokens=run.train.loss_chunk_tokens
            )

        token_nll, log_normalizer = lm_losses(normed, batch["targets"])
        nll = masked_mean(token_nll, batch["loss_mask"], total=totals["loss_mask"])
        z_loss = masked_mean(
            jnp.square(log_normalizer), batch["loss_mask"], total=totals["loss_mask"]
        )
        metrics = {"nll": nll, "z_loss": z_loss}
        if "modality" in batch:
            metrics.update(_modality_metrics(token_nll, batch, totals))
        loss = nll + run.optimizer.z_loss_weight * z_loss
        if mtp:
            mtp_loss, mtp_metrics = _mtp_loss(mtp, batch, totals, lm_losses)
            loss += config.mtp.loss_weight * mtp_loss
            metrics.update(mtp_metrics)
        # MTP layers as one-layer stacks, after the trunk's (their tokens: the module's pieces)
        layer_stats = stats + [jax.tree.map(lambda x: x[None], s) for s in mtp]
        token_shares = [_share(batch["segment_ids"], totals["tokens"])] * len(stats) + [
            _share(s["segment_ids"], totals[f"mtp{d}_tokens"]) for d, s in enumerate(mtp)
        ]
        moe_loss, moe_metrics = _moe_loss(layer_stats, totals["parts"], config)
        msa_loss, msa_metrics = _msa_loss(layer_stats, token_shares, labels["msa"], config)
        metrics.update(moe_metrics, **msa_metrics)
        loads = [s["moe"]["load"] if "moe" in s else None for s in layer_stats]
        return loss + moe_loss + msa_loss, (metrics, loads)

    return loss_fn


def make_train_step(
    model: Functional,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    run: RunConfig,
) -> Callable[[dict, Batch, ForwardMode], tuple[dict, dict]]:
    """The step function; its ForwardMode argument is static (jit with static_argnums=2)."""
    config, parts = run.model, run.train.grad_accum_steps
    loss_and_grad = jax.value_and_grad(make_loss_fn(model, run), has_aux=True)
    labels = _layer_labels(config)

    def train_step(state: dict, batch: Batch, mode: ForwardMode) -> tuple[dict, dict]:
        totals = loss_totals(batch, config.mtp.num_modules, parts)
        (loss, (metrics, loads)), grads = accumulated(loss_and_grad, parts)(
            state["params"], state["buffers"], batch, mode, totals
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        buffers = model.rebalanced(state["buffers"], loads, config.moe.bias_update_rate)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "buffers": buffers,
            "opt_state": opt_state,
        }
        metrics.update(_load_metrics(loads, labels["moe"]))
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


def _layer_labels(config) -> dict[str, list[str]]:
    """Metric suffixes of the MoE and MSA layers, in the order of the stats: "layer3", "mtp0"."""
    mtp = [f"mtp{d}" for d in range(config.mtp.num_modules)]
    moe = [f"layer{i}" for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]
    msa = [f"layer{i}" for i, kind in enumerate(config.layer_types) if kind == "minimax_m3_sparse"]
    return {
        "moe": moe + (mtp if config.mlp_layer_types[-1] == "sparse" else []),
        "msa": msa + (mtp if config.layer_types[-1] == "minimax_m3_sparse" else []),
    }


def _share(segment_ids: jax.Array, total: jax.Array) -> jax.Array:
    """This part's share of the whole batch's real tokens (MSA statistics are means over them)."""
    return (segment_ids > 0).sum() / jnp.maximum(total, 1)


def _mtp_loss(outputs: list[dict], batch: Batch, totals: dict, lm_losses) -> tuple[jax.Array, dict]:
    """Mean over MTP modules of their LM loss on targets depth + 2 ahead; per module too."""
    losses = []
    for depth, output in enumerate(outputs):
        targets, weight = mtp_targets(batch, depth)
        token_nll, _ = lm_losses(output["normed"], targets)
        losses.append(masked_mean(token_nll, weight, total=totals[f"mtp{depth}"]))
    mean = sum(losses) / len(losses)
    return mean, {"mtp_nll": mean, **{f"mtp_nll{d}": x for d, x in enumerate(losses)}}


def _moe_loss(layer_stats: list[dict], parts, config) -> tuple[jax.Array, dict]:
    """The balance loss and the capacity / exchange statistics, each a mean over the parts."""
    moe_stats = [s["moe"] for s in layer_stats if "moe" in s]
    if not moe_stats:
        return 0.0, {}
    load = jnp.concatenate([s["load"] for s in moe_stats])  # [MoE layers, E]
    share = jnp.concatenate([s["score_share"] for s in moe_stats])
    # a product of batch means: per part, not of the whole batch (README: grad_accum_steps)
    balance = load_balance_loss(load, share, config.moe.experts_per_token) / parts
    dropped = jnp.concatenate([s["dropped_fraction"] for s in moe_stats])
    # share of MoE layers whose exchange needed worst-case blocks (0 but for the padded exchange)
    worst_case = jnp.concatenate([s["exchange_worst_case"] for s in moe_stats])
    metrics = {
        "balance_loss": balance,
        "moe_dropped_fraction": dropped.mean() / parts,  # 0 but for capacity dispatch
        "moe_exchange_worst_case": worst_case.mean() / parts,
    }
    return config.moe.balance_loss_weight * balance, metrics


def _msa_loss(layer_stats, token_shares, labels, config) -> tuple[jax.Array, dict]:
    """λ · Σ indexer KL over sparse layers; KL and block recall as means over tokens."""
    loss, metrics = 0.0, {}
    for name in ("kl", "recall"):
        per_layer = [
            s["msa"][name] * share
            for s, share in zip(layer_stats, token_shares)
            if name in s.get("msa", {})
        ]
        if not per_layer:
            continue
        per_layer = jnp.concatenate(per_layer)  # [sparse layers], in layer order
        if name == "kl":
            loss = config.msa.kl_weight * per_layer.sum()
        metrics[f"msa_{name}"] = per_layer.mean()
        metrics.update({f"msa_{name}_{label}": x for label, x in zip(labels, per_layer)})
    return loss, metrics


def _load_metrics(loads: list, labels: list[str]) -> dict:
    """Expert balance of the whole step (all its parts): max/mean tokens per expert averaged over
    MoE layers (1.0 = perfectly balanced), per layer, and the share of idle (layer, expert)s."""
    loads = [load for load in loads if load is not None]
    if not loads:
        return {}
    load = jnp.concatenate(loads)  # [MoE layers, E]
    imbalance = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)  # [MoE layers]
    return {
        "expert_imbalance": imbalance.mean(),
        **{f"expert_imbalance_{label}": x for label, x in zip(labels, imbalance)},
        "moe_idle_experts": (load == 0).mean(),
    }


def _modality_metrics(token_nll: jax.Array, batch: Batch, totals: dict) -> dict:
    """Tokens per modality, and the LM loss (text targets only) by document kind and by input
    modality (`nll_<kind>_docs`, `nll_after_<modality>`: pretrain/loss.py modality_weights); NaN
    where a batch has none."""
    real = batch["segment_ids"] > 0
    metrics = {
        f"{name}_tokens": ((batch["modality"] == code) & real).sum()
        for code, name in enumerate(MODALITIES)
    }
    for group, weight in modality_weights(batch).items():
        metrics[f"nll_{group}"] = masked_mean(token_nll, weight, empty=jnp.nan, total=totals[group])
    return metrics

"""The metrics of a step from its layers' typed statistics (m3jax/decoder.py: LayerStats), and the
loss terms those statistics carry (the MoE balance loss, the indexer KL); pretrain/loss.py adds
the terms up. Every metric adds up over the parts of a batch (pretrain/accumulation.py): means
are taken over the whole batch's totals, or divided by the number of parts."""

import jax
import jax.numpy as jnp

from batch_format.batch import Batch
from batch_format.modality import MODALITIES
from m3jax.config import ModelConfig
from m3jax.decoder import LayerStats
from m3jax.mtp import MTPOutput
from pretrain.loss import load_balance_loss, masked_mean, modality_weights


def layer_labels(config: ModelConfig) -> dict[str, list[str]]:
    """Metric suffixes of the MoE and MSA layers, in the order of the stats: "layer3", "mtp0"."""
    mtp = [f"mtp{d}" for d in range(config.mtp.num_modules)]
    moe = [f"layer{i}" for i in config.moe_layers]
    msa = [f"layer{i}" for i in config.msa_layers]
    return {
        "moe": moe + (mtp if config.mlp_layer_types[-1] == "moe" else []),
        "msa": msa + (mtp if config.layer_types[-1] == "msa" else []),
    }


def layer_stats(trunk: list[LayerStats], mtp: list[MTPOutput]) -> list[LayerStats]:
    """The trunk's stacks' stats, then each MTP module's as a one-layer stack."""
    return trunk + [jax.tree.map(lambda x: x[None], output.stats) for output in mtp]


def router_loads(stats: list[LayerStats]) -> list[jax.Array | None]:
    """Per stack (then MTP module), the tokens routed to each expert [layers, E]; None without
    MoE. What `Functional.rebalanced` moves the router biases by."""
    return [None if s.moe is None else s.moe.load for s in stats]


def moe_metrics(stats: list[LayerStats], parts, experts_per_token: int) -> dict:
    """The balance loss and the capacity / exchange statistics, each a mean over the parts; {}
    without MoE."""
    moe = [s.moe for s in stats if s.moe is not None]
    if not moe:
        return {}
    load = jnp.concatenate([s.load for s in moe])  # [MoE layers, E]
    share = jnp.concatenate([s.score_share for s in moe])
    dropped = jnp.concatenate([s.dropped_fraction for s in moe])
    worst_case = jnp.concatenate([s.exchange_worst_case for s in moe])
    # a product of batch means: per part, not of the whole batch (README: grad_accum_steps)
    return {
        "balance_loss": load_balance_loss(load, share, experts_per_token) / parts,
        "moe_dropped_fraction": dropped.mean() / parts,  # 0 but for capacity dispatch
        # share of MoE layers whose exchange needed worst-case blocks (0 but for the padded one)
        "moe_exchange_worst_case": worst_case.mean() / parts,
    }


def msa_metrics(stats: list[LayerStats], token_shares: list, labels: list[str]):
    """(Σ indexer KL over the MSA layers, or 0.0 without it; KL and block recall as means over
    tokens, overall and per layer)."""
    kl_sum, metrics = 0.0, {}
    for name in ("kl", "recall"):
        per_layer = [
            getattr(s.msa, name) * share
            for s, share in zip(stats, token_shares)
            if s.msa is not None and getattr(s.msa, name) is not None
        ]
        if not per_layer:
            continue
        per_layer = jnp.concatenate(per_layer)  # [MSA layers], in layer order
        if name == "kl":
            kl_sum = per_layer.sum()
        metrics[f"msa_{name}"] = per_layer.mean()
        metrics.update({f"msa_{name}_{label}": x for label, x in zip(labels, per_layer)})
    return kl_sum, metrics


def with_sunk_kl(
    kl_weight: float, loss: jax.Array, metrics: dict, sink_grads: list, labels: list[str]
) -> tuple[jax.Array, dict]:
    """(loss, metrics) of a step whose trunk's MSA layers sent their KLs to sinks (m3jax/model.py:
    `Functional.kl_sinks`): each layer's KL, its sink's gradient, added to its `msa_kl_<label>`
    (0 from the loss function; the trunk's layers come first in `labels`), `msa_kl` their mean
    again, and kl_weight · their sum to the loss."""
    sunk = jnp.concatenate([g for g in sink_grads if g is not None])
    names = [f"msa_kl_{label}" for label in labels]
    per_layer = jnp.stack([metrics[name] for name in names]).at[: sunk.shape[0]].add(sunk)
    metrics = {**metrics, **dict(zip(names, per_layer, strict=True)), "msa_kl": per_layer.mean()}
    return loss + kl_weight * sunk.sum(), metrics


def token_share(segment_ids: jax.Array, total: jax.Array) -> jax.Array:
    """This part's share of the whole batch's real tokens (MSA statistics are means over them)."""
    return (segment_ids > 0).sum() / jnp.maximum(total, 1)


def load_metrics(loads: list, labels: list[str]) -> dict:
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


def modality_metrics(token_nll: jax.Array, batch: Batch, totals: dict) -> dict:
    """Tokens per modality, and the LM loss (text targets only) by document kind and by input
    modality (`nll_<kind>_docs`, `nll_after_<modality>`: pretrain/loss.py modality_weights); NaN
    where a batch has none."""
    real = batch.segment_ids > 0
    metrics = {
        f"{name}_tokens": ((batch.modality == code) & real).sum()
        for code, name in enumerate(MODALITIES)
    }
    for group, weight in modality_weights(batch).items():
        metrics[f"nll_{group}"] = masked_mean(token_nll, weight, empty=jnp.nan, total=totals[group])
    return metrics

"""One optimizer step as a pure function of (state, batch), for `jax.jit`.

state = {"step", "params", "buffers", "opt_state"}: nested dicts of arrays, what Orbax saves.
The loss is pretrain/loss.py's `total_loss` of the LM losses and of the terms the layers'
statistics carry (pretrain/step_metrics.py, which also turns those statistics into metrics).
After the update, each router's correction bias moves toward balanced load (outside the optimizer).
A step whose loss or gradient norm is not finite changes nothing but `step` (pretrain/faults.py).
The loads are global, all tokens of the step on any mesh: routing statistics are computed outside
the expert-parallel shard_map (m3jax/moe/layer.py). The LM losses (trunk and MTP modules) are
computed from the final-normed hidden states and the lm_head in chunks of
`train.loss_chunk_tokens` tokens (pretrain/chunked_loss.py): no [B, S, V] logits exist, forward or
backward.

`make_loss_fn` is also the evaluation's forward (pretrain/evaluation.py). Its means are taken over
`totals`, the whole batch's denominators (pretrain/loss.py: loss_totals), so the loss of a batch
evaluated in parts — micro-batches (train.grad_accum_steps, pretrain/accumulation.py) or
evaluation batches — is the sum of the parts' losses, and so are its gradients and metrics.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from batch_format.batch import Batch
from m3jax.attention import ForwardMode
from m3jax.model import Functional
from m3jax.mtp import MTPOutput
from m3jax.vision_inputs import from_packed_rows
from pretrain.accumulation import accumulated
from pretrain.chunked_loss import chunked_lm_loss, lm_head_gathered
from pretrain.config import RunConfig
from pretrain.faults import keep_finite
from pretrain.loss import (
    loss_totals,
    lm_weights,
    masked_mean,
    mean_weights,
    mtp_targets,
    total_loss,
)
from pretrain.optimizer import applied_updates
from pretrain.step_metrics import (
    layer_labels,
    layer_stats,
    load_metrics,
    modality_metrics,
    moe_metrics,
    msa_metrics,
    router_loads,
    token_share,
    with_sunk_kl,
)

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
    """loss_fn(params, buffers, batch, mode, totals, kl_sinks=None) -> (loss, (metrics, loads)).

    loads: per layer stack, then per MTP module, the tokens routed to each expert ([layers, E];
    None without MoE). Every metric adds up over the parts of a batch (see the module docstring).
    kl_sinks: `Functional.kl_sinks` or None; with them the trunk's MSA layers' KLs are left out
    of the loss and its metrics (0) and come as the sinks' gradients (`with_sunk_kl`).
    """
    config = run.model
    labels = layer_labels(config)

    def loss_fn(params, buffers, batch, mode, totals, kl_sinks=None):
        vision = None
        if config.vision is not None and batch.vision is not None:
            vision = from_packed_rows(batch.vision, config.vision.spatial_merge_size)
        if kl_sinks is not None:  # the sinks' gradients: this part's share of each layer's KL
            share = token_share(batch.segment_ids, totals["tokens"])
            kl_sinks = [None if s is None else s * share for s in kl_sinks]
        normed, stats, mtp = model.apply_normed_with_mtp(
            params, buffers, batch.tokens, batch.positions, batch.segment_ids, vision, mode=mode,
            kl_sinks=kl_sinks,
        )  # fmt: skip

        gathered = lm_head_gathered(model.param_axes["lm_head"], params["lm_head"].shape,
                                    model.mesh)  # fmt: skip

        def lm_loss(hidden, targets, *weights):  # the weighted LM loss of the lm_head's logits
            return chunked_lm_loss(hidden, params["lm_head"], targets, *weights,
                                   chunk_tokens=run.train.loss_chunk_tokens,
                                   gathered=gathered,
                                   logits_dtype=run.train.logits_dtype)  # fmt: skip

        weights = lm_weights(run, batch.loss_mask, totals["loss_mask"])
        lm = lm_loss(normed, batch.targets, *weights)
        nll = masked_mean(lm.nll, batch.loss_mask, total=totals["loss_mask"])
        z_loss = masked_mean(jnp.square(lm.log_normalizer), batch.loss_mask,
                             total=totals["loss_mask"])  # fmt: skip
        metrics = {"nll": nll, "z_loss": z_loss}
        if batch.modality is not None:
            metrics.update(modality_metrics(lm.nll, batch, totals))
        mtp_nll = 0.0
        if mtp:
            mtp_nll, mtp_metrics = _mtp_loss(mtp, batch, totals, lm_loss)
            metrics.update(mtp_metrics)
        # MTP layers as one-layer stacks, after the trunk's (their tokens: the module's pieces)
        stacks = layer_stats(stats, mtp)
        token_shares = [token_share(batch.segment_ids, totals["tokens"])] * len(stats) + [
            token_share(m.segment_ids, totals[f"mtp{d}_tokens"]) for d, m in enumerate(mtp)
        ]
        metrics.update(moe_metrics(stacks, totals["parts"], config.moe.experts_per_token))
        indexer_kl, msa = msa_metrics(stacks, token_shares, labels["msa"])
        metrics.update(msa)
        loss = total_loss(
            run, lm=lm.loss, mtp_nll=mtp_nll,
            balance=metrics.get("balance_loss", 0.0), indexer_kl=indexer_kl,
        )  # fmt: skip
        return loss, (metrics, router_loads(stacks))

    return loss_fn


def make_train_step(
    model: Functional,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    run: RunConfig,
) -> Callable[[dict, Batch, ForwardMode], tuple[dict, dict]]:
    """The step function; its ForwardMode argument is static (jit with static_argnums=2)."""
    gradients, update = make_step_halves(model, optimizer, schedule, run)

    def train_step(state: dict, batch: Batch, mode: ForwardMode) -> tuple[dict, dict]:
        return update(state, *gradients(state, batch, mode))

    return train_step


def make_step_halves(
    model: Functional,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    run: RunConfig,
) -> tuple[Callable, Callable]:
    """The step as two functions, `gradients(state, batch, mode) -> (grads, computed)`, which
    only reads the state, and `update(state, grads, computed) -> (new_state, metrics)`, which
    writes it: jitted apart, a copy of the state can run beside the first while only the
    second donates it (pretrain/session.py: a save's copy of the state)."""
    config, parts = run.model, run.train.grad_accum_steps
    loss_fn = make_loss_fn(model, run)

    def sunk_loss_fn(differentiated, buffers, batch, mode, totals):
        params, kl_sinks = differentiated
        return loss_fn(params, buffers, batch, mode, totals, kl_sinks)

    # the KL sinks differentiated beside the parameters: their gradients are the MSA layers' KLs,
    # which the kernels then compute in the backward (m3jax/attention.py: Attention.__call__)
    loss_and_grad = jax.value_and_grad(sunk_loss_fn, has_aux=True)
    labels = layer_labels(config)
    kl_sinks = model.kl_sinks()

    def gradients(state: dict, batch: Batch, mode: ForwardMode) -> tuple[dict, tuple]:
        totals = loss_totals(batch, config.mtp.num_modules, parts)
        sinks = kl_sinks if mode.indexer_loss and any(s is not None for s in kl_sinks) else None
        (loss, (metrics, loads)), (grads, sink_grads) = accumulated(loss_and_grad, parts)(
            (state["params"], sinks), state["buffers"], batch, mode, totals
        )
        if sinks is not None:
            loss, metrics = with_sunk_kl(config.msa.kl_weight, loss, metrics, sink_grads,
                                         labels["msa"])  # fmt: skip
        metrics["tokens"] = (batch.segment_ids > 0).sum()
        return grads, (loss, metrics, loads)

    def update(state: dict, grads: dict, computed: tuple) -> tuple[dict, dict]:
        loss, metrics, loads = computed
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        buffers = model.rebalanced(state["buffers"], loads, config.moe.bias_update_rate)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "buffers": buffers,
            "opt_state": opt_state,
        }
        metrics = {**metrics, **load_metrics(loads, labels["moe"])}
        grad_norm = optax.tree.norm(grads)
        new_state, skipped = keep_finite(state, new_state, loss, grad_norm)
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            lr=schedule(applied_updates(state["opt_state"])),  # the LR this update used
            skipped=skipped,
        )
        return new_state, metrics

    return gradients, update


def _mtp_loss(
    outputs: list[MTPOutput], batch: Batch, totals: dict, lm_loss
) -> tuple[jax.Array, dict]:
    """Mean over MTP modules of their LM loss on targets depth + 2 ahead; per module too."""
    losses = []
    for depth, output in enumerate(outputs):
        targets, weight = mtp_targets(batch, depth)
        weights = mean_weights(weight, totals[f"mtp{depth}"])
        losses.append(lm_loss(output.normed, targets, weights).loss)
    mean = sum(losses) / len(losses)
    return mean, {"mtp_nll": mean, **{f"mtp_nll{d}": x for d, x in enumerate(losses)}}

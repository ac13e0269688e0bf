"""Held-out evaluation: the training loss function, forward only, on a fixed set of batches.

The set is the first `eval.batches` batches of `eval.shards` through the training input pipeline
(pretrain/data_loading.py: the same tokenizer, packing, processor and seed), read once and kept on
the host, so every evaluation sees exactly the same tokens and nothing is updated. Each batch runs
the training loss (pretrain/train_step.py: make_loss_fn) with the whole set's totals, so the
batches' metrics add up to the set's: `eval_nll` is the mean over every held-out text target,
however unevenly the batches hold them. Its LM losses are training's chunked cross-entropy
(pretrain/chunked_loss.py, `train.loss_chunk_tokens`): no [B, S, V] logits here either.

Metrics (the training names, prefixed `eval_`): loss, nll, by document kind
(`eval_nll_<text|image|video>_docs`) and input modality (`eval_nll_after_<modality>`), MTP losses,
and on MSA layers the indexer KL and the block recall (`eval_msa_recall`, per layer too) under the
schedule's current phase. Host memory: `eval.batches` batches; device memory: a batch runs as the
training step's micro-batches (`train.grad_accum_steps`).
"""

import jax
import numpy as np

from pretrain.accumulation import accumulated
from pretrain.config import RunConfig
from pretrain.data_loading import make_eval_loader
from pretrain.loss import loss_totals
from pretrain.msa_schedule import forward_mode
from pretrain.session import TrainingSession
from pretrain.train_step import make_loss_fn


class Evaluator:
    """The held-out batches of a run and the compiled forward pass that evaluates them."""

    def __init__(self, session: TrainingSession, run: RunConfig):
        loader = make_eval_loader(run)
        try:
            self.batches = [next(loader) for _ in range(run.eval.batches)]
        finally:
            loader.close()
        # each batch as the training step's micro-batches: no more activation memory than it
        micro = run.train.grad_accum_steps
        parts, num_mtp = len(self.batches) * micro, run.model.mtp.num_modules
        totals = jax.device_get([loss_totals(batch, num_mtp, parts) for batch in self.batches])
        self.totals = {**jax.tree.map(lambda *x: sum(x), *totals), "parts": np.float32(parts)}
        loss_fn = make_loss_fn(session.model, run)

        def forward(params, buffers, batch, mode, totals):
            loss, (metrics, _) = loss_fn(params, buffers, batch, mode, totals)
            return {"loss": loss, **metrics}

        self._forward = jax.jit(accumulated(forward, micro), static_argnums=3)
        self.session = session

    def __call__(self) -> dict[str, float]:
        """One evaluation of the session's current parameters: {"eval_<metric>": value}."""
        session = self.session
        mode = forward_mode(session.run.model, session.tokens_seen, block_recall=True)
        params, buffers = session.state["params"], session.state["buffers"]
        sums = None
        for batch in self.batches:
            metrics = self._forward(params, buffers, session.put_batch(batch), mode, self.totals)
            sums = metrics if sums is None else jax.tree.map(lambda a, b: a + b, sums, metrics)
        sums = jax.device_get(sums)
        return {f"eval_{k}": float(v) for k, v in sums.items()}

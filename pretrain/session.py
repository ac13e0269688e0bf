"""A training session: the mesh, the sharded train state, the compiled step and its checkpoints.

Parameters are created directly in their sharded layout (a jitted init with out_shardings) or
restored from the latest checkpoint onto the current mesh; the data iterator state travels in the
same checkpoint, so a resumed run continues with exactly the next batch.
"""

import collections
import dataclasses
import math

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from data.mm_loader import modality_counts
from m3jax import sharding
from m3jax.attention import ForwardMode
from m3jax.config_loading import ConfigError
from m3jax.model import Functional
from pretrain.checkpointing import Checkpoints, abstract_with_shardings
from pretrain.config import RunConfig
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.train_step import init_state, make_train_step


class TrainingSession:
    def __init__(self, model: Functional, run: RunConfig, checkpoints: Checkpoints):
        self.run, self.checkpoints = run, checkpoints
        self.mesh = sharding.make_mesh(dataclasses.asdict(run.mesh))
        experts, expert_devices = run.model.moe.num_experts, self.mesh.shape["expert"]
        if "sparse" in run.model.mlp_layer_types and experts % expert_devices:
            raise ConfigError(
                f"model.moe.num_experts={experts} is not divisible by mesh.expert={expert_devices}"
            )
        # The MoE layers run expert-parallel over this mesh (m3jax/expert_parallel.py).
        self.model = model = model.on_mesh(self.mesh)
        data_parallel = math.prod(self.mesh.shape[a] for a in ("data", "fsdp", "expert"))
        if run.data.batch_size % data_parallel:
            raise ConfigError(
                f"data.batch_size={run.data.batch_size} is not a multiple of the "
                f"data-parallel mesh size {data_parallel}"
            )
        schedule = learning_rate(run.optimizer, run.train.steps)
        self.optimizer = make_optimizer(run.optimizer, run.train.steps, model.param_axes)
        self.abstract_state = jax.eval_shape(
            lambda: init_state(model, self.optimizer, run.train.seed)
        )
        self.state_shardings = self._state_shardings()
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._step = jax.jit(
            make_train_step(model, self.optimizer, schedule, run),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            static_argnums=2,
            donate_argnums=0,
        )
        self.state = None
        self.tokens_seen = 0  # training positions so far (B·S per step): drives the MSA warm-up
        self.modality_tokens = collections.Counter()  # this session's tokens by modality

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.abstract_state["params"]))

    def initialize(self) -> None:
        """Fresh state, created directly in its sharded layout."""
        init = jax.jit(
            lambda: init_state(self.model, self.optimizer, self.run.train.seed),
            out_shardings=self.state_shardings,
        )
        self.state = init()

    def restore_or_init(self, loader) -> int:
        """Restores the latest checkpoint (and the loader's position) or initialises; returns step."""
        step = self.checkpoints.latest_step()
        if step is None:
            self.initialize()
            return 0
        target = abstract_with_shardings(self.abstract_state, self.state_shardings)
        self.state, data_state, progress = self.checkpoints.restore(step, target)
        loader.restore(data_state)
        self.tokens_seen = progress["tokens_seen"]
        return step

    def forward_mode(self, step: int) -> ForwardMode:
        """What the forward pass of optimizer step `step` (1-based) computes besides the LM loss."""
        phase, every = self.msa_phase, self.run.logging.msa_recall_every
        return ForwardMode(
            msa_dense=phase == "dense_warmup",
            indexer_loss=phase is not None,
            block_recall=phase is not None and every > 0 and step % every == 0,
        )

    @property
    def msa_phase(self) -> str | None:
        return msa_phase(self.run, self.tokens_seen)

    def step(self, batch: dict[str, np.ndarray], mode: ForwardMode) -> dict:
        """One optimizer step on a host batch; returns its metrics as (unfetched) device arrays."""
        if "modality" in batch:
            self.modality_tokens.update(modality_counts(batch))
        return self.step_on_devices(self.put_batch(batch), mode)

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows as global arrays, sharded over the batch axes (host -> device)."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in batch.items()
        }

    def step_on_devices(self, batch: dict[str, jax.Array], mode: ForwardMode) -> dict:
        """One optimizer step on a batch already on the devices (`put_batch`); modality counts are
        left to `step`. benchmarks/bench_input_stall.py times the step alone through this."""
        self.state, metrics = self._step(self.state, batch, mode)
        self.tokens_seen += batch["tokens"].size  # global B·S
        if mode.indexer_loss:
            metrics["msa_warmup"] = float(mode.msa_dense)  # 1 while sparse layers attend densely
        return metrics

    def save(self, step: int, loader) -> None:
        self.checkpoints.save(
            step, self.state, loader.state(), progress(self.run, self.tokens_seen)
        )

    def _state_shardings(self) -> dict:
        return state_shardings(self.model, self.optimizer, self.abstract_state, self.mesh)


def state_shardings(model: Functional, optimizer, abstract_state: dict, mesh) -> dict:
    """Where each leaf of a train state lives on `mesh` (a Mesh, or an AbstractMesh to plan
    without devices): params and buffers by their logical axes, optimizer moments like their
    parameters, the rest replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = sharding.tree_shardings(model.param_axes, abstract_state["params"], mesh)
    opt_state = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        abstract_state["opt_state"],
        params,
        transform_non_params=lambda _: replicated,
    )
    return {
        "step": replicated,
        "params": params,
        "buffers": sharding.tree_shardings(model.buffer_axes, abstract_state["buffers"], mesh),
        "opt_state": opt_state,
    }


def msa_phase(run: RunConfig, tokens_seen: int) -> str | None:
    """ "dense_warmup" until msa.warmup_tokens, then "sparse"; None for models without MSA."""
    if "minimax_m3_sparse" not in run.model.layer_types:
        return None
    return "dense_warmup" if tokens_seen < run.model.msa.warmup_tokens else "sparse"


def progress(run: RunConfig, tokens_seen: int) -> dict:
    """The `progress` item of a checkpoint: what the schedule needs besides the step."""
    return {"tokens_seen": tokens_seen, "msa_phase": msa_phase(run, tokens_seen)}

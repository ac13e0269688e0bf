"""A training session: the mesh, the sharded train state, the compiled step and its checkpoints.

Parameters are created directly in their sharded layout (a jitted init with out_shardings) or
restored from the newest intact checkpoint onto the current mesh; the data iterator state travels
in the same checkpoint (every process's, pretrain/distributed.py), so a resumed run continues with
exactly the next batch. A state holding NaN or infinity is never saved.
"""

import collections
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from batch_format.batch import Batch
from data.mm_loader import modality_counts
from m3jax import sharding
from m3jax.attention import ForwardMode
from m3jax.attention_ops import documents_bound, holds_few_documents
from m3jax.config_loading import ConfigError
from m3jax.model import Functional
from pallas_kernels import target
from pretrain.checkpoint_recovery import restore_newest_intact
from pretrain.checkpointing import Checkpoints, abstract_with_shardings
from pretrain.config import RunConfig
from pretrain.data_loading import process_share, run_mesh
from pretrain.distributed import data_item, gather, own_data_state
from pretrain.faults import FaultMonitor, check_finite, finite_leaves, raise_if_not_finite
from pretrain.mfu import ModelFlops
from pretrain.msa_schedule import forward_mode, msa_phase
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.resume_checks import schedule_steps
from pretrain.train_step import init_state, make_step_halves, make_train_step


class DataPositionError(ValueError):
    """A checkpoint's data position does not fit the current loader (other data settings)."""

    def __init__(self, step: int, cause: Exception):
        super().__init__(str(cause))
        self.step, self.cause = step, cause


@dataclasses.dataclass(frozen=True)
class DueSave:
    """A save whose state is still to come: the step's data position and progress, taken at that
    step (`TrainingSession.prepare_save`); the skipped steps are added when the save starts."""

    step: int
    data: dict
    progress: dict


@dataclasses.dataclass(frozen=True)
class CopiedSave:
    """A due save with the copy of its state that the next step made in host memory, whether
    each leaf of that state is finite (unfetched device flags) and the steps skipped up to it."""

    due: DueSave
    state: dict
    finite: dict
    skipped_steps: int


class TrainingSession:
    """report: writes one line (restore fallbacks, schedule notes, numerical faults)."""

    def __init__(
        self,
        model: Functional,
        run: RunConfig,
        checkpoints: Checkpoints,
        report: Callable[[str], None] = print,
    ):
        self.run, self.checkpoints, self.report = run, checkpoints, report
        self._reported_many_documents = False  # `mode_for` says it once
        self.mesh = run_mesh(run)
        experts, expert_devices = run.model.moe.num_experts, self.mesh.shape[sharding.EXPERT_AXIS]
        if run.model.moe_layers and experts % expert_devices:
            raise ConfigError(
                f"model.moe.num_experts={experts} is not divisible by mesh.expert={expert_devices}"
            )
        # The MoE layers run expert-parallel over this mesh (m3jax/moe/expert_parallel.py).
        self.model = model = model.on_mesh(self.mesh)
        data_parallel = math.prod(self.mesh.shape[a] for a in ("data", "fsdp", "expert"))
        parts = run.train.grad_accum_steps  # every micro-batch spreads over all devices
        if run.data.batch_size % (data_parallel * parts):
            raise ConfigError(
                f"data.batch_size={run.data.batch_size} is not a multiple of the "
                f"data-parallel mesh size {data_parallel} times train.grad_accum_steps={parts}"
            )
        horizon = run.optimizer.schedule_steps or run.train.steps  # restore_or_init may change it
        self.optimizer = make_optimizer(run.optimizer, horizon, model.param_axes)
        self.abstract_state = jax.eval_shape(  # its structure does not depend on the horizon
            lambda: init_state(model, self.optimizer, run.train.seed)
        )
        self.state_shardings = self._state_shardings()
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        self.processes_per_batch = process_share(run)[1]  # blocks a global batch is loaded in
        self._use_schedule(horizon)
        self.state = None
        self._state_copy = None  # (host copy, finite flags) of the state a copying step began from
        self.tokens_seen = 0  # training positions so far (B·S per step): drives the MSA warm-up
        self.faults = FaultMonitor(run, report)  # skipped steps (all sessions), loss spikes
        self.modality_tokens = collections.Counter()  # this session's tokens by modality
        self.model_flops = ModelFlops(model)  # training FLOPs per token of a batch (for MFU)

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
        """Restores the newest intact checkpoint (and the loader's position) or initialises;
        returns the step. Fallbacks and a kept LR schedule horizon are reported."""
        target = abstract_with_shardings(self.abstract_state, self.state_shardings)
        restored = restore_newest_intact(
            self.checkpoints, target,
            allow_older=self.run.checkpoint.restore_older_if_corrupt, report=self.report,
        )  # fmt: skip
        if restored is None:
            self.initialize()
            return 0
        step, self.state, data_state, progress = restored
        try:
            loader.restore(own_data_state(data_state))
        except ValueError as e:
            raise DataPositionError(step, e) from None
        self.tokens_seen = progress["tokens_seen"]
        self.faults.skipped_steps = progress.get("skipped_steps", 0)  # absent in older ones
        horizon = schedule_steps(self.run, progress.get("schedule_steps"), step, self.report)
        if horizon != self.schedule_steps:
            self._use_schedule(horizon)
        return step

    def forward_mode(self, step: int) -> ForwardMode:
        """What the forward pass of optimizer step `step` (1-based) computes besides the LM loss
        (pretrain/msa_schedule.py)."""
        every = self.run.logging.msa_recall_every
        recall = every > 0 and step % every == 0
        return forward_mode(self.run.model, self.tokens_seen, block_recall=recall)

    def mode_for(self, batch: Batch, mode: ForwardMode) -> ForwardMode:
        """`mode` for a host batch: on one GPU process, `few_documents` where every row holds
        few enough that the GPU kernels need no fallback, so the step has no conditional the host
        waits on (the first batch of more compiles a second step, with them, and says so). Elsewhere
        unset: other backends have no such fallback (it would only compile the step twice), and
        in multi-process runs a process sees its own rows, where all must run the same program."""
        if target.platform() != "gpu" or jax.process_count() > 1:
            return mode
        block_size = self.run.model.msa.block_size
        few = holds_few_documents(np.asarray(batch.segment_ids), block_size)
        if not few and not self._reported_many_documents:
            self._reported_many_documents = True
            bound = documents_bound(batch.segment_ids.shape[1], block_size)
            self.report(f"a batch has a row of more than {bound} documents: its step compiles "
                        "with the kernels' fallbacks (once)")  # fmt: skip
        return dataclasses.replace(mode, few_documents=few)

    @property
    def msa_phase(self) -> str | None:
        return msa_phase(self.run.model, self.tokens_seen)

    def step(self, batch: Batch, mode: ForwardMode, copy_state: bool = False) -> dict:
        """One optimizer step on a host batch; returns its metrics as (unfetched) device arrays,
        plus the batch's training FLOPs per token (`model_flops_per_token`, a host float).
        copy_state: the state the step starts from is also copied to host memory
        (`take_state_copy`), for a save that overlaps the step (`checkpoint.copy_in_step`): by
        the device's transfer stream beside the step's gradients, the step run as its two
        halves (`make_step_halves`), of which only the update, after the copy, donates the
        state: no second state on the device."""
        if batch.modality is not None:
            self.modality_tokens.update(modality_counts(batch))
        mode = self.mode_for(batch, mode)
        metrics = self.step_on_devices(self.put_batch(batch), mode, copy_state)
        # counted while the (asynchronously dispatched) step runs
        return {**metrics, "model_flops_per_token": self.model_flops.per_token(batch, mode)}

    def put_batch(self, batch: Batch) -> Batch:
        """This process's rows (`process_share`) of every array as global arrays, sharded over the
        batch axes (host -> device). The global shape is given: only the rows are split over
        processes."""

        def global_array(x: np.ndarray) -> jax.Array:
            shape = (x.shape[0] * self.processes_per_batch, *x.shape[1:])
            return jax.make_array_from_process_local_data(self.batch_sharding, x, shape)

        return jax.tree.map(global_array, batch)

    def step_on_devices(self, batch: Batch, mode: ForwardMode, copy_state: bool = False) -> dict:
        """One optimizer step on a batch already on the devices (`put_batch`); modality counts are
        left to `step`. benchmarks/bench_input_stall.py times the step alone through this."""
        if copy_state:
            finite = self._finite_leaves(self.state)
            copy = jax.device_put(self.state, self._on_host)  # a transfer stream, beside the step
            grads, computed = self._gradients(self.state, batch, mode)  # reads the state
            # donates the state: the runtime has it wait for the copy
            self.state, metrics = self._update(self.state, grads, computed)
            self._state_copy = (copy, finite)
        else:
            self.state, metrics = self._step(self.state, batch, mode)
        self.tokens_seen += batch.tokens.size  # global B·S
        if mode.indexer_loss:
            metrics["msa_warmup"] = float(mode.msa_dense)  # 1 while sparse layers attend densely
        return metrics

    def save(self, step: int, loader, data_state: dict | None = None) -> None:
        """Starts saving the state at `step` with the loader's position (or `data_state`, the
        position before an interrupted batch), every process's (a collective: all call it at the
        same step). Raises NonFiniteStateError instead of saving NaN."""
        check_finite(self.state, step)
        due = self.prepare_save(step, loader, data_state)
        self._write(due, self.state, self.faults.skipped_steps)

    def prepare_save(self, step: int, loader, data_state: dict | None = None) -> DueSave:
        """The data position and progress of a save at `step`, taken now without waiting for the
        device (arguments as `save`'s), for the next step to copy the state
        (`step(copy_state=True)`, then `take_state_copy`)."""
        position = loader.state() if data_state is None else data_state
        progressed = {**progress(self.run, self.tokens_seen), "schedule_steps": self.schedule_steps}
        return DueSave(step, data_item(gather(position)), progressed)

    def take_state_copy(self, due: DueSave) -> CopiedSave:
        """`due` with the state copy the last `copy_state` step made; called once the fault
        monitor has checked `due.step` (it has observed the copying step)."""
        copied, self._state_copy = self._state_copy, None
        if copied is None:
            raise RuntimeError("no step has copied the state since the last take_state_copy")
        return CopiedSave(due, *copied, skipped_steps=self.faults.skipped_steps)

    def start_copied_save(self, copied: CopiedSave) -> None:
        """Starts saving a copied state (NonFiniteStateError as `save`'s). Waits for the copying
        step; started once the step after it is dispatched, the device has that one to run."""
        raise_if_not_finite(copied.finite, copied.due.step)
        self._write(copied.due, copied.state, copied.skipped_steps)

    def _write(self, due: DueSave, state: dict, skipped_steps: int) -> None:
        progressed = {**due.progress, "skipped_steps": skipped_steps}
        self.checkpoints.save(due.step, state, due.data, progressed)

    def _use_schedule(self, steps: int) -> None:
        """Builds the optimizer and the jitted step for an LR schedule decaying over `steps`."""
        self.schedule_steps = steps
        run, model = self.run, self.model
        self.optimizer = make_optimizer(run.optimizer, steps, model.param_axes)
        schedule = learning_rate(run.optimizer, steps)
        halves = make_step_halves(model, self.optimizer, schedule, run)
        train_step = make_train_step(model, self.optimizer, schedule, run)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        jitted = functools.partial(
            jax.jit, in_shardings=(self.state_shardings, self.batch_sharding), static_argnums=2,
            donate_argnums=0,
        )
        self._step = jitted(train_step, out_shardings=(self.state_shardings, replicated))
        # the step beside a save's copy of its state, in two programs (`step_on_devices`)
        self._gradients = jax.jit(
            halves[0], in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings["params"], replicated), static_argnums=2,
        )  # fmt: skip
        self._update = jax.jit(
            halves[1], out_shardings=(self.state_shardings, replicated), donate_argnums=0
        )
        self._on_host = jax.tree.map(
            lambda s: s.with_memory_kind("pinned_host"), self.state_shardings
        )
        self._finite_leaves = jax.jit(finite_leaves)

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


def progress(run: RunConfig, tokens_seen: int) -> dict:
    """The `progress` item of a checkpoint: what the schedule needs besides the step."""
    return {"tokens_seen": tokens_seen, "msa_phase": msa_phase(run.model, tokens_seen)}

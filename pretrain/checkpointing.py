"""Orbax checkpoints of a run: train state + data iterator state, one step per directory.

Layout: RUN_DIR/checkpoints/<step>/{state, data, progress}: the train state (arrays), the data
iterator's position (every process's: pretrain/distributed.py) and the run's progress (tokens
seen, MSA phase, skipped steps, LR schedule horizon), the last two as JSON. Orbax writes each
step to `<step>.orbax-checkpoint-tmp` and renames it when complete, so an interrupted save never
looks like a checkpoint; leftovers of a killed process are removed when the directory is opened.
Restores go onto the current mesh: the abstract target carries the shardings. Once a save is
complete the memory it freed is handed back to the OS (pretrain/host_memory.py), so host memory
does not grow save after save.

Failures are reported as one-line errors naming the step: a failed save (`CheckpointSaveError`,
raised by `save`, `poll` or `wait`, once its other writes are done and its temporary folder is
removed; removed again at later calls and at `close`, to be sure) and an unreadable
checkpoint (`CheckpointError` from `restore`). Orbax's own error logs about them (tracebacks, from
its background threads too) and those of the asyncio tasks it runs (thousands of lines for a
truncated checkpoint) are dropped while a `Checkpoints` is open.
"""

import contextlib
import logging
import os
import pathlib
import shutil

import jax
import orbax.checkpoint as ocp

from pretrain import host_memory
from pretrain.config import CheckpointConfig

TMP_SUFFIX = ".orbax-checkpoint-tmp"
CORRUPT_SUFFIX = ".corrupt"  # an unreadable checkpoint moved aside (not a step name to Orbax)


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be read or written; the message names it."""


class CheckpointSaveError(CheckpointError):
    """Saving `step` failed; `reason` is the cause in one line."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"checkpoint save at step {step} failed: {reason}")
        self.step, self.reason = step, reason


class Checkpoints:
    def __init__(self, directory: str | pathlib.Path, config: CheckpointConfig):
        self.directory = pathlib.Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: exists and is not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            # always Orbax's async path (a sync save waits for it at once): its failures can be
            # cleaned up completely (see _await_other_writes)
            enable_async_checkpointing=True,
            create=True,
            cleanup_tmp_directories=True,
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # Orbax raises many types for unusable directories
            raise CheckpointError(
                f"{self.directory}: cannot open or create the checkpoint directory "
                f"({first_line(e)}); is it writable?"
            ) from None
        self._saving: int | None = None  # step of a save that may still be running
        self._wait_after_save = not config.async_save
        self._failed_steps: set[int] = set()  # whose temporary folders are to be removed
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(quiet_orbax_errors())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: dict, data_state: dict, progress: dict) -> None:
        """Starts saving (in the background when async, else completes it); `poll` or `wait`
        reports the outcome of a background save."""
        self.wait()
        self._remove_leftovers()
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            progress=ocp.args.JsonSave(progress),
        )
        with self._failure_of(step):
            self._manager.save(step, args=args, force=True)
        self._saving = step
        if self._wait_after_save:
            self.wait()

    def poll(self) -> int | None:
        """Without blocking: the step of a save that just completed, if any; raises
        CheckpointSaveError if it failed."""
        self._remove_leftovers()
        if self._saving is not None and not self._manager.is_saving_in_progress():
            return self.wait()
        return None

    def wait(self) -> int | None:
        """Blocks until the last save is complete and returns its step (None if there was none);
        raises CheckpointSaveError if it failed."""
        if self._saving is None:
            return None
        step, self._saving = self._saving, None
        try:
            with self._failure_of(step):
                self._manager.wait_until_finished()
        finally:
            host_memory.release_freed_memory()  # the save's host copies and write buffers
        return step

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict, dict]:
        """abstract_state: ShapeDtypeStructs with shardings. Returns (state, data_state,
        progress)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            progress=ocp.args.JsonRestore(),
        )
        try:
            with _quiet_asyncio():
                restored = self._manager.restore(step, args=args)
        except Exception as e:  # corrupt, truncated, or written by a different model
            raise CheckpointError(
                f"{self.directory / str(step)}: cannot restore checkpoint ({root_cause(e)})"
            ) from None
        return restored.state, restored.data, restored.progress

    def move_aside(self, step: int) -> pathlib.Path:
        """Renames an unreadable checkpoint to `<step>.corrupt` (kept for inspection, no longer a
        step); returns the new path."""
        source = self.directory / str(step)
        target = self.directory / f"{step}{CORRUPT_SUFFIX}"
        shutil.rmtree(target, ignore_errors=True)
        source.rename(target)
        self._manager.reload()
        return target

    def close(self) -> None:
        self._manager.close()
        self._remove_leftovers()
        self._quiet.close()

    @contextlib.contextmanager
    def _failure_of(self, step: int):
        try:
            yield
        except Exception as e:  # disk full, permissions, a lost mount...
            self._await_other_writes()
            self._failed_steps.add(step)
            self._remove_leftovers()
            self._manager.reload()
            raise CheckpointSaveError(step, root_cause(e)) from None

    def _remove_leftovers(self) -> None:
        for step in self._failed_steps:
            for leftover in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
                shutil.rmtree(leftover, ignore_errors=True)

    def _await_other_writes(self) -> None:
        # Orbax (0.12.4) reports the first failed write of a save while the others still write
        # into its temporary folder, which would reappear after we remove it: wait for them.
        checkpointer = getattr(self._manager, "_checkpointer", None)
        background = getattr(getattr(checkpointer, "_async_manager", None), "_commit_futures", None)
        for write in background or ():
            with contextlib.suppress(Exception):
                write.result()


def abstract_with_shardings(shapes, shardings):
    """ShapeDtypeStructs that tell Orbax where to place each restored array."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def root_cause(error: BaseException) -> str:
    """The first line of the innermost exception in a chain (Orbax wraps the real cause)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return first_line(error)


def _from_orbax_errors(record: logging.LogRecord) -> bool:
    return f"{os.sep}orbax{os.sep}" in record.pathname and record.levelno >= logging.ERROR


def quiet_orbax_errors():
    """Drops error records (tracebacks) that Orbax's code logs meanwhile, from its background
    threads too: the caller reports the failure itself, in one line."""
    return _dropping("absl", _from_orbax_errors)


def _quiet_asyncio():
    """Drops asyncio's records meanwhile: a failed restore leaves one per unfinished read task."""
    return _dropping("asyncio", lambda record: True)


@contextlib.contextmanager
def _dropping(logger_name: str, drop):
    def keep(record: logging.LogRecord) -> bool:
        return not drop(record)

    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)

"""Orbax checkpoints of a run: train state + data iterator state, one step per directory.

Layout: RUN_DIR/checkpoints/<step>/{state, data, progress}: the train state (arrays), the data
iterator's position and the run's progress (tokens seen, MSA phase), the last two as JSON. Orbax writes each step to a temporary directory
and renames it when complete, so an interrupted save never looks like a checkpoint. Restores go
onto the current mesh: the abstract target carries the shardings.
"""

import pathlib

import jax
import orbax.checkpoint as ocp

from pretrain.config import CheckpointConfig


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be read; the message names it."""


class Checkpoints:
    def __init__(self, directory: str | pathlib.Path, config: CheckpointConfig):
        self.directory = pathlib.Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: exists and is not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep, enable_async_checkpointing=config.async_save, create=True
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # Orbax raises many types for unreadable directories
            raise CheckpointError(f"{self.directory}: not a readable checkpoint directory ({e})")

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: dict, data_state: dict, progress: dict) -> None:
        """Starts saving (in the background when async); a later save or `wait` completes it."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            progress=ocp.args.JsonSave(progress),
        )
        self._manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict, dict]:
        """abstract_state: ShapeDtypeStructs with shardings. Returns (state, data_state, progress)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            progress=ocp.args.JsonRestore(),
        )
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:  # corrupt, truncated, or written by a different model
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(
                f"{self.directory / str(step)}: cannot restore checkpoint ({message})"
            ) from None
        return restored.state, restored.data, restored.progress

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def abstract_with_shardings(shapes, shardings):
    """ShapeDtypeStructs that tell Orbax where to place each restored array."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )

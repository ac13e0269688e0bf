"""The arrays of one checkpoint of an m3-train run, checked against the run's model config.

`open_run` opens them lazily (tensorstore; m3-export streams them one slice at a time),
`load_weights` reads them whole into the {"params", "buffers"} dicts m3jax's functions take
(m3-generate, notebooks). Only parameters and buffers are read, never the optimizer state.
"""

import dataclasses
import pathlib

import jax.numpy as jnp
import tensorstore as ts

from m3jax.config_loading import from_mapping, load_yaml
from m3jax.convert.layout import leaf_shapes, nested
from pretrain.checkpoint_arrays import open_leaves
from pretrain.checkpointing import CheckpointError, Checkpoints
from pretrain.config import CheckpointConfig, RunConfig


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    run: RunConfig  # RUN_DIR/config.yaml
    step: int
    arrays: dict[tuple, ts.TensorStore]  # every model leaf (m3jax.convert.layout.leaf_shapes)


def open_run(run_dir: pathlib.Path, step: int | None = None) -> RunCheckpoint:
    """Checkpoint `step` of the run in `run_dir` (None: the latest). Raises CheckpointError naming
    the file when the run, the step or a tensor is missing or has the wrong shape."""
    run_dir = pathlib.Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: not found (is {run_dir} an m3-train run?)")
    run = from_mapping(RunConfig, load_yaml(config_path), where=str(config_path))
    step = checkpoint_step(run_dir / "checkpoints", step)
    state_dir = run_dir / "checkpoints" / str(step) / "state"
    try:
        stored = open_leaves(state_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{state_dir}: cannot open checkpoint ({e})") from None
    arrays = {}
    for leaf, shape in leaf_shapes(run.model).items():
        keys = tuple(map(str, leaf))
        if keys not in stored or tuple(stored[keys].shape) != shape:
            found = tuple(stored[keys].shape) if keys in stored else "nothing"
            raise CheckpointError(
                f"{state_dir}: {'.'.join(keys)} should have shape {shape} for the model in "
                f"{config_path}, found {found}"
            )
        arrays[leaf] = stored[keys]
    return RunCheckpoint(run, step, arrays)


def load_weights(checkpoint: RunCheckpoint) -> dict:
    """{"params": ..., "buffers": ...} of the checkpoint, read into device arrays."""
    arrays = checkpoint.arrays.items()
    return nested({leaf: jnp.asarray(array.read().result()) for leaf, array in arrays})


def checkpoint_step(directory: pathlib.Path, step: int | None) -> int:
    """`step` if `directory` holds a finished checkpoint of it; None: the latest one."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no checkpoints directory")
    checkpoints = Checkpoints(directory, CheckpointConfig(async_save=False))
    steps = checkpoints.all_steps()
    checkpoints.close()
    if not steps:
        raise CheckpointError(f"{directory}: holds no finished checkpoint")
    if step is None:
        return max(steps)
    if step not in steps:
        raise CheckpointError(f"{directory}: no checkpoint for step {step} (have {sorted(steps)})")
    return step

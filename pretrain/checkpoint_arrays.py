"""Orbax checkpoint arrays read and written a slice at a time, for converters bigger than memory.

Orbax stores each leaf of a train state as a zarr array in a tensorstore key-value store (OCDBT by
default) under `<keys joined by ".">`, and lists leaves in `_METADATA`. `open_leaves` opens them
lazily: `leaf[index]` reads only the chunks it touches. `save_streamed` writes a train state whose
leaves are `LazyArray`s, each filled block by block from a generator, through Orbax's own save (a
NumpyHandler whose write loops over blocks), so the result is an ordinary checkpoint that
`pretrain.checkpointing.Checkpoints.restore` (and so `m3-train`) reads.
"""

import ast
import asyncio
import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterator

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import type_handlers

from pretrain.checkpointing import quiet_orbax_errors

CACHE_BYTES = 2 << 30
IN_FLIGHT = 16
Blocks = Callable[[], Iterator[tuple[tuple, np.ndarray]]]  # -> (index into the array, value)


@dataclasses.dataclass(frozen=True)
class LazyArray:
    """An array that exists only as the blocks `blocks()` yields, which together cover it: each is
    array[i_1, ..., i_k] for an index of length k = index_rank (one block = one storage chunk)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    index_rank: int
    blocks: Blocks

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def chunk_shape(self) -> list[int]:
        return [1] * self.index_rank + list(self.shape[self.index_rank :])


def zeros(shape: tuple[int, ...], dtype) -> LazyArray:
    """A zero array written one leading-axis slice at a time (a fresh state's Adam moments)."""
    dtype, rank = np.dtype(dtype), min(len(shape), 1)

    def blocks():
        for index in np.ndindex(*shape[:rank]):
            yield index, np.zeros(shape[rank:], dtype)

    return LazyArray(tuple(shape), dtype, rank, blocks)


class _StreamingHandler(type_handlers.NumpyHandler):
    """Writes LazyArrays as Orbax writes numpy arrays, but block by block (never whole).

    Orbax writes all leaves concurrently; at most IN_FLIGHT blocks (of any leaf) are pending at a
    time, which bounds memory while keeping the disk busy (one write at a time per leaf was 4x
    slower on the test models: each OCDBT write waits for its commit).
    """

    def __init__(self):
        super().__init__()
        self._slots = asyncio.Semaphore(IN_FLIGHT)

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._background_serialize(values, infos, args), name="streamed_arrays"
            )
        ]

    async def _open_and_write(self, value: LazyArray, tspec: dict, ts_context) -> None:
        metadata = tspec["metadata"]  # chunks = blocks: no chunk is ever read back and rewritten
        if "chunks" in metadata:  # zarr v2
            metadata["chunks"] = value.chunk_shape
        else:  # zarr v3: the outer grid and the sharding codec's inner chunks
            metadata["chunk_grid"]["configuration"]["chunk_shape"] = value.chunk_shape
            metadata["codecs"][0]["configuration"]["chunk_shape"] = value.chunk_shape
        array = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
        pending = []
        for index, block in value.blocks():
            await self._slots.acquire()
            pending.append(asyncio.ensure_future(self._write(array, index, block, value.dtype)))
        await asyncio.gather(*pending)

    async def _write(self, array, index: tuple, block: np.ndarray, dtype: np.dtype) -> None:
        try:
            await array[index].write(np.asarray(block, dtype))
        finally:
            self._slots.release()


def save_streamed(step_dir: pathlib.Path, state: dict, data_state: dict, progress: dict) -> None:
    """Writes RUN/checkpoints/<step> with items `state` (leaves: LazyArray), `data` and `progress`
    (JSON), the layout `pretrain.checkpointing.Checkpoints` saves and restores."""
    registry = type_handlers.create_type_handler_registry((LazyArray, _StreamingHandler()))
    checkpointer = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            state=ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
            data=ocp.JsonCheckpointHandler(),
            progress=ocp.JsonCheckpointHandler(),
        )
    )
    with quiet_orbax_errors():  # a failing block (bad input) is reported by the caller
        checkpointer.save(
            epath.Path(pathlib.Path(step_dir).absolute()),
            ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                data=ocp.args.JsonSave(data_state),
                progress=ocp.args.JsonSave(progress),
            ),
        )
        checkpointer.close()


def open_leaves(state_dir: pathlib.Path) -> dict[tuple[str, ...], ts.TensorStore]:
    """Every array leaf of a saved pytree (RUN/checkpoints/<step>/state), opened lazily, keyed by
    its key path as strings, e.g. ("params", "stacks", "0", "layers", "attention", "q_proj")."""
    state_dir = pathlib.Path(state_dir).absolute()
    metadata_path = state_dir / "_METADATA"
    try:
        metadata = json.loads(metadata_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OSError(f"{metadata_path}: cannot read Orbax metadata ({e})") from None
    driver = "zarr3" if metadata.get("use_zarr3") else "zarr"
    # Slices of one chunk are read one after another (one expert, then the next): keep chunks.
    context = ts.Context({"cache_pool": {"total_bytes_limit": CACHE_BYTES}})
    leaves = {}
    for key_text, entry in metadata["tree_metadata"].items():
        if entry["value_metadata"].get("skip_deserialize"):
            continue
        keys = tuple(str(k) for k in ast.literal_eval(key_text))
        name = ".".join(keys)
        if metadata.get("use_ocdbt", True):
            kvstore = {"driver": "ocdbt", "base": f"file://{state_dir}/", "path": name}
        else:
            kvstore = {"driver": "file", "path": f"{state_dir}/{name}/"}
        leaves[keys] = ts.open({"driver": driver, "kvstore": kvstore}, open=True, context=context)
    return {keys: future.result() for keys, future in leaves.items()}

"""`load_pretrained` / `save_pretrained`: m3jax weights <-> a MiniMax-M3-VL checkpoint directory.

A checkpoint directory holds config.json and safetensors in the upstream layout (spec §7.1, what
transformers' save_pretrained writes) or in transformers' in-memory layout (§7.2), sharded with
`model.safetensors.index.json`. m3jax's weights are `{"params": ..., "buffers": ...}`: the two
nested dicts `functional(config).init` returns, i.e. the same two keys as a train state (the
buffers hold the routers' correction biases, `e_score_correction_bias` upstream).

The pieces below `save_pretrained` stream: a tensor is read from its source just before it is
written, so the CLIs in pretrain/ convert checkpoints larger than host memory. Writes go to a
hidden sibling folder that takes the target's place only when complete (`staged_output`), so a
failed or killed export never leaves a partial checkpoint. A tensor holding NaN or infinity is
refused on reading, naming it and its file.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import ModelConfig
from m3jax.config_loading import ConfigError
from m3jax.convert.hf_config import from_hf_config, to_hf_config
from m3jax.convert.layout import (
    LeafPath,
    TensorSpec,
    from_upstream,
    leaf_shapes,
    nested,
    tensor_specs,
    to_upstream,
)
from m3jax.convert.memory_layout import UpstreamView, is_memory_layout
from m3jax.convert.safetensors_io import (
    DTYPES,
    INDEX_FILE,
    SafetensorsDirectory,
    parse_size,
    write_sharded,
)

CONFIG_FILE = "config.json"
EXPORT_DTYPES = {"float32": DTYPES["F32"], "bfloat16": DTYPES["BF16"]}
MTP = re.compile(r"(^|\.)mtp\.")  # multi-token-prediction weights: transformers ignores them


class TensorSource(Protocol):
    """Tensors by upstream name: a SafetensorsDirectory, or an UpstreamView of the in-memory
    layout. `read` may return a memory map; `origin` says where a tensor lives, for errors."""

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str) -> np.ndarray: ...
    def origin(self, name: str) -> str: ...


class CheckpointFormatError(ValueError):
    """A checkpoint directory does not match the model its config describes; names the tensor."""


def load_pretrained(path: str | os.PathLike, *, strict: bool = True) -> tuple[ModelConfig, dict]:
    """Reads a checkpoint directory -> (config, {"params": ..., "buffers": ...}) as jax arrays.

    strict=True reads the MTP modules config.json's `num_mtp_modules` asks for (tensors
    `…mtp.{i}.*` in m3jax's naming, README); strict=False loads the model without MTP modules and
    skips every `mtp.*` tensor with a warning. Any other unexpected, missing or misshapen tensor
    raises CheckpointFormatError.
    """
    config, source = open_checkpoint(path, strict=strict)
    specs = tensor_specs(config)
    check_tensors(specs, source, strict=strict)
    leaves = {}
    for leaf, shape in leaf_shapes(config).items():
        array = np.empty(shape, np.float32)
        for index, block in leaf_blocks([s for s in specs if s.leaf == leaf], source):
            array[index] = block
        leaves[leaf] = jnp.asarray(array)
    return config, nested(leaves)


def save_pretrained(
    config: ModelConfig,
    weights: dict,
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> None:
    """Writes config.json + sharded safetensors in the upstream layout that transformers loads.

    weights: {"params": ..., "buffers": ...} of `functional(config)`. dtype: "float32" or
    "bfloat16". A non-empty `path` is refused unless overwrite (which replaces only checkpoint
    files).
    """
    expected = leaf_shapes(config)
    flat = {leaf: array for leaf, array in _flatten(weights)}
    if set(flat) != set(expected):
        raise ValueError(
            "weights do not match the config: "
            f"missing {sorted(map(str, set(expected) - set(flat)))}, "
            f"unexpected {sorted(map(str, set(flat) - set(expected)))}"
        )
    for leaf, shape in expected.items():
        if tuple(flat[leaf].shape) != shape:
            raise ValueError(
                f"weights{list(leaf)} has shape {flat[leaf].shape}, config needs {shape}"
            )
    with staged_output(path, overwrite=overwrite) as staging:
        write_checkpoint(
            staging,
            config,
            lambda leaf, index: np.asarray(flat[leaf][index]),
            dtype=dtype,
            shard_size=shard_size,
        )


def open_checkpoint(
    path: str | os.PathLike, *, strict: bool = True
) -> tuple[ModelConfig, TensorSource]:
    """(config, tensor source read through upstream names) of a checkpoint directory; with
    strict=False the config has no MTP modules (see load_pretrained)."""
    directory = pathlib.Path(path)
    config_path = directory / CONFIG_FILE
    try:
        data = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path}: not found (is {directory} a checkpoint directory?)")
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path}: cannot read ({e})") from None
    config = from_hf_config(data, where=str(config_path))
    if not strict:
        config = dataclasses.replace(config, mtp=dataclasses.replace(config.mtp, num_modules=0))
    source = SafetensorsDirectory(directory)
    if is_memory_layout(source.names()):
        source = UpstreamView(source)
    return config, source


def check_tensors(specs: list[TensorSpec], source: TensorSource, *, strict: bool) -> None:
    """Every expected tensor present with its shape; nothing unexpected (mtp.* if not strict)."""
    expected = {spec.name: spec for spec in specs}
    names = set(source.names())
    if missing := sorted(set(expected) - names):
        hint = ""
        if any(MTP.search(name) for name in missing):
            hint = " (MTP modules: strict=False / --no-strict loads without them)"
        raise CheckpointFormatError(
            f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}{hint}"
        )
    unexpected = sorted(names - set(expected))
    mtp = [name for name in unexpected if MTP.search(name)]
    if other := [name for name in unexpected if not MTP.search(name)]:
        raise CheckpointFormatError(
            f"{len(other)} unexpected tensor(s) in the checkpoint, e.g. "
            + ", ".join(f"{name} in {source.origin(name)}" for name in other[:5])
        )
    if mtp:
        message = (
            f"{len(mtp)} multi-token-prediction tensor(s) (mtp.*, e.g. {mtp[0]}) outside the MTP "
            "modules of config.json's num_mtp_modules, in m3jax's naming"
        )
        if strict:
            raise CheckpointFormatError(
                message + "; pass strict=False (--no-strict) to load without MTP modules"
            )
        warnings.warn("skipping " + message, stacklevel=2)
    for name, spec in expected.items():
        if tuple(source.shape(name)) != spec.shape:
            raise CheckpointFormatError(
                f"{name} in {source.origin(name)} has shape {list(source.shape(name))}, the config "
                f"needs {list(spec.shape)}"
            )


def leaf_blocks(
    specs: list[TensorSpec], source: TensorSource
) -> Iterator[tuple[tuple, np.ndarray]]:
    """(index into the leaf, float32 value) for each upstream tensor of one leaf, read lazily.
    Raises CheckpointFormatError for a tensor holding NaN or infinity."""
    for spec in specs:
        value = np.asarray(source.read(spec.name), np.float32)
        if not np.isfinite(value).all():
            raise CheckpointFormatError(
                f"{spec.name} in {source.origin(spec.name)} holds NaN or infinity (corrupt?)"
            )
        yield spec.index, from_upstream(spec, value)


@contextlib.contextmanager
def staged_output(path: str | os.PathLike, *, overwrite: bool) -> Iterator[pathlib.Path]:
    """A hidden sibling folder of `path` to write a checkpoint into. When the block completes it
    becomes `path` (or, with overwrite, its files replace an earlier checkpoint's config.json,
    index and model*.safetensors there, config.json last); when it fails it is removed and `path`
    is untouched. A non-empty `path` is refused unless overwrite."""
    directory = pathlib.Path(path)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory")
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{directory} is not empty; pass overwrite (--overwrite) to replace it"
        )
    staging = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if directory.exists() and not any(directory.iterdir()):
        directory.rmdir()
    if not directory.exists():
        staging.rename(directory)
        return
    shards = directory.glob("model*.safetensors")
    for old in [directory / CONFIG_FILE, directory / INDEX_FILE, *shards]:
        old.unlink(missing_ok=True)
    for new in sorted(staging.iterdir(), key=lambda f: f.name == CONFIG_FILE):
        new.replace(directory / new.name)
    staging.rmdir()


def write_checkpoint(
    directory: pathlib.Path,
    config: ModelConfig,
    read_slice: Callable[[LeafPath, tuple], np.ndarray],
    *,
    dtype: str,
    shard_size: str | int,
    on_tensor: Callable[[str], None] = lambda name: None,
) -> None:
    """Writes the safetensors shards (each tensor = to_upstream(read_slice(leaf, index))), the
    index and config.json. read_slice is called once per upstream tensor, in writing order."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    specs = {spec.name: spec for spec in tensor_specs(config)}

    def produce(name: str) -> np.ndarray:
        spec = specs[name]
        return to_upstream(spec, np.asarray(read_slice(spec.leaf, spec.index), np.float32))

    write_sharded(
        directory,
        [(name, spec.shape) for name, spec in specs.items()],
        produce,
        dtype=EXPORT_DTYPES[dtype],
        shard_size=parse_size(shard_size),
        on_tensor=on_tensor,
    )
    config_json = json.dumps(to_hf_config(config, dtype=dtype), indent=2)
    (directory / CONFIG_FILE).write_text(config_json + "\n")


def _flatten(tree: dict) -> list[tuple[LeafPath, object]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        (tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), x) for path, x in flat
    ]

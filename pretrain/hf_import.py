"""`m3-import`: a MiniMax-M3-VL checkpoint -> an m3-train run directory that resumes from it.

    m3-import --hf MiniMax-M3/ --output runs/m3-continued [--config run.yaml] [--no-strict]
    m3-train --config runs/m3-continued/config.yaml --run-dir runs/m3-continued

Reads config.json and the safetensors (upstream layout, or transformers' in-memory layout) and
writes RUN/config.yaml and RUN/checkpoints/0/{state, data}: the full train state m3-train builds
(step 0, the imported params and router biases, fresh optimizer moments) and the data position of a
fresh loader. The model section comes from config.json; every other section (data, optimizer,
train, mesh, checkpoint, logging) from --config, or the RunConfig defaults without it. A model
section in --config may set training-only fields (dtype, remat, init_std, moe.bias_update_rate,
moe.balance_loss_weight); any other model field it sets must equal config.json's.

Tensors stream one at a time from the safetensors to the Orbax arrays: host memory stays near one
tensor, into a hidden folder beside --output that is renamed to it when complete: a failed import
leaves nothing behind. A truncated shard or a tensor holding NaN or infinity stops it, naming the
file and the tensor. --strict (default) imports the MTP modules config.json's `num_mtp_modules`
asks for and refuses any other `mtp.*` tensor; --no-strict imports the model without MTP modules
and skips every `mtp.*` tensor with a warning. Any error stops with one line on stderr and exit
code 2 (the traceback with --debug).
"""

import argparse
import pathlib
import shutil
import sys
import time
import warnings

import jax
import numpy as np
import yaml
from tqdm import tqdm

from m3jax.config import ModelConfig
from m3jax.config_loading import ConfigError, from_mapping, load_yaml, to_mapping
from m3jax.convert.hf_config import TRAINING_FIELDS
from m3jax.convert.layout import tensor_specs
from m3jax.convert.pretrained import check_tensors, leaf_blocks, open_checkpoint
from m3jax.model import functional
from pretrain.checkpoint_arrays import LazyArray, save_streamed, zeros
from pretrain.cli import add_debug_flag, run_command
from pretrain.config import RunConfig, RunError
from pretrain.data_loading import make_loader
from pretrain.optimizer import make_optimizer
from pretrain.session import progress
from pretrain.train_step import init_state

IMPORT_STEP = 0
SETTLE_CHECKS, SETTLE_SECONDS = 20, 0.05  # removing a failed import's folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-import", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, type=pathlib.Path, help="checkpoint directory")
    parser.add_argument("--output", required=True, type=pathlib.Path, help="new run directory")
    parser.add_argument("--config", type=pathlib.Path, help="run YAML for the non-model sections")
    parser.add_argument(
        "--strict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="import num_mtp_modules MTP modules, refuse other mtp.* tensors (--no-strict: "
        "no MTP modules, mtp.* skipped with a warning)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)

    def command() -> int:
        import_checkpoint(args.hf, args.output, config_path=args.config, strict=args.strict)
        return 0

    return run_command("m3-import", command, debug=args.debug)


def import_checkpoint(
    hf_dir: pathlib.Path,
    run_dir: pathlib.Path,
    *,
    config_path: pathlib.Path | None = None,
    strict: bool = True,
) -> RunConfig:
    """Writes run_dir/config.yaml and run_dir/checkpoints/0; returns the run config."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunError(f"{run_dir} is not empty; m3-import writes a new run directory")
    model, source = open_checkpoint(hf_dir, strict=strict)
    specs = tensor_specs(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_tensors(specs, source, strict=strict)
    for warning in caught:
        print(f"m3-import: warning: {warning.message}", file=sys.stderr)
    run = run_config(model, config_path)
    data_state = make_loader(run).state()
    optimizer = make_optimizer(run.optimizer, run.train.steps, functional(model).param_axes)
    abstract = jax.eval_shape(lambda: init_state(functional(model), optimizer, run.train.seed))
    staging = run_dir.parent / f".{run_dir.name}.importing"  # a failed import's is replaced
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tqdm(total=len(specs), desc="m3-import", unit="tensor") as bar:
            state = _lazy_state(abstract, specs, source, progress=lambda: bar.update(1))
            step_dir = staging / "checkpoints" / str(IMPORT_STEP)
            save_streamed(step_dir, state, data_state, progress(run, tokens_seen=0))
        (staging / "config.yaml").write_text(yaml.safe_dump(to_mapping(run), sort_keys=False))
    except BaseException:
        _remove_for_good(staging)  # leave no half-written run
        raise
    if run_dir.exists():
        run_dir.rmdir()  # empty (checked above)
    staging.rename(run_dir)
    print(f"m3-import: {hf_dir} -> {run_dir} (step {IMPORT_STEP}); continue training with\n"
          f"  m3-train --config {run_dir / 'config.yaml'} --run-dir {run_dir}")  # fmt: skip
    return run


def run_config(model: ModelConfig, config_path: pathlib.Path | None) -> RunConfig:
    """The imported model with the other sections of `config_path` (or defaults); see module doc."""
    where = str(config_path) if config_path else "m3-import defaults"
    data = load_yaml(config_path) if config_path else {}
    overrides = data.pop("model", None) or {}
    merged = _merge(to_mapping(model), overrides)
    run = from_mapping(RunConfig, {**data, "model": merged}, where=where)
    for key in _leaf_keys(overrides):
        if key in (*TRAINING_FIELDS, "init_std"):  # init_std: weights come from the checkpoint
            continue
        ours, theirs = _get(run.model, key), _get(model, key)
        if ours != theirs:
            raise ConfigError(
                f"{where}: model.{key}={ours!r} differs from the checkpoint's config.json "
                f"({theirs!r}); the architecture comes from the checkpoint"
            )
    return run


def _lazy_state(abstract: dict, specs, source, progress) -> dict:
    """The train state with imported params/buffers and zero optimizer state, as LazyArrays."""
    by_leaf: dict = {}
    for spec in specs:
        by_leaf.setdefault(spec.leaf, []).append(spec)

    def imported(leaf, shape):
        leaf_specs = by_leaf[leaf]

        def blocks():
            for index, block in leaf_blocks(leaf_specs, source):
                yield index, block
                progress()

        return LazyArray(shape, np.dtype(np.float32), len(leaf_specs[0].index), blocks)

    weights = {
        collection: jax.tree_util.tree_map_with_path(
            lambda path, x, c=collection: imported((c, *map(_key, path)), tuple(x.shape)),
            abstract[collection],
        )
        for collection in ("params", "buffers")
    }
    optimizer_state = jax.tree.map(lambda x: zeros(x.shape, x.dtype), abstract["opt_state"])
    return {"step": zeros((), np.int32), **weights, "opt_state": optimizer_state}


def _remove_for_good(path: pathlib.Path) -> None:
    # Array writes already in flight when a tensor failed are committed by tensorstore in the
    # background and can recreate the folder just after it is removed: remove until it stays gone.
    for _ in range(SETTLE_CHECKS):
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(SETTLE_SECONDS)
        if not path.exists():
            return


def _key(key):
    return getattr(key, "key", getattr(key, "idx", None))


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaf_keys(mapping: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part, None)
    return config


if __name__ == "__main__":
    sys.exit(main())

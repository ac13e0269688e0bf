"""`m3-export`: an m3-train checkpoint -> a MiniMax-M3-VL checkpoint transformers loads.

    m3-export --run runs/exp1 [--step N] --output out/exp1-hf [--dtype bfloat16|float32]
              [--overwrite] [--shard-size 5GB]

Reads RUN/config.yaml and RUN/checkpoints/<step>/state (the latest step by default) and writes
config.json + model-0000i-of-0000n.safetensors + model.safetensors.index.json in MiniMax's upstream
layout (spec §7.1). Tensors stream one at a time from the Orbax arrays to the shard being written,
so host memory stays near one shard whatever the model size, into a hidden folder beside --output
that replaces it when complete. Optimizer state is not exported. Any error stops with one line on
stderr and exit code 2 (the traceback with --debug).
"""

import argparse
import pathlib
import sys

from tqdm import tqdm

from m3jax.convert.layout import tensor_specs
from m3jax.convert.pretrained import EXPORT_DTYPES, staged_output, write_checkpoint
from m3jax.convert.safetensors_io import parse_size
from pretrain.cli import add_debug_flag, run_command
from pretrain.run_checkpoint import open_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, type=pathlib.Path, help="m3-train run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--output", required=True, type=pathlib.Path, help="directory to write")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="float32",
                        help="float32 (default: exact) or bfloat16 (half the size)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    parser.add_argument("--shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB")
    add_debug_flag(parser)
    args = parser.parse_args(argv)

    def command() -> int:
        parse_size(args.shard_size)
        export(args.run, args.output, step=args.step, dtype=args.dtype,
               shard_size=args.shard_size, overwrite=args.overwrite)  # fmt: skip
        return 0

    return run_command("m3-export", command, debug=args.debug)


def export(
    run_dir: pathlib.Path,
    output: pathlib.Path,
    *,
    step: int | None,
    dtype: str,
    shard_size: str,
    overwrite: bool,
) -> int:
    """Writes the checkpoint of `step` (None: the latest) to `output`; returns the step."""
    checkpoint = open_run(run_dir, step)
    model, arrays = checkpoint.run.model, checkpoint.arrays
    bar = tqdm(total=len(tensor_specs(model)), desc="m3-export", unit="tensor")
    with bar, staged_output(output, overwrite=overwrite) as staging:
        write_checkpoint(
            staging,
            model,
            lambda leaf, index: arrays[leaf][index].read().result(),
            dtype=dtype,
            shard_size=shard_size,
            on_tensor=lambda name: bar.update(1),
        )
    print(f"m3-export: step {checkpoint.step} of {run_dir} -> {output} ({dtype})")
    return checkpoint.step


if __name__ == "__main__":
    sys.exit(main())

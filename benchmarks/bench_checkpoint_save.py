"""What one asynchronous checkpoint save costs the training loop (issue 18: < 3 % of its step).

    python -m benchmarks.bench_checkpoint_save --config configs/bench-h200.yaml \
        --dir /dev/shm/m3jax-save [--steps 10] [--saves 3] [section.key=value ...]

The session is built as `m3-train` builds it (`TrainingSession`, `Checkpoints` with the run's
`checkpoint.async_save`), on one fixed batch already on the device (no input pipeline: the
input stall is bench_input_stall's). Each step is dispatched and waited for, so every step's
time is known:

1. `--steps` steps alone: the median step time T.
2. `--saves` times: `session.save(step, loader)` after a step, as pretrain/train.py calls it
   (the finiteness check, then Orbax's save, which copies the state to the host before it
   returns and writes files in background threads; with `checkpoint.device_copy`, where the
   device has room, Orbax saves a device copy of the state from a thread of its own:
   `in_background`, pretrain/state_copy.py), then steps until `Checkpoints.poll` says the save
   is complete. The save's cost is the time the call blocked plus what the steps run meanwhile
   took beyond T:

       cost = blocked + sum(step_i - T for the steps while the save was in progress)

   reported as a fraction of one step (cost / T) and of the checkpoint interval
   (cost / (checkpoint.every_steps x T)); the verdict takes the worst save after the first
   (the first also sets Orbax's machinery up, once per run; it is listed too). The first 8 of
   those step times are listed too: whether a save slows the step right after it or many.

Each save writes into an emptied `--dir`, which must hold one copy of the state (its size is
printed first); the directory is removed at the end.
The last stdout line is JSON.
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import time

import jax

from m3jax import xla_flags
from m3jax.model import functional
from pretrain.checkpointing import Checkpoints
from pretrain.config import load_run_config
from pretrain.data_loading import make_loader
from pretrain.session import TrainingSession

SAVE_TARGET = 0.03  # issue 18: an async save under 3 % of its step


def timed_step(session: TrainingSession, batch, mode) -> float:
    start = time.perf_counter()
    jax.block_until_ready(session.step_on_devices(batch, mode))
    return time.perf_counter() - start


def one_save(session: TrainingSession, loader, batch, mode, step: int, step_s: float) -> dict:
    """Starts the save of `step`, then steps until it is complete; the cost as in the docstring."""
    start = time.perf_counter()
    session.save(step, loader)
    blocked = time.perf_counter() - start
    in_background = session.checkpoints.saving_in_background
    during = []
    while session.run.checkpoint.async_save and session.checkpoints.poll() is None:
        during.append(timed_step(session, batch, mode))
    complete = time.perf_counter() - start
    cost = blocked + sum(t - step_s for t in during)
    return {"step": step, "blocked_s": blocked, "complete_s": complete,
            "in_background": in_background, "steps_during": len(during), "cost_s": cost,
            "cost_of_step": cost / step_s,
            "first_steps_ms": [round(t * 1e3, 1) for t in during[:8]]}  # fmt: skip


def fresh_checkpoints(session: TrainingSession, directory: pathlib.Path) -> None:
    """Each save goes to an empty directory and the previous one is removed first, so that the
    disk holds one copy of the state (bench-h200's is 48 GB)."""
    if session.checkpoints is not None:
        session.checkpoints.close()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    session.checkpoints = Checkpoints(directory, session.run.checkpoint)


def main(argv: list[str] | None = None) -> int:
    xla_flags.apply()  # before the first backend starts
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--dir", required=True, help="checkpoint directory (removed first)")
    parser.add_argument("--steps", type=int, default=10, help="steps timed alone")
    parser.add_argument("--saves", type=int, default=3, help="saves timed")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as m3-train takes them")
    args = parser.parse_args(argv)
    run = load_run_config(args.config, args.overrides)
    directory = pathlib.Path(args.dir)
    session = TrainingSession(functional(run.model), run, None)
    fresh_checkpoints(session, directory)
    session.initialize()
    state_gb = sum(x.nbytes for x in jax.tree.leaves(session.state)) / 1e9
    free_gb = shutil.disk_usage(directory).free / 1e9
    print(f"state {state_gb:.1f} GB; {free_gb:.1f} GB free in {directory}; async_save="
          f"{run.checkpoint.async_save}", flush=True)  # fmt: skip
    if free_gb < 1.1 * state_gb:
        print("bench_checkpoint_save: error: the directory cannot hold two checkpoints",
              file=sys.stderr)  # fmt: skip
        return 2
    loader = make_loader(run)
    batch = jax.block_until_ready(session.put_batch(next(loader)))
    mode = session.forward_mode(1)
    compile_s = timed_step(session, batch, mode)
    timed_step(session, batch, mode)  # warm-up
    alone = [timed_step(session, batch, mode) for _ in range(args.steps)]
    step_s = statistics.median(alone)
    print(f"compile {compile_s:.1f} s; step alone: median {step_s * 1e3:.1f} ms over "
          f"{args.steps}", flush=True)  # fmt: skip
    saves, step = [], args.steps + 2
    for _ in range(args.saves):
        if saves:
            fresh_checkpoints(session, directory)
        saves.append(one_save(session, loader, batch, mode, step, step_s))
        step += saves[-1]["steps_during"] + 1
        print(json.dumps(saves[-1]), flush=True)
        timed_step(session, batch, mode)  # the next save's step
    session.checkpoints.close()
    shutil.rmtree(directory, ignore_errors=True)
    loader.close()
    steady = saves[1:] or saves  # the first save also sets Orbax up (once per run)
    worst = max(s["cost_of_step"] for s in steady)
    report = {
        "benchmark": "checkpoint_save", "config": args.config, "overrides": args.overrides,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "state_gb": state_gb,
        "async_save": run.checkpoint.async_save, "step_s": step_s, "saves": saves,
        "worst_cost_of_step": worst, "below_target": worst < SAVE_TARGET,
        "cost_of_interval": worst / run.checkpoint.every_steps,
    }  # fmt: skip
    print(f"\n| save | device copy | blocked s | complete s | steps meanwhile | cost s | of one "
          f"step ({step_s * 1e3:.0f} ms) |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for s in saves:
        print(f"| step {s['step']} | {'yes' if s['in_background'] else 'no'} | "
              f"{s['blocked_s']:.3f} | {s['complete_s']:.2f} | {s['steps_during']} | "
              f"{s['cost_s']:.3f} | {100 * s['cost_of_step']:.1f} % |")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one asynchronous checkpoint save costs the training loop (issue 18: < 3 % of its step).

    python -m benchmarks.bench_checkpoint_save --config configs/bench-h200.yaml \
        --dir /dev/shm/m3jax-save [--steps 10] [--saves 3] [section.key=value ...]

The session is built as `m3-train` builds it (`TrainingSession`, `Checkpoints` with the run's
`checkpoint.async_save`), on one fixed batch already on the device (no input pipeline: the
input stall is bench_input_stall's). Steps run as pretrain/train.py runs them: each is
dispatched before the one before it is waited for (`Pipeline`), so the host's work between
steps (and a save thread's use of the interpreter) hides behind the device's as it does in
training; a step's time is the interval between its completion and the previous one's.

1. `--steps` steps alone: the median step time T.
2. `--saves` times: the pipeline drained (train.py reads the newest step's loss before a plain
   save), then `session.save(step, loader)` as train.py calls it (the finiteness check, then
   Orbax's save, which copies the state to the host before it returns and writes files in
   background threads); with `checkpoint.copy_in_step=true` as train.py runs it instead: the
   next step copies the state it starts from to host memory, and Orbax's save of that copy
   starts once the step after it is dispatched. Then steps until `Checkpoints.poll` says the
   save is complete, and the pipeline drained again. The save's cost is what that stretch took
   beyond its steps':

       cost = (drained after the save - drained before it) - steps meanwhile x T

   that is the time the save held the loop (`blocked_s`: the call that starts it), the steps'
   slowdown and the pipeline's refill, reported as a fraction of one step (cost / T) and of
   the checkpoint interval (cost / (checkpoint.every_steps x T)); the verdict takes the worst
   save after the first (the first also sets Orbax's machinery up and compiles the copying
   step: once per run; it is listed too). The first 8 step times meanwhile are listed too
   (whether a save slows the step right after it or many), and how long their dispatches held
   the loop (a dispatch that waits, or a loop starved by the save's threads, idles the device).

`--trace DIR` profiles the last save (its steps and Orbax's call) for `trace_summary --timeline`:
whether the state's copies to host memory ran beside the steps' compute, and where the device
idled.

Each save writes into an emptied `--dir`, which must hold one copy of the state (its size is
printed first; emptied before the step that precedes the save, outside the timing); the
directory is removed at the end.
The last stdout line is JSON.
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import jax

from m3jax import xla_flags
from m3jax.model import functional
from pretrain.checkpointing import Checkpoints
from pretrain.config import load_run_config
from pretrain.data_loading import make_loader
from pretrain.session import TrainingSession

SAVE_TARGET = 0.03  # issue 18: an async save under 3 % of its step


class Pipeline:
    """Steps of `session` on one batch with one step in flight, as pretrain/train.py runs them."""

    def __init__(self, session: TrainingSession, batch, mode):
        self._session, self._batch, self._mode = session, batch, mode
        self._in_flight = None
        self.last_done = time.perf_counter()  # when the last step waited for was complete
        self.dispatch_s: list[float] = []  # how long each dispatch held the loop

    def step(self, copy_state: bool = False, then: Callable[[], None] | None = None):
        """Dispatches a step (`copy_state`: one that also copies its state to the host), calls
        `then`, then waits for the step before it; returns that one's time (since the completion
        before it), or None if none was in flight."""
        previous, began = self._in_flight, time.perf_counter()
        self._in_flight = self._session.step_on_devices(self._batch, self._mode, copy_state)
        self.dispatch_s.append(time.perf_counter() - began)
        if then is not None:
            then()
        return None if previous is None else self._wait(previous)

    def drain(self) -> float | None:
        """Waits for the step in flight; returns its time (None if there was none)."""
        previous, self._in_flight = self._in_flight, None
        return None if previous is None else self._wait(previous)

    def run(self, steps: int) -> list[float]:
        """`steps` step times, from a drained pipeline to a drained pipeline."""
        times = [self.step() for _ in range(steps)] + [self.drain()]
        return [t for t in times if t is not None]

    def _wait(self, metrics) -> float:
        jax.block_until_ready(metrics)
        done, before = time.perf_counter(), self.last_done
        self.last_done = done
        return done - before


def one_save(session: TrainingSession, loader, pipeline: Pipeline, step: int, step_s: float):
    """Saves `step` from a drained pipeline, steps until the save is complete, drains; the cost as
    in the module doc."""
    pipeline.drain()
    start, held, during = pipeline.last_done, [], []
    dispatches = len(pipeline.dispatch_s)

    def start_save(save: Callable[[], None]) -> None:  # held: how long the call held the loop
        began = time.perf_counter()
        save()
        held.append(time.perf_counter() - began)

    if session.run.checkpoint.copy_in_step:  # as train.py: step + 1 copies the state, the save
        due = session.prepare_save(step, loader)  # starts once step + 2 is dispatched
        pipeline.step(copy_state=True)
        copied = session.take_state_copy(due)
        then = lambda: start_save(lambda: session.start_copied_save(copied))  # noqa: E731
        during.append(pipeline.step(then=then))
    else:
        start_save(lambda: session.save(step, loader))
    blocked = held[0]
    while session.run.checkpoint.async_save and session.checkpoints.poll() is None:
        if (seconds := pipeline.step()) is not None:
            during.append(seconds)
    if (seconds := pipeline.drain()) is not None:
        during.append(seconds)
    complete = pipeline.last_done - start if during else blocked  # synchronous: all blocked
    cost = complete - len(during) * step_s
    dispatched = pipeline.dispatch_s[dispatches : dispatches + 8]
    return {"step": step, "blocked_s": blocked, "complete_s": complete,
            "steps_during": len(during), "cost_s": cost,
            "cost_of_step": cost / step_s,
            "first_steps_ms": [round(t * 1e3, 1) for t in during[:8]],
            "first_dispatches_ms": [round(t * 1e3, 1) for t in dispatched]}  # fmt: skip


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
    parser.add_argument("--trace", metavar="DIR",
                        help="profile the last save into DIR (a perfetto trace; read it with "
                             "`python -m benchmarks.trace_summary DIR --timeline`)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="section.key=value, as m3-train takes them")
    args = parser.parse_intermixed_args(argv)
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
    host_batch = next(loader)
    batch = jax.block_until_ready(session.put_batch(host_batch))
    mode = session.mode_for(host_batch, session.forward_mode(1))  # as m3-train's steps take it
    pipeline = Pipeline(session, batch, mode)
    compile_s = pipeline.run(1)[0]
    pipeline.run(1)  # warm-up
    step_s = statistics.median(pipeline.run(args.steps))
    print(f"compile {compile_s:.1f} s; step alone: median {step_s * 1e3:.1f} ms over "
          f"{args.steps}", flush=True)  # fmt: skip
    saves, step = [], args.steps + 2
    for index in range(args.saves):
        if saves:  # the directory emptied before the step that precedes the save, not timed
            fresh_checkpoints(session, directory)
            pipeline.run(1)
        profiled = nullcontext()
        if args.trace and index == args.saves - 1:
            profiled = jax.profiler.trace(args.trace, create_perfetto_trace=True)
        with profiled:
            saves.append(one_save(session, loader, pipeline, step, step_s))
        step += saves[-1]["steps_during"] + 1
        print(json.dumps(saves[-1]), flush=True)
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
    print(f"\n| save | blocked s | complete s | steps meanwhile | cost s | of one step "
          f"({step_s * 1e3:.0f} ms) |\n|---|---|---|---|---|---|")  # fmt: skip
    for s in saves:
        print(f"| step {s['step']} | {s['blocked_s']:.3f} | {s['complete_s']:.2f} | "
              f"{s['steps_during']} | {s['cost_s']:.3f} | {100 * s['cost_of_step']:.1f} % |")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Input stall of the real training loop: does the Grain pipeline keep the accelerator busy?

    python -m benchmarks.bench_input_stall --config configs/small-gpu-multimodal.yaml
        [--steps 30] [--workers 8] [--time-budget 200] [--out results.json] [section.key=value ...]

The run is built as `m3-train` builds it (`load_run_config`, `make_loader`, `TrainingSession`;
no checkpoint is written), then three measurements:

1. Pipeline alone: a loader with the run's workers, read as fast as possible, no training.
   Start-up (time to the first batch) is reported apart; the rate is taken over the second half
   of `--pipeline-batches`, after the workers' prefetch buffers have drained.
2. Step alone: the jitted train step on one fixed batch already on the device (the pipeline's
   first batch): compile, one warm-up, then the median of N steps, each `block_until_ready`.
   The host -> device copy of one batch is timed apart (median of 5).
3. The real loop, with a fresh loader (workers started cold): `session.step(next(loader), mode)`
   as pretrain/train.py's loop runs it, fetching the metrics every `logging.every_steps` steps
   as that loop does (its only waits for the device besides checkpoints, which are left out).

Method for 3. The loop may overlap input with compute: where a step is dispatched
asynchronously, the host is already in next(loader) for step i+1 while the device runs step i,
so time in next(loader) is not stall by itself. Where dispatch blocks (seen on the H200: session.step
returned only when the step had finished), it is. A watcher thread blocks on each step's metrics
in order and records when each step finished (done[i]); the main thread records when it had the
batch (fetched[i]) and when session.step returned (enqueued[i]). The device can start step i only
once the host has the batch and has copied it, so

    idle before step i = max(0, min(enqueued[i], fetched[i] + copy) - done[i-1])
    stall = sum of idle / (done[last] - done[first steady - 1])    over the steady steps,

with `copy` the host -> device copy timed alone in 2 (counted as idle whenever the host is late:
an upper bound on what a slow pipeline costs).

The first `--startup-steps` steps (waiting for the workers to start) are reported apart. The
watcher sees a finished step up to one interpreter switch interval late (set to 0.5 ms here),
which can only hide idle time, so each step's idle may be under-counted by that much. Cross-check:
(wall - steps x step time alone) / wall. Also reported: the host's time in next(loader) per step
and its share of the wall time, which is what a loop without overlap would stall.

Every step runs the forward mode of the run's first step without the MSA recall pass (m3-train
adds one every `logging.msa_recall_every` steps), so that one compilation serves 2 and 3 and the
loop measures the common, cheapest step: the most demanding one for the pipeline.
`--time-budget S` shortens the loop so that the whole benchmark ends within about S seconds.
Progress lines go to stdout as it runs, then a markdown summary; the last line is JSON.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time

import jax

from batch_format.batch import Batch
from data.mm_documents import DataError
from m3jax import xla_flags
from m3jax.config_loading import ConfigError
from m3jax.model import functional
from pretrain.checkpointing import Checkpoints
from pretrain.config import RunConfig, RunError, load_run_config
from pretrain.data_loading import make_loader
from pretrain.session import TrainingSession

STALL_TARGET = 0.02  # issue 5: < 2% input stall
SWITCH_INTERVAL_S = 5e-4  # how late the watcher thread may see a finished step (default 5 ms)
MIN_LOOP_STEPS = 10  # --time-budget keeps at least this many: one metrics fetch at every_steps 10


def main(argv: list[str] | None = None) -> int:
    xla_flags.apply()  # before the first backend starts
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--steps", type=int, default=30, help="steady steps of the real loop")
    parser.add_argument("--compute-steps", type=int, help="timed steps alone (default: --steps)")
    parser.add_argument("--startup-steps", type=int, default=3, help="loop steps reported apart")
    parser.add_argument("--pipeline-batches", type=int, default=64, help="batches read alone")
    parser.add_argument("--workers", type=int, help="Grain worker processes (data.workers)")
    parser.add_argument("--time-budget", type=float, help="seconds: shorten the loop to fit")
    parser.add_argument("--out", help="write the JSON report here (also after each phase)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as m3-train takes them")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.workers is not None:
        overrides.append(f"data.workers={args.workers}")
    try:
        report = measure(
            load_run_config(args.config, overrides), steps=args.steps,
            compute_steps=args.compute_steps or args.steps, startup_steps=args.startup_steps,
            pipeline_batches=args.pipeline_batches, time_budget=args.time_budget, out=args.out,
            config=args.config,
        )  # fmt: skip
    except (ConfigError, RunError, DataError) as e:  # as m3-train reports them
        print(f"bench_input_stall: error: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(json.dumps(report), flush=True)
    return 0


def measure(
    run: RunConfig,
    *,
    steps: int,
    compute_steps: int,
    startup_steps: int = 3,
    pipeline_batches: int = 64,
    time_budget: float | None = None,
    out: str | os.PathLike | None = None,
    config: str = "",
) -> dict:
    """Runs the three measurements of the module docstring; returns the report (JSON values)."""
    if steps < 1 or compute_steps < 1 or startup_steps < 1 or pipeline_batches < 2:
        raise ValueError("steps, compute_steps, startup_steps >= 1 and pipeline_batches >= 2")
    began = time.perf_counter()
    device = jax.devices()[0]
    report = {
        "benchmark": "input_stall", "config": config, "complete": False,
        "device": f"{device.platform} {device.device_kind}", "jax": jax.__version__,
        "cpu_count": os.cpu_count(), "workers": run.data.workers,
        "batch_size": run.data.batch_size, "seq_len": run.data.seq_len,
        "patch_budget": run.data.patch_budget, "dev_shm_free_gb": _shm_free_gb(),
    }  # fmt: skip
    data = run.data
    _log(f"{config or 'run'} on {report['device']}, {report['cpu_count']} CPUs, {data.workers} "
         f"Grain workers (batches cross in /dev/shm: {report['dev_shm_free_gb']:.1f} GB free), "
         f"batch {data.batch_size} x {data.seq_len}")  # fmt: skip
    report["pipeline"], fixed_batch = pipeline_alone(make_loader(run), pipeline_batches)
    _write(out, report)
    with tempfile.TemporaryDirectory(prefix="bench-input-stall-") as scratch:
        checkpoints = Checkpoints(pathlib.Path(scratch) / "checkpoints", run.checkpoint)
        session = TrainingSession(functional(run.model), run, checkpoints)
        session.initialize()
        _log(f"session: {session.num_params / 1e6:.1f}M params, mesh {dict(session.mesh.shape)}")
        mode = dataclasses.replace(session.forward_mode(1), block_recall=False)
        report["forward_mode"] = dataclasses.asdict(mode)
        report["step"] = step_alone(session, fixed_batch, mode, compute_steps)
        _write(out, report)
        loop_steps = _fit_steps(steps, startup_steps, report, time_budget, began)
        report["loop"] = real_loop(
            session, run, mode, startup_steps, loop_steps, report["step"]["put_batch_s"]
        )
        checkpoints.close()
    report["summary"] = summarize(report)
    report["seconds"] = time.perf_counter() - began
    report["complete"] = True
    _write(out, report)
    return report


def pipeline_alone(loader, batches: int) -> tuple[dict, Batch]:
    """Reads `batches` batches after the first with nothing else running; returns the rates and
    the first batch (the fixed batch of the step-alone timing)."""
    start = time.perf_counter()
    first = next(loader)
    startup = time.perf_counter() - start
    _log(f"pipeline alone: first batch after {startup:.1f} s (worker start-up)")
    times, tokens = [time.perf_counter()], []
    for i in range(batches):
        batch = next(loader)
        times.append(time.perf_counter())
        tokens.append(int((batch.segment_ids > 0).sum()))
        if (i + 1) % max(1, batches // 4) == 0:
            _log(f"pipeline alone: {i + 1}/{batches} batches, {times[-1] - times[0]:.1f} s")
    loader.close()
    half = batches // 2  # rates over the second half: the prefetch buffers have drained by then
    seconds = times[-1] - times[half]
    return {
        "startup_s": startup,
        "batches": batches,
        "measured_batches": batches - half,
        "first_half_s": times[half] - times[0],
        "seconds": seconds,
        "batches_per_s": (batches - half) / seconds,
        "tokens_per_s": sum(tokens[half:]) / seconds,
        "batch_mb": sum(x.nbytes for x in jax.tree.leaves(first)) / 1e6,
    }, first


def step_alone(session: TrainingSession, batch: Batch, mode, steps: int) -> dict:
    """The jitted step on one batch already on the device: compile, warm-up, median of `steps`."""
    mode = session.mode_for(batch, mode)  # the step the loop's `session.step` runs for it
    on_device = jax.block_until_ready(session.put_batch(batch))
    start = time.perf_counter()
    jax.block_until_ready(session.step_on_devices(on_device, mode))
    compile_s = time.perf_counter() - start
    _log(f"step alone: first step (compilation) {compile_s:.1f} s")
    jax.block_until_ready(session.step_on_devices(on_device, mode))  # warm-up
    times = []
    for i in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(session.step_on_devices(on_device, mode))
        times.append(time.perf_counter() - start)
        _log(f"step alone: {i + 1}/{steps}: {times[-1] * 1e3:.1f} ms")
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(session.put_batch(batch))
        copies.append(time.perf_counter() - start)
    return {
        "compile_s": compile_s,
        "steps": steps,
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "put_batch_s": statistics.median(copies),
        "tokens_per_s": batch.tokens.size * jax.process_count() / statistics.median(times),
    }


def real_loop(
    session: TrainingSession, run: RunConfig, mode, startup: int, steps: int, copy_s: float
) -> dict:
    """pretrain/train.py's loop on a fresh loader, timed per step (see the module docstring)."""
    loader, watcher = make_loader(run), _CompletionWatcher()
    total, log_every, pending, rows = startup + steps, run.logging.every_steps, [], []
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    watcher.start()
    begin = time.perf_counter()
    try:
        for i in range(total):
            fetch_start = time.perf_counter()
            batch = next(loader)
            fetched = time.perf_counter()
            metrics = session.step(batch, mode)  # host -> device copy, then async dispatch
            enqueued = time.perf_counter()
            rows.append({"fetch_s": fetched - fetch_start, "put_dispatch_s": enqueued - fetched,
                         "fetched": fetched, "enqueued": enqueued})  # fmt: skip
            watcher.watch(metrics)
            pending.append(metrics)
            if (i + 1) % log_every == 0 or i == 0 or i == total - 1:  # as the loop logs
                jax.device_get(pending)
                pending = []
            if i < startup or (i + 1 - startup) % max(1, steps // 10) == 0 or i == total - 1:
                _log(f"loop: step {i + 1}/{total}, fetch {rows[-1]['fetch_s'] * 1e3:.1f} ms, "
                     f"copy+dispatch {rows[-1]['put_dispatch_s'] * 1e3:.1f} ms")  # fmt: skip
    finally:
        done = watcher.finish()
        sys.setswitchinterval(switch_interval)
        loader.close()
    return _loop_report(rows, done, begin, startup, copy_s)


def _loop_report(
    rows: list[dict], done: list[float], begin: float, startup: int, copy_s: float
) -> dict:
    previous = begin
    for row, finished in zip(rows, done):
        started = min(row["enqueued"], row["fetched"] + copy_s)  # the earliest the step can run
        row["idle_s"] = max(0.0, started - previous)
        row["interval_s"] = finished - previous
        row["done"] = finished
        previous = finished
    steady = rows[startup:]
    wall = steady[-1]["done"] - rows[startup - 1]["done"]
    idle = sum(r["idle_s"] for r in steady)
    fetch = [r["fetch_s"] for r in steady]
    for row in rows:  # times relative to the loop's start
        for key in ("fetched", "enqueued", "done"):
            row[key] -= begin
    return {
        "startup_steps": startup,
        "startup_s": rows[startup - 1]["done"],
        "startup_idle_s": sum(r["idle_s"] for r in rows[:startup]),
        "steps": len(steady),
        "wall_s": wall,
        "idle_s": idle,
        "stall_fraction": idle / wall,
        "interval_s_median": statistics.median(r["interval_s"] for r in steady),
        "fetch_s_median": statistics.median(fetch),
        "fetch_s_max": max(fetch),
        "fetch_fraction": sum(fetch) / wall,
        "put_dispatch_s_median": statistics.median(r["put_dispatch_s"] for r in steady),
        "per_step": rows,
    }


def summarize(report: dict) -> dict:
    step, loop, pipeline = report["step"], report["loop"], report["pipeline"]
    compute = loop["steps"] * step["step_s"]
    return {
        "stall_fraction": loop["stall_fraction"],
        "stall_below_target": loop["stall_fraction"] < STALL_TARGET,
        "stall_fraction_by_difference": max(0.0, loop["wall_s"] - compute) / loop["wall_s"],
        "step_per_s": 1 / step["step_s"],
        "loop_step_per_s": loop["steps"] / loop["wall_s"],
        "pipeline_batches_per_s": pipeline["batches_per_s"],
        # > 1: the pipeline alone produces batches faster than the step alone consumes them
        "pipeline_over_step_rate": pipeline["batches_per_s"] * step["step_s"],
    }


def markdown(report: dict) -> str:
    p, s, loop, summary = report["pipeline"], report["step"], report["loop"], report["summary"]
    verdict = "below" if summary["stall_below_target"] else "NOT below"
    rows = {
        "pipeline alone": (
            f"start-up {p['startup_s']:.1f} s; {p['batches_per_s']:.2f} batches/s, "
            f"{p['tokens_per_s']:,.0f} tokens/s (last {p['measured_batches']} of {p['batches']} "
            f"batches); {p['batch_mb']:.0f} MB per batch"
        ),
        "step alone": (
            f"compile {s['compile_s']:.1f} s; median {s['step_s'] * 1e3:.1f} ms (min "
            f"{s['step_s_min'] * 1e3:.1f}, max {s['step_s_max'] * 1e3:.1f}) over {s['steps']}; "
            f"{s['tokens_per_s']:,.0f} tokens/s; host -> device copy "
            f"{s['put_batch_s'] * 1e3:.1f} ms"
        ),
        f"loop start-up ({loop['startup_steps']} steps)": (
            f"{loop['startup_s']:.1f} s, device idle {loop['startup_idle_s']:.1f} s"
        ),
        f"loop, steady ({loop['steps']} steps)": (
            f"wall {loop['wall_s']:.1f} s; step interval median "
            f"{loop['interval_s_median'] * 1e3:.1f} ms; device idle {loop['idle_s'] * 1e3:.0f} ms "
            f"= **{100 * loop['stall_fraction']:.2f}%** (by difference with the step alone: "
            f"{100 * summary['stall_fraction_by_difference']:.2f}%)"
        ),
        "host in next(loader)": (
            f"median {loop['fetch_s_median'] * 1e3:.1f} ms, max {loop['fetch_s_max'] * 1e3:.1f} "
            f"ms, {100 * loop['fetch_fraction']:.1f}% of the wall; copy+dispatch median "
            f"{loop['put_dispatch_s_median'] * 1e3:.1f} ms"
        ),
        "pipeline rate / step rate": f"{summary['pipeline_over_step_rate']:.2f} (> 1: keeps up)",
    }
    header = (
        f"\n## Input stall: {report['config']} on {report['device']}\n\n"
        f"{report['cpu_count']} CPUs, {report['workers']} Grain workers, batch "
        f"{report['batch_size']} x {report['seq_len']} tokens, patch budget "
        f"{report['patch_budget']}, jax {report['jax']}\n\n| measurement | result |\n|---|---|"
    )
    verdict = (
        f"\nStall {100 * summary['stall_fraction']:.2f}% is {verdict} the "
        f"{100 * STALL_TARGET:.0f}% target."
    )
    return "\n".join([header, *(f"| {k} | {v} |" for k, v in rows.items()), verdict])


class _CompletionWatcher(threading.Thread):
    """Blocks on each step's metrics in dispatch order; records when each step finished."""

    def __init__(self):
        super().__init__(daemon=True, name="step-completion-watcher")
        self._queue, self.done = queue.SimpleQueue(), []

    def watch(self, metrics) -> None:
        self._queue.put(metrics)

    def run(self):
        while (metrics := self._queue.get()) is not None:
            jax.block_until_ready(metrics)
            self.done.append(time.perf_counter())

    def finish(self) -> list[float]:
        self._queue.put(None)
        self.join()
        return self.done


def _fit_steps(steps: int, startup: int, report: dict, budget: float | None, began: float) -> int:
    """The loop's steady steps: fewer if `budget` seconds would not hold them, >= MIN_LOOP_STEPS."""
    if budget is None:
        return steps
    interval = max(report["step"]["step_s"], 1 / report["pipeline"]["batches_per_s"])
    left = budget - (time.perf_counter() - began) - report["pipeline"]["startup_s"] - 5.0
    fitted = min(steps, max(MIN_LOOP_STEPS, int(left / (1.1 * interval)) - startup))
    if fitted < steps:
        _log(f"time budget: {fitted} steady loop steps instead of {steps}")
    report["steps_requested"] = steps
    return fitted


def _shm_free_gb() -> float:
    try:
        return shutil.disk_usage("/dev/shm").free / 1e9
    except OSError:
        return float("nan")


def _write(out, report: dict) -> None:
    if out:
        pathlib.Path(out).write_text(json.dumps(report, indent=1) + "\n")


def _log(message: str) -> None:
    print(f"bench_input_stall: {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

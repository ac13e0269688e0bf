"""`m3-train`: pretrain an M3 model from a YAML config, resuming from the run's latest checkpoint.

    m3-train --config configs/demo.yaml [--run-dir runs/demo] [section.key=value ...]

RUN_DIR holds config.yaml, checkpoints/<step>/, metrics.jsonl and tensorboard/; with `eval.shards`
the held-out loss is logged every `eval.every_steps` steps (pretrain/evaluation.py). A run directory
with checkpoints is always resumed, never overwritten; the architecture and the data settings must
match the saved ones (pretrain/resume_checks.py). The first Ctrl-C or SIGTERM finishes the current
step (or abandons the batch being loaded), saves a checkpoint and exits; a second Ctrl-C aborts at
once, a second SIGTERM changes nothing. Any error stops with one line on stderr and exit code 2
(a traceback only with --debug); so do too many non-finite steps (pretrain/faults.py) and a
checkpoint save that fails twice in a row (pretrain/checkpoint_recovery.py).

Multi-host: one process per host, each with the same command; under SLURM (`srun`), on a TPU pod
slice or Kubernetes they find each other, elsewhere `--coordinator --num-processes --process-id`
say how (pretrain/distributed.py). Process 0 alone prints and writes config.yaml, metrics.jsonl
and TensorBoard; a stop signal to any process stops them all after the same step, all saving it.
"""

import argparse
import pathlib
import signal
import sys
import time

import jax
import numpy as np
import yaml
from tqdm import tqdm

from batch_format.batch import Batch
from data.mm_documents import DataError
from m3jax import xla_flags
from m3jax.config_loading import to_mapping
from m3jax.model import functional
from pretrain.checkpoint_recovery import SaveRetry
from pretrain.checkpointing import Checkpoints
from pretrain.cli import add_debug_flag, run_command
from pretrain.config import RunConfig, RunError, load_run_config
from pretrain.data_loading import make_loader
from pretrain.distributed import add_flags, any_process, initialize, is_primary
from pretrain.evaluation import Evaluator
from pretrain.metrics import MetricsWriter, NoMetrics, read_metrics
from pretrain.mfu import Peak, device_peak, window_throughput
from pretrain.resume_checks import check_model, data_position_error, saved_run
from pretrain.session import CopiedSave, DataPositionError, TrainingSession

LOG_KEYS = (
    "loss", "nll", "mtp_nll", "msa_kl", "msa_recall", "grad_norm", "lr", "expert_imbalance",
    "moe_dropped_fraction", "tokens_per_s", "model_flops_per_token", "mfu", "skipped_steps",
    "skipped_documents"
)  # fmt: skip
SHOWN_IF_NOT_ZERO = ("moe_dropped_fraction", "skipped_steps", "skipped_documents")
EVAL_LOG_KEYS = ("eval_nll", "eval_mtp_nll", "eval_msa_recall")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/demo.yaml")
    parser.add_argument("--run-dir", help="where checkpoints and logs go (default runs/<config>)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. optimizer.lr=1e-3")
    add_flags(parser)
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)
    run_dir = pathlib.Path(args.run_dir or f"runs/{pathlib.Path(args.config).stem}")

    def command() -> int:
        xla_flags.apply()  # XLA reads them when the first backend starts
        initialize(args)  # before anything touches a device
        summary = train(load_run_config(args.config, args.overrides), run_dir)
        return 128 + summary["stopped_by_signal"] if summary["stopped_by_signal"] else 0

    try:
        return run_command("m3-train", command, debug=args.debug)
    except KeyboardInterrupt:
        print("m3-train: aborted without saving", file=sys.stderr)
        return 128 + signal.SIGINT


def train(run: RunConfig, run_dir: pathlib.Path) -> dict:
    """Trains until run.train.steps (or a stop); returns the summary it prints (process 0)."""
    primary = is_primary()
    say = print if primary else _quiet
    report = tqdm.write if primary else _quiet
    saved = saved_run(run_dir)
    check_model(run_dir, saved, run)
    loader = make_loader(run)
    new_dirs = [d for d in (run_dir, run_dir / "checkpoints") if not d.exists()]
    checkpoints = Checkpoints(run_dir / "checkpoints", run.checkpoint)
    try:
        session = TrainingSession(functional(run.model), run, checkpoints, report=report)
        start = session.restore_or_init(loader)
    except BaseException as e:
        checkpoints.close()
        for directory in reversed(new_dirs):  # a failed start leaves no empty run behind
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        if isinstance(e, DataPositionError):
            raise data_position_error(run_dir, saved, run, e.step, e.cause) from None
        raise
    evaluator = Evaluator(session, run) if run.eval.shards else None
    resumed = session.checkpoints.latest_step() is not None  # step 0 too: m3-import writes it
    if primary:
        _write_config(run_dir, run)
        writer = MetricsWriter(run_dir, tensorboard=run.logging.tensorboard, resume_step=start)
    else:
        writer = NoMetrics()
    say(
        f"m3-train: {'resuming at step ' + str(start) if resumed else 'starting'} in {run_dir} "
        f"({session.num_params / 1e6:.2f}M params, {jax.device_count()} {jax.default_backend()} "
        f"device(s), mesh {dict(session.mesh.shape)})",
        flush=True,
    )
    peak = device_peak(run.train.peak_tflops, jax.devices())
    say(f"m3-train: {peak.describe()}", flush=True)
    if start >= run.train.steps:
        say(f"m3-train: the run is complete ({start} of train.steps={run.train.steps}); "
              "raise train.steps to continue it")  # fmt: skip
    try:
        with _StopOnSignal() as stop:
            stopped_at = _loop(session, loader, writer, start, stop, run, evaluator, peak)
    finally:
        writer.close()
        session.checkpoints.close()
    if not primary:  # metrics.jsonl is process 0's
        return {"start_step": start, "end_step": stopped_at, "stopped_by_signal": stop.signum}
    summary = _summary(run_dir, start, stopped_at, stop.signum)
    summary["peak"] = peak
    summary["modality_tokens"] = dict(session.modality_tokens)
    summary["skipped_steps"] = session.faults.skipped_steps
    summary["skipped_documents"] = loader.skip_counts()
    _print_summary(summary)
    return summary


def _loop(session, loader, writer, start: int, stop, run: RunConfig, evaluator, peak: Peak) -> int:
    """Runs steps start..total; returns the step reached. Checkpoints at intervals and on a stop:
    a signal, too many non-finite steps (then raises RunError) or no usable data left (DataError)."""
    total, log_every = run.train.steps, run.logging.every_steps
    pending, window_start, untimed = [], time.perf_counter(), 0
    step = saved = start
    faults, position, data_error = session.faults, None, None
    due = None  # a save prepared at the last step, whose state this step copies
    copied = None  # a save whose state the last step copied: started once this step is dispatched
    primary = is_primary()
    bar = tqdm(total=total, initial=start, desc="train", unit="step", mininterval=1.0,
               disable=not (run.logging.progress_bar and primary), dynamic_ncols=True)  # fmt: skip
    write = bar.write if primary else _quiet
    saver = SaveRetry(session.checkpoints, lambda at: session.save(at, loader, position), write)
    with bar:
        phase = None
        while step < total and not faults.stop_reason:
            if session.msa_phase != phase:
                phase = session.msa_phase
                seen = f"{session.tokens_seen:,} tokens seen"
                write(f"m3-train: step {step}: MSA phase {phase} ({seen})")
            batch, position, data_error = _agreed_batch(stop, loader)
            if batch is None:
                break
            mode = session.forward_mode(step + 1)
            metrics = session.step(batch, mode, copy_state=due is not None)
            step += 1
            if copied is not None:  # while the device runs this step, not after it
                saved, copied = _start_copied(saver, session, copied), None
            faults.observe(step, metrics, loader.provenance())
            if due is not None:  # observed: the fault monitor has checked the due step
                copied, due = session.take_state_copy(due), None
            pending.append(metrics)
            if step == start + 1:  # compilation: keep its metrics, leave it out of throughput
                jax.block_until_ready(metrics)
                seconds = time.perf_counter() - window_start
                write(f"m3-train: first step (incl. compilation) took {seconds:.1f} s")
                window_start, untimed = time.perf_counter(), 1
            if step % log_every == 0 or step == total or step == start + 1:
                faults.flush()
                logged = _reduce(
                    jax.device_get(pending), untimed, time.perf_counter() - window_start, peak
                )
                logged.update(skipped_steps=faults.skipped_steps, **loader.skip_counts())
                writer.write(step, logged)
                bar.set_postfix(loss=f"{logged['loss']:.3f}", refresh=False)
                write(_console_line(step, total, logged))
                pending, window_start, untimed = [], time.perf_counter(), 0
            if evaluator is not None and step % run.eval.every_steps == 0:
                window_start += _evaluate(evaluator, writer, write, step)  # not in throughput
            if step % run.checkpoint.every_steps == 0 or step == total:
                if run.checkpoint.copy_in_step and step < total:
                    due = session.prepare_save(step, loader, position)  # no wait for the device
                else:
                    faults.flush()
                    saver.save(step)
                    saved = step
            saver.poll(step, retry=due is None and copied is None)  # no retry overtakes a copy
            bar.update(1)
    if copied is not None:  # stopped right after the copying step
        saved = _start_copied(saver, session, copied)
    faults.flush()
    if (stop.signum or faults.stop_reason or data_error) and step > start and saved != step:
        saver.save(step)
    saver.finish(step)
    where = f"checkpoint at step {step} saved" if step else "no step done, nothing to save"
    if faults.stop_reason:
        raise RunError(f"{faults.stop_reason}; stopped: {where} (the last good state)")
    if data_error:
        raise DataError(f"{data_error}; stopped: {where}")
    if stop.signum and primary:
        print(f"m3-train: {signal.Signals(stop.signum).name}: {where}, stopping", flush=True)
    return step


def _start_copied(saver: SaveRetry, session: TrainingSession, copied: CopiedSave) -> int:
    """Starts the save whose state a step copied (`checkpoint.copy_in_step`); returns its step."""
    saver.save(copied.due.step, lambda: session.start_copied_save(copied))
    return copied.due.step


def _agreed_batch(stop, loader) -> tuple[Batch | None, dict | None, DataError | None]:
    """(the next batch, None, None), or when a process stops (a signal, no usable data left: all
    processes stop before the same step) (None, the position to save or None for the loader's,
    the DataError if the data ran out). Every process calls this once per step."""
    if stop.alone and stop.signum:  # came during the step: no batch to load, nothing to agree
        return None, None, None
    before, error = loader.state(), None
    try:
        batch = stop.next_batch(loader)  # None if a signal came meanwhile
    except DataError as e:  # nothing usable left: keep the steps done, then stop
        batch, error = None, e
    if not stop.agreed(has_batch=batch is not None):
        return batch, None, None
    if error is None and not stop.signum:
        error = DataError("another process of the run has no usable data left")
    return None, before, error  # the position before the batch not trained on


def _evaluate(evaluator: Evaluator, writer: MetricsWriter, write, step: int) -> float:
    """Evaluates, logs; returns the seconds it took."""
    began = time.perf_counter()
    logged = evaluator()
    writer.write(step, logged)
    parts = [f"{k} {logged[k]:.4g}" for k in EVAL_LOG_KEYS if k in logged]
    write(f"eval {step:>7} | " + " | ".join(parts))
    return time.perf_counter() - began


def _write_config(run_dir: pathlib.Path, run: RunConfig) -> None:
    # whole or not at all: the other processes of a run may be reading it (resume_checks.py)
    temporary = run_dir / "config.yaml.tmp"
    temporary.write_text(yaml.safe_dump(to_mapping(run), sort_keys=False))
    temporary.replace(run_dir / "config.yaml")


def _quiet(*args, **kwargs) -> None:
    """print / tqdm.write on processes other than 0."""


def _console_line(step: int, total: int, logged: dict) -> str:
    shown = [k for k in LOG_KEYS if k in logged and (logged[k] or k not in SHOWN_IF_NOT_ZERO)]
    parts = [f"{k} {logged[k]:.4g}" for k in shown]
    if "tokens_per_s" in logged and "mfu" not in logged:  # no peak FLOP/s for these devices
        parts.insert(shown.index("tokens_per_s") + 2, "mfu n/a")
    return f"step {step:>6}/{total} | " + " | ".join(parts)


def _reduce(window: list[dict], untimed: int, seconds: float, peak: Peak) -> dict:
    """Means of a logging window's per-step metrics; throughput and MFU over its steps after
    `untimed` (pretrain/mfu.py). Skipped steps are counted by the FaultMonitor instead."""
    per_window = ("tokens", "skipped", "model_flops_per_token")  # not means of steps
    keys = dict.fromkeys(k for m in window for k in m if k not in per_window)
    logged = {k: _nan_mean([float(m[k]) for m in window if k in m]) for k in keys}
    logged.update(window_throughput(window[untimed:], seconds, peak))
    return logged


def _summary(run_dir: pathlib.Path, start: int, end: int, signum: int) -> dict:
    records = read_metrics(run_dir / "metrics.jsonl")
    history = [r for r in records if "nll" in r]  # training records (evaluations: eval_nll)
    evaluations = [r["eval_nll"] for r in records if "eval_nll" in r]
    session_history = [r for r in history if r["step"] > start]
    return {
        "run_dir": str(run_dir),
        "start_step": start,
        "end_step": end,
        "first_nll": history[0]["nll"] if history else None,  # the LM loss, without KL/aux terms
        "last_nll": history[-1]["nll"] if history else None,
        "last_nll_by_document": _last_by_document(history),
        "last_eval_nll": evaluations[-1] if evaluations else None,
        **{
            key: _mean([r[key] for r in session_history if key in r])
            for key in ("tokens_per_s", "model_flops_per_token", "model_tflops_per_s", "mfu")
        },
        "stopped_by_signal": signum,
    }


def _last_by_document(history: list[dict]) -> dict:
    """Multimodal runs: kind -> (step, LM loss) of the last logged step whose batches had that kind
    of document (text / image / video; NaN in logging windows without one)."""
    last = {}
    for kind in ("text", "image", "video"):
        logged = [(r["step"], r[f"nll_{kind}_docs"]) for r in history if f"nll_{kind}_docs" in r]
        logged = [(step, value) for step, value in logged if not np.isnan(value)]
        if logged:
            last[kind] = logged[-1]
    return last


def _nan_mean(values: list[float]) -> float:
    """Mean of the non-NaN values (per-document-kind losses are NaN in batches without that kind)."""
    finite = [v for v in values if not np.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _print_summary(summary: dict) -> None:
    print("m3-train: summary")
    print(f"  steps        {summary['start_step']} -> {summary['end_step']}")
    if summary["first_nll"] is not None:
        first, last = summary["first_nll"], summary["last_nll"]
        print(f"  LM loss      {first:.4f} (first logged step) -> {last:.4f} (last)")
    if summary["last_eval_nll"] is not None:
        print(f"  held-out     LM loss {summary['last_eval_nll']:.4f} (last evaluation)")
    if summary["modality_tokens"]:
        counts = ", ".join(
            f"{k.split('_')[0]} {v:,}" for k, v in summary["modality_tokens"].items()
        )
        print(f"  tokens       {counts} (this session)")
    if summary["last_nll_by_document"]:
        losses = ", ".join(
            f"{kind} {value:.4f} (step {step})"
            for kind, (step, value) in summary["last_nll_by_document"].items()
        )
        print(f"  LM loss by document kind (last logged): {losses}")
    if summary["skipped_steps"]:
        print(f"  skipped      {summary['skipped_steps']} step(s) with a non-finite loss or "
              "gradient (all sessions; nothing was updated)")  # fmt: skip
    if skipped := summary["skipped_documents"]:
        total, read = skipped["skipped_documents"], skipped["documents_read"]
        reasons = ", ".join(
            f"{key.removeprefix('skipped_')} {count:,}"
            for key, count in skipped.items()
            if key.startswith("skipped_") and key != "skipped_documents" and count
        )
        share = f"{total / read:.1%}" if read else "all"
        print(f"  data         {total:,} of {read:,} documents read were unusable ({share}), "
              f"skipped: {reasons or 'none'}")  # fmt: skip
    if summary["tokens_per_s"] is not None:
        print(
            f"  throughput   {summary['tokens_per_s']:,.0f} tokens/s (this session, after compilation)"
        )
        print(f"  model FLOPs  {summary['model_flops_per_token']:.4g} per token (training), "
              f"{summary['model_tflops_per_s']:.4g} TFLOP/s (all devices)")  # fmt: skip
        peak, mfu = summary["peak"], summary["mfu"]
        if mfu is None:
            print(f"  MFU          {peak.note}")
        else:
            print(f"  MFU          {mfu:.2%} (mean over this session's timed windows; "
                  f"{peak.tflops:g} TFLOP/s per device × {peak.devices}: {peak.note})")  # fmt: skip
    print(f"  run dir      {summary['run_dir']} (checkpoints/, metrics.jsonl, tensorboard/)")


class _Interrupted(Exception):
    """Raised by the signal handler out of a `next(loader)` that may take long (skipping data)."""


class _StopOnSignal:
    """The first SIGINT/SIGTERM asks the loop to checkpoint and stop, and abandons a batch being
    loaded; a second SIGINT aborts; a second SIGTERM (schedulers repeat them) changes nothing.
    With several processes a signal reaches one of them: `agreed` tells them all."""

    def __enter__(self):
        self.signum = 0
        self._loading = False
        self.alone = jax.process_count() == 1
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def next_batch(self, loader) -> Batch | None:
        """next(loader), or None when a stop signal arrives meanwhile (the loader's position is
        then undefined: the caller saves the position from before the call)."""
        try:
            self._loading = True
            batch = next(loader)
            self._loading = False
            return batch
        except _Interrupted:
            return None
        finally:
            self._loading = False

    def agreed(self, *, has_batch: bool) -> bool:
        """Whether to stop before the next step: a process got a signal (then `signum` is its,
        on every process) or has no batch. A collective: every process calls it once per step."""
        signum, missing = any_process(self.signum, int(not has_batch))
        if signum or missing:
            self.signum = signum  # the same on every process
            return True
        return False  # keeps a signal that came meanwhile: the next step's agreement tells all

    def _handle(self, signum, frame):
        if self.signum:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        print(
            f"\nm3-train: {signal.Signals(signum).name} received: saving a checkpoint after this step "
            "(Ctrl-C again to abort without saving)",
            file=sys.stderr,
            flush=True,
        )
        if self._loading:
            raise _Interrupted

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())

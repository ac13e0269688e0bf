"""`m3-train`: pretrain an M3 model from a YAML config, resuming from the run's latest checkpoint.

    m3-train --config configs/demo.yaml [--run-dir runs/demo] [section.key=value ...]

RUN_DIR holds config.yaml, checkpoints/<step>/, metrics.jsonl and tensorboard/; with `eval.shards`
the held-out loss is logged every `eval.every_steps` steps (pretrain/evaluation.py). A run directory
with checkpoints is always resumed, never overwritten; the model config must match the saved one.
The first Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits (a second
Ctrl-C aborts at once). Bad input stops with one line on stderr and exit code 2.
"""

import argparse
import dataclasses
import pathlib
import signal
import sys
import time

import jax
import numpy as np
import yaml
from tqdm import tqdm

from data.mm_documents import DataError
from m3jax.config_loading import ConfigError, from_mapping, load_yaml, to_mapping
from m3jax.model import functional
from pretrain.checkpointing import CheckpointError, Checkpoints
from pretrain.config import RunConfig, RunError, load_run_config
from pretrain.data_loading import make_loader
from pretrain.evaluation import Evaluator
from pretrain.metrics import MetricsWriter, read_metrics
from pretrain.session import TrainingSession

LOG_KEYS = (
    "loss", "nll", "mtp_nll", "msa_kl", "msa_recall", "grad_norm", "lr", "expert_imbalance",
    "moe_dropped_fraction", "tokens_per_s"
)  # fmt: skip
EVAL_LOG_KEYS = ("eval_nll", "eval_mtp_nll", "eval_msa_recall")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config, e.g. configs/demo.yaml")
    parser.add_argument("--run-dir", help="where checkpoints and logs go (default runs/<config>)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. optimizer.lr=1e-3")
    args = parser.parse_args(argv)
    run_dir = pathlib.Path(args.run_dir or f"runs/{pathlib.Path(args.config).stem}")
    try:
        run = load_run_config(args.config, args.overrides)
        summary = train(run, run_dir)
    except (ConfigError, CheckpointError, RunError, DataError) as e:
        print(f"m3-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("m3-train: aborted without saving", file=sys.stderr)
        return 128 + signal.SIGINT
    return 128 + summary["stopped_by_signal"] if summary["stopped_by_signal"] else 0


def train(run: RunConfig, run_dir: pathlib.Path) -> dict:
    """Trains until run.train.steps (or a stop signal); returns the summary it prints."""
    _check_saved_model(run_dir, run)
    loader = make_loader(run)
    session = TrainingSession(
        functional(run.model), run, Checkpoints(run_dir / "checkpoints", run.checkpoint)
    )
    start = session.restore_or_init(loader)
    evaluator = Evaluator(session, run) if run.eval.shards else None
    resumed = session.checkpoints.latest_step() is not None  # step 0 too: m3-import writes it
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(run), sort_keys=False))
    writer = MetricsWriter(run_dir, tensorboard=run.logging.tensorboard, resume_step=start)
    print(
        f"m3-train: {'resuming at step ' + str(start) if resumed else 'starting'} in {run_dir} "
        f"({session.num_params / 1e6:.2f}M params, {jax.device_count()} {jax.default_backend()} "
        f"device(s), mesh {dict(session.mesh.shape)})",
        flush=True,
    )
    if start >= run.train.steps:
        print(f"m3-train: the run is complete ({start} of train.steps={run.train.steps}); "
              "raise train.steps to continue it")  # fmt: skip
    try:
        with _StopOnSignal() as stop:
            stopped_at = _loop(session, loader, writer, start, stop, run, evaluator)
    finally:
        writer.close()
        session.checkpoints.wait()
        session.checkpoints.close()
    summary = _summary(run_dir, start, stopped_at, stop.signum)
    summary["modality_tokens"] = dict(session.modality_tokens)
    _print_summary(summary)
    return summary


def _loop(session, loader, writer, start: int, stop, run: RunConfig, evaluator) -> int:
    """Runs steps start..total; returns the step reached. Checkpoints at intervals and on stop."""
    total, log_every = run.train.steps, run.logging.every_steps
    pending, window_start, untimed = [], time.perf_counter(), 0
    step = saved = start
    bar = tqdm(total=total, initial=start, desc="train", unit="step", mininterval=1.0,
               disable=not run.logging.progress_bar, dynamic_ncols=True)  # fmt: skip
    with bar:
        phase = None
        while step < total and not stop.signum:
            if session.msa_phase != phase:
                phase = session.msa_phase
                seen = f"{session.tokens_seen:,} tokens seen"
                bar.write(f"m3-train: step {step}: MSA phase {phase} ({seen})")
            metrics = session.step(next(loader), session.forward_mode(step + 1))
            step += 1
            pending.append(metrics)
            if step == start + 1:  # compilation: keep its metrics, leave it out of throughput
                jax.block_until_ready(metrics)
                seconds = time.perf_counter() - window_start
                bar.write(f"m3-train: first step (incl. compilation) took {seconds:.1f} s")
                window_start, untimed = time.perf_counter(), 1
            if step % log_every == 0 or step == total or step == start + 1:
                logged = _reduce(
                    jax.device_get(pending), untimed, time.perf_counter() - window_start
                )
                writer.write(step, logged)
                bar.set_postfix(loss=f"{logged['loss']:.3f}", refresh=False)
                parts = [f"{k} {logged[k]:.4g}" for k in LOG_KEYS if k in logged]
                bar.write(f"step {step:>6}/{total} | " + " | ".join(parts))
                pending, window_start, untimed = [], time.perf_counter(), 0
            if evaluator is not None and step % run.eval.every_steps == 0:
                window_start += _evaluate(evaluator, writer, bar, step)  # not in throughput
            if step % run.checkpoint.every_steps == 0 or step == total:
                session.save(step, loader)
                saved = step
            bar.update(1)
    if stop.signum:
        name = signal.Signals(stop.signum).name
        if step > start and saved != step:
            session.save(step, loader)
        where = f"checkpoint at step {step} saved" if step else "no step done, nothing to save"
        print(f"m3-train: {name}: {where}, stopping", flush=True)
    return step


def _evaluate(evaluator: Evaluator, writer: MetricsWriter, bar, step: int) -> float:
    """Evaluates, logs; returns the seconds it took."""
    began = time.perf_counter()
    logged = evaluator()
    writer.write(step, logged)
    parts = [f"{k} {logged[k]:.4g}" for k in EVAL_LOG_KEYS if k in logged]
    bar.write(f"eval {step:>7} | " + " | ".join(parts))
    return time.perf_counter() - began


def _reduce(window: list[dict], untimed: int, seconds: float) -> dict:
    """Means of a logging window's per-step metrics; throughput over its steps after `untimed`."""
    keys = dict.fromkeys(k for m in window for k in m if k != "tokens")  # recall: some steps only
    logged = {k: _nan_mean([float(m[k]) for m in window if k in m]) for k in keys}
    if len(window) > untimed:
        tokens = sum(int(m["tokens"]) for m in window[untimed:])
        logged["tokens_per_s"] = tokens / max(seconds, 1e-9)
    return logged


def _check_saved_model(run_dir: pathlib.Path, run: RunConfig) -> None:
    """A run directory belongs to one model: refuse to resume it with different model fields."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        return
    saved = from_mapping(RunConfig, load_yaml(saved_path), where=str(saved_path)).model
    for field in dataclasses.fields(saved):
        before, now = getattr(saved, field.name), getattr(run.model, field.name)
        if before != now:
            raise RunError(
                f"{run_dir} holds a run with model.{field.name}={before!r}, not {now!r}; "
                "use another --run-dir to start a new run"
            )


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
        "tokens_per_s": _mean([r["tokens_per_s"] for r in session_history if "tokens_per_s" in r]),
        "stopped_by_signal": signum,
    }


def _last_by_document(history: list[dict]) -> dict:
    """Multimodal runs: the last logged LM loss in text / image / video documents (not NaN)."""
    last = {}
    for kind in ("text", "image", "video"):
        values = [r[f"nll_{kind}_docs"] for r in history if f"nll_{kind}_docs" in r]
        values = [v for v in values if not np.isnan(v)]
        if values:
            last[kind] = values[-1]
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
        losses = ", ".join(f"{k} {v:.4f}" for k, v in summary["last_nll_by_document"].items())
        print(f"  LM loss by document kind (last logged): {losses}")
    if summary["tokens_per_s"] is not None:
        print(
            f"  throughput   {summary['tokens_per_s']:,.0f} tokens/s (this session, after compilation)"
        )
    print(f"  run dir      {summary['run_dir']} (checkpoints/, metrics.jsonl, tensorboard/)")


class _StopOnSignal:
    """The first SIGINT/SIGTERM asks the loop to checkpoint and stop; a second SIGINT aborts."""

    def __enter__(self):
        self.signum = 0
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\nm3-train: {signal.Signals(signum).name} received: saving a checkpoint after this step "
            "(Ctrl-C again to abort without saving)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())

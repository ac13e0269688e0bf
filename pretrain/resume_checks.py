"""What may change when a run directory is resumed, and how a refused change is named.

- Model: the architecture is fixed by the checkpoint; training-only knobs (dtype, remat,
  attention_impl, msa_kernels, init_std, moe.bias_update_rate, moe.balance_loss_weight: the ones
  m3-import lets a config set) may change. A refused change names the field:
  `model.moe.num_experts=8, not 4`.
- Data: the data position in a checkpoint belongs to the data settings it was saved with; when it
  does not fit the current loader, every changed `data.*` field is named: `data.seq_len 256 → 128`.
- LR schedule: its horizon (the steps the cosine decays over) is saved in every checkpoint and kept
  when `train.steps` grows, so continuing a finished run does not reshape the schedule it already
  followed: past the horizon the LR stays at its floor. `optimizer.schedule_steps` stretches it.
"""

import dataclasses
import pathlib
from collections.abc import Callable

from m3jax.config_loading import from_mapping, load_yaml
from m3jax.convert.hf_config import TRAINING_FIELDS
from pretrain.config import RunConfig, RunError

RESUMABLE_MODEL_FIELDS = (*TRAINING_FIELDS, "init_std")


def saved_run(run_dir: pathlib.Path) -> RunConfig | None:
    """The config a run directory was last started with (RUN/config.yaml), if any."""
    path = run_dir / "config.yaml"
    return from_mapping(RunConfig, load_yaml(path), where=str(path)) if path.exists() else None


def check_model(run_dir: pathlib.Path, saved: RunConfig | None, run: RunConfig) -> None:
    """Raises RunError naming the first architecture field that differs from the saved run's."""
    if saved is None:
        return
    for key, before, now in changed_fields(saved.model, run.model):
        if key not in RESUMABLE_MODEL_FIELDS:
            raise RunError(
                f"{run_dir} holds a run with model.{key}={before!r}, not {now!r}; "
                "use another --run-dir to start a new run"
            )


def data_position_error(
    run_dir: pathlib.Path, saved: RunConfig | None, run: RunConfig, step: int, cause: Exception
) -> RunError:
    """The error for a data position that the current loader cannot continue from."""
    changes = changed_fields(saved.data, run.data, "data.") if saved is not None else []
    if not changes:
        return RunError(f"{run_dir}: checkpoint {step}: cannot restore the data position ({cause})")
    named = ", ".join(f"{key} {before!r} → {now!r}" for key, before, now in changes)
    return RunError(
        f"{run_dir}: cannot resume with {named}: checkpoint {step}'s data position belongs to the "
        "saved data settings; set them back or use another --run-dir"
    )


def schedule_steps(
    run: RunConfig, saved_steps: int | None, resumed_step: int, report: Callable[[str], None]
) -> int:
    """The LR schedule horizon a (resumed) run uses; reports a kept or changed horizon."""
    asked = run.optimizer.schedule_steps
    if saved_steps is None or resumed_step == 0:  # fresh, or m3-import's step 0: nothing followed
        return asked or run.train.steps
    if asked is not None:
        if asked != saved_steps:
            report(f"m3-train: optimizer.schedule_steps={asked}: the LR schedule now decays over "
                   f"{asked} steps (it was {saved_steps})")  # fmt: skip
        return asked
    if run.train.steps != saved_steps:
        report(
            f"m3-train: train.steps={run.train.steps}, but this run's LR schedule decays over "
            f"{saved_steps} steps: kept (the LR stays at its floor after step {saved_steps}); "
            f"set optimizer.schedule_steps to change it"
        )
    return saved_steps


def changed_fields(before, now, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, before, now) of every leaf field that differs between two config dataclasses."""
    changes = []
    for field in dataclasses.fields(before):
        old, new = getattr(before, field.name), getattr(now, field.name)
        key = prefix + field.name
        if dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new):
            changes += changed_fields(old, new, key + ".")
        elif old != new:
            changes.append((key, old, new))
    return changes

"""Numerical faults: a non-finite step changes nothing, is counted and reported with its batch;
too many of them stop the run; a loss spike is reported; a non-finite state is never saved.

Inside the jitted step, `keep_finite` selects between the updated and the previous state on one
on-device flag (no host sync): a step whose loss or gradient norm is NaN or infinite leaves params,
optimizer state and router biases exactly as they were (only `step` advances, with the data).

On the host, `FaultMonitor` reads each step's flag and loss one step late (while the next step
runs), so watching costs no pipeline bubble; `flush` reads the newest step too (before logging and
saving). More than `train.max_skipped_steps` skipped steps within the last
`train.skipped_steps_window` steps sets `stop_reason`; the loop then checkpoints the last good state
and stops. A finite loss more than `logging.loss_spike_zscore` standard deviations above the mean of
the last SPIKE_WINDOW finite losses is reported as a spike (training goes on).
"""

import collections
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pretrain.config import RunConfig

SPIKE_WINDOW = 100  # finite losses the spike detector compares against
SPIKE_MIN_HISTORY = 20  # no spike verdict before this many losses


class NonFiniteStateError(RuntimeError):
    """The train state holds NaN or infinity; it is not saved. The message names the leaves."""


def keep_finite(state: dict, updated: dict, loss: jax.Array, grad_norm: jax.Array):
    """(`updated` if loss and gradient norm are finite, else `state` with `updated`'s step;
    skipped flag). Runs inside jit: a select per leaf, no host sync."""
    skipped = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    kept = jax.tree.map(lambda new, old: jnp.where(skipped, old, new), updated, state)
    return {**kept, "step": updated["step"]}, skipped


@jax.jit
def finite_leaves(state: dict) -> dict:
    """Per leaf: whether it holds only finite numbers (device booleans; inside a step too)."""

    def finite(x):
        return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True

    return jax.tree.map(finite, state)


def check_finite(state: dict, step: int) -> None:
    """Raises NonFiniteStateError naming the first non-finite leaves (one device reduction)."""
    raise_if_not_finite(finite_leaves(state), step)


def raise_if_not_finite(flags: dict, step: int) -> None:
    """NonFiniteStateError naming the leaves whose `finite_leaves` flag is false (fetches them)."""
    flagged = jax.tree_util.tree_flatten_with_path(jax.device_get(flags))[0]
    bad = [jax.tree_util.keystr(path) for path, ok in flagged if not ok]
    if bad:
        raise NonFiniteStateError(
            f"the train state at step {step} holds NaN or infinity in {len(bad)} array(s), e.g. "
            f"{', '.join(bad[:3])}; it was not saved"
        )


@dataclasses.dataclass
class _Observed:
    step: int
    skipped: jax.Array
    loss: jax.Array
    provenance: str


class FaultMonitor:
    """Counts skipped steps, stops after too many, reports loss spikes (see the module doc).

    Args:
        run: train.max_skipped_steps, train.skipped_steps_window, logging.loss_spike_zscore.
        report: writes one line (the progress bar's `write`).
        skipped_steps: skipped steps of earlier sessions (from the checkpoint).
    """

    def __init__(self, run: RunConfig, report: Callable[[str], None], skipped_steps: int = 0):
        self._limit, self._window = run.train.max_skipped_steps, run.train.skipped_steps_window
        self._zscore = run.logging.loss_spike_zscore
        self._report = report
        self.skipped_steps = skipped_steps
        self.stop_reason: str | None = None
        self._recent: collections.deque[int] = collections.deque()  # skipped steps in the window
        self._losses: collections.deque[float] = collections.deque(maxlen=SPIKE_WINDOW)
        self._pending: _Observed | None = None

    def observe(self, step: int, metrics: dict, provenance: str) -> None:
        """Takes a step's (unfetched) metrics; checks the step before it."""
        previous = self._pending
        self._pending = _Observed(step, metrics["skipped"], metrics["loss"], provenance)
        if previous is not None:
            self._check(previous)

    def flush(self) -> None:
        """Checks the newest observed step too (waits for it)."""
        if self._pending is not None:
            self._check(self._pending)
            self._pending = None

    def _check(self, observed: _Observed) -> None:
        skipped, loss = jax.device_get((observed.skipped, observed.loss))
        if skipped:
            self._skipped(observed.step, float(loss), observed.provenance)
        else:
            self._watch_spike(observed.step, float(loss), observed.provenance)

    def _skipped(self, step: int, loss: float, provenance: str) -> None:
        self.skipped_steps += 1
        self._recent.append(step)
        while self._recent[0] <= step - self._window:
            self._recent.popleft()
        self._report(
            f"m3-train: step {step}: non-finite loss or gradient (loss {loss}), update skipped "
            f"({self.skipped_steps} so far); batch: {provenance}"
        )
        if len(self._recent) > self._limit and self.stop_reason is None:
            self.stop_reason = (
                f"{len(self._recent)} of the last {self._window} steps (up to step {step}) had a "
                f"non-finite loss or gradient, more than train.max_skipped_steps={self._limit}; "
                "lower optimizer.lr or check the data"
            )

    def _watch_spike(self, step: int, loss: float, provenance: str) -> None:
        history = self._losses
        if self._zscore > 0 and len(history) >= SPIKE_MIN_HISTORY:
            mean, std = float(np.mean(history)), float(np.std(history))
            z = (loss - mean) / max(std, 1e-12)
            if z > self._zscore:
                self._report(
                    f"m3-train: warning: step {step}: loss spike {loss:.4g} ({z:.1f} standard "
                    f"deviations above the last {len(history)} steps' {mean:.4g}); batch: "
                    f"{provenance}"
                )
                return  # a spike stays out of the reference window
        history.append(loss)

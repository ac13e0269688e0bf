"""What a run does when a checkpoint fails: restore an older one, or retry a failed save once.

- Restoring: the newest checkpoint that reads is restored. Unreadable newer ones are reported in
  one line each and moved aside to `<step>.corrupt` (kept for inspection), unless
  `checkpoint.restore_older_if_corrupt` is false, which stops instead.
- Saving: a failed save (disk full, ...) is reported in one line when it is noticed (at the next
  step for an async save); its temporary folder is removed and older checkpoints are untouched.
  The state is saved again at the first step after the failed one (never into the failed step's
  folder, which writes still in flight may touch); if that fails too, or the failed save was the
  run's last, the run stops (CheckpointError: exit code 2) and can be resumed from the latest
  complete checkpoint.
"""

from collections.abc import Callable

from pretrain.checkpointing import CheckpointError, Checkpoints, CheckpointSaveError


def restore_newest_intact(
    checkpoints: Checkpoints,
    abstract_state: dict,
    *,
    allow_older: bool,
    report: Callable[[str], None],
) -> tuple[int, dict, dict, dict] | None:
    """(step, state, data_state, progress) of the newest readable checkpoint; None if there are
    no checkpoints. Raises CheckpointError if none reads (or the newest does not and
    allow_older is false)."""
    steps = sorted(checkpoints.all_steps(), reverse=True)
    unreadable: list[tuple[int, CheckpointError]] = []
    for position, step in enumerate(steps):
        try:
            restored = checkpoints.restore(step, abstract_state)
        except CheckpointError as error:
            unreadable.append((step, error))
            older = steps[position + 1 :]
            if older and not allow_older:
                raise CheckpointError(
                    f"{error}; checkpoint.restore_older_if_corrupt=false, so the older step "
                    f"{older[0]} is not restored instead"
                ) from None
            continue
        for bad_step, error in unreadable:
            moved = checkpoints.move_aside(bad_step)
            report(f"m3-train: warning: {error}; moved it to {moved.name}, restoring step {step}")
        return (step, *restored)
    if not unreadable:
        return None
    first = unreadable[0][1]
    if len(unreadable) == 1:
        raise first
    others = ", ".join(str(step) for step, _ in unreadable[1:])
    raise CheckpointError(f"{first}; the older checkpoints (steps {others}) do not restore either")


class SaveRetry:
    """Runs checkpoint saves; a failure is reported and retried once at a later step, a second
    failure in a row raises CheckpointError (see the module doc).

    Args:
        checkpoints: the run's checkpoints (for poll, wait and the latest complete step).
        save_state: starts saving the current train state at a step.
        report: writes one line.
    """

    def __init__(
        self,
        checkpoints: Checkpoints,
        save_state: Callable[[int], None],
        report: Callable[[str], None],
    ):
        self._checkpoints, self._save_state, self._report = checkpoints, save_state, report
        self._failed_step: int | None = None  # a failure not yet followed by a complete save
        self._retry_due = False

    def save(self, step: int, start: Callable[[], None] | None = None) -> None:
        """Starts the save of `step`: `start` (the state copied by the step after it) or
        `save_state`'s."""
        self._retry_due = False
        self._guard(start or (lambda: self._save_state(step)))

    def poll(self, step: int, retry: bool = True) -> None:
        """Each step: notices a background save that has failed; retries once it may (`retry`
        false: not at this step, e.g. while a save whose state a step copies is still to start:
        that save is then the retry)."""
        self._guard(self._checkpoints.poll)
        if retry and self._retry_due and step > self._failed_step:
            self.save(step)

    def finish(self, step: int) -> None:
        """At the end: waits for the last save (and for its retry, if it failed)."""
        self._guard(self._checkpoints.wait, last=True)
        if self._retry_due and step > self._failed_step:
            self.save(step)
            self._guard(self._checkpoints.wait, last=True)

    def _guard(self, action: Callable[[], int | None], last: bool = False) -> None:
        try:
            completed = action()
        except CheckpointSaveError as error:
            self._failed(error, last)
            return
        if completed is not None:  # a save that completed: the next failure is a first again
            self._failed_step = None

    def _failed(self, error: CheckpointSaveError, last: bool) -> None:
        latest = self._checkpoints.latest_step()
        kept = "no complete checkpoint yet" if latest is None else f"latest complete: step {latest}"
        if self._failed_step is not None or last:
            retried = self._failed_step is not None
            again = f"; it retried step {self._failed_step}'s failed save" if retried else ""
            raise CheckpointError(
                f"{error}{again}; {kept}; stopping (free space or fix "
                f"{self._checkpoints.directory}, then run again to resume)"
            )
        self._failed_step, self._retry_due = error.step, True
        self._report(f"m3-train: {error}; its temporary folder was removed, {kept}; "
                     "retrying at the next step")  # fmt: skip

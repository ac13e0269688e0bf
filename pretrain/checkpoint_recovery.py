"""What a run does when a checkpoint fails: restore an older one, or retry a failed save once.

- Restoring: the newest checkpoint that reads is restored. Unreadable newer ones are reported in
  one line each and moved aside to `<step>.corrupt` (kept for inspection), unless
  `checkpoint.restore_older_if_corrupt` is false, which stops instead.
- Saving: a failed save (disk full, ...) is reported in one line when it is noticed (at the next
  step for an async save); its temporary folder is already gone and older checkpoints are
  untouched. The current state is saved again at once; if that fails too, the run stops
  (CheckpointError: exit code 2) and can be resumed from the latest complete checkpoint.
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
    """Runs checkpoint saves; the first failure in a row is reported and retried, the second
    raises CheckpointError (see the module doc).

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
        self._retrying = False

    def save(self, step: int) -> None:
        self._guard(lambda: self._save_state(step), step)

    def poll(self, step: int) -> None:
        """Each step: notices a background save that has failed (retrying at `step`)."""
        self._guard(self._checkpoints.poll, step)

    def finish(self, step: int) -> None:
        """At the end: waits for the last save (and for its retry, if it failed)."""
        self._guard(self._checkpoints.wait, step)
        self._guard(self._checkpoints.wait, step)  # the retry's outcome; no-op if none

    def _guard(self, action: Callable[[], int | None], step: int) -> None:
        try:
            completed = action()
        except CheckpointSaveError as error:
            self._failed(error, step)
            return
        if completed is not None:
            self._retrying = False

    def _failed(self, error: CheckpointSaveError, step: int) -> None:
        latest = self._checkpoints.latest_step()
        kept = "no complete checkpoint yet" if latest is None else f"latest complete: step {latest}"
        if self._retrying:
            raise CheckpointError(
                f"{error}, again after a retry; {kept}; stopping (free space or fix "
                f"{self._checkpoints.directory}, then run again to resume)"
            )
        self._retrying = True
        self._report(f"m3-train: {error}; its temporary folder was removed, {kept}; "
                     f"retrying at step {step}")  # fmt: skip
        self.save(step)

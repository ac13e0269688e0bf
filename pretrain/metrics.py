"""Where training metrics go: metrics.jsonl (one JSON object per logged step, and one per
evaluation) and TensorBoard (`train/<name>`, `eval/<name>`).

On resume, lines of metrics.jsonl past the restored step (written after the last checkpoint of
an interrupted run) are dropped, so the file always describes one consistent history.
"""

import json
import pathlib

from tensorboardX import SummaryWriter


class MetricsWriter:
    def __init__(self, run_dir: pathlib.Path, *, tensorboard: bool, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._tensorboard = SummaryWriter(str(run_dir / "tensorboard")) if tensorboard else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in metrics.items():
                held_out = name.startswith("eval_")
                tag = f"eval/{name.removeprefix('eval_')}" if held_out else f"train/{name}"
                self._tensorboard.add_scalar(tag, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


class NoMetrics:
    """A MetricsWriter that writes nothing: processes other than 0 of a multi-host run."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _truncate_after(path: pathlib.Path, step: int) -> None:
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) != len(records):
        path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")

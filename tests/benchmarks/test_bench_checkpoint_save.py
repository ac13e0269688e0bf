"""benchmarks/bench_checkpoint_save.py: its cost accounting on made-up step times, then end to end
on CPU through its command line (a tiny text run, async and synchronous saves)."""

import json
import types

import pytest
import yaml
from tiny import tiny_run

from benchmarks import bench_checkpoint_save
from m3jax.config_loading import to_mapping


class _FakeCheckpoints:
    """A save that completes after `polls` polls."""

    def __init__(self, polls: int):
        self.polls = polls

    def poll(self):
        self.polls -= 1
        return 7 if self.polls < 0 else None


class _FakePipeline:
    """Steps of 1.25 s each, from t = 100 s; `events` lists dispatches (True: a copying step)."""

    def __init__(self):
        self.last_done, self._in_flight, self.events = 100.0, False, []
        self.dispatch_s = [0.5]  # a dispatch before the save, not listed

    def step(self, copy_state=False, then=None):
        previous, self._in_flight = self._in_flight, True
        self.events.append(copy_state)
        self.dispatch_s.append(0.001)
        if then is not None:
            then()
        return self._done() if previous else None

    def drain(self):
        previous, self._in_flight = self._in_flight, False
        return self._done() if previous else None

    def _done(self):
        self.last_done += 1.25
        return 1.25


class _Clock:
    """perf_counter for the benchmark: time moves only when a save call holds the loop."""

    def __init__(self):
        self.now = 200.0

    def hold(self, seconds):
        self.now += seconds


def test_cost_is_the_saves_stretch_beyond_its_steps_time(monkeypatch):
    clock = _Clock()
    session = types.SimpleNamespace(
        run=tiny_run(checkpoint={"async_save": True}),
        checkpoints=_FakeCheckpoints(polls=3),
        save=lambda step, loader: clock.hold(0.5),
    )
    monkeypatch.setattr(bench_checkpoint_save.time, "perf_counter", lambda: clock.now)
    save = bench_checkpoint_save.one_save(session, None, _FakePipeline(), step=7, step_s=1.0)
    assert save["steps_during"] == 3  # 3 dispatched, drained after
    assert save["blocked_s"] == pytest.approx(0.5)  # the save call
    assert save["first_steps_ms"] == [1250.0] * 3
    assert save["first_dispatches_ms"] == [1.0] * 3
    assert save["complete_s"] == pytest.approx(3 * 1.25)
    assert save["cost_s"] == pytest.approx(3 * 1.25 - 3 * 1.0)
    assert save["cost_of_step"] == pytest.approx(save["cost_s"] / 1.0)


def test_a_copied_save_starts_once_the_step_after_the_copying_one_is_dispatched(monkeypatch):
    """As train.py: step + 1 copies the state, step + 2 is dispatched, then the save starts."""
    clock, pipeline = _Clock(), _FakePipeline()

    def start_copied_save(copied):
        assert copied == ("copy of", ("due", 7))
        pipeline.events.append("save")
        clock.hold(0.25)

    session = types.SimpleNamespace(
        run=tiny_run(checkpoint={"async_save": True, "copy_in_step": True}),
        checkpoints=_FakeCheckpoints(polls=2),
        prepare_save=lambda step, loader: ("due", step),
        take_state_copy=lambda due: ("copy of", due),
        start_copied_save=start_copied_save,
    )
    monkeypatch.setattr(bench_checkpoint_save.time, "perf_counter", lambda: clock.now)
    save = bench_checkpoint_save.one_save(session, None, pipeline, step=7, step_s=1.0)
    assert pipeline.events == [True, False, "save", False, False]
    assert save["blocked_s"] == pytest.approx(0.25)
    assert save["steps_during"] == 4  # the copying step, the one dispatched before the save, two
    assert save["cost_s"] == pytest.approx(4 * 1.25 - 4 * 1.0)


def test_the_pipeline_dispatches_each_step_before_waiting_for_the_one_before(monkeypatch):
    events = []

    def step_on_devices(batch, mode, copy_state):
        events.append(("dispatch", len(events)))
        return len(events) - 1

    session = types.SimpleNamespace(step_on_devices=step_on_devices)
    monkeypatch.setattr(bench_checkpoint_save.jax, "block_until_ready",
                        lambda step: events.append(("wait", step)))  # fmt: skip
    times = bench_checkpoint_save.Pipeline(session, None, None).run(3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    kinds = [kind for kind, _ in events]
    assert kinds == ["dispatch", "dispatch", "wait", "dispatch", "wait", "wait"]
    assert [step for kind, step in events if kind == "wait"] == [0, 1, 3]  # in dispatch order


@pytest.mark.slow  # ≈15 s on 2 cores per case, mostly compiling the tiny step
@pytest.mark.parametrize("async_save, copy_in_step", [(True, False), (False, False), (True, True)])
def test_bench_checkpoint_save_end_to_end(tmp_path, capsys, async_save, copy_in_step):
    """With copy_in_step the step after each save's start copies the state (counted among the
    steps meanwhile); overrides may come before options (as `m3-train`'s)."""
    run = tiny_run(checkpoint={"async_save": async_save})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(run)))
    directory = tmp_path / "checkpoints"
    argv = ["--config", str(config), "--dir", str(directory), "--steps", "2", "--saves", "2"]
    trace = tmp_path / "trace"
    if copy_in_step:  # the last save profiled, for trace_summary --timeline
        argv += ["checkpoint.copy_in_step=true", "--trace", str(trace)]
    assert bench_checkpoint_save.main(argv) == 0
    assert bool(list(trace.glob("**/perfetto_trace.json.gz"))) == copy_in_step
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["step"] for s in report["saves"]] == [4, 4 + report["saves"][0]["steps_during"] + 1]
    for save in report["saves"]:
        assert save["complete_s"] >= save["blocked_s"] > 0
        if not async_save:  # a synchronous save is all blocking: no step runs meanwhile
            assert save["steps_during"] == 0 and save["cost_s"] == save["blocked_s"]
        if copy_in_step:
            assert save["steps_during"] >= 1
    assert report["worst_cost_of_step"] == report["saves"][1]["cost_of_step"]
    assert not directory.exists()  # removed at the end

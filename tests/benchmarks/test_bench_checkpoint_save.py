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

    saving_in_background = True

    def __init__(self, polls: int):
        self.polls = polls

    def poll(self):
        self.polls -= 1
        return 7 if self.polls < 0 else None


def test_cost_is_blocked_time_plus_the_slowdown_of_the_steps_meanwhile(monkeypatch):
    session = types.SimpleNamespace(
        run=tiny_run(checkpoint={"async_save": True}),
        checkpoints=_FakeCheckpoints(polls=3),
        save=lambda step, loader: None,
    )
    monkeypatch.setattr(bench_checkpoint_save, "timed_step", lambda *args: 1.25)
    save = bench_checkpoint_save.one_save(session, None, None, None, step=7, step_s=1.0)
    assert save["steps_during"] == 3 and save["in_background"]
    assert save["first_steps_ms"] == [1250.0] * 3
    assert save["cost_s"] == pytest.approx(save["blocked_s"] + 3 * 0.25)
    assert save["cost_of_step"] == pytest.approx(save["cost_s"] / 1.0)


@pytest.mark.slow  # ≈15 s on 2 cores per case, mostly compiling the tiny step
@pytest.mark.parametrize("async_save", [True, False])
def test_bench_checkpoint_save_end_to_end(tmp_path, capsys, async_save):
    run = tiny_run(checkpoint={"async_save": async_save, "device_copy": True})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(run)))
    directory = tmp_path / "checkpoints"
    argv = ["--config", str(config), "--dir", str(directory), "--steps", "2", "--saves", "2"]
    assert bench_checkpoint_save.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["step"] for s in report["saves"]] == [4, 4 + report["saves"][0]["steps_during"] + 1]
    for save in report["saves"]:
        assert save["complete_s"] >= save["blocked_s"] > 0
        assert save["in_background"] == async_save  # a device copy where async (CPU: room)
        if not async_save:  # a synchronous save is all blocking: no step runs meanwhile
            assert save["steps_during"] == 0 and save["cost_s"] == save["blocked_s"]
    assert report["worst_cost_of_step"] == report["saves"][1]["cost_of_step"]
    assert not directory.exists()  # removed at the end

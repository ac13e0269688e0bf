"""benchmarks/bench_input_stall.py: its stall accounting on made-up timelines whose stall is known,
then end to end on CPU (a tiny multimodal run on the demo corpus, through its command line)."""

import json

import pytest
import yaml
from tiny import _merged, tiny_run, tiny_vision_run

from benchmarks import bench_input_stall
from m3jax.config_loading import to_mapping

DEMO_DATA = {
    "shards": ["demo:multimodal", "demo:text"],
    "weights": [0.9, 0.1],
    "patch_budget": 256,
    "seq_len": 64,
    "batch_size": 4,
    "processor": {"image_max_pixels": 12544, "video_max_pixels": 7056, "video_fps": 2.0,
                  "max_video_frames": 16},
}  # fmt: skip


@pytest.mark.slow  # ≈17 s on 2 cores, mostly compiling the tiny step
def test_bench_input_stall_report_is_consistent(tmp_path, capsys):
    run = tiny_vision_run(**_merged(
        {"model": {"vision": {"image_token_id": 259, "video_token_id": 260}}, "data": DEMO_DATA},
        {"logging": {"every_steps": 2}},
    ))  # fmt: skip
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(run)))
    out = tmp_path / "report.json"
    argv = ["--config", str(config), "--steps", "4", "--compute-steps", "2", "--startup-steps",
            "2", "--pipeline-batches", "4", "--time-budget", "1", "--out", str(out)]  # fmt: skip
    assert bench_input_stall.main(argv) == 0
    stdout = capsys.readouterr().out
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == json.loads(out.read_text()) and report["complete"]
    assert report["steps_requested"] == 4  # the budget never cuts below MIN_LOOP_STEPS (10)
    assert "| loop, steady (4 steps) |" in stdout and "bench_input_stall: loop: step 6/6" in stdout

    loop, step, pipeline = report["loop"], report["step"], report["pipeline"]
    rows = loop["per_step"]
    assert len(rows) == 6 and loop["steps"] == 4 and loop["startup_steps"] == 2
    assert step["steps"] == 2 and 0 < step["step_s_min"] <= step["step_s"] <= step["step_s_max"]
    assert pipeline["measured_batches"] == 2 and pipeline["batches_per_s"] > 0
    assert report["forward_mode"]["block_recall"] is False
    previous_done = 0.0
    for row in rows:  # a step is enqueued before it finishes; steps finish in order
        assert 0 <= row["fetch_s"] and 0 <= row["put_dispatch_s"]
        assert row["fetch_s"] + row["put_dispatch_s"] <= row["enqueued"] < row["done"]
        assert previous_done < row["done"] and 0 <= row["idle_s"] <= row["interval_s"]
        previous_done = row["done"]
    assert 0 <= loop["idle_s"] <= loop["wall_s"] and 0 <= loop["stall_fraction"] <= 1
    summary = report["summary"]
    assert summary["stall_fraction"] == loop["stall_fraction"]
    assert summary["stall_below_target"] == (loop["stall_fraction"] < 0.02)
    assert 0 <= summary["stall_fraction_by_difference"] <= 1


STEP_S, COPY_S = 0.1, 0.001  # the made-up timelines' step and host -> device copy


def timeline(fetch_s: float, blocking: bool, steps: int = 8) -> tuple[list[dict], list[float]]:
    """The loop's rows and finish times for a host that takes `fetch_s` per batch and a device
    that takes STEP_S per step, starting once the batch is fetched and copied; a blocking dispatch
    returns only when the step is done (as on the H200), else right after the copy."""
    rows, done, host, device_free = [], [], 0.0, 0.0
    for _ in range(steps):
        fetched = host + fetch_s
        finished = max(device_free, fetched + COPY_S) + STEP_S
        enqueued = finished if blocking else fetched + COPY_S
        rows.append({"fetch_s": fetch_s, "put_dispatch_s": enqueued - fetched,
                     "fetched": fetched, "enqueued": enqueued})  # fmt: skip
        done.append(finished)
        host, device_free = enqueued, finished
    return rows, done



@pytest.mark.slow  # ≈12 s on 2 cores
def test_bench_input_stall_runs_on_a_text_corpus(tmp_path, capsys):
    """The text loader goes through the same loop and is closed like the multimodal one."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(to_mapping(tiny_run())))
    argv = ["--config", str(config), "--steps", "2", "--compute-steps", "1", "--startup-steps",
            "1", "--pipeline-batches", "2"]  # fmt: skip
    assert bench_input_stall.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["complete"] and report["patch_budget"] == 0 and report["loop"]["steps"] == 2

@pytest.mark.parametrize(
    "fetch_s, blocking, stall",
    [
        # batches ready at once, dispatch blocking for the whole step: the device idles only for
        # the copy (the first version counted the whole blocked dispatch as idle: 99 %)
        (0.0, True, COPY_S / (COPY_S + STEP_S)),
        (0.0, False, 0.0),  # the host runs ahead: no idle at all
        (0.15, False, (0.15 - STEP_S + COPY_S) / (0.15 + COPY_S)),  # a slow pipeline
        (0.15, True, (0.15 + COPY_S) / (0.15 + COPY_S + STEP_S)),  # slow and no overlap
    ],
)
def test_loop_report_stall_of_known_timelines(fetch_s, blocking, stall):
    rows, done = timeline(fetch_s, blocking)
    report = bench_input_stall._loop_report(rows, done, 0.0, 2, COPY_S)
    assert report["steps"] == 6
    assert report["stall_fraction"] == pytest.approx(stall, abs=1e-9)
    assert report["fetch_fraction"] == pytest.approx(6 * fetch_s / report["wall_s"])

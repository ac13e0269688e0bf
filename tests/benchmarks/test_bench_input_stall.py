"""benchmarks/bench_input_stall.py end to end on CPU: a tiny multimodal run on the demo corpus,
through its command line; the report's times must be consistent with each other."""

import json

import pytest
import yaml
from tiny import _merged, tiny_vision_run

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
        assert previous_done < row["done"]
        assert row["fetched"] == pytest.approx(row["enqueued"] - row["put_dispatch_s"])
        started = min(row["enqueued"], row["fetched"] + step["put_batch_s"])
        assert row["idle_s"] == pytest.approx(max(0.0, started - previous_done), abs=1e-9)
        assert 0 <= row["idle_s"] <= row["interval_s"]
        assert row["interval_s"] == pytest.approx(row["done"] - previous_done)
        previous_done = row["done"]
    steady = rows[2:]
    assert loop["wall_s"] == pytest.approx(steady[-1]["done"] - rows[1]["done"])
    assert loop["wall_s"] == pytest.approx(sum(r["interval_s"] for r in steady))
    assert loop["idle_s"] == pytest.approx(sum(r["idle_s"] for r in steady))
    assert 0 <= loop["idle_s"] <= loop["wall_s"] and 0 <= loop["stall_fraction"] <= 1
    assert loop["fetch_fraction"] == pytest.approx(
        sum(r["fetch_s"] for r in steady) / loop["wall_s"]
    )
    summary = report["summary"]
    assert summary["stall_fraction"] == loop["stall_fraction"]
    assert summary["stall_below_target"] == (loop["stall_fraction"] < 0.02)
    assert 0 <= summary["stall_fraction_by_difference"] <= 1
    assert summary["pipeline_over_step_rate"] == pytest.approx(
        pipeline["batches_per_s"] * step["step_s"]
    )

"""The GPU benchmarks' own logic, on CPU: bench_msa's kernel configs and phase filter, bench_train's
synthetic packed rows and corpus rows, pinned kernels and isolated variants; bench_msa_tpu's
refusal without a TPU."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import bench_msa, bench_msa_tpu, bench_train
from pallas_kernels.msa import pallas as msa_pallas
from tiny import tiny_run


def test_parse_tiling_sets_fields_of_each_part():
    config = bench_msa.parse_tiling("forward.rows=64,backward.key_split=4,selection.num_warps=4")
    assert config.forward.rows == 64 and config.backward.key_split == 4
    assert config.selection.num_warps == 4
    default = bench_msa.parse_tiling("")
    assert config.backward.rows == default.backward.rows  # untouched fields keep their defaults
    with pytest.raises(ValueError, match="Tiling has no field 'no_such_field'"):
        bench_msa.parse_tiling("forward.no_such_field=1")
    with pytest.raises(ValueError, match="no tiling 'sideways'"):
        bench_msa.parse_tiling("sideways.rows=1")
    own = bench_msa.parse_tiling("teacher_bytes=8589934592,forward.rows=32")
    assert own.teacher_bytes == 8 << 30 and own.forward.rows == 32
    assert own.partial_bytes == default.partial_bytes


def test_phase_filter_keeps_the_cudnn_baseline_of_what_is_timed():
    assert bench_msa.wanted("cudnn fwd", ["select"]) and bench_msa.wanted("cudnn fwd", ["fwd"])
    assert not bench_msa.wanted("cudnn fwd", ["fwd+bwd"])
    assert not bench_msa.wanted("cudnn fwd+bwd", ["fwd"])
    assert bench_msa.wanted("pallas[forward.rows=64] fwd+bwd", ["fwd+bwd"])
    assert not bench_msa.wanted("pallas select", ["fwd", "fwd+bwd"])


def test_bench_inputs_place_the_second_document_mid_block():
    x = bench_msa.make_inputs(1000, documents=2)
    segments, positions = np.asarray(x["segment_ids"][0]), np.asarray(x["positions"][0])
    start = int(np.argmax(segments == 2))
    assert start % bench_msa.BLOCK != 0 and positions[start] == 0
    np.testing.assert_array_equal(positions[start:], np.arange(1000 - start))


def test_synthetic_batch_packs_documents_with_positions_from_zero():
    batch = bench_train.synthetic_batch(3, 4096, vocab=512, mean_document=700)
    segments, positions = np.asarray(batch.segment_ids), np.asarray(batch.positions)
    assert segments.shape == positions.shape == (3, 4096)
    documents = 0
    for row_segments, row_positions in zip(segments, positions, strict=True):
        starts = np.flatnonzero(np.diff(row_segments)) + 1
        documents += len(starts) + 1
        assert (row_positions[starts] == 0).all() and row_positions[0] == 0
        inside = np.ones(4096, bool)
        inside[starts] = inside[0] = False
        assert (np.diff(row_positions)[inside[1:]] == 1).all()
    assert documents >= 9  # rows hold several documents (≈ 4096 / 700 each on average)
    assert (np.asarray(batch.targets)[:, :-1] == np.asarray(batch.tokens)[:, 1:]).all()


def test_kernel_pins_become_the_variants_msa_kernel_settings():
    """`kernels.<field>=value` tokens are added to the variant's `model.msa_kernels`, after the
    config's own (a pin wins), and a bad one is refused with the field named."""
    run = tiny_run(model={"msa_kernels": ["partial_bytes=1024", "kl_kernel=pass"]})
    pins = ["kernels.backward_kernel=triton", "kernels.kl_kernel=slots"]
    pinned = bench_train.with_kernel_pins(run, pins)
    assert pinned.model.msa_kernels == ("partial_bytes=1024", "kl_kernel=pass",
                                        "backward_kernel=triton", "kl_kernel=slots")  # fmt: skip
    config = msa_pallas.configured(pinned.model.msa_kernels).config
    assert (config.partial_bytes, config.backward_kernel, config.kl_kernel) == (
        1024, "triton", "slots")  # fmt: skip
    assert bench_train.with_kernel_pins(run, []) is run
    with pytest.raises(ValueError, match="no field 'colour'"):
        bench_train.with_kernel_pins(run, ["kernels.colour=red"])


def test_tpu_bench_refuses_to_time_without_a_tpu(monkeypatch):
    """bench_msa_tpu on a CPU machine: an error naming the backend unless --interpret."""
    monkeypatch.setattr("sys.argv", ["bench_msa_tpu", "--lengths", "256"])
    with pytest.raises(SystemExit, match="needs a TPU"):
        bench_msa_tpu.main()


def test_isolated_variants_run_one_child_each_and_report_a_dead_childs_last_words(
    monkeypatch, capsys
):
    """--isolate: one child process per variant, the profile only for the first; its row comes
    back, and a child that died without one (e.g. killed for memory) becomes an error row."""
    commands = []

    def fake_run(command, **_):
        commands.append(command)
        variant = command[command.index("--variants") + 1]
        if variant == "broken":
            return subprocess.CompletedProcess(command, -9, "", "startup\nKilled by the OOM\n")
        speed = 2000.0 if variant else 1000.0
        row = {"variant": variant or "as configured", "tokens_per_s": speed, "step_ms": 1e6 / speed,
               "mfu_989": 0.1, "of_matmul_rate": 0.2, "peak_gb": 1.0, "first_loss": 2.0,
               "last_loss": 1.0}  # fmt: skip
        return subprocess.CompletedProcess(command, 0, f"{{}}\n{json.dumps([row])}\n", "")

    monkeypatch.setattr(bench_train.subprocess, "run", fake_run)
    monkeypatch.setenv("XLA_FLAGS", "")  # main adds the HLO dump of a profiled run (undone after)
    argv = ["bench_train", "--config", "c.yaml", "--isolate", "--profile", "/tmp/p",
            "--variants", "", "model.remat=none", "broken"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_train.main()
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c[c.index("--variants") + 1] for c in commands] == ["", "model.remat=none", "broken"]
    assert ["--profile" in c for c in commands] == [True, False, False]
    assert "--xla_dump_to=/tmp/p/hlo --xla_dump_hlo_as_text" in os.environ["XLA_FLAGS"]
    assert rows[1]["vs_first"] == 2.0 and "error" not in rows[1]
    assert rows[2]["error"] == "child exited -9: Killed by the OOM"


def test_a_variant_of_n_devices_runs_in_a_child_that_sees_n(monkeypatch, capsys):
    """`devices=N`: the variant's own process sees N devices (the first N GPUs, or N host devices:
    the count replaces any already in XLA_FLAGS); vs first compares tokens/s per device. An
    `xla_…` token: the variant's own process (without --isolate) starts XLA with that flag, in
    place of the same flag's value in XLA_FLAGS."""
    seen = []

    def fake_run(command, env, **_):
        seen.append((command, env))
        devices = bench_train.variant_devices(command[command.index("--variants") + 1]) or 1
        row = {"variant": "v", "tokens_per_s": 1000.0 * devices * (0.9 if devices > 1 else 1),
               "devices": devices, "step_ms": 10.0, "mfu_989": 0.1, "of_matmul_rate": 0.2,
               "peak_gb": 1.0, "first_loss": 2.0, "last_loss": 1.0}  # fmt: skip
        return subprocess.CompletedProcess(command, 0, f"{json.dumps([row])}\n", "")

    monkeypatch.setattr(bench_train.subprocess, "run", fake_run)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_other=1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["bench_train", "--config", "c.yaml",
            "--variants", "devices=1", "devices=2 mesh.data=2 data.batch_size=2",
            "xla_other=2 xla_gpu_flag=false"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_train.main()
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    envs = [env for _, env in seen]
    assert [env.get("CUDA_VISIBLE_DEVICES") for env in envs] == ["0", "0,1", None]
    flags = envs[1]["XLA_FLAGS"].split()
    assert "--xla_other=1" in flags
    assert [f for f in flags if "device_count" in f] == ["--xla_force_host_platform_device_count=2"]
    flags = envs[2]["XLA_FLAGS"].split()
    assert "--xla_other=2" in flags and "--xla_other=1" not in flags
    assert "--xla_gpu_flag=false" in flags
    assert all("--child" in command for command, _ in seen)
    assert rows[1]["vs_first"] == pytest.approx(0.9)
    assert bench_train.variant_xla_flags("model.remat=none xla_a=1") == ["--xla_a=1"]


def test_a_variant_trains_on_a_mesh_of_the_devices_it_sees(tmp_path):
    """In-process (4 host devices under the tests): m3-train's session, state sharded over
    data × expert, finite losses; per-device figures over all four (the variant's devices= and
    xla_… tokens are its process's, not config overrides)."""
    import yaml
    from tiny import TINY

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    variant = ["mesh.data=2", "mesh.expert=2", "devices=4", "xla_other=1"]
    row = bench_train.time_variant(str(config), variant, steps=2, document_tokens=12)
    assert row["devices"] == 4 and row["mesh"]["data"] == 2 and row["mesh"]["expert"] == 2
    assert row["finite"] and row["tokens"] == 4 * 32 and row["step_ms"] > 0


def test_corpus_rows_are_the_loaders_first_batch_and_train(tmp_path):
    """--rows corpus: the config's own data through m3-train's loader (here the tiny run's
    Shakespeare), not synthetic rows; a variant trains on it; an unknown source is refused."""
    import yaml
    from tiny import TINY

    from pretrain.data_loading import make_loader

    run = tiny_run()
    loader = make_loader(run)
    expected = next(loader)
    loader.close()
    corpus = bench_train.host_rows(run, "corpus", document_tokens=12)
    synthetic = bench_train.host_rows(run, "synthetic", document_tokens=12)
    np.testing.assert_array_equal(np.asarray(corpus.tokens), np.asarray(expected.tokens))
    np.testing.assert_array_equal(np.asarray(corpus.segment_ids), np.asarray(expected.segment_ids))
    assert not np.array_equal(np.asarray(corpus.tokens), np.asarray(synthetic.tokens))
    with pytest.raises(ValueError, match="rows='random'"):
        bench_train.host_rows(run, "random", document_tokens=12)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    row = bench_train.time_variant(str(config), [], steps=1, rows="corpus")
    assert row["rows"] == "corpus" and row["finite"] and row["tokens"] == 4 * 32

"""m3-plan: per-device bytes from the compiled step on fake devices, and the HLO collective count.

The suite runs on 4 fake devices (conftest.py); the command-line case plans on 8 in a subprocess.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import yaml
from conftest import REPO
from jax.sharding import PartitionSpec
from tiny import TINY, tiny_run

from m3jax import sharding
from pretrain import hlo_collectives, plan


def compiled_on_fsdp4(per_device) -> str:
    """The compiled HLO text of `per_device` over an [8, 8] f32 array split by rows on fsdp=4."""
    mesh = sharding.make_mesh({"fsdp": 4})
    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=PartitionSpec("fsdp"),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    return jax.jit(sharded).lower(jnp.ones((8, 8))).compile().as_text()


def test_collective_bytes_count_each_trip_of_a_loop():
    """An all-gather of [2, 8] f32 shards into [8, 8] (256 bytes) inside a 5-step scan."""

    def gathered_sum(x):
        def body(carry, _):
            whole = jax.lax.all_gather(x * carry, "fsdp", tiled=True)  # depends on the carry
            return carry + whole.sum(), None

        return jax.lax.scan(body, jnp.ones(()), None, length=5)[0]

    hlo = compiled_on_fsdp4(gathered_sum)
    assert hlo_collectives.collective_bytes(hlo)["all-gather"] == 5 * 8 * 8 * 4


def test_collective_bytes_count_a_conditionals_cheapest_branch_with_its_loops():
    """One branch: an all-gather into [8, 8] f32 (256 bytes); the other: the same gather of a
    half 4 times in a scan (512 bytes, 128 a trip). The first is the one that counts."""

    def branches(x):
        def gathered(a):
            return jax.lax.all_gather(a, "fsdp", tiled=True).sum()

        def in_a_loop():
            body = lambda carry, _: (carry + gathered(x[:, :4] * carry), None)  # noqa: E731
            return jax.lax.scan(body, jnp.ones(()), None, length=4)[0]

        return jax.lax.cond(x.sum() > 0, lambda: gathered(x), in_a_loop)

    hlo = compiled_on_fsdp4(branches)
    assert "conditional(" in hlo and "known_trip_count" in hlo
    assert hlo_collectives.collective_bytes(hlo)["all-gather"] == 8 * 8 * 4


def test_collective_bytes_count_xla_gpus_async_pairs_once():
    """XLA:GPU prints collectives as start/done pairs: the done's result counts (the operand for
    a reduce-scatter), once, and a pair over a size-1 axis not at all."""
    groups = "replica_groups=mesh['expert'=2,'seq'=1] {'expert'}"
    over_seq = "replica_groups=mesh['expert'=2,'seq'=1] {'seq'}"
    hlo = f"""ENTRY %main (p: bf16[4,8]) -> bf16[4,8] {{
  %p = bf16[4,8]{{1,0}} parameter(0)
  %a2a-start = ((bf16[4,8]{{1,0}}), bf16[4,8]{{1,0}}) all-to-all-start(%p), {groups}
  %a2a-done = bf16[4,8]{{1,0}} all-to-all-done(%a2a-start)
  %rs-start = ((bf16[4,8]{{1,0}}), bf16[2,8]{{1,0}}) reduce-scatter-start(%a2a-done), {groups}
  %rs-done = bf16[2,8]{{1,0}} reduce-scatter-done(%rs-start)
  %ag-start = (bf16[2,8]{{1,0}}, bf16[2,8]{{1,0}}) all-gather-start(%rs-done), {over_seq}
  ROOT %ag-done = bf16[2,8]{{1,0}} all-gather-done(%ag-start)
}}"""  # fmt: skip
    assert hlo_collectives.collective_bytes(hlo) == {"all-to-all": 64, "reduce-scatter": 64}


@pytest.mark.slow
def test_plan_bytes_per_device_shrink_as_fsdp_grows():
    """4 devices: pure data parallel, then fsdp=4. Params and optimizer state are split 4 ways
    (the Adam moments sharded like their parameters), and the step as a whole holds less."""
    replicated = plan.plan(tiny_run(mesh={"data": 4}))
    sharded = plan.plan(tiny_run(mesh={"data": 1, "fsdp": 4}))
    assert sharded.params < replicated.params / 2
    assert sharded.opt_state < replicated.opt_state / 2
    assert sharded.total < replicated.total
    for result in (replicated, sharded):  # two moments like the params, plus a few scalars
        assert 2 * result.params <= result.opt_state <= 2 * result.params + 64
    assert sharded.collectives.get("all-gather", 0) > 0  # fsdp gathers weights
    assert sharded.notes and "capacity" in sharded.notes[0]  # the dropless stand-in is named


def test_planned_rows_take_the_flag_then_a_batch_override_then_one_per_device():
    run = tiny_run(data={"batch_size": 3})
    assert plan.planned_rows(5, ["data.batch_size=3"], run, data_parallel=2) == 5
    assert plan.planned_rows(None, ["mesh.data=2", "data.batch_size=3"], run, 2) == 3
    assert plan.planned_rows(None, ["mesh.data=2"], run, data_parallel=2) == 2


@pytest.mark.slow
def test_m3_plan_command_plans_8_fake_devices_growing_by_layers(tmp_path):
    config = tmp_path / "tiny.yaml"
    layers = {"num_layers": 5, "layer_types": ["full", "msa*4"],
              "mlp_layer_types": ["dense", "moe*4"]}  # fmt: skip
    config.write_text(yaml.safe_dump({**TINY, "model": {**TINY["model"], **layers}}))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.plan", "--config", str(config), "--devices", "8",
         "--mesh", "fsdp=4,expert=2", "--layers", "3", "--seq-len", "16"],
        env={**os.environ, "XLA_FLAGS": flags}, cwd=REPO, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grown linearly to all layers" in result.stdout
    planned = json.loads(result.stdout.strip().splitlines()[-1])
    assert planned["mesh"]["fsdp"] == 4 and planned["mesh"]["expert"] == 2
    assert planned["compiled_layers"] == [3, 4] and planned["seq_len"] == 16
    assert planned["batch_size"] == 8  # one row per data-parallel device
    assert planned["params"] > 0 and planned["temporaries"] > 0
    assert planned["collectives"]["all-to-all"] > 0  # the expert-parallel exchange


@pytest.mark.slow
def test_m3_plan_compiles_for_two_h200s_with_the_gpu_kernels(tmp_path):
    """XLA:GPU ahead of time (`--target h200`, no GPU here): an expert-parallel step with MSA and
    MoE layers of shapes the GPU kernels take compiles with them (Mosaic GPU: MoE and the MSA
    forward and backward; Triton: the selection; cuDNN: the dense layer), the dropless exchange
    is an all-to-all, and no CPU stand-in is planned."""
    config = tmp_path / "gpu.yaml"
    model = {"vocab_size": 512, "hidden_size": 256, "num_layers": 3, "num_heads": 8,
             "num_kv_heads": 1, "head_dim": 128, "rotary_dim": 64, "dense_mlp_dim": 512,
             "dtype": "bfloat16", "layer_types": ["full", "msa*2"],
             "mlp_layer_types": ["dense", "moe*2"],
             "msa": {"index_heads": 1, "index_head_dim": 128, "block_size": 128,
                     "topk_blocks": 2},
             "moe": {**TINY["model"]["moe"], "num_experts": 8, "expert_dim": 256}}  # fmt: skip
    config.write_text(yaml.safe_dump({**TINY, "model": model}))
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.plan", "--config", str(config), "--devices", "2",
         "--mesh", "expert=2", "--seq-len", "1024", "--target", "h200"],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    planned = json.loads(result.stdout.strip().splitlines()[-1])
    assert planned["target"] == "NVIDIA H200" and planned["mesh"]["expert"] == 2
    assert planned["notes"] == []  # dropless MoE and the kernels as compiled, no stand-in
    kernels = planned["kernels"]
    assert kernels.get("mosaic_gpu_v2", 0) >= 4, kernels
    assert kernels.get("__gpu$xla.gpu.triton", 0) >= 1, kernels
    assert any(name.startswith("__cudnn$fmha") for name in kernels), kernels
    assert planned["collectives"]["all-to-all"] > 0
    assert 0 < planned["temporaries"] < 10e9

"""Context parallelism (m3jax/context_parallel.py): the zig-zag layout, and the training loss and
its gradients on meshes with seq > 1 equal one device's.

The model: tests/tiny.py (a full-attention layer, an MSA + MoE layer, here one MTP module) at 64
tokens a row, MSA past its warm-up with blocks of 4 and the top 2 kept (16 blocks: selection
drops most of them), indexer KL and block recall on, dropless MoE. Four rows of packed documents
whose boundaries cut through the zig-zag chunks of every mesh, one row with trailing padding.
float32, tolerance 1e-5 of each leaf's largest magnitude (sums in another order).

The suite runs on 4 fake devices (conftest.py): the 4-device mesh here, the 8-device ones again in
a subprocess with 8 (`test_context_parallel_on_8_devices`).
"""

import dataclasses
import functools
import itertools
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from moe_cases import assert_trees_close
from tiny import tiny_run

from batch_format.batch import Batch, make_batch
from m3jax import context_parallel, sharding
from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.loss import loss_totals
from pretrain.train_step import make_loss_fn

MESHES = {
    "seq4": {"seq": 4},
    "data2-seq4": {"data": 2, "seq": 4},
    "fsdp2-expert2-seq2": {"fsdp": 2, "expert": 2, "seq": 2},
    "tensor2-seq2-data2": {"tensor": 2, "seq": 2, "data": 2},
    "seq8": {"seq": 8},
}
RUNNABLE = [n for n, sizes in MESHES.items() if math.prod(sizes.values()) <= jax.device_count()]
SEQ = 64
DOCUMENTS = [[13, 30, 21], [64], [5, 40, 10], [33, 27]]  # lengths per row; row 3 ends in padding
RUN = tiny_run(
    model={"msa": {"block_size": 4, "topk_blocks": 2}, "mtp": {"num_modules": 1}},
    data={"seq_len": SEQ, "batch_size": len(DOCUMENTS)},
)
MODE = ForwardMode(msa_dense=False, indexer_loss=True, block_recall=True)
MESH_STATISTICS = ("moe_exchange_worst_case",)  # which exchange branch ran: a mesh's own


def mesh_of(sizes: dict):
    return sharding.make_mesh(sizes, devices=jax.devices()[: math.prod(sizes.values())])


def packed_batch() -> Batch:
    rng = np.random.default_rng(0)
    segments = np.zeros((len(DOCUMENTS), SEQ), np.int32)
    positions = np.zeros_like(segments)
    for row, lengths in enumerate(DOCUMENTS):
        starts = np.cumsum([0, *lengths])
        for doc, (start, end) in enumerate(itertools.pairwise(starts)):
            segments[row, start:end], positions[row, start:end] = doc + 1, np.arange(end - start)
    tokens, targets = rng.integers(0, RUN.model.vocab_size, (2, *segments.shape), np.int32)
    return make_batch(tokens=tokens, targets=targets, positions=positions, segment_ids=segments,
                      loss_mask=(segments > 0).astype(np.float32))  # fmt: skip


def loss_and_grads(mesh=None, attention_impl: str | None = None, kl_sinks: bool = False):
    """(loss, metrics, gradients) of the training loss on `mesh` (None: one device); kl_sinks:
    the gradients (params', the MSA layers' KL sinks') as the training step takes them."""
    config = RUN.model
    if attention_impl is not None:
        config = dataclasses.replace(config, attention_impl=attention_impl)
    model = functional(config, mesh)
    params, buffers = model.init(0)
    batch = jax.tree.map(jnp.asarray, packed_batch())
    if mesh is not None:
        params = jax.device_put(params, sharding.tree_shardings(model.param_axes, params, mesh))
        batch = jax.device_put(batch, sharding.batch_sharding(mesh))
    loss_fn = make_loss_fn(model, RUN)

    def sunk_loss_fn(differentiated, *args):
        params, sinks = differentiated
        return loss_fn(params, *args, sinks)

    @jax.jit
    def step(differentiated, batch):
        totals = loss_totals(batch, RUN.model.mtp.num_modules, 1)
        (loss, (metrics, _)), grads = jax.value_and_grad(sunk_loss_fn, has_aux=True)(
            differentiated, buffers, batch, MODE, totals
        )
        metrics = {k: v for k, v in metrics.items() if k not in MESH_STATISTICS}
        return loss, metrics, grads if kl_sinks else grads[0]

    return step((params, model.kl_sinks() if kl_sinks else None), batch)


@functools.cache
def one_device():
    return loss_and_grads()


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", RUNNABLE)
def test_loss_and_gradients_equal_one_device(mesh_name):
    loss, metrics, grads = loss_and_grads(mesh_of(MESHES[mesh_name]))
    loss_ref, metrics_ref, grads_ref = one_device()
    assert float(metrics_ref["msa_recall"]) < 0.9  # selection drops blocks dense attention wants
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6, err_msg=mesh_name)
    assert_trees_close(metrics, metrics_ref, err_msg=mesh_name)
    assert_trees_close(grads, grads_ref, err_msg=mesh_name)


def test_zigzag_layout_puts_chunks_i_and_2n_minus_1_minus_i_on_device_i():
    mesh = mesh_of({"seq": 4})
    x = jnp.arange(2 * 32).reshape(2, 32)
    balanced = context_parallel.to_balanced(x, mesh)
    chunks = np.asarray(x).reshape(2, 8, 4)
    for device, shard in enumerate(sorted(balanced.addressable_shards, key=lambda s: s.index)):
        expected = np.concatenate([chunks[:, device], chunks[:, 7 - device]], axis=1)
        np.testing.assert_array_equal(shard.data, expected)
    np.testing.assert_array_equal(context_parallel.to_natural(balanced, mesh), x)
    stacked = jnp.stack([balanced, balanced + 1])  # [L, B, S]: a layer axis first
    np.testing.assert_array_equal(context_parallel.to_natural(stacked, mesh, axis=2)[1], x + 1)


def test_a_row_that_does_not_split_into_2n_chunks_is_refused():
    with pytest.raises(
        ValueError, match="sequence length 12 is not a multiple of 2 × mesh.seq = 8"
    ):
        context_parallel.to_balanced(jnp.zeros((1, 12)), mesh_of({"seq": 4}))


def test_kl_sinks_on_seq2_give_one_devices_kl_and_gradients():
    """The training step's KL sinks under context parallelism (each device's chunks' sinks):
    their gradients are one device's per-layer KLs, the loss plus their weighted sum its loss,
    and the parameters' gradients its gradients."""
    loss, metrics, (grads, sink_grads) = loss_and_grads(mesh_of({"seq": 2}), kl_sinks=True)
    loss_ref, metrics_ref, grads_ref = one_device()
    kls = [g for g in sink_grads if g is not None]
    assert len(kls) == 1 and kls[0].shape == (1,)
    np.testing.assert_allclose(kls[0][0], metrics_ref["msa_kl_layer1"], rtol=1e-5)
    assert float(metrics["msa_kl_layer1"]) == 0 and float(kls[0][0]) > 0.01
    np.testing.assert_allclose(loss + RUN.model.msa.kl_weight * kls[0][0], loss_ref, rtol=1e-6)
    assert_trees_close(grads, grads_ref)


@pytest.mark.slow
def test_loss_and_gradients_through_the_msa_gpu_kernels_equal_one_device():
    """attention_impl="pallas" (the GPU kernels in Pallas' interpreter) on seq=2: each device's
    two query chunks go to the kernels as runs of slots; the loss, metrics and gradients equal
    one device's through the XLA path."""
    loss, metrics, grads = loss_and_grads(mesh_of({"seq": 2}), attention_impl="pallas")
    loss_ref, metrics_ref, grads_ref = one_device()
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    assert_trees_close(metrics, metrics_ref)
    assert_trees_close(grads, grads_ref)


if "seq8" not in RUNNABLE:  # the CPU suite's 4 devices: rerun the 8-device cases with 8

    @pytest.mark.slow
    def test_context_parallel_on_8_devices():
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
        env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8"}
        eight = [n for n, sizes in MESHES.items() if math.prod(sizes.values()) == 8]
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
             "-m", "slow", "-k", " or ".join(eight)],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
        assert re.search(rf"\b{len(eight)} passed", result.stdout), result.stdout

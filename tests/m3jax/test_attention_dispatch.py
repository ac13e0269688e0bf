"""Which MSA backend a layer runs (`model.attention_impl`), and that the model trains the same on
each: "auto" takes the Pallas kernels on a GPU where they apply and the XLA path elsewhere;
"pallas" takes the kernels or says why not; the layer runs dense attention whenever every query
keeps all its blocks (S <= topk_blocks · block_size)."""

import collections
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import attention_ops
from m3jax.attention import ForwardMode
from m3jax.config import MSAConfig
from m3jax.model import functional
from pallas_kernels import target
from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import reference as msa_reference
from pallas_kernels.msa import tpu as msa_tpu
from pallas_kernels.msa import xla as msa_xla
from jaxpr_values import kernel_calls, scan_lengths
from tiny import tiny_run

# stand-ins for the devices kernels are chosen for (pallas_kernels/target.py)
A_HOPPER = mock.Mock(platform="gpu", compute_capability="9.0", core_count=132)
A_TPU = mock.Mock(platform="tpu")

MSA = MSAConfig(index_heads=2, index_head_dim=32, block_size=32, topk_blocks=2)


def operands(dtype=jnp.bfloat16, seq=100):
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (1, seq, 8, 32), dtype)
    k = jax.random.normal(keys[1], (1, seq, 2, 32), dtype)
    v = jax.random.normal(keys[2], (1, seq, 2, 32), dtype)
    index_q = jax.random.normal(keys[3], (1, seq, 2, 32), dtype)
    index_k = jax.random.normal(keys[4], (1, seq, 32), dtype)
    return q, k, v, index_q, index_k


def test_auto_takes_the_kernels_on_a_gpu_where_they_apply():
    q, k, _, index_q, _ = operands()
    assert attention_ops.msa_backend("auto", MSA, q, k, index_q) is msa_xla  # a CPU machine
    with target.ahead_of_time([A_HOPPER]), \
            mock.patch.object(msa_pallas, "_interpret", lambda interpret: False):  # fmt: skip
        assert attention_ops.msa_backend("auto", MSA, q, k, index_q) is msa_pallas
        f32 = q.astype(jnp.float32)  # the compiled kernels take bf16/f16 only
        assert attention_ops.msa_backend("auto", MSA, f32, k, index_q) is msa_xla
        with pytest.raises(ValueError, match="attention_impl='pallas'.*float32"):
            attention_ops.msa_backend("pallas", MSA, f32, k, index_q)
    assert attention_ops.msa_backend("xla", MSA, q, k, index_q) is msa_xla
    assert attention_ops.msa_backend("reference", MSA, q, k, index_q) is msa_reference


def test_msa_kernel_settings_configure_the_gpu_kernels_only():
    """`model.msa_kernels` reaches the GPU kernels' functions as their Config; the XLA path and
    the reference take none."""
    q, k, _, index_q, _ = operands()
    settings = ("partial_bytes=1024", "mosaic_backward.warpgroups=2")
    with target.ahead_of_time([A_HOPPER]), \
            mock.patch.object(msa_pallas, "_interpret", lambda interpret: False):  # fmt: skip
        backend = attention_ops.msa_backend("auto", MSA, q, k, index_q, settings)
    config = backend.sparse_attention.keywords["config"]
    assert (config.partial_bytes, config.mosaic_backward.warpgroups) == (1024, 2)
    assert config.mosaic.warpgroups == msa_pallas.Config().mosaic.warpgroups  # the rest default
    assert backend.top_blocks.keywords["config"] is config
    assert backend.dense_attention is msa_pallas.dense_attention
    assert attention_ops.msa_backend("xla", MSA, q, k, index_q, settings) is msa_xla


def test_few_documents_is_a_bound_on_each_rows_runs_of_segment_ids():
    """The host's check of a batch (`ForwardMode.few_documents`): every row at most as many runs
    of equal ids (padding's run too) as both cuDNN's packed slots and the MSA kernels' tables
    take."""
    assert attention_ops.documents_bound(4096, 128) == 16  # cuDNN's 16 slots at 4K
    assert attention_ops.documents_bound(32768, 128) == 32
    assert attention_ops.documents_bound(131072, 128) == 8  # 2^20 / S slots past 32K
    assert attention_ops.documents_bound(32768, 2048) == 18  # ceil(S / block) + 2 documents
    rows = np.zeros((2, 4096), np.int32)
    rows[0, :4000] = np.repeat(np.arange(1, 16), 267)[:4000]  # 15 documents, then padding
    assert attention_ops.holds_few_documents(rows, 128)  # 16 runs
    rows[1, 100:101] = 7  # 3 runs in the other row
    assert attention_ops.holds_few_documents(rows, 128)
    rows[0, 4095] = 99  # a 17th run
    assert not attention_ops.holds_few_documents(rows, 128)


def test_few_documents_reaches_the_gpu_kernels_config():
    q, k, _, index_q, _ = operands()
    with target.ahead_of_time([A_HOPPER]), \
            mock.patch.object(msa_pallas, "_interpret", lambda interpret: False):  # fmt: skip
        backend = attention_ops.msa_backend("auto", MSA, q, k, index_q, few_documents=True)
        assert attention_ops.msa_backend("auto", MSA, q, k, index_q) is msa_pallas
    assert backend.sparse_attention.keywords["config"].few_documents
    assert attention_ops.msa_backend("xla", MSA, q, k, index_q, few_documents=True) is msa_xla


def test_msa_kernel_settings_reach_the_model_layers_kernels():
    """The tiny model traced with `msa_kernels` that bound a window's shares to one byte (so a
    window is `min_window` queries): its 48 queries run in a loop of three windows of 16, where
    the defaults take them in one."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 272, (1, 48)), jnp.int32)
    positions, segments = jnp.arange(48)[None], jnp.ones((1, 48), jnp.int32)

    def loop_lengths(settings):
        run = tiny_run(model={"attention_impl": "pallas", "msa_kernels": list(settings)})
        model = functional(run.model)
        params, buffers = model.init(0)
        mode = ForwardMode(indexer_loss=True)
        jaxpr = jax.make_jaxpr(
            lambda p: model.apply(p, buffers, tokens, positions, segments, mode=mode)[0]
        )(params).jaxpr
        return scan_lengths(jaxpr)

    default, windowed = loop_lengths(()), loop_lengths(("partial_bytes=1", "min_window=16"))
    assert 3 not in default and windowed[3] == 1
    assert windowed - collections.Counter({3: 1}) == default - collections.Counter({1: 1})


def test_auto_takes_the_tpu_kernels_on_a_tpu_where_they_apply():
    wide = MSAConfig(index_heads=2, index_head_dim=128, block_size=128, topk_blocks=2)
    q, k, _, index_q, _ = operands()
    q, k, index_q = (jnp.pad(x, [(0, 0)] * 3 + [(0, 96)]) for x in (q, k, index_q))  # Dh 128
    with target.ahead_of_time([A_TPU]):
        assert attention_ops.msa_backend("auto", wide, q, k, index_q) is msa_tpu
        assert attention_ops.msa_backend("pallas", wide, q, k, index_q) is msa_tpu
        narrow = operands()  # head_dim 32: not lane-dense
        assert attention_ops.msa_backend("auto", MSA, narrow[0], narrow[1], narrow[3]) is msa_xla
        with pytest.raises(ValueError, match="attention_impl='pallas'.*head_dim=32"):
            attention_ops.msa_backend("pallas", MSA, narrow[0], narrow[1], narrow[3])
        assert attention_ops.msa_backend("xla", wide, q, k, index_q) is msa_xla


def test_msa_layer_on_a_tpu_selects_with_the_tpu_kernel():
    """The layer m3-train runs, on a mocked TPU: `top_blocks` is the Mosaic selection kernel
    (interpreted here), with the reference's result."""
    wide = MSAConfig(index_heads=2, index_head_dim=128, block_size=128, topk_blocks=2)
    q, k, v, index_q, index_k = (
        jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 96)]) for x in operands(jnp.float32)
    )  # head dims 128
    segments, positions = jnp.ones((1, 100), jnp.int32), jnp.arange(100)[None]
    kernel = mock.Mock(wraps=msa_tpu.tpu_selection.top_blocks)
    with target.ahead_of_time([A_TPU]), \
            mock.patch.object(msa_tpu, "_interpret", lambda interpret: True), \
            mock.patch.object(msa_tpu.tpu_selection, "top_blocks", kernel):  # fmt: skip
        backend = attention_ops.msa_backend("auto", wide, q, k, index_q)
        *_, blocks = attention_ops.msa_layer(
            backend, wide, q, k, v, index_q, index_k, segments, positions,
            dense_phase=False, student=None, with_blocks=True,
        )  # fmt: skip
    assert backend is msa_tpu and kernel.call_count == 1
    expected = msa_reference.top_blocks(index_q, index_k, segments, positions, block_size=128,
                                        topk_blocks=2, local_blocks=1)  # fmt: skip
    np.testing.assert_array_equal(blocks, expected)


def test_pallas_refuses_a_block_that_does_not_split():
    q, k, _, index_q, _ = operands(jnp.float32)
    odd = MSAConfig(index_heads=2, index_head_dim=32, block_size=33, topk_blocks=2)
    with pytest.raises(ValueError, match="block_size=33"):
        attention_ops.msa_backend("pallas", odd, q, k, index_q)


class CountingBackend:
    """The XLA backend, counting its sparse-attention calls."""

    sparse_calls = 0

    def __getattr__(self, name):
        return getattr(msa_xla, name)

    def sparse_attention(self, *args, **kwargs):
        self.sparse_calls += 1
        return msa_xla.sparse_attention(*args, **kwargs)


@pytest.mark.parametrize("seq, sparse", [(64, False), (100, True)])
def test_msa_layer_is_dense_attention_while_every_block_is_kept(seq, sparse):
    q, k, v, index_q, index_k = operands(jnp.float32, seq)
    segments = jnp.ones((1, seq), jnp.int32)
    positions = jnp.arange(seq)[None]
    backend = CountingBackend()
    out, kl, blocks = attention_ops.msa_layer(
        backend, MSA, q, k, v, index_q, index_k, segments, positions,
        dense_phase=False, student=(index_q, index_k), with_blocks=True,
    )  # fmt: skip
    assert (backend.sparse_calls > 0) == sparse and blocks.shape == (1, seq, 2, 2)
    expected = msa_reference.sparse_attention(
        q, k, v, blocks, segments, positions, block_size=32, student=(index_q, index_k)
    )
    np.testing.assert_allclose(out, expected[0], atol=1e-5)
    np.testing.assert_allclose(kl, expected[1], atol=1e-5)


@pytest.mark.slow
def test_model_loss_and_gradients_equal_with_kernels_and_xla():
    """The tiny model (MSA selection active) through the Pallas kernels (interpreted) and the XLA
    path: the same training loss and the same gradient of every parameter."""
    batch = 2, 48
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 272, batch), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(20), np.arange(28)])[None].repeat(2, 0))
    segments = jnp.asarray(np.array([1] * 20 + [2] * 28)[None].repeat(2, 0), jnp.int32)
    mode = ForwardMode(indexer_loss=True)
    results = []
    for impl in ("xla", "pallas"):
        model = functional(tiny_run(model={"attention_impl": impl}).model)
        params, buffers = model.init(0)

        def loss(params):
            logits, stats = model.apply(params, buffers, tokens, positions, segments, mode=mode)
            kl = sum(s.msa.kl.sum() for s in stats if s.msa is not None)
            return jnp.mean(jax.nn.logsumexp(logits, -1)) + kl

        results.append(jax.value_and_grad(loss)(params))
    (value_xla, grads_xla), (value_pallas, grads_pallas) = results
    np.testing.assert_allclose(value_pallas, value_xla, rtol=1e-5)
    for g, e in zip(jax.tree.leaves(grads_pallas), jax.tree.leaves(grads_xla)):
        np.testing.assert_allclose(g, e, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "remat, forward_runs", [("full", 2), ("save_attention", 1), ("save_attention_dots", 1)]
)
def test_save_attention_remat_runs_the_msa_kernels_forward_once(remat, forward_runs):
    """`model.remat=save_attention` (and `save_attention_dots`) keeps the MSA kernels' attention
    outputs for the backward pass (`full` recomputes them: the LSE and forward kernels run twice a
    step), with the gradients of no rematerialisation. The selection is recomputed under all."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 272, (1, 48)), jnp.int32)
    positions, segments = jnp.arange(48)[None], jnp.ones((1, 48), jnp.int32)
    mode = ForwardMode(indexer_loss=True)

    def gradient(remat):
        model = functional(tiny_run(model={"attention_impl": "pallas", "remat": remat}).model)
        params, buffers = model.init(0)

        def loss(params):
            logits, stats = model.apply(params, buffers, tokens, positions, segments, mode=mode)
            kl = sum(s.msa.kl.sum() for s in stats if s.msa is not None)
            return jnp.mean(jax.nn.logsumexp(logits, -1)) + kl

        return jax.grad(loss), params

    grad, params = gradient(remat)
    runs = kernel_calls(jax.make_jaxpr(grad)(params).jaxpr)
    assert runs == {"msa_select": 2, "msa_lse": forward_runs, "msa_forward": forward_runs,
                    "msa_backward": 1}  # fmt: skip
    plain, _ = gradient("none")
    for g, e in zip(jax.tree.leaves(grad(params)), jax.tree.leaves(plain(params))):
        np.testing.assert_allclose(g, e, atol=1e-6)


"""Multi-token prediction modules: what each position sees, packed-row boundaries, and the trunk
left as it is (training with them: tests/pretrain/test_mtp_training.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from tiny import tiny_run

from batch_format.batch import make_batch
from m3jax.model import functional
from m3jax.mtp import depth_segment_ids, shifted
from pretrain.loss import mtp_targets

RUN = tiny_run(model={"mtp": {"num_modules": 2}})


def mtp_logits(params, buffers, tokens, segment_ids):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    model = functional(RUN.model)
    _, _, outputs = model.apply_normed_with_mtp(params, buffers, tokens, positions, segment_ids)
    return [np.asarray(model.head(params, buffers, out.normed)) for out in outputs]


def test_mtp_module_i_at_position_s_sees_tokens_up_to_s_plus_i_plus_1():
    params, buffers = functional(RUN.model).init(0)
    tokens = jax.random.randint(jax.random.key(0), (1, 24), 0, 263)
    segments = jnp.ones_like(tokens)
    before = mtp_logits(params, buffers, tokens, segments)
    after = mtp_logits(params, buffers, tokens.at[0, 10].set((tokens[0, 10] + 1) % 263), segments)
    for depth in (0, 1):
        changed = np.abs(after[depth] - before[depth]).max(-1)[0] > 1e-6  # [S]
        first = 10 - depth - 1  # module `depth` at s reads token s + depth + 1
        assert not changed[:first].any() and changed[first], depth


def test_mtp_segments_end_before_the_next_piece_and_targets_look_ahead():
    segment_ids = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(depth_segment_ids(segment_ids, 0), [[1, 1, 1, 0, 2, 2, 0, 0]])
    np.testing.assert_array_equal(depth_segment_ids(segment_ids, 1), [[1, 1, 0, 0, 2, 0, 0, 0]])
    unread = jnp.zeros((1, 8), jnp.int32)
    batch = make_batch(tokens=unread, positions=unread, segment_ids=segment_ids,
                       targets=jnp.arange(8)[None] + 10,
                       loss_mask=jnp.array([[1, 1, 0, 1, 1, 1, 1, 0]], jnp.float32))  # fmt: skip
    targets, weight = mtp_targets(batch, 0)
    np.testing.assert_array_equal(targets, [[11, 12, 13, 14, 15, 16, 17, 0]])
    np.testing.assert_array_equal(weight, [[1, 0, 1, 0, 1, 1, 0, 0]])  # target 12 has no loss
    np.testing.assert_array_equal(shifted(jnp.arange(4)[None], 3, fill=-1), [[3, -1, -1, -1]])


def test_mtp_modules_leave_the_trunk_unchanged():
    plain = functional(tiny_run().model)
    params, buffers = functional(RUN.model).init(0)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 263)
    segment_ids = jnp.ones_like(tokens).at[:, 20:].set(2)
    inputs = (tokens, jnp.broadcast_to(jnp.arange(32), tokens.shape), segment_ids)
    model = functional(RUN.model)
    normed, _, outputs = model.apply_normed_with_mtp(params, buffers, *inputs)
    with_mtp = model.head(params, buffers, normed)
    trunk_params = {k: v for k, v in params.items() if k != "mtp"}
    trunk_buffers = {k: v for k, v in buffers.items() if k != "mtp"}
    without, _ = plain.apply(trunk_params, trunk_buffers, *inputs)
    np.testing.assert_allclose(with_mtp, without, rtol=0, atol=1e-6)
    assert len(outputs) == 2 and outputs[1].normed.shape == normed.shape

"""The XLA path's training step holds nothing quadratic in the sequence length.

Its attention and selection work in query tiles, so every array of the step (forward and
backward, inside the layer scan and the tile loops) grows at most linearly with S. One way this
broke: JAX's partial evaluation of the layer scan hoisted the key masks of the selection's tiles
(they depend on segment ids and positions only) out of the tile loop, stacking them into
[S, Hi, T] bools. The test walks the step's jaxpr at two lengths and names any value that grew
quadratically.
"""

import jax
import numpy as np
from jaxpr_values import value_sizes
from tiny import tiny_run

from batch_format.batch import make_batch
from m3jax.attention import ForwardMode
from m3jax.model import functional
from pretrain.optimizer import learning_rate, make_optimizer
from pretrain.train_step import init_state, make_train_step

LENGTHS = (256, 512)  # several query tiles at both (the XLA paths' tiles are 64 and 128 queries)


def step_values(seq: int) -> dict[str, tuple[int, str]]:
    run = tiny_run(data={"seq_len": seq, "batch_size": 1}, model={"attention_impl": "xla"})
    model = functional(run.model)
    optimizer = make_optimizer(run.optimizer, run.train.steps, model.param_axes)
    step = make_train_step(model, optimizer, learning_rate(run.optimizer, run.train.steps), run)
    state = jax.eval_shape(lambda: init_state(model, optimizer, seed=0))
    rows = jax.ShapeDtypeStruct((1, seq), np.int32)
    batch = make_batch(tokens=rows, targets=rows, positions=rows, segment_ids=rows,
                       loss_mask=jax.ShapeDtypeStruct((1, seq), np.float32))  # fmt: skip
    for mode in (ForwardMode(indexer_loss=True), ForwardMode(indexer_loss=True, block_recall=True)):
        jaxpr = jax.make_jaxpr(lambda s, b, mode=mode: step(s, b, mode))(state, batch)
        yield mode, value_sizes(jaxpr.jaxpr)


def test_no_value_of_the_training_step_grows_quadratically_with_the_sequence():
    for (mode, short), (_, long) in zip(step_values(LENGTHS[0]), step_values(LENGTHS[1])):
        assert short.keys() == long.keys()  # the same program at both lengths
        quadratic = [f"{long[k][1]} at {k}" for k in long if long[k][0] > 3 * max(short[k][0], 1)]
        assert not quadratic, f"{mode}: {len(quadratic)} values grow as S², e.g. {quadratic[:3]}"

"""Gradient accumulation: a step's batch as k micro-batches whose losses, gradients and metrics add
up to the whole batch's, so the update is the one of the whole batch at 1/k of the activations.

The loss function normalises every mean by the whole batch's totals (pretrain/loss.py:
loss_totals), which is what makes the parts add up; the exception is the optional MoE balance
loss, a product of two batch means, taken per micro-batch and averaged. Router loads add up too,
so the correction biases move by the whole batch's load.

Micro-batch m holds rows m, m + k, m + 2k, ...: rows are sharded over the data-parallel devices in
contiguous blocks, so with B / k a multiple of the data-parallel size each device keeps its own
rows and no micro-batch needs data from another device. The micro-batches run under `lax.scan`:
one compiled copy of the forward and backward pass, whatever k.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from batch_format.batch import Batch


def micro_batches(batch: Batch, parts: int) -> Batch:
    """Every [B, ...] array of the batch (its vision part's too) -> [parts, B / parts, ...]:
    micro-batch m holds rows m, m + parts, ..."""

    def split(x):
        rows = x.shape[0]
        return jnp.swapaxes(x.reshape(rows // parts, parts, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def accumulated(fn: Callable, parts: int) -> Callable:
    """`fn(params, buffers, batch, mode, totals)` over `parts` micro-batches of batch, its outputs
    summed (every leaf must add up: the loss function's loss, metrics and loads, gradients);
    `fn` itself when parts is 1. The training step accumulates gradients with it, the
    evaluation its forward pass."""
    if parts == 1:
        return fn

    def run(params, buffers, batch, mode, totals):
        micro = micro_batches(batch, parts)

        def part_out(part):
            return fn(params, buffers, part, mode, totals)

        def add(carry, part):
            return jax.tree.map(jnp.add, carry, part_out(part)), None

        shapes = jax.eval_shape(part_out, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, _ = jax.lax.scan(add, zeros, micro)
        return total

    return run

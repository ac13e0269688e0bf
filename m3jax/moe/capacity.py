"""The capacity exchange of expert parallelism (capacity dispatch; `moe.exchange` does not apply).

`jax.lax.all_to_all` of the fixed [E, C, D] capacity buffers (C per expert and source device,
local.capacity over the device's N tokens), one batched einsum over the [E/Ep, Ep·C, D] buffers
received, the same all_to_all back. Rows past C are dropped and counted.

Shapes: E experts (all), C capacity (rows per expert and source device), D model width, Ep
expert-parallel devices.
"""

import jax

from m3jax.sharding import EXPERT_AXIS


def exchange(buffers: jax.Array, *, local) -> jax.Array:
    """[E, C, D] capacity buffers -> the experts' outputs [E, C, D], across devices."""
    parts = jax.lax.axis_size(EXPERT_AXIS)
    num_experts, size, dim = buffers.shape
    local_experts = num_experts // parts
    sent = buffers.reshape(parts, local_experts * size, dim)
    received = jax.lax.all_to_all(sent, EXPERT_AXIS, 0, 0, tiled=True)  # [Ep(source), E/Ep·C, D]
    received = received.reshape(parts, local_experts, size, dim).transpose(1, 0, 2, 3)
    y = local(received.reshape(local_experts, parts * size, dim))
    y = y.reshape(local_experts, parts, size, dim).transpose(1, 0, 2, 3)
    y = jax.lax.all_to_all(y.reshape(parts, -1, dim), EXPERT_AXIS, 0, 0, tiled=True)
    return y.reshape(num_experts, size, dim)

"""Stacked copies of one layer: created under `nnx.vmap`, applied in order under `lax.scan`.

The text decoder (runs of identical decoder layers) and the ViT (identical encoder layers) both use
this, so compile time does not grow with depth. Every parameter of a stacked layer gets a leading
"layers" logical axis.

Shapes: L layers.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.moe.local import EXPERT_PROJECTIONS
from pallas_kernels.msa.reference import SAVED_BY_ANY_REMAT, SAVED_BY_REMAT

_names = jax.checkpoint_policies.save_only_these_names
_dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
_both = jax.checkpoint_policies.save_from_both_policies

# Every policy saves the MSA kernels' LSEs (SAVED_BY_ANY_REMAT: small), so that no recompute runs
# the Mosaic forward's KL passes for them
REMAT_POLICIES = {
    "full": _names(SAVED_BY_ANY_REMAT),
    "save_dots": _both(_dots, _names(SAVED_BY_ANY_REMAT)),
    # recompute all but the MSA kernels' attention outputs (projections recomputed)
    "save_attention": _names(SAVED_BY_REMAT, SAVED_BY_ANY_REMAT),
    # and every dot without batch dimensions (projections, router, shared expert): 1.03x
    # save_attention's step on bench-h200, peak <= 93 GB against 84 (benchmarks/RESULTS.md)
    "save_attention_dots": _both(_dots, _names(SAVED_BY_REMAT, SAVED_BY_ANY_REMAT)),
    # and the routed experts' gate and up products (grouped matmuls, which no dot policy sees):
    # the backward runs one of a layer's expert products again instead of three
    "save_attention_dots_experts": _both(
        _dots, _names(SAVED_BY_REMAT, SAVED_BY_ANY_REMAT, EXPERT_PROJECTIONS)
    ),
}


def stacked_layers(
    make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs
) -> nnx.Module:
    """`num_layers` independent initialisations of `make_layer`, parameters stacked on axis 0."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(rngs)

    layers = create(rngs)
    for _, variable in nnx.iter_graph(layers):
        if isinstance(variable, nnx.Variable):
            axes = variable.get_metadata()["logical_axes"]
            variable.set_metadata(logical_axes=("layers", *axes))
    return layers


def scan_layers(
    layers: nnx.Module,
    x: jax.Array,
    step: Callable[[nnx.Module, jax.Array], tuple[jax.Array, Any]],
    remat: str,
    projection_dtype: jnp.dtype | None = None,
    per_layer: Any = None,
) -> tuple[jax.Array, Any]:
    """Runs `step(layer, x) -> (x, per-layer output)` over the stack; outputs stacked over layers.
    per_layer: None, or a pytree of arrays with a leading layer axis whose slices the step takes
    as a third argument, `step(layer, x, slice)` (the MSA layers' KL sinks, m3jax/attention.py).

    remat: one of REMAT_POLICIES' names, or "none" (what the backward pass recomputes per
    layer). projection_dtype: the dtype every layer casts its `*_proj` weights to at use (the
    activations'; None: no cast here): they are cast once for the whole stack before the scan,
    so the backward's recompute does not cast them again and the scan stacks their gradients in
    that dtype (the values are the same: each layer's gradient was rounded to it by the cast in
    the layer): 8.7 ms of a bench-h200 step on an H200 (benchmarks/RESULTS.md).
    """
    graphdef, state = nnx.split(layers)
    if projection_dtype is not None:
        state = jax.tree_util.tree_map_with_path(
            lambda path, w: w.astype(projection_dtype) if _is_projection(path) else w, state
        )

    def body(x, scanned):
        layer_state, extra = scanned
        layer = nnx.merge(graphdef, layer_state)
        return step(layer, x) if per_layer is None else step(layer, x, extra)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, x, (state, per_layer))


def _is_projection(path) -> bool:
    """Whether a state leaf is a `*_proj` weight (attention, MLP and expert projections: the
    matrices the layers multiply in the activations' dtype; the router and norms stay fp32)."""
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    return bool(names) and str(names[-1]).endswith("_proj")

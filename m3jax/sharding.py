"""Logical axis names -> mesh axes: the one table that decides how m3jax is sharded.

Mesh axes (always all five; a size-1 axis costs nothing): data, fsdp, expert, seq, tensor.
Parameters carry logical names (m3jax/params.py); `RULES` maps each name to mesh axes. A dimension
that its mesh axes do not divide is replicated instead (e.g. 4 kv heads on tensor=8), so every
config runs on every mesh; the choice is visible in `describe`. Of several mesh axes, the longest
leading part that divides a dimension shards it.
"""

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import target

DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, SEQ_AXIS, TENSOR_AXIS = "data", "fsdp", "expert", "seq", "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, SEQ_AXIS, TENSOR_AXIS)

RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # outside the experts, the expert axis is data parallel
    ("seq", ("seq",)),
    # FSDP over the expert axis too: outside the experts it is data parallel (a weight whose
    # expert dim takes `expert` keeps fsdp alone)
    ("embed", ("fsdp", "expert")),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("layers", ()),
    ("head_dim", ()),
    ("norm", ()),
    ("patch", ()),  # the C·T·P·P = 1176 pixel features of a patch row (vision patch embedding)
)


def make_mesh(axis_sizes: Mapping[str, int], devices: list | None = None) -> Mesh:
    """A mesh over all devices with axes MESH_AXES; one size may be -1 (= whatever is left)."""
    devices = target.devices() if devices is None else devices
    sizes = [axis_sizes.get(name, 1) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(size for size in sizes if size != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"found {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def partition_spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Logical axes of one array -> PartitionSpec, replicating dims their mesh axes don't divide."""
    rules = dict(RULES)
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape, strict=True):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule in m3jax.sharding.RULES")
        mesh_axes = tuple(a for a in rules.get(name, ()) if a not in used and mesh.shape[a] > 1)
        while mesh_axes and dim % math.prod(mesh.shape[a] for a in mesh_axes):
            mesh_axes = mesh_axes[:-1]  # the longest leading part of the axes that divides dim
        if not mesh_axes:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def tree_shardings(axes_tree, shapes_tree, mesh: Mesh):
    """NamedShardings for a pytree, from its logical axes tree (tuples as leaves) and shapes."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, partition_spec(axes, x.shape, mesh)),
        axes_tree,
        shapes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of [B, S] input arrays: rows over the data-parallel axes, sequence over seq."""
    return NamedSharding(mesh, PartitionSpec(dict(RULES)["batch"], dict(RULES)["seq"]))


def constrain_activations(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """x [B, S, ...] laid out like the batch (rows over data, fsdp, expert; sequence over seq;
    the rest whole), at a block boundary. GSPMD left alone may carry a layer scan's activations
    (and their cotangents) sharded like the weights instead, and then regather them whole.
    mesh None: one device, nothing to say."""
    if mesh is None:
        return x
    spec = partition_spec(("batch", "seq") + (None,) * (x.ndim - 2), x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def per_device_rows(fn, mesh: Mesh | None, rows: int):
    """`fn` over arrays whose axis 0 is the batch, run on each device's rows (`jax.shard_map` over
    the batch mesh axes), where the mesh splits the batch alone and `rows` divide. Attention's
    query-tiled loops otherwise leave GSPMD to guess the layout of their carries (measured with
    m3-plan at M3's shape: gradient buffers of the whole global batch, all-reduced per query
    tile). Elsewhere (one device, seq or tensor > 1, rows not divisible) `fn` itself."""
    if mesh is None or mesh.shape["seq"] > 1 or mesh.shape["tensor"] > 1:
        return fn
    axes = tuple(a for a in dict(RULES)["batch"] if mesh.shape[a] > 1)
    if not axes or rows % math.prod(mesh.shape[a] for a in axes):
        return fn
    rows_spec = PartitionSpec(axes)
    # check_vma off: every operand and result is split over the same axes (kernels inside drop
    # the varying type, see pallas_kernels/shard_map.vary_like)
    return jax.shard_map(fn, mesh=mesh, in_specs=rows_spec, out_specs=rows_spec, check_vma=False)


def bytes_per_device(shapes_tree, shardings_tree) -> int:
    """Bytes each device holds of a pytree of arrays (or ShapeDtypeStructs) under its shardings
    (NamedShardings on a Mesh or an AbstractMesh: a plan needs no devices)."""
    leaves = jax.tree.leaves(shapes_tree)
    shardings = jax.tree.leaves(shardings_tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    return sum(
        math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x, s in zip(leaves, shardings, strict=True)
    )

"""Logical-axis sharding rules, and that the train step computes the same thing on any mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from data.text_corpus import load_documents
from data.text_loader import PackedTextLoader
from data.tokenizer import ByteTokenizer
from m3jax import sharding
from m3jax.config_loading import ConfigError
from m3jax.model import functional
from pretrain.session import TrainingSession
from tiny import tiny_run, tiny_vision_run


def test_make_mesh_fills_the_minus_one_axis():
    mesh = sharding.make_mesh({"data": -1, "tensor": 2})
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "seq": 1, "tensor": 2}


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"data": 3}, "needs 3 devices, found 4"),
        ({"data": -1, "fsdp": 3}, "not divisible by 3"),
        ({"data": -1, "fsdp": -1}, "at most one axis may be -1"),
    ],
)
def test_make_mesh_rejects_impossible_shapes(sizes, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(sizes)


def test_partition_spec_maps_names_and_replicates_what_does_not_divide():
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": 1})
    assert sharding.partition_spec(
        ("embed", "heads", "head_dim"), (8, 4, 16), mesh
    ) == PartitionSpec("fsdp", "tensor", None)
    assert sharding.partition_spec(
        ("embed", "kv_heads", "head_dim"), (8, 1, 16), mesh
    ) == PartitionSpec("fsdp", None, None)
    assert sharding.partition_spec(
        ("layers", "expert", "embed", "mlp"), (3, 4, 8, 6), mesh
    ) == PartitionSpec(None, None, "fsdp", "tensor")
    assert sharding.partition_spec(("embed", None), (8, 4), mesh) == PartitionSpec("fsdp", None)
    with pytest.raises(ValueError, match="logical axis 'bogus' has no rule"):
        sharding.partition_spec(("bogus",), (4,), mesh)


def test_partition_spec_never_uses_a_mesh_axis_twice():
    mesh = sharding.make_mesh({"tensor": 4, "data": 1})
    assert sharding.partition_spec(("heads", "mlp"), (8, 8), mesh) == PartitionSpec("tensor", None)


@pytest.mark.parametrize("run", [tiny_run(), tiny_vision_run()], ids=["text", "vision"])
def test_every_weight_of_the_model_is_split_over_the_mesh(run):
    """On fsdp=2 x tensor=2 (tiny dims all even), every parameter but the norms' is split: a
    weight tagged without its logical names (None) or with a name whose rule is empty would be
    replicated whole on every device."""
    model = functional(run.model)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2})
    shapes, _ = model.shapes()
    shardings = sharding.tree_shardings(model.param_axes, shapes, mesh)
    axes = jax.tree.leaves(model.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    for names, shape, split in zip(
        axes, jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True
    ):
        if names[-1] == "norm":
            assert split.is_fully_replicated, names
        else:
            assert split.shard_shape(shape.shape) != shape.shape, (names, split.spec)


def losses_on_mesh(mesh: dict, steps: int = 3, **sections) -> list[float]:
    run = tiny_run(mesh=mesh, **sections)
    session = TrainingSession(functional(run.model), run, checkpoints=None)
    session.initialize()
    documents = load_documents("shakespeare")[:20]
    loader = PackedTextLoader(documents, ByteTokenizer(), seq_len=32, batch_size=4, seed=0)
    return [
        float(session.step(next(loader), session.forward_mode(i + 1))["loss"]) for i in range(steps)
    ]


@pytest.mark.slow
def test_train_step_gives_the_same_losses_on_every_mesh():
    reference = losses_on_mesh({"data": 4})
    for mesh in (
        {"data": 1, "fsdp": 4},
        {"data": 2, "tensor": 2},
        {"data": 1, "expert": 2, "fsdp": 2},
    ):
        np.testing.assert_allclose(losses_on_mesh(mesh), reference, rtol=2e-5, err_msg=str(mesh))


def test_session_rejects_experts_that_the_expert_axis_does_not_divide():
    """mesh.expert = -1 resolves to 4 devices only here, after the config has loaded."""
    run = tiny_run(model={"moe": {"num_experts": 6}}, mesh={"data": 1, "expert": -1})
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by mesh.expert=4"):
        TrainingSession(functional(run.model), run, checkpoints=None)

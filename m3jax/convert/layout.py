"""Every m3jax array, named and shaped as in MiniMax's upstream safetensors layout (spec §7.1).

`tensor_specs(config)` lists one `TensorSpec` per upstream tensor: its name and shape, and which
slice of which m3jax leaf holds it. Our leaves differ from upstream in three ways: layers of one
kind are stacked (leading layer axis) and so are experts; projections keep heads as an axis
([D, H, Dh] rather than [H·Dh, D]); and kernels are [in, out] where torch's Linear is [out, in].
`to_upstream` / `from_upstream` convert one slice; both are exact inverses (reshapes and one
transpose), so export then import is bit-exact.

Leaf paths start at the model's variables: ("params", "stacks", 0, "layers", "attention",
"q_proj"), ("buffers", ...). Shapes: D width, H heads, Dh head dim, E experts, F MLP width.
"""

import dataclasses
import math

import jax
import numpy as np

from m3jax.config import ModelConfig
from m3jax.model import functional, layer_runs

LeafPath = tuple  # of str (dict keys) and int (stack numbers)

TEXT = "language_model.model."
VISION = "vision_tower.vision_model."

# Per decoder layer: our path inside a stack's "layers" -> (upstream name after "layers.{i}.",
# split). split = number of leading "in" axes of a kernel: the slice is reshaped to
# [prod(in), prod(out)] and transposed to torch's [out, in]; None = no transpose (norm weights).
ATTENTION = {
    ("input_norm", "scale"): ("input_layernorm.weight", None),
    ("post_attention_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("attention", "q_proj"): ("self_attn.q_proj.weight", 1),  # [D, H, Dh] -> [H·Dh, D]
    ("attention", "k_proj"): ("self_attn.k_proj.weight", 1),
    ("attention", "v_proj"): ("self_attn.v_proj.weight", 1),
    ("attention", "o_proj"): ("self_attn.o_proj.weight", 2),  # [H, Dh, D] -> [D, H·Dh]
    ("attention", "q_norm", "scale"): ("self_attn.q_norm.weight", None),
    ("attention", "k_norm", "scale"): ("self_attn.k_norm.weight", None),
    ("attention", "indexer", "q_proj"): ("self_attn.index_q_proj.weight", 1),
    ("attention", "indexer", "k_proj"): ("self_attn.index_k_proj.weight", 1),
    ("attention", "indexer", "q_norm", "scale"): ("self_attn.index_q_norm.weight", None),
    ("attention", "indexer", "k_norm", "scale"): ("self_attn.index_k_norm.weight", None),
}
DENSE_MLP = {
    ("mlp", "gate_proj"): ("mlp.gate_proj.weight", 1),
    ("mlp", "up_proj"): ("mlp.up_proj.weight", 1),
    ("mlp", "down_proj"): ("mlp.down_proj.weight", 1),
}
MOE = {
    ("mlp", "router"): ("block_sparse_moe.gate.weight", 1),  # [D, E] -> [E, D]
    ("mlp", "correction_bias"): ("block_sparse_moe.e_score_correction_bias", None),  # a buffer
    ("mlp", "shared_expert", "gate_proj"): ("block_sparse_moe.shared_experts.gate_proj.weight", 1),
    ("mlp", "shared_expert", "up_proj"): ("block_sparse_moe.shared_experts.up_proj.weight", 1),
    ("mlp", "shared_expert", "down_proj"): ("block_sparse_moe.shared_experts.down_proj.weight", 1),
}
EXPERTS = {  # leaves with an expert axis: one upstream tensor per (layer, expert)
    ("mlp", "gate_proj"): ("block_sparse_moe.experts.{expert}.w1.weight", 1),
    ("mlp", "up_proj"): ("block_sparse_moe.experts.{expert}.w3.weight", 1),
    ("mlp", "down_proj"): ("block_sparse_moe.experts.{expert}.w2.weight", 1),
}
MTP = {  # an MTP module's own leaves besides its decoder layer (m3jax/mtp.py)
    ("embed_norm", "scale"): ("enorm.weight", None),
    ("hidden_norm", "scale"): ("hnorm.weight", None),
    ("projection",): ("eh_proj.weight", 1),  # [2D, D] -> [D, 2D]: embedding half first
    ("final_norm", "scale"): ("norm.weight", None),
}
# Vision encoder layer and projector: Linear modules (kernel [in..., out...] + bias) and norms.
VISION_LAYER = {
    ("norm1",): "layer_norm1",
    ("norm2",): "layer_norm2",
    ("attention", "q_proj"): "self_attn.q_proj",
    ("attention", "k_proj"): "self_attn.k_proj",
    ("attention", "v_proj"): "self_attn.v_proj",
    ("attention", "out_proj"): "self_attn.out_proj",
    ("mlp", "fc1"): "mlp.fc1",
    ("mlp", "fc2"): "mlp.fc2",
}
PROJECTOR = {
    ("linear_1",): "multi_modal_projector.linear_1",
    ("linear_2",): "multi_modal_projector.linear_2",
    ("merge_1",): "patch_merge_mlp.linear_1",
    ("merge_2",): "patch_merge_mlp.linear_2",
}
MODULE_PARTS = {"kernel": "weight", "bias": "bias", "scale": "weight"}  # Linear and LayerNorm


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One upstream tensor = leaf[index], converted (see the module docstring)."""

    name: str  # upstream name, e.g. "language_model.model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # upstream shape
    leaf: LeafPath
    index: tuple[int, ...]  # leading indices into the leaf: (layer in stack[, expert])
    slice_shape: tuple[int, ...]  # shape of leaf[index]
    split: int | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def to_upstream(spec: TensorSpec, block: np.ndarray) -> np.ndarray:
    """leaf[spec.index] -> the upstream tensor (C-contiguous)."""
    if spec.split is None:
        return np.ascontiguousarray(block.reshape(spec.shape))
    rows = math.prod(spec.slice_shape[: spec.split])
    return np.ascontiguousarray(block.reshape(rows, -1).T.reshape(spec.shape))


def from_upstream(spec: TensorSpec, tensor: np.ndarray) -> np.ndarray:
    """The upstream tensor -> the value of leaf[spec.index]."""
    if spec.split is None:
        return tensor.reshape(spec.slice_shape)
    rows = math.prod(spec.slice_shape[: spec.split])
    return tensor.reshape(-1, rows).T.reshape(spec.slice_shape)


def leaf_shapes(config: ModelConfig) -> dict[LeafPath, tuple[int, ...]]:
    """Shape of every m3jax leaf (params and buffers), from the model structure alone."""
    params, buffers = functional(config).shapes()
    tree = {"params": params, "buffers": buffers}
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key(k) for k in path): tuple(leaf.shape) for path, leaf in flat}


def nested(leaves: dict[LeafPath, object]) -> dict:
    """{leaf path: array} -> the nested {"params": ..., "buffers": ...} dicts."""
    tree: dict = {}
    for leaf, value in leaves.items():
        node = tree
        for key in leaf[:-1]:
            node = node.setdefault(key, {})
        node[leaf[-1]] = value
    return tree


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """All upstream tensors of the model, in a stable order (text, then vision and projector).

    Raises ValueError if some m3jax leaf has no upstream name (a new layer without a rule here).
    """
    shapes = leaf_shapes(config)
    specs = _text_specs(config, shapes)
    if config.vision is not None:
        specs += _vision_specs(config, shapes)
    covered = {spec.leaf for spec in specs}
    if uncovered := sorted(map(str, set(shapes) - covered)):
        raise ValueError(f"m3jax leaves without an upstream tensor name: {uncovered}")
    return specs


def _text_specs(config: ModelConfig, shapes: dict) -> list[TensorSpec]:
    specs = [
        _spec(TEXT + "embed_tokens.weight", ("params", "embed"), (), None, shapes, flatten=False),
        _spec(TEXT + "norm.weight", ("params", "final_norm", "scale"), (), None, shapes),
        _spec("language_model.lm_head.weight", ("params", "lm_head"), (), 1, shapes),
    ]
    first_layer = 0
    for stack, (_, mlp_type, count) in enumerate(layer_runs(config)):
        for i in range(count):
            prefix = f"{TEXT}layers.{first_layer + i}."
            module = ("stacks", stack, "layers")
            specs += _layer_specs(prefix, module, (i,), mlp_type, config, shapes)
        first_layer += count
    return specs + _mtp_specs(config, shapes)


def _mtp_specs(config: ModelConfig, shapes: dict) -> list[TensorSpec]:
    """Multi-token-prediction modules under `…mtp.{i}.` (README: our naming; transformers skips
    `mtp.*`): DeepSeek-V3's enorm / hnorm / eh_proj, then the decoder layer's upstream names as
    after `layers.{i}.`, then the module's final norm."""
    specs = []
    for depth in range(config.mtp.num_modules):
        prefix, module = f"{TEXT}mtp.{depth}.", ("params", "mtp", "depths", depth)
        for rel, (name, split) in MTP.items():
            specs.append(_spec(prefix + name, (*module, *rel), (), split, shapes))
        mlp_type = config.mlp_layer_types[-1]
        specs += _layer_specs(prefix, module[1:] + ("layer",), (), mlp_type, config, shapes)
    return specs


def _layer_specs(prefix, module, index, mlp_type, config, shapes) -> list[TensorSpec]:
    """One decoder layer whose leaves sit under (collection, *module) at `index`."""
    specs = []
    rules = {**ATTENTION, **(MOE if mlp_type == "moe" else DENSE_MLP)}
    for rel, (name, split) in rules.items():
        leaf = _layer_leaf(module, rel, shapes)
        if leaf is not None:
            specs.append(_spec(prefix + name, leaf, index, split, shapes))
    if mlp_type == "moe":
        for rel, (name, split) in EXPERTS.items():
            leaf = ("params", *module, *rel)
            for expert in range(config.moe.num_experts):
                name_e = prefix + name.format(expert=expert)
                specs.append(_spec(name_e, leaf, (*index, expert), split, shapes))
    return specs


def _vision_specs(config: ModelConfig, shapes: dict) -> list[TensorSpec]:
    vision = config.vision
    patch_shape = (
        vision.hidden_size,
        vision.num_channels,
        vision.temporal_patch_size,
        vision.patch_size,
        vision.patch_size,
    )
    patch = VISION + "embeddings.patch_embedding.weight"
    specs = [
        _spec(patch, ("params", "vision", "patch_embed"), (), 1, shapes, shape=patch_shape),
        *_module_specs(VISION + "pre_layrnorm", ("params", "vision", "pre_norm"), (), shapes),
    ]
    for i in range(vision.num_layers):
        for rel, name in VISION_LAYER.items():
            leaf = ("params", "vision", "layers", *rel)
            specs += _module_specs(f"{VISION}encoder.layers.{i}.{name}", leaf, (i,), shapes)
    for rel, name in PROJECTOR.items():
        specs += _module_specs(name, ("params", "projector", *rel), (), shapes)
    return specs


def _module_specs(name: str, module: LeafPath, index: tuple, shapes: dict) -> list[TensorSpec]:
    """A Linear (kernel, bias) or LayerNorm (scale, bias) module -> its .weight and .bias."""
    specs = []
    for part, upstream in MODULE_PARTS.items():
        leaf = (*module, part)
        if leaf in shapes:
            kernel_in = len(shapes[leaf]) - len(shapes[(*module, "bias")])
            split = kernel_in if part == "kernel" else None
            specs.append(_spec(f"{name}.{upstream}", leaf, index, split, shapes))
    return specs


def _layer_leaf(module: tuple, rel: tuple, shapes: dict) -> LeafPath | None:
    for collection in ("params", "buffers"):
        leaf = (collection, *module, *rel)
        if leaf in shapes:
            return leaf
    return None


def _spec(name, leaf, index, split, shapes, *, flatten=True, shape=None) -> TensorSpec:
    slice_shape = shapes[leaf][len(index) :]
    if shape is None:
        if split is not None:
            rows = math.prod(slice_shape[:split])
            shape = (math.prod(slice_shape) // rows, rows)
        else:
            shape = (math.prod(slice_shape),) if flatten else slice_shape
    return TensorSpec(name, tuple(shape), leaf, index, tuple(slice_shape), split)


def _key(key) -> str | int:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    raise TypeError(f"unexpected pytree key {key!r}")

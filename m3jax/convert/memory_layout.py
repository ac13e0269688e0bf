"""transformers' in-memory layout (`model.state_dict()`, spec §7.2) read as the upstream layout.

Checkpoints saved from a state dict name tensors as the modules do (`model.language_model.…`,
`model.vision_tower.layers.…`) and fuse some of them: `mlp.experts.gate_up_proj` [E, 2F, D]
holds every expert's w1 (rows :F) and w3 (rows F:), `mlp.experts.down_proj` [E, D, F] every w2,
and a dense or shared MLP's `gate_up_proj.weight` [2F, D] its gate (rows :F) and up (rows F:).
`UpstreamView` presents such a source under upstream names, each a slice read lazily from the
fused tensor.
"""

import re

import numpy as np

from m3jax.convert.safetensors_io import SafetensorsDirectory

RENAMES = (  # in-memory prefix or infix -> upstream, applied in order (spec §7.2)
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^model\.language_model\.", "language_model.model."),
    (r"^model\.vision_tower\.embeddings\.proj\.",
     "vision_tower.vision_model.embeddings.patch_embedding."),
    (r"^model\.vision_tower\.layers\.", "vision_tower.vision_model.encoder.layers."),
    (r"^model\.vision_tower\.pre_layrnorm\.", "vision_tower.vision_model.pre_layrnorm."),
    (r"^model\.multi_modal_projector\.merge_linear_(\d)\.", r"patch_merge_mlp.linear_\1."),
    (r"^model\.multi_modal_projector\.linear_(\d)\.", r"multi_modal_projector.linear_\1."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
    (r"\.mlp\.(gate|experts|shared_experts)\.", r".block_sparse_moe.\1."),
    (r"\.self_attn\.indexer\.([qk])_(proj|norm)\.", r".self_attn.index_\1_\2."),
)  # fmt: skip


def is_memory_layout(names: list[str]) -> bool:
    """True if the names are transformers' in-memory ones; raises if they mix both layouts."""
    memory = [n for n in names if n.startswith("model.") or n.startswith("lm_head.")]
    upstream = [n for n in names if n.startswith(("language_model.", "vision_tower."))]
    if memory and upstream:
        raise ValueError(
            f"checkpoint mixes transformers' in-memory names ({memory[0]!r}) with upstream names "
            f"({upstream[0]!r})"
        )
    return bool(memory)


class UpstreamView:
    """A SafetensorsDirectory in the in-memory layout, read through upstream names."""

    def __init__(self, source: SafetensorsDirectory):
        self.source = source
        self._parts: dict[str, tuple[str, tuple]] = {}  # upstream -> (memory name, index)
        for name in source.names():
            for upstream, index in _split(_renamed(name), source.shape(name)):
                self._parts[upstream] = (name, index)

    def names(self) -> list[str]:
        return list(self._parts)

    def origin(self, name: str) -> str:
        """Where an upstream tensor comes from, for error messages."""
        memory, index = self._parts[name]
        where = self.source.file(memory).path
        return f"{where} ({memory}{list(index) if index else ''})"

    def shape(self, name: str) -> tuple[int, ...]:
        memory, index = self._parts[name]
        shape = self.source.shape(memory)
        return tuple(np.empty(shape, np.bool_)[index].shape) if index else shape

    def read(self, name: str) -> np.ndarray:
        memory, index = self._parts[name]
        tensor = self.source.read(memory)
        return tensor[index] if index else tensor


def _renamed(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def _split(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple]]:
    """An in-memory tensor (already renamed) -> [(upstream name, index into it)]."""
    if name.endswith(".experts.gate_up_proj"):  # [E, 2F, D]
        base, half = name.removesuffix("gate_up_proj"), shape[1] // 2
        return [
            (f"{base}{e}.{w}.weight", (e, rows))
            for e in range(shape[0])
            for w, rows in (("w1", slice(0, half)), ("w3", slice(half, None)))
        ]
    if name.endswith(".experts.down_proj"):  # [E, D, F]
        base = name.removesuffix("down_proj")
        return [(f"{base}{e}.w2.weight", (e,)) for e in range(shape[0])]
    if name.endswith(".gate_up_proj.weight"):  # dense or shared MLP [2F, D]
        base, half = name.removesuffix("gate_up_proj.weight"), shape[0] // 2
        return [
            (f"{base}gate_proj.weight", (slice(0, half),)),
            (f"{base}up_proj.weight", (slice(half, None),)),
        ]
    return [(name, ())]

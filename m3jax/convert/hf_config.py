"""transformers' MiniMax-M3-VL config.json <-> ModelConfig (spec §2).

`from_hf_config` reads what transformers 5.23 reads, with its defaults and precedence: the
upstream keys (`sparse_attention_config`, `moe_layer_freq`, top-level `rope_theta` /
`partial_rotary_factor` / `rope_scaling`) as well as transformers' own. Partial RoPE follows
`partial_rotary_factor` (transformers ignores `rotary_dim`, spec §0.2). Every other key must be
known: mapped, harmless (token ids, cache flags, ...), or pinned to the only value m3jax and
transformers implement (e.g. `n_shared_experts: 1`); anything else raises ConfigError naming it.

Training knobs (TRAINING_FIELDS: dtype, remat, the attention implementation and the MSA kernels'
settings, MoE bias update rate and balance loss weight, MTP loss weight) are not part of
config.json; a loaded config has their defaults. MiniMax's
`num_mtp_modules` is the number of multi-token-prediction modules (`mtp.num_modules`).

`to_hf_config` writes a config.json that transformers loads as
`MiniMaxM3SparseForConditionalGeneration`, with `partial_rotary_factor` and, for engines that read
MiniMax's own keys, consistent `sparse_attention_config` / `moe_layer_freq`. A text-only model
(vision None) is written without `vision_config`; transformers then builds a default, randomly
initialised vision tower, and `from_hf_config` reads such a file back as text-only.
"""

import dataclasses
from typing import Any

from m3jax.config import ModelConfig, MoEConfig, MSAConfig, MTPConfig, VisionConfig
from m3jax.config_loading import ConfigError

ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"
# our layer kinds (m3jax/config.py) -> transformers' names for them
HF_ATTENTION_TYPES = {"full": "full_attention", "msa": "minimax_m3_sparse"}
HF_MLP_TYPES = {"dense": "dense", "moe": "sparse"}
# ModelConfig fields config.json does not carry (how we train, not what the model computes).
TRAINING_FIELDS = (
    "dtype", "remat", "attention_impl", "msa_kernels", "moe.bias_update_rate",
    "moe.balance_loss_weight", "mtp.loss_weight",
)  # fmt: skip
MODEL_TYPES = {
    "top": "minimax_m3_vl",
    "text": "minimax_m3_vl_text",
    "vision": "minimax_m3_vl_vision",
}

# transformers name -> (our field path, transformers' default) (spec §2.1, §2.2).
TEXT_FIELDS = {
    "vocab_size": ("vocab_size", 200064),
    "hidden_size": ("hidden_size", 6144),
    "intermediate_size": ("moe.expert_dim", 3072),
    "dense_intermediate_size": ("dense_mlp_dim", 12288),
    "shared_intermediate_size": ("moe.shared_expert_dim", 3072),
    "num_hidden_layers": ("num_layers", 60),
    "num_attention_heads": ("num_heads", 64),
    "num_key_value_heads": ("num_kv_heads", 4),
    "head_dim": ("head_dim", 128),
    "rms_norm_eps": ("rms_norm_eps", 1e-6),
    "swiglu_alpha": ("swiglu_alpha", 1.702),
    "swiglu_limit": ("swiglu_limit", 7.0),
    "num_experts_per_tok": ("moe.experts_per_token", 4),
    "num_local_experts": ("moe.num_experts", 128),
    "routed_scaling_factor": ("moe.routed_scaling", 2.0),
    "index_n_heads": ("msa.index_heads", 4),
    "index_head_dim": ("msa.index_head_dim", 128),
    "index_block_size": ("msa.block_size", 128),
    "index_topk_blocks": ("msa.topk_blocks", 16),
    "index_local_blocks": ("msa.local_blocks", 1),
    "initializer_range": ("init_std", 0.02),
    "num_mtp_modules": ("mtp.num_modules", 0),  # transformers keeps it as a plain attribute
}
VISION_FIELDS = {
    "hidden_size": ("hidden_size", 1280),
    "intermediate_size": ("intermediate_size", 5120),
    "num_hidden_layers": ("num_layers", 32),
    "num_attention_heads": ("num_heads", 16),
    "num_channels": ("num_channels", 3),
    "patch_size": ("patch_size", 14),
    "temporal_patch_size": ("temporal_patch_size", 2),
    "spatial_merge_size": ("spatial_merge_size", 2),
    "layer_norm_eps": ("layer_norm_eps", 1e-5),
}
# Keys with no effect on the forward pass (transformers ignores them or they only concern
# tokenisation, generation, training losses or serialisation).
IGNORED = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "max_position_embeddings", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "image_size",
    "use_sparse_attention", "sparse_init_block", "sparse_score_type", "sparse_disable_index_value",
    "qk_norm_type", "model_type",
}  # fmt: skip
# Keys transformers accepts but whose other values it silently mis-implements or lacks.
PINNED = {
    "attention_dropout": (0, 0.0),
    "tie_word_embeddings": (False,),
    "n_shared_experts": (1,),
    "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,),
    "use_gemma_norm": (True,),
    "use_qk_norm": (True,),
    "attention_output_gate": (False,),
    "quantization_config": (None,),
}
TEXT_ACTIVATIONS = ("silu", "swigluoai")  # transformers forces "silu"; the math is swigluoai
SPARSE_KEYS = {  # sparse_attention_config key -> transformers field
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}


def from_hf_config(data: dict, *, where: str = "config.json") -> ModelConfig:
    """config.json contents (top level `minimax_m3_vl`, or a bare text config) -> ModelConfig."""
    if data.get("model_type", MODEL_TYPES["top"]) == MODEL_TYPES["text"]:
        return _build(ModelConfig, _text_fields(data, where, ""), where)
    _check_model_type(data, "top", where, "")
    top = dict(data)
    text = top.pop("text_config", None)
    vision = top.pop("vision_config", None)
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: 'text_config' must be a mapping, got {text!r}")
    fields = _text_fields(text, where, "text_config.")
    image = _pop_alias(top, "image_token_index", "image_token_id", 200025, where)
    video = _pop_alias(top, "video_token_index", "video_token_id", 200026, where)
    projector = top.pop("projector_hidden_size", 6144)
    merged = top.pop("merged_hidden_size", None)
    _check_rest(top, where, "")
    if vision is not None:
        vision_fields = _vision_fields(vision, where)
        vision_fields.update(
            projector_hidden_size=projector, image_token_id=image, video_token_id=video
        )
        fields["vision"] = _build(VisionConfig, vision_fields, where)
        expected = fields["hidden_size"] * fields["vision"].spatial_merge_size ** 2
        if merged is not None and merged != expected:
            raise ConfigError(
                f"{where}: merged_hidden_size={merged} is not hidden_size · spatial_merge_size² = "
                f"{expected}"
            )
    return _build(ModelConfig, fields, where)


def to_hf_config(config: ModelConfig, *, dtype: str = "float32") -> dict:
    """ModelConfig -> a config.json dict for transformers' MiniMax-M3-VL (see module docstring)."""
    text = {"model_type": MODEL_TYPES["text"]}
    for hf_name, (field, _) in TEXT_FIELDS.items():
        text[hf_name] = _get(config, field)
    partial = config.rotary_dim / config.head_dim
    sparse = [int(kind == "msa") for kind in config.layer_types]
    text.update(
        hidden_act="swigluoai",
        attention_dropout=0.0,
        tie_word_embeddings=False,
        layer_types=[HF_ATTENTION_TYPES[kind] for kind in config.layer_types],
        mlp_layer_types=[HF_MLP_TYPES[kind] for kind in config.mlp_layer_types],
        rope_theta=config.rope_theta,
        partial_rotary_factor=partial,  # the only key transformers reads for partial RoPE
        rotary_dim=config.rotary_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": partial,
        },
        sparse_attention_config={
            **{key: text[field] for key, field in SPARSE_KEYS.items()},
            "sparse_attention_freq": sparse,
        },
        moe_layer_freq=[int(kind == "moe") for kind in config.mlp_layer_types],
    )
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPES["top"],
        "dtype": dtype,
        "tie_word_embeddings": False,
        "text_config": text,
    }
    if config.vision is not None:
        vision = config.vision
        out["vision_config"] = {
            "model_type": MODEL_TYPES["vision"],
            **{hf_name: getattr(vision, field) for hf_name, (field, _) in VISION_FIELDS.items()},
            "hidden_act": "gelu",
            "attention_dropout": 0.0,
            "initializer_range": config.init_std,
            "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
        }
        out.update(
            image_token_index=vision.image_token_id,
            video_token_index=vision.video_token_id,
            projector_hidden_size=vision.projector_hidden_size,
            merged_hidden_size=config.hidden_size * vision.spatial_merge_size**2,
        )
    return out


def with_training_fields(config: ModelConfig, source: ModelConfig) -> ModelConfig:
    """`config` with the TRAINING_FIELDS of `source` (config.json leaves them at their defaults)."""
    moe = dataclasses.replace(
        config.moe,
        bias_update_rate=source.moe.bias_update_rate,
        balance_loss_weight=source.moe.balance_loss_weight,
    )
    mtp = dataclasses.replace(config.mtp, loss_weight=source.mtp.loss_weight)
    return dataclasses.replace(
        config, dtype=source.dtype, remat=source.remat, attention_impl=source.attention_impl,
        msa_kernels=source.msa_kernels, moe=moe, mtp=mtp,
    )  # fmt: skip


def _text_fields(text: dict, where: str, prefix: str) -> dict:
    """Text config mapping -> kwargs of ModelConfig (all but vision)."""
    _check_model_type(text, "text", where, prefix)
    text = dict(text)
    sparse = text.pop("sparse_attention_config", None) or {}
    moe_freq = text.pop("moe_layer_freq", None)
    for key, value in sparse.items():  # transformers lets these override the flat fields
        if key in SPARSE_KEYS:
            _agree(text, SPARSE_KEYS[key], value, where, f"{prefix}sparse_attention_config.{key}")
            text[SPARSE_KEYS[key]] = value
        elif key != "sparse_attention_freq" and key not in IGNORED:
            raise ConfigError(
                f"{where}: {prefix}sparse_attention_config.{key}={value!r} is not supported "
                "by m3jax"
            )
    if "num_experts" in text:  # transformers' alias
        _agree(text, "num_local_experts", text["num_experts"], where, prefix + "num_experts")
        text["num_local_experts"] = text.pop("num_experts")
    fields = _nested(
        {field: text.pop(key, default) for key, (field, default) in TEXT_FIELDS.items()}
    )
    layers = fields["num_layers"]
    fields["layer_types"] = _our_kinds(
        _layer_list(text, "layer_types", sparse.get("sparse_attention_freq"),
                    tuple(HF_ATTENTION_TYPES.values()), layers, where, prefix),
        HF_ATTENTION_TYPES, where, prefix + "layer_types",
    )  # fmt: skip
    fields["mlp_layer_types"] = _our_kinds(
        _layer_list(text, "mlp_layer_types", moe_freq, tuple(HF_MLP_TYPES.values()), layers,
                    where, prefix),
        HF_MLP_TYPES, where, prefix + "mlp_layer_types",
    )  # fmt: skip
    fields["rope_theta"], partial = _text_rope(text, where, prefix)
    rotary_dim = int(fields["head_dim"] * partial)
    written = text.pop("rotary_dim", None)
    if written is not None and written != rotary_dim and partial == 1.0:
        raise ConfigError(
            f"{where}: {prefix}rotary_dim={written} without partial_rotary_factor: transformers "
            f"ignores rotary_dim and rotates all head_dim={fields['head_dim']} channels; add "
            f"partial_rotary_factor={written / fields['head_dim']} (or rotary_dim={rotary_dim})"
        )
    fields["rotary_dim"] = rotary_dim
    activation = text.pop("hidden_act", "silu")
    if activation not in TEXT_ACTIVATIONS:
        raise ConfigError(
            f"{where}: {prefix}hidden_act={activation!r} is not supported (M3 uses swigluoai)"
        )
    _check_rest(text, where, prefix)
    fields["msa"] = _build(MSAConfig, fields["msa"], where)
    fields["moe"] = _build(MoEConfig, fields["moe"], where)
    fields["mtp"] = _build(MTPConfig, fields["mtp"], where)
    return fields


def _text_rope(text: dict, where: str, prefix: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) with transformers' precedence: rope_parameters (or a
    top-level rope_scaling, which replaces it) first, then top-level keys, then defaults."""
    rope = text.pop("rope_scaling", None) or text.pop("rope_parameters", None) or {}
    text.pop("rope_parameters", None)
    theta = text.pop("rope_theta", 5e6)
    partial = text.pop("partial_rotary_factor", 1.0)
    rope = dict(rope)
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"{where}: {prefix}rope_parameters.rope_type={kind!r} is not supported (only 'default')"
        )
    theta = rope.pop("rope_theta", theta)
    partial = rope.pop("partial_rotary_factor", partial)
    for key, value in rope.items():
        raise ConfigError(
            f"{where}: {prefix}rope_parameters.{key}={value!r} is not supported by m3jax"
        )
    return float(theta), float(partial)


def _vision_fields(vision: dict, where: str) -> dict:
    prefix = "vision_config."
    if not isinstance(vision, dict):
        raise ConfigError(f"{where}: 'vision_config' must be a mapping, got {vision!r}")
    _check_model_type(vision, "vision", where, prefix)
    vision = dict(vision)
    fields = {field: vision.pop(name, default) for name, (field, default) in VISION_FIELDS.items()}
    activation = vision.pop("hidden_act", "gelu")
    if activation != "gelu":
        raise ConfigError(f"{where}: {prefix}hidden_act={activation!r} is not supported ('gelu')")
    rope = dict(vision.pop("rope_parameters", None) or {})
    kind = rope.pop("rope_type", "axial")
    if kind not in ("axial", "default"):  # transformers turns "default" into "axial" here
        raise ConfigError(f"{where}: {prefix}rope_parameters.rope_type={kind!r} is not 'axial'")
    fields["rope_theta"] = float(rope.pop("rope_theta", vision.pop("rope_theta", 10000.0)))
    for key, value in rope.items():
        raise ConfigError(f"{where}: {prefix}rope_parameters.{key}={value!r} is not supported")
    vision.pop("initializer_range", None)  # one init_std for the whole model (text_config's)
    _check_rest(vision, where, prefix)
    return fields


def _our_kinds(values: list, names: dict[str, str], where: str, key: str) -> tuple[str, ...]:
    """transformers' layer kinds -> ours (`names`: ours -> theirs)."""
    ours = {theirs: our for our, theirs in names.items()}
    unknown = sorted({str(v) for v in values} - set(ours))
    if unknown:
        raise ConfigError(f"{where}: {key}: unknown kinds {unknown} (known: {sorted(ours)})")
    return tuple(ours[v] for v in values)


def _layer_list(text, name, freq, kinds, layers, where, prefix) -> list[str]:
    """layer_types / mlp_layer_types, else from the upstream 0/1 frequency list, else the default
    (every layer full attention / MoE), as transformers does."""
    values = text.pop(name, None)
    from_freq = None if freq is None else [kinds[1] if f else kinds[0] for f in freq]
    default = kinds[0] if name == "layer_types" else kinds[1]
    if values is None:
        values = from_freq if from_freq is not None else [default] * layers
    elif from_freq is not None and list(values) != from_freq:
        raise ConfigError(
            f"{where}: {prefix}{name} and its upstream 0/1 list disagree: {list(values)} vs {freq}"
        )
    if not isinstance(values, list):
        raise ConfigError(f"{where}: {prefix}{name} must be a list, got {values!r}")
    return values


def _check_rest(section: dict, where: str, prefix: str) -> None:
    """Every key left in `section` must be ignorable or hold its pinned value."""
    for key, value in section.items():
        if key in IGNORED:
            continue
        if key in PINNED:
            allowed = PINNED[key]
            if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
                raise ConfigError(
                    f"{where}: {prefix}{key}={value!r} is not supported by m3jax (only "
                    f"{allowed[0]!r})"
                )
            continue
        raise ConfigError(f"{where}: {prefix}{key}={value!r} is not supported by m3jax")


def _check_model_type(section: dict, kind: str, where: str, prefix: str) -> None:
    model_type = section.get("model_type", MODEL_TYPES[kind])
    if model_type != MODEL_TYPES[kind]:
        raise ConfigError(
            f"{where}: {prefix}model_type={model_type!r}, expected {MODEL_TYPES[kind]!r}"
        )


def _pop_alias(section: dict, name: str, alias: str, default: Any, where: str) -> Any:
    if alias in section:
        _agree(section, name, section[alias], where, alias)
        section[name] = section.pop(alias)
    return section.pop(name, default)


def _agree(section: dict, key: str, value: Any, where: str, source: str) -> None:
    if key in section and section[key] != value:
        raise ConfigError(f"{where}: {source}={value!r} contradicts {key}={section[key]!r}")


def _nested(flat: dict) -> dict:
    """{"moe.expert_dim": 3} -> {"moe": {"expert_dim": 3}}."""
    out: dict = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _build(cls: type, fields: dict, where: str) -> Any:
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None

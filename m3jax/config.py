"""Model configuration: frozen dataclasses that mirror MiniMax-M3-VL's text and vision configs.

Field names follow our style (whole words); `spec/m3_architecture.md` §2 gives the transformers name
for each, and `m3jax/convert/hf_config.py` translates. Every inconsistency a user can write is
rejected in `__post_init__` with a message that names the field and its value.
"""

import dataclasses
import warnings

from batch_format.vision import patch_dim

ATTENTION_TYPES = ("full", "msa")  # per layer: full causal attention, or MiniMax Sparse Attention
MLP_TYPES = ("dense", "moe")  # per layer: the dense MLP, or the mixture of experts
# transformers' names, which configs written before these kinds used; read with a rename message
RENAMED_TYPES = {
    "layer_types": {"full_attention": "full", "minimax_m3_sparse": "msa"},
    "mlp_layer_types": {"sparse": "moe"},
}
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = (
    "none", "full", "save_dots", "save_attention", "save_attention_dots",
    "save_attention_dots_experts",
)  # fmt: skip
ATTENTION_IMPLS = ("auto", "pallas", "xla", "reference")
MOE_DISPATCH_MODES = ("dropless", "capacity", "dense")  # m3jax/moe/local.py
GROUPED_MATMUL_IMPLS = (
    "auto",
    "xla",
    "mosaic_gpu",
    "megablox",
)  # m3jax/moe/local.grouped_matmul_impl
EP_EXCHANGES = ("padded", "ragged")  # m3jax/moe/padded.py, ragged.py; dropless dispatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class MSAConfig:
    """MiniMax Sparse Attention: the index branch and its block selection (`spec/msa.md` §1)."""

    index_heads: int = 4  # Hi; must equal the model's num_kv_heads (one index head per GQA group)
    index_head_dim: int = 128  # Di
    block_size: int = 128  # keys per block
    topk_blocks: int = 16  # blocks kept per (query, index head), local blocks included
    local_blocks: int = 1  # blocks ending at the query's own block that are always kept
    # Training (spec/msa.md §2): loss = LM + kl_weight · Σ_MSA layers KL(attention ‖ indexer).
    kl_weight: float = 1.0
    # Dense warm-up: for the first warmup_tokens training tokens MSA layers attend densely and
    # the indexer learns from the dense attention distribution; then selection switches on.
    warmup_tokens: int = 0

    def __post_init__(self):
        _require_positive_ints(self, "msa.", may_be_zero=("warmup_tokens",))
        if self.kl_weight < 0:
            raise ValueError(f"msa.kl_weight={self.kl_weight} must be >= 0")
        if self.local_blocks > self.topk_blocks:
            raise ValueError(
                f"msa.local_blocks={self.local_blocks} exceeds msa.topk_blocks={self.topk_blocks}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sigmoid-routed mixture of experts with one shared expert (`spec/m3_architecture.md` §3.6)."""

    num_experts: int = 128
    experts_per_token: int = 4
    expert_dim: int = 3072  # width of one routed expert (HF intermediate_size)
    shared_expert_dim: int = 3072
    routed_scaling: float = 2.0
    # Aux-loss-free balancing: after each step, bias_e += rate * clip((mean - load_e) / mean, ±1)
    # (m3jax/moe/router.py balanced_bias). 3e-2 recovered a skewed 32-expert router fastest on CPU; the
    # released M3 shape uses 1e-3 (configs/m3.yaml). README, "Expert balance".
    bias_update_rate: float = 3e-2
    balance_loss_weight: float = 0.0  # optional auxiliary load-balance loss; 0 disables it
    # How the chosen experts compute, and with mesh.expert > 1 how tokens travel between devices:
    # dropless (grouped matmul; ragged all-to-all), capacity (fixed [E, C, D] buffers, overflow
    # dropped; fixed-size all-to-all) or dense (every expert on every token: the test reference).
    dispatch: str = "dropless"
    # capacity: each expert takes at most ⌈capacity_factor · tokens · k / E⌉ rows per device.
    capacity_factor: float = 1.25
    # dropless: the grouped matmul's implementation. auto = the Pallas Mosaic GPU kernel on GPUs
    # (bf16/f16, widths multiples of 128), megablox on TPUs (bf16/f32, widths multiples of
    # 128), else XLA's ragged_dot.
    grouped_matmul: str = "auto"
    # dropless with mesh.expert > 1: how tokens travel. padded = each token once to each device
    # owning some of its experts, in fixed-size all_to_all blocks of exchange_factor × the tokens a
    # device pair exchanges under uniform routing (moe/padded.padded_blocks), worst-case sizes
    # only in steps where they would overflow; ragged = jax.lax.ragged_all_to_all of exactly the
    # (token, expert) rows (slower on GPUs: benchmarks/RESULTS.md). Both drop nothing.
    exchange: str = "padded"
    exchange_factor: float = 1.25

    def __post_init__(self):
        _require_positive_ints(self, "moe.")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"moe.experts_per_token={self.experts_per_token} exceeds "
                f"moe.num_experts={self.num_experts}"
            )
        if self.bias_update_rate < 0 or self.balance_loss_weight < 0:
            raise ValueError("moe.bias_update_rate and moe.balance_loss_weight must be >= 0")
        if self.dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"moe.dispatch={self.dispatch!r} is not one of {MOE_DISPATCH_MODES}")
        if self.grouped_matmul not in GROUPED_MATMUL_IMPLS:
            raise ValueError(
                f"moe.grouped_matmul={self.grouped_matmul!r} is not one of {GROUPED_MATMUL_IMPLS}"
            )
        if self.exchange not in EP_EXCHANGES:
            raise ValueError(f"moe.exchange={self.exchange!r} is not one of {EP_EXCHANGES}")
        for name in ("capacity_factor", "exchange_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name}={getattr(self, name)} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """ViT tower, projector and placeholder tokens (`spec/m3_architecture.md` §4-5)."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2  # m: m×m neighbouring patches merge into one LM token
    projector_hidden_size: int = 6144
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    image_token_id: int = 200025  # placeholder token ids whose embeddings the features replace
    video_token_id: int = 200026

    def __post_init__(self):
        _require_positive_ints(self, "vision.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision.hidden_size={self.hidden_size} is not a multiple of "
                f"vision.num_heads={self.num_heads}"
            )
        if self.head_dim < 6:
            raise ValueError(
                f"vision head dim {self.head_dim} (hidden_size / num_heads) must be >= 6: the 3-D "
                "RoPE rotates 2·floor(head_dim / 6) channel pairs per axis"
            )
        if self.image_token_id == self.video_token_id:
            raise ValueError(
                f"vision.image_token_id and vision.video_token_id are both {self.image_token_id}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of pixel_values (1176), ordered (c, t, y, x): batch_format/vision.py."""
        return patch_dim(self.temporal_patch_size, self.patch_size, self.num_channels)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPConfig:
    """Multi-token prediction modules, DeepSeek-V3's sequential design (m3jax/mtp.py)."""

    # Module i (0-based) predicts the token i + 2 ahead; 0 = none (config.json: num_mtp_modules).
    num_modules: int = 0
    # loss += loss_weight · mean over modules of their LM loss (DeepSeek-V3: 0.3, later 0.1).
    loss_weight: float = 0.3

    def __post_init__(self):
        _require_positive_ints(self, "mtp.", may_be_zero=("num_modules",))
        if self.loss_weight < 0:
            raise ValueError(f"mtp.loss_weight={self.loss_weight} must be >= 0")


def _require_positive_ints(config, prefix: str, may_be_zero: tuple[str, ...] = ()) -> None:
    """The int fields of these configs count things: below 1 (or 0 where allowed) is a mistake."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        lowest = 0 if field.name in may_be_zero else 1
        if type(value) is int and value < lowest:
            raise ValueError(f"{prefix}{field.name}={value} must be >= {lowest}")


def _renamed_kinds(kinds: tuple[str, ...], field: str) -> tuple[str, ...]:
    renames = RENAMED_TYPES[field]
    for old in sorted(set(kinds) & set(renames)):
        warnings.warn(
            f"{field}: {old!r} is now {renames[old]!r}; rename it in the config", stacklevel=4
        )
    return tuple(renames.get(kind, kind) for kind in kinds)


def expand_layer_pattern(entries: tuple[str, ...], field: str) -> tuple[str, ...]:
    """`("full*3", "msa*57")` -> 60 names; plain names count once."""
    names = []
    for entry in entries:
        name, _, count = entry.partition("*")
        name = name.strip()
        if count and not count.strip().isdigit():
            raise ValueError(f"{field}: bad repeat count in {entry!r} (write 'name*N')")
        names.extend([name] * (int(count) if count else 1))
    return tuple(names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The M3 decoder. Defaults are the released MiniMax-M3 text shape (`configs/m3.yaml`)."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    num_layers: int = 60
    num_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64  # partial NeoX RoPE on the first rotary_dim channels of each head
    rope_theta: float = 5e6
    rms_norm_eps: float = 1e-6
    dense_mlp_dim: int = 12288  # MLP width of "dense" layers
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Per layer, full | msa and dense | moe (m3jax/convert/hf_config.py maps transformers' names);
    # "name*N" repeats a name N times.
    layer_types: tuple[str, ...] = ("full*3", "msa*57")
    mlp_layer_types: tuple[str, ...] = ("dense*3", "moe*57")
    init_std: float = 0.02
    dtype: str = (
        "float32"  # activation/matmul dtype; params stay float32, norms/softmax/router fp32
    )
    remat: str = "none"  # what the backward recomputes per layer: one of REMAT_POLICIES
    # "auto": the MSA Pallas GPU kernels where they apply, else "xla"; "pallas": the kernels or an
    # error; "xla": query-tiled attention and MSA, memory linear in S; "reference": O(S²) jnp (tests)
    attention_impl: str = "auto"
    # the MSA GPU kernels' settings, 'field=value' of pallas_kernels/msa/pallas.py's Config (e.g.
    # 'partial_bytes=8589934592': one query window to 8 GiB of per-entry shares); () its defaults
    msa_kernels: tuple[str, ...] = ()
    msa: MSAConfig = MSAConfig()
    moe: MoEConfig = MoEConfig()
    mtp: MTPConfig = MTPConfig()
    vision: VisionConfig | None = None  # None: a text-only model (no vision tower or projector)

    def __post_init__(self):
        for field in ("layer_types", "mlp_layer_types"):
            kinds = expand_layer_pattern(getattr(self, field), field)
            object.__setattr__(self, field, _renamed_kinds(kinds, field))
        _require_positive_ints(self, "")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )
        for field, kinds, allowed in (
            ("layer_types", self.layer_types, ATTENTION_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES),
        ):
            if len(kinds) != self.num_layers:
                raise ValueError(
                    f"{field} lists {len(kinds)} layers but num_layers={self.num_layers}"
                )
            for i, kind in enumerate(kinds):
                if kind not in allowed:
                    raise ValueError(f"{field}[{i}]={kind!r} is not one of {allowed}")
        if self.msa_layers:
            if self.msa.index_heads != self.num_kv_heads:
                raise ValueError(
                    f"msa.index_heads={self.msa.index_heads} must equal "
                    f"num_kv_heads={self.num_kv_heads} (one index head per GQA group)"
                )
            if self.msa.index_head_dim < self.rotary_dim:
                raise ValueError(
                    f"msa.index_head_dim={self.msa.index_head_dim} is smaller than "
                    f"rotary_dim={self.rotary_dim}: transformers' indexer RoPE is then not a rotation"
                )
        if self.vision is not None:
            for field in ("image_token_id", "video_token_id"):
                if getattr(self.vision, field) >= self.vocab_size:
                    raise ValueError(
                        f"vision.{field}={getattr(self.vision, field)} is not below "
                        f"vocab_size={self.vocab_size}"
                    )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl={self.attention_impl!r} is not one of {ATTENTION_IMPLS}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} is not one of {REMAT_POLICIES}")
        if self.msa_kernels:
            from pallas_kernels.msa.pallas import Config  # the kernels load only when configured

            try:
                Config().with_fields(self.msa_kernels)
            except ValueError as e:  # with_fields names the bad item
                raise ValueError(f"msa_kernels: {e}") from None

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_heads // self.num_kv_heads

    def layer_kind(self, i: int) -> tuple[str, str]:
        return self.layer_types[i], self.mlp_layer_types[i]

    @property
    def msa_layers(self) -> tuple[int, ...]:
        """The indices of the MSA layers (the MTP modules' layers not included)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "msa")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE layers (the MTP modules' layers not included)."""
        return tuple(i for i, kind in enumerate(self.mlp_layer_types) if kind == "moe")

"""The M3 model, and the functional interface the trainer and the tests use.

M3Model: embeddings (no √d scaling) -> layer stacks -> final Gemma norm -> untied lm_head
(spec/m3_architecture.md §3). With `config.vision`, it also owns the vision tower and projector:
their merged features replace the embeddings of image/video placeholder tokens (§5.3) before the
first layer. With `config.mtp.num_modules`, multi-token-prediction modules (m3jax/mtp.py) follow
the trunk; only `normed_with_mtp` (training) runs them, so inference and export parity see the
plain model. It stops at the final norms, before the lm_head, whose product the training loss
computes in token chunks (pretrain/chunked_loss.py).
`decode` appends one token per row to a KV cache (generation, m3jax/generation.py).
With mesh seq > 1 the layers run on the load-balanced (zig-zag) layout of the sequence
(m3jax/context_parallel.py): the trunk permutes its input once and restores natural order after
the last layer, so the loss, MTP and every returned per-token statistic see natural order.
`Functional` wraps it for pure `jax.jit` code: parameters and buffers are plain nested dicts of
arrays (what Orbax saves and optax updates), and `apply` merges them into the module graph inside
the traced function.

Shapes: B batch, S sequence, D model width, V vocab, P patches (P / m² merged feature rows).
"""

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from m3jax import context_parallel, params
from m3jax.attention import AttentionInputs, ForwardMode
from m3jax.config import ModelConfig
from m3jax.decoder import LayerStack, LayerStats
from m3jax.kv_cache import KVCache
from m3jax.moe.router import balanced_bias
from m3jax.mtp import MTPOutput, MultiTokenPrediction
from m3jax.norms import RMSNorm
from m3jax.projector import Projector
from m3jax.rope import rope_tables
from m3jax.vision import VisionTower
from m3jax.vision_inputs import VisionInputs


def layer_runs(config: ModelConfig) -> list[tuple[str, str, int]]:
    """Consecutive layers of one (attention type, mlp type) -> [(attention, mlp, count), ...]."""
    kinds = zip(config.layer_types, config.mlp_layer_types)
    return [(*kind, len(list(group))) for kind, group in itertools.groupby(kinds)]


class M3Model(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        """mesh: the devices the MoE layers spread their experts over (None: one device)."""
        dim, vocab, std = config.hidden_size, config.vocab_size, config.init_std
        self.embed = params.normal(rngs, (vocab, dim), ("vocab", "embed"), std)
        self.stacks = nnx.List(
            [LayerStack(config, a, m, n, rngs=rngs, mesh=mesh) for a, m, n in layer_runs(config)]
        )
        self.final_norm = RMSNorm(dim, config.rms_norm_eps)
        self.lm_head = params.normal(rngs, (dim, vocab), ("embed", "vocab"), std)
        self.mtp = (
            MultiTokenPrediction(config, rngs=rngs, mesh=mesh) if config.mtp.num_modules else None
        )
        if config.vision is not None:
            self.vision = VisionTower(config, rngs=rngs)
            self.projector = Projector(config, rngs=rngs)
        self.config, self.mesh = config, mesh

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: VisionInputs | None = None,
        mode: ForwardMode = ForwardMode(),
        *,
        output_hidden_states: bool = False,
    ) -> tuple[jax.Array, list[LayerStats]]:
        """tokens, positions, segment_ids: [B, S] int32 (segment 0 = padding); vision: packed
        patches and the placeholder -> feature-row index (m3jax/vision_inputs.py), or None;
        mode: static switches of the MSA layers (warm-up, indexer loss, recall).

        Returns logits [B, S, V] fp32 and, per layer stack, its LayerStats stacked over its layers
        (m3jax/decoder.py: moe, msa, with mode.kv_cache the cache, with output_hidden_states each
        layer's output). The embeddings after the placeholder scatter are `embeddings(...)`.
        """
        _, hidden, _, stats = self._trunk(
            tokens, positions, segment_ids, vision, mode, output_hidden_states
        )
        return self.head(self.final_norm(hidden)), stats

    def normed_with_mtp(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: VisionInputs | None = None,
        mode: ForwardMode = ForwardMode(),
        kl_sinks: list | None = None,
    ) -> tuple[jax.Array, list[LayerStats], list[MTPOutput]]:
        """`__call__` plus the MTP modules, both up to the lm_head: (the final-normed hidden
        states [B, S, D] in config.dtype, stats, one MTPOutput per module (m3jax/mtp.py; none
        without MTP modules)). `head` gives
        their logits; the training loss applies the lm_head itself in token chunks
        (pretrain/chunked_loss.py), so no [B, S, V] logits exist. kl_sinks: per layer stack
        [L] fp32 zeros (MSA stacks) or None, the trunk's MSA layers' KL sinks
        (`Functional.kl_sinks`)."""
        embeddings, hidden, inputs, stats = self._trunk(
            tokens, positions, segment_ids, vision, mode, False, kl_sinks
        )
        mtp = [] if self.mtp is None else self.mtp(embeddings, hidden, inputs, mode)
        return self.final_norm(hidden), stats, mtp

    def head(self, x: jax.Array) -> jax.Array:
        """Normed hidden states [B, S, D] -> logits [B, S, V] fp32 (the lm_head, shared by MTP)."""
        return jnp.einsum(
            "bsd,dv->bsv", x, self.lm_head[...].astype(x.dtype), preferred_element_type=jnp.float32
        )

    def _trunk(self, tokens, positions, segment_ids, vision, mode, output_hidden_states,
               kl_sinks=None):  # fmt: skip
        """(input embeddings, last layer output before the final norm, attention inputs, stats)."""
        config = self.config
        embeddings = self.embeddings(tokens, vision)
        cos, sin = rope_tables(positions, config.rotary_dim, config.rope_theta)
        inputs = AttentionInputs(positions, segment_ids, cos, sin)
        x, stats = context_parallel.run_balanced(
            self._layers, self.mesh, embeddings, inputs, mode, output_hidden_states, kl_sinks,
            layer_axis=True,
        )  # fmt: skip
        return embeddings, x, inputs, stats

    def _layers(self, x, inputs, mode, output_hidden_states, kl_sinks=None):
        """Every layer stack in order -> (last output, stats per stack)."""
        stats = []
        kl_sinks = [None] * len(self.stacks) if kl_sinks is None else kl_sinks
        for stack, sinks in zip(self.stacks, kl_sinks, strict=True):
            x, stack_stats = stack(x, inputs, mode, output_hidden_states=output_hidden_states,
                                   kl_sinks=sinks)  # fmt: skip
            stats.append(stack_stats)
        return x, stats

    def decode(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """One new text token per row, tokens [B, 1] at positions cache.lengths -> (logits [B, V]
        fp32, the cache with the tokens appended). Prefill the cache with mode.kv_cache."""
        positions = cache.lengths[:, None]
        cos, sin = rope_tables(positions, self.config.rotary_dim, self.config.rope_theta)
        inputs = AttentionInputs(positions, jnp.ones_like(positions), cos, sin)
        x = self.embeddings(tokens, None)
        stacks = []
        for stack, stack_cache in zip(self.stacks, cache.stacks, strict=True):
            x, stack_cache = stack.decode(x, inputs, stack_cache)
            stacks.append(stack_cache)
        return self.head(self.final_norm(x))[:, 0], KVCache(tuple(stacks), cache.lengths + 1)

    def embeddings(self, tokens: jax.Array, vision: VisionInputs | None) -> jax.Array:
        """First layer input [B, S, D]: token embeddings, placeholders replaced by features."""
        x = self.embed[...][tokens].astype(self.config.dtype)
        if vision is None:
            return x
        if self.config.vision is None:
            raise ValueError("vision inputs given to a text-only model (config.vision is None)")
        states = self.vision(vision.patches, vision.positions, vision.segment_ids)  # [N, P, Dv]
        features = self.projector(states).astype(x.dtype)  # [N, P/m², D]
        features = features.reshape(-1, features.shape[-1])  # rows of all N, in order
        index = vision.token_index
        return jnp.where((index >= 0)[..., None], features[jnp.maximum(index, 0)], x)


@dataclasses.dataclass(frozen=True)
class Functional:
    """A model as pure functions over (params, buffers): nested dicts of arrays."""

    config: ModelConfig
    graphdef: Any
    param_axes: dict  # same structure as params; leaves are tuples of logical axis names
    buffer_axes: dict
    mesh: Mesh | None = None  # the devices `apply` runs on (`functional`'s), None: one device

    def init(self, seed: int) -> tuple[dict, dict]:
        """Fresh (params, buffers). Jit it with out_shardings to create them already sharded."""
        model = M3Model(self.config, rngs=nnx.Rngs(jax.random.key(seed)))
        _, param_state, buffer_state = nnx.split(model, nnx.Param, params.Buffer)
        return nnx.to_pure_dict(param_state), nnx.to_pure_dict(buffer_state)

    def shapes(self) -> tuple[dict, dict]:
        """ShapeDtypeStructs of (params, buffers); nothing is allocated."""
        return jax.eval_shape(self.init, 0)

    def apply(
        self,
        params: dict,
        buffers: dict,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: VisionInputs | None = None,
        mode: ForwardMode = ForwardMode(),
        *,
        output_hidden_states: bool = False,
    ) -> tuple[jax.Array, list[LayerStats]]:
        """Forward pass: see M3Model.__call__."""
        model = nnx.merge(self.graphdef, params, buffers)
        return model(
            tokens, positions, segment_ids, vision, mode, output_hidden_states=output_hidden_states
        )

    def apply_normed_with_mtp(
        self,
        params: dict,
        buffers: dict,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        vision: VisionInputs | None = None,
        mode: ForwardMode = ForwardMode(),
        kl_sinks: list | None = None,
    ) -> tuple[jax.Array, list[LayerStats], list[MTPOutput]]:
        """Forward pass with the MTP modules (training), up to the lm_head (`params["lm_head"]`,
        [D, V]): see M3Model.normed_with_mtp."""
        model = nnx.merge(self.graphdef, params, buffers)
        return model.normed_with_mtp(tokens, positions, segment_ids, vision, mode, kl_sinks)

    def kl_sinks(self) -> list:
        """Per layer stack, zeros [L] fp32 where its layers are MSA layers, else None: the
        sinks whose gradients are the layers' KLs (m3jax/attention.py: `Attention.__call__`)."""
        return [jnp.zeros(count, jnp.float32) if attention == "msa" else None
                for attention, _, count in layer_runs(self.config)]  # fmt: skip

    def head(self, params: dict, buffers: dict, hidden: jax.Array) -> jax.Array:
        """Logits [B, S, V] fp32 of final-normed hidden states [B, S, D]: see M3Model.head."""
        return nnx.merge(self.graphdef, params, buffers).head(hidden)

    def embeddings(
        self, params: dict, buffers: dict, tokens: jax.Array, vision: VisionInputs | None = None
    ) -> jax.Array:
        """The first layer's input [B, S, D]: see M3Model.embeddings."""
        return nnx.merge(self.graphdef, params, buffers).embeddings(tokens, vision)

    def decode(
        self, params: dict, buffers: dict, tokens: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """One generation step: see M3Model.decode (m3jax/generation.py drives it)."""
        return nnx.merge(self.graphdef, params, buffers).decode(tokens, cache)

    def on_mesh(self, mesh: Mesh) -> "Functional":
        """The same model with its MoE layers expert-parallel over `mesh` (see `functional`)."""
        return functional(self.config, mesh)

    def rebalanced(self, buffers: dict, loads: list, rate: float) -> dict:
        """Buffers after one aux-loss-free step of every router bias.

        loads: the tokens routed to each expert (MoEStats.load), per layer stack ([layers, E])
        then per MTP module ([1, E]); None for stacks or modules without MoE, which own no
        buffers. A stack's or module's buffers are its MoE routers' biases, whatever their path.
        """
        num_stacks = len(layer_runs(self.config))

        def moved(tree: dict, load: jax.Array) -> dict:
            return jax.tree.map(
                lambda bias: balanced_bias(bias, load.reshape(bias.shape), rate), tree
            )

        rebalanced = dict(buffers)
        if "stacks" in buffers:
            stacks = buffers["stacks"]
            rebalanced["stacks"] = {i: moved(stacks[i], loads[i]) for i in stacks}
        if "mtp" in buffers:
            depths = buffers["mtp"]["depths"]
            moved_depths = {i: moved(depths[i], loads[num_stacks + i]) for i in depths}
            rebalanced["mtp"] = {**buffers["mtp"], "depths": moved_depths}
        return rebalanced


def functional(config: ModelConfig, mesh: Mesh | None = None) -> Functional:
    """Traces the module structure once (abstractly) and returns its functional form.

    mesh: the devices `apply` runs on, when its MoE layers should run expert-parallel (over the
    mesh's `expert` axis, m3jax/moe/expert_parallel.py); None runs them as on one device.
    """
    model = nnx.eval_shape(lambda: M3Model(config, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, param_state, buffer_state = nnx.split(model, nnx.Param, params.Buffer)
    return Functional(config, graphdef, _axes(param_state), _axes(buffer_state), mesh)


def _axes(state: nnx.State) -> dict:
    return nnx.to_pure_dict(
        jax.tree.map(
            lambda v: v.get_metadata()["logical_axes"],
            state,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    )

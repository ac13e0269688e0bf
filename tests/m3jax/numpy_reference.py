"""An independent float64 NumPy implementation of the MiniMax-M3 text decoder, for parity tests.

Why it exists: m3jax must reproduce transformers 5.23's `minimax_m3_vl` text model. This file is
written from `spec/m3_architecture.md` §3 (and `spec/msa.md` §1), *not* from m3jax, so that a test
comparing the two catches a misreading of the spec on either side. It reads weights in the upstream
on-disk naming and layout (spec §7.1: `language_model.model.layers.{i}.self_attn.q_proj.weight`
[Hq·Dh, d], ...) and a config dict with transformers' field names. Like transformers it handles one
document per row (positions 0..S-1); loops over rows and heads keep it close to the spec's text.

Besides logits it returns diagnostics that let a test prove a code path was exercised (clamp rates,
sparse selections that drop causal blocks, routing changed by the correction bias) and that fp32
cannot flip a discrete choice (the smallest top-k margins).

Shapes: S sequence, d model width, Hq query heads, Hkv kv heads, Hi index heads, Dh head dim,
Di index head dim, R rotary dims, E experts, I expert width, V vocab.
"""

import math

import numpy as np

PREFIX = "language_model.model."


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gemma RMSNorm over the last axis: the stored weight is an offset, the scale is (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + weight)


def rope_tables(seq_len: int, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [S, R] for positions 0..S-1: inv_freq_j = θ^(-2j/R), table = [freqs, freqs]."""
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    table = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(table), np.sin(table)


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX half-split rotation of the first R = cos.shape[-1] channels of x [S, N, W]."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return np.concatenate([rot * cos + rotate_half(rot) * sin, rest], axis=-1)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def swigluoai(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """(clip(u, -ℓ, ℓ) + 1) · g' · sigmoid(α g') with g' = min(g, ℓ): the gate is clamped above only."""
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return (up + 1.0) * gate * sigmoid(alpha * gate)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _top_margin(values: np.ndarray, k: int) -> float:
    """Gap between the k-th and (k+1)-th largest finite values (inf when there is no competitor)."""
    finite = np.sort(values[np.isfinite(values)])[::-1]
    if len(finite) <= k:
        return math.inf
    return float(finite[k - 1] - finite[k])


class _Stats:
    """Counters a test can assert on; see `forward`'s docstring."""

    def __init__(self, num_layers: int):
        self.clamped_gate = np.zeros(num_layers)
        self.clamped_up = np.zeros(num_layers)
        self.activations = np.zeros(num_layers)
        self.selections = {}  # (row, layer) -> [Hi][S] list of sets of selected block ids
        self.dropped_causal_blocks = 0  # (row, layer, head, query) triples that skip a causal block
        self.min_selection_margin = math.inf
        self.bias_changed_choice = 0  # tokens whose chosen experts differ from the bias-free top-k
        self.min_routing_margin = math.inf

    def count_clamps(self, layer: int, gate: np.ndarray, up: np.ndarray, limit: float):
        self.clamped_gate[layer] += np.sum(gate > limit)
        self.clamped_up[layer] += np.sum(np.abs(up) > limit)
        self.activations[layer] += gate.size


def _feed_forward(x, gate_w, up_w, down_w, config, stats, layer):
    """SwiGLU-OAI MLP with weights in [out, in] layout: gate/up [I, d], down [d, I]."""
    gate, up = x @ gate_w.T, x @ up_w.T
    stats.count_clamps(layer, gate, up, config["swiglu_limit"])
    act = swigluoai(gate, up, config["swiglu_alpha"], config["swiglu_limit"])
    return act @ down_w.T


def _msa_visibility(hn, weights, config, cos, sin, stats, row, layer):
    """Lightning indexer, spec §3.5 steps 1-9 -> visible[Hi, S, S] bool (block selected, causal)."""
    p = f"{PREFIX}layers.{layer}.self_attn."
    seq = hn.shape[0]
    heads, dim = config["index_n_heads"], config["index_head_dim"]
    block, topk, local = (
        config["index_block_size"],
        config["index_topk_blocks"],
        config["index_local_blocks"],
    )
    eps = config["rms_norm_eps"]
    # 1. Projections and Gemma norms; a single shared key head.
    iq = rms_norm(
        (hn @ weights[p + "index_q_proj.weight"].T).reshape(seq, heads, dim),
        weights[p + "index_q_norm.weight"],
        eps,
    )
    ik = rms_norm(
        hn @ weights[p + "index_k_proj.weight"].T, weights[p + "index_k_norm.weight"], eps
    )
    # 2. RoPE with the main attention's tables sliced to [..., :Di] (Di >= R: the first R rotate).
    iq = apply_rope(iq, cos[:, :dim], sin[:, :dim])
    ik = apply_rope(ik[:, None, :], cos[:, :dim], sin[:, :dim])[:, 0, :]
    num_blocks = -(-seq // block)
    kk = min(topk, num_blocks)
    visible = np.zeros((heads, seq, seq), bool)
    selections = []
    for h in range(heads):
        head_selections = []
        for i in range(seq):
            # 3-4. Raw dot products, future keys -inf.
            scores = np.full(num_blocks * block, -np.inf)  # 5. padded to nb·B with -inf
            scores[: i + 1] = ik[: i + 1] @ iq[i, h]
            # 6. Block score = max over the block's keys.
            block_scores = scores.reshape(num_blocks, block).max(axis=-1)
            stats.min_selection_margin = min(
                stats.min_selection_margin, _top_margin(block_scores, kk)
            )
            # 7. Local forcing: the query's own block and the L-1 before it (clamped at block 0).
            for offset in range(local):
                block_scores[max(i // block - offset, 0)] = np.inf
            # 8. Top-kk blocks; chosen -inf blocks are padding (-1).
            order = np.argsort(-block_scores, kind="stable")[:kk]
            chosen = [int(b) if block_scores[b] != -np.inf else -1 for b in order]
            selected = {b for b in chosen if b >= 0}
            head_selections.append(selected)
            if len(selected) < i // block + 1:
                stats.dropped_causal_blocks += 1
            # 9. Key j is visible iff its block is selected and j <= i.
            for j in range(i + 1):
                visible[h, i, j] = j // block in selected
        selections.append(head_selections)
    stats.selections[(row, layer)] = selections
    return visible


def _attention(hn, weights, config, layer, cos, sin, stats, row):
    """Per-head-normed GQA with partial RoPE and a causal (plus MSA) mask. hn: [S, d] -> [S, d]."""
    p = f"{PREFIX}layers.{layer}.self_attn."
    seq = hn.shape[0]
    num_heads, num_kv, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    eps = config["rms_norm_eps"]
    q = rms_norm(
        (hn @ weights[p + "q_proj.weight"].T).reshape(seq, num_heads, head_dim),
        weights[p + "q_norm.weight"],
        eps,
    )
    k = rms_norm(
        (hn @ weights[p + "k_proj.weight"].T).reshape(seq, num_kv, head_dim),
        weights[p + "k_norm.weight"],
        eps,
    )
    v = (hn @ weights[p + "v_proj.weight"].T).reshape(seq, num_kv, head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    mask = np.tril(np.ones((seq, seq), bool))
    sparse = config["layer_types"][layer] == "minimax_m3_sparse"
    if sparse:
        visible = _msa_visibility(hn, weights, config, cos, sin, stats, row, layer)
    out = np.zeros((seq, num_heads, head_dim))
    for h in range(num_heads):
        kv = h // (num_heads // num_kv)
        head_mask = mask & visible[h // (num_heads // config["index_n_heads"])] if sparse else mask
        logits = (q[:, h] @ k[:, kv].T) * head_dim**-0.5
        logits = np.where(head_mask, logits, -np.inf)  # no row is empty: the diagonal is visible
        out[:, h] = _softmax(logits) @ v[:, kv]
    return out.reshape(seq, num_heads * head_dim) @ weights[p + "o_proj.weight"].T


def _moe(x, weights, config, layer, stats):
    """Sigmoid router + correction bias (selection only), renormalised top-k, one shared expert."""
    p = f"{PREFIX}layers.{layer}.block_sparse_moe."
    k, scaling = config["num_experts_per_tok"], config["routed_scaling_factor"]
    scores = sigmoid(x @ weights[p + "gate.weight"].T)  # [N, E]
    choice = scores + weights[p + "e_score_correction_bias"]
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        chosen = np.argsort(-choice[n], kind="stable")[:k]
        unbiased = np.argsort(-scores[n], kind="stable")[:k]
        stats.bias_changed_choice += set(chosen.tolist()) != set(unbiased.tolist())
        stats.min_routing_margin = min(stats.min_routing_margin, _top_margin(choice[n], k))
        routing_weights = scores[n, chosen] / scores[n, chosen].sum()
        for expert, weight in zip(chosen, routing_weights):
            e = f"{p}experts.{expert}."
            out[n] += (
                weight
                * _feed_forward(
                    x[n : n + 1],
                    weights[e + "w1.weight"],
                    weights[e + "w3.weight"],
                    weights[e + "w2.weight"],
                    config,
                    stats,
                    layer,
                )[0]
            )
    s = p + "shared_experts."
    shared = _feed_forward(
        x,
        weights[s + "gate_proj.weight"],
        weights[s + "up_proj.weight"],
        weights[s + "down_proj.weight"],
        config,
        stats,
        layer,
    )
    return scaling * out + shared  # the shared expert is not scaled


def _dense_mlp(x, weights, config, layer, stats):
    p = f"{PREFIX}layers.{layer}.mlp."
    return _feed_forward(
        x,
        weights[p + "gate_proj.weight"],
        weights[p + "up_proj.weight"],
        weights[p + "down_proj.weight"],
        config,
        stats,
        layer,
    )


def forward(weights: dict[str, np.ndarray], config: dict, tokens: np.ndarray):
    """Logits of the M3 text model, one document per row.

    Args:
      weights: upstream-layout tensors (spec §7.1), any float dtype; computed in float64.
      config: transformers field names: vocab_size, hidden_size, num_hidden_layers,
        num_attention_heads, num_key_value_heads, head_dim, partial_rotary_factor, rope_theta,
        rms_norm_eps, layer_types, mlp_layer_types, index_n_heads, index_head_dim, index_block_size,
        index_topk_blocks, index_local_blocks, num_local_experts, num_experts_per_tok,
        routed_scaling_factor, swiglu_alpha, swiglu_limit.
      tokens: [B, S] int token ids; positions are 0..S-1 in every row.
    Returns:
      logits [B, S, V] float64 and a dict of diagnostics:
        clamp_fraction_gate / clamp_fraction_up: [L] fraction of gate (> ℓ) / up (|u| > ℓ)
          pre-activations that the swigluoai clamps changed (dense MLP, shared and chosen experts);
        selections: {(row, layer): [Hi][S] sets of selected block ids} on sparse layers;
        dropped_causal_blocks: (row, layer, index head, query) count whose selection misses one of
          the query's causal blocks, i.e. where MSA differs from dense causal attention;
        min_selection_margin / min_routing_margin: smallest gap between the last chosen and the first
          rejected block score / biased router score (fp32 must not be able to flip them);
        bias_changed_choice: tokens whose expert set differs from the bias-free top-k.
    """
    weights = {name: np.asarray(w, np.float64) for name, w in weights.items()}
    num_layers, eps = config["num_hidden_layers"], config["rms_norm_eps"]
    rotary_dim = int(config["head_dim"] * config["partial_rotary_factor"])
    stats = _Stats(num_layers)
    all_logits = []
    for row, row_tokens in enumerate(np.asarray(tokens)):
        cos, sin = rope_tables(len(row_tokens), rotary_dim, config["rope_theta"])
        x = weights[PREFIX + "embed_tokens.weight"][row_tokens]  # no √d scaling
        for layer in range(num_layers):
            p = f"{PREFIX}layers.{layer}."
            hn = rms_norm(x, weights[p + "input_layernorm.weight"], eps)
            h = x + _attention(hn, weights, config, layer, cos, sin, stats, row)
            hn2 = rms_norm(h, weights[p + "post_attention_layernorm.weight"], eps)
            if config["mlp_layer_types"][layer] == "sparse":
                x = h + _moe(hn2, weights, config, layer, stats)
            else:
                x = h + _dense_mlp(hn2, weights, config, layer, stats)
        x = rms_norm(x, weights[PREFIX + "norm.weight"], eps)
        all_logits.append(x @ weights["language_model.lm_head.weight"].T)
    info = {
        "clamp_fraction_gate": stats.clamped_gate / np.maximum(stats.activations, 1),
        "clamp_fraction_up": stats.clamped_up / np.maximum(stats.activations, 1),
        "selections": stats.selections,
        "dropped_causal_blocks": stats.dropped_causal_blocks,
        "min_selection_margin": stats.min_selection_margin,
        "min_routing_margin": stats.min_routing_margin,
        "bias_changed_choice": stats.bias_changed_choice,
    }
    return np.stack(all_logits), info

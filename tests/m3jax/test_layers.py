"""The model's pieces against small independent references written here from the spec.

Why: the whole-model parity test (`test_model_vs_numpy.py`) says *that* something is off; these
say *which* piece, and pin the semantics that are easy to get subtly wrong while still producing
plausible numbers: the Gemma (1 + w) norm offset and its fp32 compute, RoPE's half-split pairing and
partial rotation, swigluoai's asymmetric clamps, and the router's "bias selects, scores weigh" rule
(spec/m3_architecture.md §3.3, §3.4, §3.6).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3jax.config import ModelConfig, MoEConfig
from m3jax.mlp import MLP, swigluoai
from m3jax.moe.layer import MoE
from m3jax.moe.router import balanced_bias, route
from m3jax.norms import rms_norm
from m3jax.rope import apply_rope, rope_tables

ALPHA, LIMIT = 1.702, 7.0


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _random_module(make, seed: int, std: float = 0.5):
    """Builds a module abstractly and fills every parameter and buffer with N(0, std²) draws."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)
    values = jax.tree.map(
        lambda leaf: jnp.asarray(rng.normal(0.0, std, leaf.shape), jnp.float32),
        nnx.to_pure_dict(state),
    )
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------------------------------
# RMSNorm (Gemma): y = x · rsqrt(mean(x²) + eps) · (1 + w), fp32 inside.


def test_rms_norm_matches_gemma_formula():
    rng = np.random.default_rng(0)
    x, w = rng.normal(0, 2, (2, 5, 32)), rng.normal(0, 0.3, 32)
    expected = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * (1 + w)
    y = rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-6)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_weight_is_an_offset():
    """w = 0 (the init) is the identity scale, w = -1 silences a channel, w = 1 doubles it."""
    x = jnp.asarray(np.random.default_rng(1).normal(0, 3, (4, 16)), jnp.float32)
    unit = rms_norm(x, jnp.zeros(16), 1e-6)
    np.testing.assert_allclose(np.sqrt(np.mean(np.asarray(unit) ** 2, -1)), 1.0, rtol=1e-5)
    w = jnp.zeros(16).at[3].set(-1.0).at[5].set(1.0)
    y = np.asarray(rms_norm(x, w, 1e-6))
    np.testing.assert_array_equal(y[:, 3], 0.0)
    np.testing.assert_allclose(y[:, 5], 2 * np.asarray(unit)[:, 5], rtol=1e-6)


def test_rms_norm_adds_eps_inside_the_root():
    x = jnp.full((1, 8), 1e-3, jnp.float32)
    y = rms_norm(x, jnp.zeros(8), 1e-6)
    np.testing.assert_allclose(np.asarray(y), 1e-3 / math.sqrt(1e-6 + 1e-6), rtol=1e-5)
    assert np.all(np.asarray(rms_norm(jnp.zeros((1, 8)), jnp.zeros(8), 1e-6)) == 0)


def test_rms_norm_bfloat16_input_computes_in_float32():
    """bf16 in, bf16 out, but (1 + w) and the statistics in fp32: a w of 3e-3 is below bf16's
    resolution at 1 (2^-7), so bf16 arithmetic would lose it; fp32 arithmetic rounds once, at the end.
    """
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(0, 1, (64, 256)), jnp.bfloat16)
    w = jnp.full((256,), 3e-3, jnp.float32)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == jnp.bfloat16
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    exact = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6) * (1 + 3e-3)
    expected = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.mean(got != expected) < 0.01  # only ties at a rounding boundary may differ
    np.testing.assert_allclose(got, expected, rtol=2**-7)  # and then by one bf16 ulp
    # The check can tell: all-bf16 arithmetic misses many of these roundings.
    xb = x.astype(jnp.bfloat16)
    naive = (
        xb * jax.lax.rsqrt(jnp.mean(xb * xb, -1, keepdims=True) + 1e-6) * (1 + w.astype(xb.dtype))
    )
    assert np.mean(np.asarray(naive.astype(jnp.float32), np.float64) != expected) > 0.1


# --------------------------------------------------------------------------------------------------
# Partial NeoX RoPE: first R channels rotate, channel i pairs with i + R/2, θ^(-2j/R).


def test_rope_tables_use_theta_power_frequencies_repeated_twice():
    positions = jnp.asarray([[0, 1, 5, 100]], jnp.int32)
    cos, sin = rope_tables(positions, 8, 10000.0)
    assert cos.shape == sin.shape == (1, 4, 8)
    inv_freq = 10000.0 ** (-np.arange(4) * 2 / 8)  # [1, 0.1, 0.01, 0.001]
    angles = np.asarray([0, 1, 5, 100])[:, None] * np.concatenate([inv_freq, inv_freq])
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(angles), atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin[0]), np.sin(angles), atol=1e-5)


def _rope_inputs(rotary_dim=8, head_dim=16, seq=6, heads=3, seed=0, theta=10000.0):
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(2, seq, heads, head_dim)), jnp.float32)
    positions = jnp.asarray(np.random.default_rng(seed + 1).integers(0, 50, (2, seq)), jnp.int32)
    cos, sin = rope_tables(positions, rotary_dim, theta)
    return x, positions, cos, sin


def test_apply_rope_leaves_channels_beyond_rotary_dim_untouched():
    x, _, cos, sin = _rope_inputs()
    y = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(np.asarray(y[..., 8:]), np.asarray(x[..., 8:]))
    assert not np.allclose(np.asarray(y[..., :8]), np.asarray(x[..., :8]))


def test_apply_rope_pairs_channel_i_with_i_plus_half_rotary_dim():
    """A unit vector on channel i < R/2 becomes (cos, sin) on channels (i, i + R/2), nothing else."""
    positions = jnp.asarray([[7]], jnp.int32)
    cos, sin = rope_tables(positions, 8, 10000.0)
    for i in range(4):
        x = jnp.zeros((1, 1, 1, 16)).at[..., i].set(1.0)
        y = np.asarray(apply_rope(x, cos, sin))[0, 0, 0]
        angle = 7 * 10000.0 ** (-2 * i / 8)
        expected = np.zeros(16)
        expected[i], expected[i + 4] = math.cos(angle), math.sin(angle)
        np.testing.assert_allclose(y, expected, atol=1e-6)


def test_apply_rope_preserves_norm_of_rotated_part():
    x, _, cos, sin = _rope_inputs()
    y = apply_rope(x, cos, sin)
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(y[..., :8]), axis=-1),
        np.linalg.norm(np.asarray(x[..., :8]), axis=-1),
        rtol=1e-5,
    )


def test_apply_rope_matches_complex_rotation():
    """Half-split RoPE = multiplying z = x[:R/2] + i·x[R/2:R] by exp(i · position · inv_freq)."""
    x, positions, cos, sin = _rope_inputs()
    y = np.asarray(apply_rope(x, cos, sin))
    x = np.asarray(x, np.float64)
    inv_freq = 10000.0 ** (-np.arange(4) * 2 / 8)
    phase = np.exp(1j * np.asarray(positions)[..., None, None] * inv_freq)  # [B, S, 1, R/2]
    z = (x[..., :4] + 1j * x[..., 4:8]) * phase
    expected = np.concatenate([z.real, z.imag, x[..., 8:]], axis=-1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_apply_rope_dot_products_depend_only_on_relative_position():
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))

    def score(m, n):
        cos_m, sin_m = rope_tables(jnp.asarray([[m]]), 8, 10000.0)
        cos_n, sin_n = rope_tables(jnp.asarray([[n]]), 8, 10000.0)
        return float(jnp.sum(apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)))

    assert score(9, 4) == pytest.approx(score(30, 25), rel=1e-4)
    assert score(9, 4) != pytest.approx(score(9, 5), rel=1e-2)


def test_apply_rope_keeps_bfloat16():
    x, _, cos, sin = _rope_inputs()
    y = apply_rope(x.astype(jnp.bfloat16), cos, sin)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(y.astype(jnp.float32)), np.asarray(apply_rope(x, cos, sin)), atol=0.05
    )


# --------------------------------------------------------------------------------------------------
# swigluoai: (clip(u, ±ℓ) + 1) · g' · sigmoid(α g'), g' = min(g, ℓ).


def _swigluoai_at(gate, up):
    return float(swigluoai(jnp.float32(gate), jnp.float32(up), ALPHA, LIMIT))


def test_swigluoai_values_at_known_points():
    assert _swigluoai_at(0.0, 3.0) == 0.0
    assert _swigluoai_at(1.0, 0.0) == pytest.approx(_sigmoid(ALPHA), rel=1e-6)
    assert _swigluoai_at(2.0, 1.0) == pytest.approx(2 * 2 * _sigmoid(2 * ALPHA), rel=1e-6)
    assert _swigluoai_at(-1.0, -1.0) == 0.0  # up = -1 cancels the +1
    assert _swigluoai_at(-3.0, 2.0) == pytest.approx(3 * -3 * _sigmoid(-3 * ALPHA), rel=1e-6)


def test_swigluoai_clamps_gate_from_above_only():
    assert _swigluoai_at(10.0, 0.5) == _swigluoai_at(7.0, 0.5)
    assert _swigluoai_at(7.0, 0.5) == pytest.approx(1.5 * 7 * _sigmoid(7 * ALPHA), rel=1e-6)
    # Below -ℓ the gate is not clamped: -10·σ(-17.02) is ~100x smaller than -7·σ(-11.91).
    low = _swigluoai_at(-10.0, 0.5)
    assert low == pytest.approx(1.5 * -10 * _sigmoid(-10 * ALPHA), rel=1e-4)
    assert abs(low) < abs(_swigluoai_at(-7.0, 0.5)) / 50


def test_swigluoai_clamps_up_on_both_sides():
    assert _swigluoai_at(1.0, 10.0) == _swigluoai_at(1.0, 7.0)
    assert _swigluoai_at(1.0, 7.0) == pytest.approx(8 * _sigmoid(ALPHA), rel=1e-6)
    assert _swigluoai_at(1.0, -10.0) == _swigluoai_at(1.0, -7.0)
    assert _swigluoai_at(1.0, -7.0) == pytest.approx(-6 * _sigmoid(ALPHA), rel=1e-6)


def test_mlp_matches_reference():
    mlp = _random_module(lambda: MLP(8, 12, alpha=ALPHA, limit=LIMIT, std=1.0, rngs=nnx.Rngs(0)), 4)
    x = np.random.default_rng(5).normal(0, 3, (2, 3, 8))
    gate, up = x @ np.asarray(mlp.gate_proj[...]), x @ np.asarray(mlp.up_proj[...])
    assert np.any(gate > LIMIT) and np.any(np.abs(up) > LIMIT)  # the clamps take part
    gate_c, up_c = np.minimum(gate, LIMIT), np.clip(up, -LIMIT, LIMIT)
    expected = ((up_c + 1) * gate_c * _sigmoid(ALPHA * gate_c)) @ np.asarray(mlp.down_proj[...])
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x, jnp.float32))), expected, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# Router: chosen by sigmoid(logits) + bias, weighted by the bias-free scores renormalised over k.


def test_route_weights_are_renormalised_bias_free_scores():
    rng = np.random.default_rng(6)
    logits, bias = rng.normal(0, 2, (10, 8)), rng.normal(0, 0.3, 8)
    chosen, weights, scores = route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias), 3)
    chosen, weights = np.asarray(chosen), np.asarray(weights)
    s = _sigmoid(logits)
    np.testing.assert_allclose(np.asarray(scores), s, rtol=1e-6)
    for n in range(10):
        assert set(chosen[n]) == set(np.argsort(-(s[n] + bias))[:3])
        np.testing.assert_allclose(weights[n], s[n, chosen[n]] / s[n, chosen[n]].sum(), rtol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def test_route_bias_changes_choice_not_weights_formula():
    s = np.array([[0.9, 0.8, 0.3, 0.1]])
    logits = jnp.asarray(np.log(s / (1 - s)), jnp.float32)  # sigmoid(logits) = s
    chosen, weights, _ = route(logits, jnp.zeros(4), 2)
    assert set(np.asarray(chosen)[0]) == {0, 1}
    np.testing.assert_allclose(np.asarray(weights)[0], s[0, np.asarray(chosen)[0]] / 1.7, rtol=1e-6)
    chosen, weights, _ = route(logits, jnp.asarray([0.0, 0.0, 0.0, 1.0]), 2)
    chosen = np.asarray(chosen)[0]
    assert set(chosen) == {0, 3}  # 0.1 + 1.0 beats 0.8
    # Weighted by the scores alone: 0.9 / 1.0 and 0.1 / 1.0, not (0.9, 1.1) / 2.0.
    np.testing.assert_allclose(np.asarray(weights)[0], s[0, chosen] / 1.0, rtol=1e-6)


def test_balanced_bias_moves_each_expert_toward_mean_load():
    bias = jnp.asarray([[0.5, 0.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]])
    # means 6, 2 and 0, per layer; the third layer routed no token
    load = jnp.asarray([[9.0, 3.0, 6.0, 6.0], [0.0, 1.0, 1.0, 6.0], [0.0, 0.0, 0.0, 0.0]])
    new = np.asarray(balanced_bias(bias, load, 0.01))
    # rate × (mean - load) / mean, clipped to ±rate: idle +rate, ≥ 2× the mean -rate
    expected = [[0.495, 0.005, -0.5, 0.0], [0.01, 0.005, 0.005, -0.01], [0.1, 0.0, 0.0, 0.0]]
    np.testing.assert_allclose(new, expected, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# MoE block against a per-token loop.


def test_moe_matches_per_token_loop():
    config = ModelConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rotary_dim=4,
        dense_mlp_dim=8,
        layer_types=("full",),
        mlp_layer_types=("moe",),
        moe=MoEConfig(num_experts=5, experts_per_token=2, expert_dim=6, shared_expert_dim=7),
    )
    moe = _random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), seed=7, std=1.0)
    x = np.random.default_rng(8).normal(0, 1, (2, 4, 8))
    mask = np.array([[True, True, True, False], [True, True, False, False]])
    out, stats = moe(jnp.asarray(x, jnp.float32), jnp.asarray(mask))

    def ffn(v, gate_w, up_w, down_w):
        g, u = np.minimum(v @ gate_w, LIMIT), np.clip(v @ up_w, -LIMIT, LIMIT)
        return ((u + 1) * g * _sigmoid(ALPHA * g)) @ down_w

    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(moe)))
    expected, load, share, bias_mattered = np.zeros_like(x), np.zeros(5), np.zeros(5), False
    for b, t in np.ndindex(2, 4):
        v = x[b, t]
        s = _sigmoid(v @ p["router"])
        chosen = np.argsort(-(s + p["correction_bias"]))[:2]
        bias_mattered |= set(chosen) != set(np.argsort(-s)[:2])
        for e in chosen:
            expert = ffn(v, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
            expected[b, t] += 2.0 * s[e] / s[chosen].sum() * expert  # routed_scaling = 2
        shared = p["shared_expert"]
        expected[b, t] += ffn(v, shared["gate_proj"], shared["up_proj"], shared["down_proj"])
        if mask[b, t]:
            load[chosen] += 1
            share += s / s.sum()
    assert bias_mattered  # the correction bias changed some token's experts
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(stats.load), load)
    np.testing.assert_allclose(np.asarray(stats.score_share), share, rtol=1e-5)

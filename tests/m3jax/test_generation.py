"""Generation: KV-cached decoding equals the full forward, MSA decode reads only its blocks, and
batching, padding, stopping and compilation behave (greedy parity with transformers' `generate`:
tests/interop/test_hf_parity.py).

The models have MSA selection active: prompts are longer than topk_blocks · block_size, so a
decoded query keeps fewer blocks than it can see (asserted), and init_std is large enough that
logits are O(1), which makes the tolerances meaningful.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_run, tiny_vision_run

import m3jax
from m3jax import decode_attention, generation
from m3jax.model import functional
from pallas_kernels.attention.reference import gqa_attention
from pallas_kernels.msa import reference

ATOL = 2e-5  # float32 logits of std ≈ 1.7: decode step vs full forward (observed ≤ 5e-6)
MSA = {"block_size": 4, "topk_blocks": 3, "local_blocks": 1}  # selection past 12 positions
TEXT = tiny_run(model={"init_std": 0.3, "msa": MSA}).model
VISION = tiny_vision_run(model={"init_std": 0.3, "msa": MSA}).model
IMAGE = VISION.vision.image_token_id


def weights(config, seed=0):
    params, buffers = functional(config).init(seed)
    return {"params": params, "buffers": buffers}


def teacher_forced_logits(config, weights, full_rows, prompt_lengths, steps, **media):
    """Logits of the prefill and of `steps` decode steps fed the rows' next tokens: [n, B, V]."""
    prompts = [row[:n] for row, n in zip(full_rows, prompt_lengths)]
    logits, cache = generation.prefill(config, weights, prompts, **media, max_new_tokens=steps)
    out = [np.asarray(logits)]
    for i in range(steps):
        tokens = np.array([row[n + i] for row, n in zip(full_rows, prompt_lengths)])
        logits, cache = generation.decode_step(config, weights, tokens, cache)
        out.append(np.asarray(logits))
    assert list(np.asarray(cache.lengths)) == [n + steps for n in prompt_lengths]
    return np.stack(out)


@pytest.mark.slow
def test_decode_steps_equal_the_full_forward_for_rows_of_different_lengths():
    w = weights(TEXT)
    rng = np.random.default_rng(0)
    rows, prompt_lengths, steps = [rng.integers(0, 256, 45), rng.integers(0, 256, 45)], [30, 7], 14
    decoded = teacher_forced_logits(TEXT, w, rows, prompt_lengths, steps)
    full = np.asarray(m3jax.forward(TEXT, w, np.stack(rows)))  # causal: a prefix sees a prefix
    assert 0.3 < full.std() < 10
    for b, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(decoded[:, b], full[b, n - 1 : n + steps], rtol=0, atol=ATOL)


@pytest.mark.slow
def test_bfloat16_decode_steps_stay_with_the_bfloat16_full_forward():
    config = tiny_run(model={"init_std": 0.3, "msa": MSA, "dtype": "bfloat16"}).model
    w = weights(config)
    rows = [np.random.default_rng(5).integers(0, 256, 30)] * 2
    decoded = teacher_forced_logits(config, w, rows, [24, 9], 5)
    full = np.asarray(m3jax.forward(config, w, np.stack(rows)))
    for b, n in enumerate([24, 9]):
        np.testing.assert_allclose(decoded[:, b], full[b, n - 1 : n + 5], rtol=0, atol=0.05)


@pytest.mark.slow
def test_decode_steps_equal_the_full_forward_after_an_image_prompt():
    w = weights(VISION)
    rng = np.random.default_rng(1)
    grid = np.array([[1, 4, 4]])  # 16 patches -> 4 placeholder tokens
    row = np.concatenate([rng.integers(0, 256, 5), [IMAGE] * 4, rng.integers(0, 256, 30)])
    media = {"pixel_values": rng.normal(size=(16, 1176)).astype(np.float32),
             "image_grid_thw": grid}  # fmt: skip
    decoded = teacher_forced_logits(VISION, w, [row], [20], 10, **media)
    full = np.asarray(m3jax.forward(VISION, w, row[None, :30], **media))[0]
    np.testing.assert_allclose(decoded[:, 0], full[19:], rtol=0, atol=ATOL)
    # The image matters: the same prompt with other pixels decodes to other logits.
    other = {**media, "pixel_values": media["pixel_values"][::-1].copy()}
    changed = teacher_forced_logits(VISION, w, [row], [20], 0, **other)[0]
    assert np.abs(changed - decoded[0]).max() > 1e-2


@pytest.mark.parametrize("local_blocks", [1, 2])
def test_decode_block_selection_equals_the_full_forward_selection(local_blocks):
    """Every query position of a 37-token row: the decode-time choice from a 48-slot cache is the
    set `reference.select_blocks` keeps for that query in a full forward."""
    rng = np.random.default_rng(2)
    seq, slots, heads, dim, block_size, topk = 37, 48, 2, 8, 4, 3
    index_q = jnp.asarray(rng.normal(size=(2, seq, heads, dim)), jnp.float32)
    index_k = jnp.asarray(rng.normal(size=(2, seq, dim)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(seq), (2, seq))
    expected = reference.top_blocks(
        index_q, index_k, jnp.ones((2, seq), jnp.int32), positions, block_size=block_size,
        topk_blocks=topk, local_blocks=local_blocks,
    )  # fmt: skip  [B, S, Hi, k]
    cached = jnp.pad(index_k, ((0, 0), (0, slots - seq), (0, 0)))
    dropped = 0
    for p in range(seq):
        got = decode_attention.select_blocks(
            index_q[:, p : p + 1], cached, jnp.full((2,), p), block_size=block_size,
            topk_blocks=topk, local_blocks=local_blocks,
        )  # fmt: skip
        assert as_sets(got) == as_sets(expected[:, p]), p
        dropped += int((np.asarray(got) >= 0).sum(-1).min() < p // block_size + 1)
    assert dropped > 0  # the selection really drops visible blocks


def test_msa_decode_attention_reads_only_the_selected_blocks():
    """NaN in every cached key and value outside a head's selected blocks leaves its output
    unchanged, and the output is exact attention over the selected keys."""
    rng = np.random.default_rng(3)
    batch, slots, kv_heads, groups, dim, block_size = 2, 32, 2, 2, 8, 4
    q = jnp.asarray(rng.normal(size=(batch, 1, kv_heads * groups, dim)), jnp.float32)
    keys, values = (jnp.asarray(rng.normal(size=(batch, slots, kv_heads, dim)), jnp.float32)
                    for _ in range(2))  # fmt: skip
    positions = jnp.array([29, 13])
    blocks = jnp.array([[[7, 2, 0], [7, 5, -1]], [[3, 1, -1], [3, 0, 2]]])  # [B, K, k]
    out = decode_attention.sparse(q, keys, values, blocks, positions, block_size)
    key_block = jnp.arange(slots) // block_size
    chosen = (blocks[..., None] == key_block).any(-2)  # [B, K, T]
    poisoned = jnp.where(chosen.transpose(0, 2, 1)[..., None], keys, jnp.nan)
    poisoned_values = jnp.where(chosen.transpose(0, 2, 1)[..., None], values, jnp.nan)
    again = decode_attention.sparse(q, poisoned, poisoned_values, blocks, positions, block_size)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    visible = chosen & (jnp.arange(slots) <= positions[:, None, None])
    expected = gqa_attention(q, keys, values, visible[:, :, None, None, :])
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_generate_batched_prompts_of_different_lengths_equal_each_prompt_alone():
    w = weights(TEXT)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n) for n in (33, 5, 18)]
    batched = m3jax.generate(TEXT, w, prompts, max_new_tokens=10)
    assert batched.shape == (3, 10) and (batched >= 0).all()
    for prompt, row in zip(prompts, batched):
        np.testing.assert_array_equal(m3jax.generate(TEXT, w, [prompt], max_new_tokens=10)[0], row)


def test_generate_stops_a_row_at_eos_and_streams_every_step():
    w = weights(TEXT)
    prompts = [np.arange(20, 40), np.arange(50, 61)]
    free = m3jax.generate(TEXT, w, prompts, max_new_tokens=8)
    eos = int(free[0, 2])
    assert eos not in free[1, :3]  # row 1 goes on past step 2
    streamed = []
    stopped = m3jax.generate(TEXT, w, prompts, max_new_tokens=8, eos_token_id=eos,
                             on_tokens=streamed.append)  # fmt: skip
    first_eos = [int(np.argmax(row == eos)) if eos in row else 8 for row in free]
    for row, free_row, end in zip(stopped, free, first_eos):
        np.testing.assert_array_equal(row[: end + 1], free_row[: end + 1])
        assert (row[end + 1 :] == -1).all()
    np.testing.assert_array_equal(np.stack(streamed), stopped[:, : len(streamed)].T)


def test_generate_compiles_prefill_and_decode_once_for_prompts_in_one_bucket():
    w = weights(TEXT)
    generation._prefill_program.cache_clear()
    generation._decode_program.cache_clear()
    for lengths in ((9, 30), (12, 3)):
        m3jax.generate(TEXT, w, [np.arange(n) for n in lengths], max_new_tokens=4)
    assert generation._prefill_program.cache_info().currsize == 1
    assert generation._prefill_program(TEXT, 128)._cache_size() == 1
    assert generation._decode_program(TEXT)._cache_size() == 1


def test_generation_runs_capacity_dispatch_dropless():
    capacity = tiny_run(model={"moe": {"dispatch": "capacity", "capacity_factor": 0.1}}).model
    assert generation.decoding_config(capacity).moe.dispatch == "dropless"
    assert generation.decoding_config(TEXT) is TEXT


def test_generate_rejects_bad_arguments():
    w = weights(TEXT)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        m3jax.generate(TEXT, w, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        m3jax.generate(TEXT, w, [[1, 2], []])
    with pytest.raises(ValueError, match="top_p=0"):
        m3jax.generate(TEXT, w, [[1, 2]], temperature=1.0, top_p=0)


def as_sets(blocks) -> list:
    flat = np.asarray(blocks).reshape(-1, np.asarray(blocks).shape[-1])
    return [frozenset(int(i) for i in row if i >= 0) for row in flat]

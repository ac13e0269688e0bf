"""A byte-level BPE tokenizer.json (Hugging Face `tokenizers`, the format MiniMax ships) behind the
byte tokenizer's interface, training one offline, and choosing a run's tokenizer by name.

Special tokens are found by their strings, MiniMax-M3's: `]~!b[` (bos, id 200034 in M3), `[e~[`
(eos, 200020), `]!p~[` (pad, 200000), the placeholders `]<]image[>[` (200025) and `]<]video[>[`
(200026) and the vision brackets `]<]start of image[>[` / `]<]end of image[>[`, which transformers'
M3 processor also puts around video frames (spec §6.3). The pad string is optional (M3's
tokenizer_config names no pad token); without it padding uses eos, which carries no loss there.
Video timestamps (`]<]1.5 seconds[>[`) are ordinary text, as in M3's processor (spec §6.3): its
vocabulary has no timestamp tokens.

As with the byte tokenizer, `encode` never turns text into a special id: a literal
"]<]image[>[" in a document is tokenized as text (`encode_special_tokens`), so documents cannot
inject placeholders; the packer adds special ids itself.

`train_bpe` learns a vocabulary the M3 way round: BPE entries first (the 256 byte symbols, then
merges), the special tokens after them, as M3's 200,000 BPE entries are followed by its specials.
"""

import os
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.tokenizer import ByteTokenizer

BYTES = "bytes"  # data.tokenizer value of the byte tokenizer
ROLES = {  # attribute -> MiniMax-M3's string; the order special tokens get when we train
    "pad_id": "]!p~[",
    "bos_id": "]~!b[",
    "eos_id": "[e~[",
    "image_id": "]<]image[>[",
    "video_id": "]<]video[>[",
    "vision_start_id": "]<]start of image[>[",
    "vision_end_id": "]<]end of image[>[",
}
OPTIONAL_ROLES = ("pad_id",)


class TokenizerError(ValueError):
    """A tokenizer file is unusable; the message names the file and what is missing."""


class BPETokenizer:
    """A tokenizer.json with the interface of `ByteTokenizer`: vocab_size, the special ids,
    encode(text, add_bos=, add_eos=) and decode(ids)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            self._tokenizer = Tokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises plain Exceptions for unreadable files
            raise TokenizerError(f"{self.path}: not a readable tokenizer.json ({e})") from None
        self._tokenizer.encode_special_tokens = True  # text never becomes a special id
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        for role, token in ROLES.items():
            token_id = self._tokenizer.token_to_id(token)
            if token_id is None and role not in OPTIONAL_ROLES:
                raise TokenizerError(
                    f"{self.path}: has no special token {token!r} ({role.removesuffix('_id')}); "
                    "m3-tokenizer train adds MiniMax-M3's special tokens"
                )
            setattr(self, role, token_id)
        if self.pad_id is None:
            self.pad_id = self.eos_id

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Returns the int32 ids [S] of `text`, optionally wrapped in bos/eos."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(
            ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else []), np.int32
        )

    def decode(self, ids) -> str:
        """Returns the text of a 1-D sequence of ids; special ids render as their strings.
        Ids outside [0, vocab_size) raise ValueError."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"decode expects a 1-D sequence of integer ids, got {ids.shape}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[bad.argmax()])} is outside the vocabulary "
                f"[0, {self.vocab_size}) of {self.path}"
            )
        return self._tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def load_tokenizer(name: str) -> ByteTokenizer | BPETokenizer:
    """`data.tokenizer`: "bytes" (the byte tokenizer) or the path of a tokenizer.json."""
    return ByteTokenizer() if name == BYTES else BPETokenizer(name)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` entries, MiniMax-M3's special tokens included (at
    the end). A corpus too small for that many merges gives fewer."""
    bpe_entries = vocab_size - len(ROLES)
    if bpe_entries < 256:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for merges: the 256 byte symbols and "
            f"{len(ROLES)} special tokens take {256 + len(ROLES)}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_entries,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(list(ROLES.values()))
    return tokenizer

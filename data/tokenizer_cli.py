"""`m3-tokenizer`: train a byte-level BPE tokenizer.json offline, with MiniMax-M3's special tokens.

    m3-tokenizer train --input SHARDS_OR_TEXT [--input ...] --vocab-size N --output tokenizer.json

Each --input is a shard set (a folder written by `m3-shards build`, or `demo:multimodal` /
`demo:text`: the demo corpus) whose text segments are read, or a text source as `data.source`
takes it (`shakespeare`, a .txt/.md/.jsonl file or a folder of them). The tokenizer has at most N
entries: 256 byte symbols, merges, then the special tokens (data/bpe_tokenizer.py). A run uses it
with `data.tokenizer: PATH/tokenizer.json`. Errors stop with one line on stderr, exit code 2.
"""

import argparse
import pathlib
import sys
from collections.abc import Iterator

from data.bpe_tokenizer import ROLES, BPETokenizer, TokenizerError, train_bpe
from data.demo_corpus import DEMO_PREFIX, shard_set_path
from data.shard_format import MANIFEST_NAME, ShardFormatError, decode_record
from data.shard_reader import ShardSet
from data.text_corpus import load_documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-tokenizer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a byte-level BPE tokenizer.json")
    train.add_argument("--input", action="append", required=True,
                       help="shard set or text source; repeat for several")  # fmt: skip
    train.add_argument("--vocab-size", type=int, required=True, help="entries, specials included")
    train.add_argument("--output", required=True, type=pathlib.Path, help="tokenizer.json to write")
    args = parser.parse_args(argv)
    try:
        tokenizer = train_bpe(_texts(args.input), args.vocab_size)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(args.output))
        written = BPETokenizer(args.output)
    except (OSError, ValueError, ShardFormatError, TokenizerError) as e:
        print(f"m3-tokenizer: error: {e}", file=sys.stderr)
        return 2
    ids = ", ".join(f"{role.removesuffix('_id')} {getattr(written, role)}" for role in ROLES)
    print(f"m3-tokenizer: wrote {args.output}: {written.vocab_size} entries "
          f"(asked for {args.vocab_size}); special ids: {ids}")  # fmt: skip
    return 0


def _texts(inputs: list[str]) -> Iterator[str]:
    """The text of every input, one string per text segment or document, read lazily."""
    for name in inputs:
        path = shard_set_path(name)
        if name.startswith(DEMO_PREFIX) or (pathlib.Path(path) / MANIFEST_NAME).is_file():
            yield from _shard_texts(path)
        else:
            yield from (document.text for document in load_documents(path))


def _shard_texts(directory: str) -> Iterator[str]:
    shards = ShardSet(directory)
    for position in range(len(shards)):
        raw = shards[position]
        if raw.error:
            raise ShardFormatError(f"{raw.where}: {raw.error}")
        for segment in decode_record(raw.data)["segments"]:
            if segment["type"] == "text":
                yield segment["text"]


if __name__ == "__main__":
    sys.exit(main())

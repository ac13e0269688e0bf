"""`m3-shards`: build, inspect and verify shard sets.

    m3-shards build --input SRC --output DIR [--shard-size 512MB] [--workers N]
    m3-shards inspect DIR [--samples 3] [--tokenizer bytes|PATH/tokenizer.json]
    m3-shards verify DIR

`build` reads a JSONL manifest or a document folder (README "Shards"), checks and fits every
media file, writes shards atomically and ends with the list of skipped inputs and their reasons.
`inspect` prints the manifest's counts and decodes a few records, counting their tokens with the
chosen tokenizer. `verify` re-reads every record,
decodes its media and compares it with the index; it exits 1 if anything is wrong.
Errors that stop a command are one line on stderr, exit code 2.
"""

import argparse
import dataclasses
import re
import sys

import numpy as np
from tqdm import tqdm

from data.media import MediaError, MediaLimits, decode_image, probe_video
from data.mm_documents import DocumentProcessor
from data.shard_builder import index_row, write_documents
from data.shard_format import ShardFormatError, decode_record, file_sha256
from data.shard_inputs import BuildError, read_inputs
from data.shard_reader import ShardSet
from data.bpe_tokenizer import BYTES, TokenizerError, load_tokenizer
from data.vision_processing import ProcessorConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """ "512MB" -> 512·2^20 bytes (K/M/G/T are powers of 1024; a bare number is bytes)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512MB, 64KB or 1G")
    number, unit = float(match.group(1)), match.group(2).lower()
    value = int(number * 1024 ** " kmgt".index(unit or " "))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least one byte")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-shards", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write a shard set from a manifest or folder")
    build.add_argument("--input", required=True, help="JSONL manifest or document folder")
    build.add_argument("--output", required=True, help="new folder for the shard set")
    build.add_argument("--shard-size", type=parse_size, default="512MB", help="bytes per shard")
    build.add_argument("--workers", type=int, default=1, help="processes checking media")
    build.add_argument("--license", help="licence of documents that do not name one")
    build.add_argument("--source", help="source of documents that do not name one")
    build.add_argument("--max-tokens", type=int, help="skip documents estimated longer")
    build.add_argument(
        "--strict", action="store_true",
        help="skip what is otherwise written with a warning: empty documents, images smaller "
        "than one patch, repeated ids",
    )  # fmt: skip
    limits = MediaLimits()
    for field in dataclasses.fields(MediaLimits):
        build.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(getattr(limits, field.name)),
            default=getattr(limits, field.name),
            help=f"media cap (default {getattr(limits, field.name)})",
        )
    build.add_argument("--no-progress", action="store_true")
    inspect = commands.add_parser("inspect", help="print counts and a few decoded records")
    inspect.add_argument("directory")
    inspect.add_argument("--samples", type=int, default=3)
    inspect.add_argument("--tokenizer", default=BYTES, help="bytes (default) or a tokenizer.json")
    verify = commands.add_parser("verify", help="re-read and decode every record")
    verify.add_argument("directory")
    verify.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            return _build(args)
        if args.command == "inspect":
            return _inspect(args.directory, args.samples, args.tokenizer)
        return _verify(args.directory, progress=not args.no_progress)
    except (BuildError, ShardFormatError, TokenizerError, OSError, ValueError) as e:
        print(f"m3-shards: error: {e}", file=sys.stderr)
        return 2


def _build(args) -> int:
    if args.workers < 1:
        raise BuildError(f"--workers={args.workers} must be >= 1")
    limits = MediaLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MediaLimits)})
    documents, problems = read_inputs(args.input, source=args.source, license=args.license)
    report = write_documents(
        documents,
        args.output,
        shard_size=args.shard_size,
        workers=args.workers,
        limits=limits,
        max_tokens=args.max_tokens,
        progress=not args.no_progress,
        info={"built_from": str(args.input), "media_limits": dataclasses.asdict(limits)},
        total=len(documents),
        strict=args.strict,
    )
    report.skipped = sorted(problems + report.skipped, key=lambda item: _natural(item[0]))
    totals = report.totals
    print(
        f"m3-shards: wrote {report.documents} documents in {report.shards} shard(s), "
        f"{report.bytes / 2**20:.1f} MiB, to {report.output}: {totals['images']} images, "
        f"{totals['videos']} videos ({totals['video_seconds']:.1f} s), "
        f"{totals['text_bytes']} text bytes, ~{totals['est_tokens']} tokens"
    )
    for where, note in report.notes:
        print(f"  re-encoded  {where}: {note}")
    for where, warning in report.warnings:
        print(f"  warning     {where}: {warning}")
    if report.skipped:
        print(f"m3-shards: skipped {len(report.skipped)} input(s):")
        for where, reason in report.skipped:
            print(f"  skipped     {where}: {reason}")
    return 0


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _inspect(directory: str, samples: int, tokenizer_name: str) -> int:
    tokenizer = load_tokenizer(tokenizer_name)
    shards = ShardSet(directory)
    manifest = shards.manifest
    print(f"{directory}: schema v{manifest['version']}, {len(shards)} records in "
          f"{len(shards.shards)} shard(s), {sum(shards.sizes.values()) / 2**20:.1f} MiB")  # fmt: skip
    for name, value in manifest["totals"].items():
        print(
            f"  {name:14s} {value:,.1f}" if isinstance(value, float) else f"  {name:14s} {value:,}"
        )
    config = ProcessorConfig(**manifest.get("processor_for_estimates", {}))
    processor = DocumentProcessor(tokenizer, config, 1 << 30, 1 << 30)
    for position in np.linspace(0, len(shards) - 1, min(samples, len(shards))).astype(int):
        raw = shards[int(position)]
        print(f"\n{raw.where}")
        if raw.error:
            print(f"  ERROR {raw.error}")
            continue
        record = decode_record(raw.data)
        print(f"  doc_id {record['doc_id']!r}  source {record['source']!r}  "
              f"license {record['license']!r}  meta {record['meta']}")  # fmt: skip
        for segment in record["segments"]:
            print("  " + _describe(segment))
        document = processor(raw)
        if hasattr(document, "tokens"):
            print(f"  -> {len(document.tokens)} tokens, {len(document.patches)} patches "
                  f"(the manifest's processor, tokenizer {tokenizer_name})")  # fmt: skip
        else:
            print(f"  -> not usable: {document.reason}")
    return 0


def _describe(segment: dict) -> str:
    if segment["type"] == "text":
        text = segment["text"].replace("\n", " ")
        return f"text  {len(segment['text'])} chars: {text[:70]!r}{'...' if len(text) > 70 else ''}"
    if segment["type"] == "image":
        shape = decode_image(segment["bytes"]).shape
        return f"image {segment['format']} {segment['width']}x{segment['height']} (decoded {shape})"
    return (f"video {segment['format']} {segment['width']}x{segment['height']} "
            f"{segment['num_frames']} frames at {segment['fps']:g} fps ({segment['duration']:.1f} s)")  # fmt: skip


def _verify(directory: str, progress: bool) -> int:
    shards = ShardSet(directory)
    problems = []
    for entry in shards.manifest["shards"]:
        digest = file_sha256(shards.directory / entry["file"])
        if digest != entry.get("sha256"):
            problems.append(f"{entry['file']}: sha256 {digest[:12]}... differs from the manifest")
    processor = ProcessorConfig(**shards.manifest.get("processor_for_estimates", {}))
    for position in tqdm(range(len(shards)), desc="m3-shards verify", disable=not progress):
        raw = shards[position]
        try:
            if raw.error:
                raise ShardFormatError(raw.error)
            record = decode_record(raw.data)
            for number, segment in enumerate(record["segments"]):
                _check_media(segment, number)
            expected = index_row(record, len(raw.data), processor)
            if expected.tobytes() != shards.index[position].tobytes():
                raise ShardFormatError("index row does not match the record")
        except (ShardFormatError, MediaError) as e:
            problems.append(f"{raw.where}: {e}")
    for problem in problems:
        print(f"  BAD  {problem}")
    print(f"m3-shards verify: {len(shards)} records in {len(shards.shards)} shard(s), "
          f"{len(problems)} problem(s)")  # fmt: skip
    return 1 if problems else 0


def _check_media(segment: dict, number: int) -> None:
    try:
        if segment["type"] == "image":
            height, width = decode_image(segment["bytes"]).shape[:2]
            if (height, width) != (segment["height"], segment["width"]):
                raise MediaError(f"decodes to {width}x{height}, record says "
                                 f"{segment['width']}x{segment['height']}")  # fmt: skip
        elif segment["type"] == "video":
            info = probe_video(segment["bytes"])
            if info.num_frames != segment["num_frames"]:
                raise MediaError(f"{info.num_frames} frames, record says {segment['num_frames']}")
    except MediaError as e:
        raise MediaError(f"segment {number} ({segment['type']}): {e}") from None


if __name__ == "__main__":
    sys.exit(main())

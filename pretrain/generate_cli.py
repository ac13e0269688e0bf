"""`m3-generate`: continue a prompt of text, images and a video with a trained or exported model.

    m3-generate --run runs/demo [--step N] --prompt "A photo of" [--image a.jpg ...] [--video c.mp4]
    m3-generate --hf exports/demo --prompt TEXT [...]
                [--max-new-tokens 64] [--temperature 0.8 --top-p 0.95 --top-k 50 --seed 0]

--run reads a checkpoint of an m3-train run (the latest by default) and processes media with the
run's `data.processor`; --hf reads a MiniMax-M3-VL checkpoint (m3-export's output) and processes
media as M3 does. The prompt is <bos>, the images, the video, then the text (data/prompt.py); the
continuation streams to stdout as it is generated and stops at <eos> or --max-new-tokens. Greedy
unless --temperature > 0. Tokens are the run's data.tokenizer (bytes or a tokenizer.json; bytes
for --hf unless --tokenizer names one); the model's vocabulary and vision placeholder ids must
fit it. Bad input stops with one line on stderr and exit code 2 (the traceback with --debug).
"""

import argparse
import pathlib
import sys
from typing import TextIO

import numpy as np

import m3jax
from data.bpe_tokenizer import BYTES, BPETokenizer
from data.prompt import encode_prompt
from data.tokenizer import ByteTokenizer
from data.vision_processing import ProcessorConfig
from m3jax.config import ModelConfig
from pretrain.cli import add_debug_flag, run_command
from pretrain.data_loading import check_tokenizer, named_tokenizer
from pretrain.run_checkpoint import load_weights, open_run

Tokenizer = ByteTokenizer | BPETokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m3-generate", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=pathlib.Path, help="m3-train run directory")
    source.add_argument("--hf", type=pathlib.Path, help="MiniMax-M3-VL checkpoint directory")
    parser.add_argument("--step", type=int, help="with --run: checkpoint step (default: latest)")
    parser.add_argument("--prompt", required=True, help="the text the continuation follows")
    parser.add_argument("--image", type=pathlib.Path, action="append", default=[],
                        help="an image file (repeat for several), before the text")  # fmt: skip
    parser.add_argument("--video", type=pathlib.Path, help="a video file, before the text")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 (default): no limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="bytes or a tokenizer.json (default: the run's "
                        "data.tokenizer; bytes with --hf)")  # fmt: skip
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.step is not None and args.run is None:
        parser.error("--step needs --run")

    def command() -> int:
        config, weights, processor, origin, trained_with = _load(args)
        tokenizer_name = args.tokenizer or trained_with
        tokenizer = named_tokenizer(tokenizer_name)
        check_tokenizer(config, tokenizer, tokenizer_name, media=bool(args.image or args.video))
        prompt = encode_prompt(
            args.prompt,
            images=[path.read_bytes() for path in args.image],
            video=args.video.read_bytes() if args.video else None,
            tokenizer=tokenizer,
            processor=processor,
        )
        print(f"m3-generate: {origin}; prompt of {len(prompt.input_ids)} tokens", file=sys.stderr)
        stream = TextStream(tokenizer, sys.stdout)
        m3jax.generate(
            config, weights, [prompt.input_ids], **prompt.media,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            eos_token_id=tokenizer.eos_id, on_tokens=stream,
        )  # fmt: skip
        stream.close()
        return 0

    return run_command("m3-generate", command, debug=args.debug)


def continuation_text(ids: np.ndarray, tokenizer: Tokenizer) -> str:
    """The text of generated ids [N] (m3jax.generate's row) up to <eos> or -1, as TextStream
    prints it: ids the tokenizer lacks (a model's spare vocabulary rows) as <|id:N|>."""
    ids = np.asarray(ids)
    ends = np.flatnonzero((ids < 0) | (ids == tokenizer.eos_id))
    ids = ids[: ends[0] if len(ends) else len(ids)]
    known = ids < tokenizer.vocab_size
    cuts = np.flatnonzero(np.diff(known.astype(np.int8))) + 1
    return "".join(
        tokenizer.decode(run) if known[start] else "".join(f"<|id:{i}|>" for i in run)
        for run, start in zip(np.split(ids, cuts), [0, *cuts])
        if len(run)
    )


class TextStream:
    """Writes generated ids as text as they come, for either tokenizer: each call renders the
    whole continuation so far (`continuation_text`) and writes what is new, holding back trailing
    U+FFFD (a UTF-8 sequence or byte-level BPE token split over several ids) until the next id
    completes it; <eos> and -1 (a finished row) print nothing."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self._ids: list[int] = []
        self._written = 0

    def __call__(self, ids: np.ndarray) -> None:
        token = int(ids[0])
        if token < 0 or token == self.tokenizer.eos_id:
            return
        self._ids.append(token)
        self._write(continuation_text(np.array(self._ids), self.tokenizer).rstrip("\ufffd"))

    def close(self) -> None:
        self._write(continuation_text(np.array(self._ids, np.int64), self.tokenizer))
        self.out.write("\n")
        self.out.flush()

    def _write(self, text: str) -> None:
        if len(text) > self._written:
            self.out.write(text[self._written :])
            self.out.flush()
            self._written = len(text)


def _load(args) -> tuple[ModelConfig, dict, ProcessorConfig, str, str]:
    """(config, weights, media processor, where they came from, the tokenizer they were
    trained with: the run's data.tokenizer, "bytes" for an export)."""
    if args.run is not None:
        checkpoint = open_run(args.run, args.step)
        weights = load_weights(checkpoint)
        origin = f"step {checkpoint.step} of {args.run}"
        run = checkpoint.run
        return run.model, weights, run.data.processor, origin, run.data.tokenizer
    config, weights = m3jax.load_pretrained(args.hf)
    vision = config.vision
    processor = ProcessorConfig()
    if vision is not None:  # M3's pixel budgets with this tower's patch geometry
        processor = ProcessorConfig(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            spatial_merge_size=vision.spatial_merge_size,
        )
    return config, weights, processor, str(args.hf), BYTES


if __name__ == "__main__":
    sys.exit(main())

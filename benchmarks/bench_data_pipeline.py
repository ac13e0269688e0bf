"""Input-pipeline throughput on this CPU: documents, tokens, images and video seconds per second.

    python -m benchmarks.bench_data_pipeline [--large-docs 160] [--workers 2]

Datasets: the demo corpus (multimodal and Shakespeare shard sets, demo processor budgets) and a
synthetic larger set built here (photo-like JPEGs of 320-1024 px and 4 s 320x240 clips at 24 fps,
processed with M3's default budgets). Each variant reads one epoch through the full pipeline
(decode, resize, patchify, pack, batch); rates are measured after the first batch (worker start-up
is reported apart) and scale the shard index's totals by the share of tokens read in that time.
`workers=0` runs everything in this process, and the per-cpu-s columns divide by its CPU time: one
core's throughput, unaffected by other load on the machine. Prints a markdown table, then JSON.
"""

import argparse
import io
import json
import os
import pathlib
import tempfile
import time

import numpy as np
import PIL.Image

from data.demo_corpus import DEMO_PROCESSOR, demo_shard_sets
from data.media import encode_video
from data.mm_loader import MultimodalLoader
from data.shard_builder import write_documents
from data.shard_inputs import InputDocument
from data.shard_reader import ShardSet
from data.vision_processing import ProcessorConfig

M3 = ProcessorConfig()


def synthetic_documents(count: int, seed: int = 0) -> list[InputDocument]:
    """Photo-like images (smooth noise, JPEG) and clips with 100-2000 bytes of text each."""
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(count):
        segments = [("text", "lorem ipsum " * int(rng.integers(10, 170)))]
        if i % 8 == 7:
            base = rng.integers(0, 256, (96 // 8, 32 // 8 * 10, 3), dtype=np.uint8)
            frames = np.stack([
                np.asarray(PIL.Image.fromarray(np.roll(base, t, axis=1)).resize((320, 240)))
                for t in range(96)
            ])  # fmt: skip
            segments.append(("video", encode_video(frames, 24.0)))
        else:
            height, width = (int(x) for x in rng.integers(320, 1024, 2))
            small = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
            image = PIL.Image.fromarray(small).resize((width, height), PIL.Image.BICUBIC)
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=90)
            segments.append(("image", buffer.getvalue()))
        segments.append(("text", "the end"))
        documents.append(
            InputDocument(f"syn{i}", f"syn{i}", "bench", "CC0-1.0", {}, tuple(segments))
        )
    return documents


def run_epoch(path, processor, *, seq_len, patch_budget, batch_size, workers) -> dict:
    shards = ShardSet(path)
    loader = MultimodalLoader(
        [str(path)], seq_len=seq_len, batch_size=batch_size, patch_budget=patch_budget, seed=0,
        processor=processor, num_workers=workers, num_epochs=1, shard_index=0, shard_count=1,
        read_threads=1,
    )  # fmt: skip
    start = time.perf_counter()
    first = None  # time and tokens at the first batch: worker start-up is left out
    tokens = rows = 0
    for batch in loader:
        tokens += int((batch.segment_ids > 0).sum())
        rows += batch.tokens.shape[0]
        if first is None:
            first = (time.perf_counter(), tokens, time.process_time())
    end, cpu_end = time.perf_counter(), time.process_time()
    loader.close()
    index = shards.index
    # Rates over the steady part (after the first batch), scaled by its share of the tokens.
    share = (tokens - first[1]) / tokens
    seconds = end - first[0]
    return {
        "startup_s": first[0] - start,
        "seconds": seconds,
        "documents_per_s": share * len(index) / seconds,
        "tokens_per_s": (tokens - first[1]) / seconds,
        "images_per_s": share * float(index["images"].sum()) / seconds,
        "video_seconds_per_s": share * float(index["video_seconds"].sum()) / seconds,
        "row_fill": tokens / max(1, rows * seq_len),
        # CPU seconds of this process (all its threads) in the steady part: with workers=0 this is
        # the pipeline's whole cost, so per-CPU-second rates hold however busy the machine is.
        "cpu_seconds": cpu_end - first[2],
        "documents_per_cpu_s": share * len(index) / (cpu_end - first[2]),
        "tokens_per_cpu_s": (tokens - first[1]) / (cpu_end - first[2]),
        "images_per_cpu_s": share * float(index["images"].sum()) / (cpu_end - first[2]),
        "video_seconds_per_cpu_s": share
        * float(index["video_seconds"].sum())
        / (cpu_end - first[2]),
    }


def cpu_rate(result: dict, what: str) -> float:
    """Per CPU-second of the main process: meaningful only without worker processes."""
    return result[f"{what}_per_cpu_s"] if result["workers"] == 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large-docs", type=int, default=160)
    parser.add_argument("--workers", type=int, default=2, help="also run with this many workers")
    args = parser.parse_args()
    demo = demo_shard_sets(progress=False)
    with tempfile.TemporaryDirectory() as scratch:
        large = pathlib.Path(scratch) / "large"
        write_documents(synthetic_documents(args.large_docs), large, shard_size=32 << 20)
        variants = [
            ("demo multimodal", demo["multimodal"], DEMO_PROCESSOR, 256, 256),
            ("demo text (Shakespeare)", demo["text"], DEMO_PROCESSOR, 256, 0),
            ("synthetic large (M3 budgets)", large, M3, 4096, 8192),
        ]
        results = []
        for name, path, processor, seq_len, budget in variants:
            for workers in sorted({0, args.workers}):
                result = run_epoch(path, processor, seq_len=seq_len, patch_budget=budget,
                                   batch_size=4, workers=workers)  # fmt: skip
                results.append({"dataset": name, "workers": workers, "seq_len": seq_len,
                                "patch_budget": budget, **result})  # fmt: skip
    print(f"\nData pipeline, one epoch, {os.cpu_count()} CPU core(s) on this machine\n")
    print(
        "| dataset | workers | S / P | docs/s | tokens/s | images/s | video s/s | row fill "
        "| start-up s | steady s | docs/cpu-s | tokens/cpu-s | images/cpu-s | video s/cpu-s |"
    )
    print("|---" * 14 + "|")
    for r in results:
        print(f"| {r['dataset']} | {r['workers']} | {r['seq_len']} / {r['patch_budget']} | "
              f"{r['documents_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['images_per_s']:.1f} | "
              f"{r['video_seconds_per_s']:.2f} | {r['row_fill']:.3f} | {r['startup_s']:.1f} | "
              f"{r['seconds']:.1f} | {cpu_rate(r, 'documents'):.1f} | {cpu_rate(r, 'tokens'):,.0f} | "
              f"{cpu_rate(r, 'images'):.1f} | {cpu_rate(r, 'video_seconds'):.2f} |")  # fmt: skip
    print(
        json.dumps({"benchmark": "data_pipeline", "cpu_count": os.cpu_count(), "results": results})
    )


if __name__ == "__main__":
    main()

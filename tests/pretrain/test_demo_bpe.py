"""configs/demo-bpe.yaml end to end, as `make demo-bpe` runs it: a BPE tokenizer trained offline
by `m3-tokenizer train`, then m3-train with one MTP module, accumulation 2 and evaluation (a few
steps of it)."""

import pytest
from conftest import REPO

from data.bpe_tokenizer import BPETokenizer
from data.tokenizer_cli import main as tokenizer_main
from pretrain.config import load_run_config
from pretrain.metrics import read_metrics
from pretrain.train import main as train_main

CONFIG = REPO / "configs" / "demo-bpe.yaml"


@pytest.mark.slow
def test_demo_bpe_trains_with_bpe_mtp_accumulation_and_evaluation(tmp_path, capsys):
    tokenizer_path = tmp_path / "tokenizer.json"
    inputs = ["--input", "demo:multimodal", "--input", "demo:text"]
    args = ["train", *inputs, "--vocab-size", "1024", "--output", str(tokenizer_path)]
    assert tokenizer_main(args) == 0
    run = load_run_config(CONFIG)
    tokenizer = BPETokenizer(tokenizer_path)
    assert run.model.vocab_size == tokenizer.vocab_size == 1024
    assert (run.model.vision.image_token_id, run.model.vision.video_token_id) == (
        tokenizer.image_id, tokenizer.video_id,
    )  # fmt: skip
    assert (run.model.mtp.num_modules, run.train.grad_accum_steps) == (1, 2)
    overrides = [f"data.tokenizer={tokenizer_path}", "train.steps=4", "eval.every_steps=2",
                 "eval.batches=1", "logging.every_steps=2", "logging.progress_bar=false",
                 "checkpoint.every_steps=4"]  # fmt: skip
    run_dir = tmp_path / "run"
    assert train_main(["--config", str(CONFIG), "--run-dir", str(run_dir), *overrides]) == 0
    assert "held-out     LM loss" in capsys.readouterr().out
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4]
    assert all(r["mtp_nll"] > 0 and r["image_tokens"] + r["video_tokens"] > 0 for r in steps)
    assert [r["step"] for r in records if "eval_nll" in r] == [2, 4]
    assert (run_dir / "checkpoints" / "4").is_dir()

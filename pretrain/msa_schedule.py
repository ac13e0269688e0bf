"""MSA's dense warm-up during training (spec/msa.md §2): the phase a run is in by the tokens it has
seen, and what each step's (and each evaluation's) forward pass computes besides the LM loss.

Phases: "dense_warmup" (MSA layers attend densely; the indexer learns from the KL) until
`model.msa.warmup_tokens`, then "sparse" (the selection is in use); None for models without MSA
layers.
"""

from m3jax.attention import ForwardMode
from m3jax.config import ModelConfig


def msa_phase(model: ModelConfig, tokens_seen: int) -> str | None:
    """ "dense_warmup" until msa.warmup_tokens, then "sparse"; None for models without MSA."""
    if not model.msa_layers:
        return None
    return "dense_warmup" if tokens_seen < model.msa.warmup_tokens else "sparse"


def forward_mode(model: ModelConfig, tokens_seen: int, *, block_recall: bool) -> ForwardMode:
    """What a forward pass computes besides the LM loss after `tokens_seen` training tokens: the
    MSA layers dense in the warm-up, the indexer loss whenever there are MSA layers, and the block
    recall if `block_recall` (m3-train: every logging.msa_recall_every steps; evaluation:
    always)."""
    phase = msa_phase(model, tokens_seen)
    return ForwardMode(
        msa_dense=phase == "dense_warmup",
        indexer_loss=phase is not None,
        block_recall=phase is not None and block_recall,
    )

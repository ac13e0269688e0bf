"""The attention computations a layer needs, by implementation (config `attention_impl`).

Every MSA backend module implements the signatures that `pallas_kernels/msa/reference.py` owns
(`top_blocks`, `sparse_attention`, `dense_attention`, `block_recall`), so the model switches with
one field:
- "reference": the O(S²) `jnp` references (exact, readable; tests and short S);
- "xla": query-tiled XLA with memory linear in S (pallas_kernels/*/xla.py);
- "pallas": the kernels of the machine, an error where they cannot run the layer — on GPUs MSA's
  Pallas kernels (pallas_kernels/msa/pallas.py) and cuDNN's packed flash attention for dense
  attention (pallas_kernels/attention/cudnn.py); on TPUs MSA's Mosaic TPU kernels
  (pallas_kernels/msa/tpu.py) and jax's splash attention with segment ids for dense attention
  (pallas_kernels/attention/splash.py);
- "auto" (default): "pallas" on GPUs and TPUs where the kernels apply, else "xla".
Under context parallelism (mesh seq > 1, m3jax/context_parallel.py) a device's queries are two
chunks of the row at given slots (`query_slots`, two runs of consecutive slots). Every MSA
backend takes them (the GPU kernels as runs). cuDNN and splash take whole rows only: a device
runs them on the whole row, its queries in their slots and zeros elsewhere (`through_whole_rows`
in pallas_kernels/attention/reference.py), so its dense layers do the row's attention work
unsplit, at the kernel's rate.

Shapes: B batch, S sequence, H query heads, K kv heads (= Hi index heads), Dh head dim, Di index
head dim.
"""

from collections.abc import Sequence
from types import ModuleType, SimpleNamespace

import jax
import numpy as np

from m3jax.config import MSAConfig
from pallas_kernels import target
from pallas_kernels.attention import cudnn as attention_cudnn
from pallas_kernels.attention import splash as attention_splash
from pallas_kernels.attention import xla as attention_xla
from pallas_kernels.attention.reference import at_query_slots, document_causal_mask, gqa_attention
from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import reference as msa_reference
from pallas_kernels.msa import tpu as msa_tpu
from pallas_kernels.msa import xla as msa_xla
from pallas_kernels.msa.mosaic_backward import most_documents
from pallas_kernels.msa.reference import Student, kl_through_sink

MSA_BACKENDS = {"reference": msa_reference, "xla": msa_xla, "pallas": msa_pallas}


def documents_bound(seq: int, block_size: int) -> int:
    """The most runs of segment ids a row of `seq` tokens may hold for every kernel here to run
    it without its fallback: cuDNN's packed layout has `default_segments(seq)` slots, and the MSA
    GPU kernels' tables hold the segments of rows of up to `mosaic_backward.most_documents`."""
    return min(attention_cudnn.default_segments(seq), most_documents(seq, block_size))


def holds_few_documents(segment_ids: np.ndarray, block_size: int) -> bool:
    """Whether every row of a host batch's segment_ids [B, T] has at most `documents_bound` runs
    of equal ids (padding's run counted): `ForwardMode.few_documents` for the step that takes it."""
    runs = 1 + (segment_ids[:, 1:] != segment_ids[:, :-1]).sum(axis=1)
    return bool(runs.max() <= documents_bound(segment_ids.shape[1], block_size))


def msa_backend(
    impl: str,
    msa: MSAConfig,
    q: jax.Array,
    k: jax.Array,
    index_q: jax.Array,
    gpu_settings: Sequence[str] = (),
    few_documents: bool = False,
) -> ModuleType | SimpleNamespace:
    """The backend that runs an MSA layer with these operands under `attention_impl=impl` (a
    module, or the GPU kernels' functions under `gpu_settings`: the model's `msa_kernels`;
    few_documents: `ForwardMode.few_documents`, the GPU kernels without their fallback)."""
    if impl in ("reference", "xla"):
        return MSA_BACKENDS[impl]
    platform = target.platform()
    if impl == "auto" and platform not in ("gpu", "tpu"):
        return msa_xla
    kernels = (
        msa_tpu if platform == "tpu" else msa_pallas.configured(gpu_settings, few_documents)
    )
    reason = kernels.unsupported_reason(q, k, index_q, block_size=msa.block_size)
    if impl == "pallas" and reason:
        raise ValueError(f"attention_impl='pallas' cannot run this MSA layer: {reason}")
    return msa_xla if reason else kernels


def dense(
    impl: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    causal=True,
    query_slots: jax.Array | None = None,
    few_documents: bool = False,
) -> jax.Array:
    """Attention within documents -> out [B, S, H, Dh]: causal for full-attention layers,
    bidirectional within each segment (one image or video chunk) for the ViT. query_slots: [S],
    the queries' slots in the key row (segment_ids [B, T]); None: S = T. few_documents:
    `ForwardMode.few_documents` (cuDNN without its fallback for rows of more segments)."""
    if impl == "reference":
        query_segments = at_query_slots(segment_ids, query_slots)
        mask = query_segments[:, :, None] == segment_ids[:, None, :]
        if causal:
            mask = document_causal_mask(segment_ids, query_slots)
        return gqa_attention(q, k, v, mask[:, None, None])
    if impl in ("pallas", "auto"):
        # splash has no fallback to leave out; cuDNN's is left out for rows of few documents
        kernels, options = (
            (attention_splash, {})
            if target.platform() == "tpu"
            else (attention_cudnn, {"bounded": few_documents})
        )
        reason = kernels.unsupported_reason(q, k)
        # on a CPU, "pallas" interprets the MSA kernels; cuDNN and splash have no interpreter
        if impl == "pallas" and reason and target.platform() != "cpu":
            raise ValueError(f"attention_impl='pallas' cannot run this dense attention: {reason}")
        if not reason:
            return kernels.dense_attention(
                q, k, v, segment_ids, causal=causal, query_slots=query_slots, **options
            )
    return attention_xla.dense_attention(
        q, k, v, segment_ids, causal=causal, query_slots=query_slots
    )[0]


def msa_layer(
    backend: ModuleType,
    msa: MSAConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    index_q: jax.Array,
    index_k: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    dense_phase: bool,
    student: Student,
    with_blocks: bool,
    query_slots: jax.Array | None = None,
    kl_sink: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """One MSA layer's attention -> (out [B, S, H, Dh], KL [B, S, Hi] or None, blocks or None).

    dense_phase: the MSA warm-up — attend densely, the KL teacher is the dense distribution. While
    every query has at most topk_blocks blocks (T <= topk_blocks · block_size) sparse attention is
    dense attention, so the dense path runs then too. with_blocks: also return the selection
    [B, S, Hi, k] (always computed when the layer attends sparsely). query_slots: [S] the
    queries' slots in the row of T keys (k, v, index_k, segment_ids, positions); None: S = T.
    kl_sink: [B, S, Hi] fp32 or None, with a student: the KL goes to the sink's cotangent
    (pallas_kernels/msa/reference.py: `kl_through_sink`).
    """
    sparse = not dense_phase and k.shape[1] > msa.topk_blocks * msa.block_size
    # only context parallelism passes query slots: backends without them keep their signature
    slots = {} if query_slots is None else {"query_slots": query_slots}
    blocks = None
    if sparse or with_blocks:
        blocks = backend.top_blocks(
            index_q, index_k, segment_ids, positions, block_size=msa.block_size,
            topk_blocks=msa.topk_blocks, local_blocks=msa.local_blocks, **slots,
        )  # fmt: skip
    if sparse:
        out, kl = backend.sparse_attention(
            q, k, v, blocks, segment_ids, positions, block_size=msa.block_size, student=student,
            kl_sink=kl_sink, **slots,
        )  # fmt: skip
    else:
        out, kl = backend.dense_attention(q, k, v, segment_ids, student=student, **slots)
        kl = kl_through_sink(kl, kl_sink)
    return out, kl, blocks


def recall(
    backend: ModuleType,
    msa: MSAConfig,
    q: jax.Array,
    k: jax.Array,
    blocks: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    query_slots: jax.Array | None = None,
) -> jax.Array:
    """Share of the dense teacher's top blocks that the selection kept -> [B, S, K] fp32."""
    slots = {} if query_slots is None else {"query_slots": query_slots}
    return backend.block_recall(
        q, k, blocks, segment_ids, positions, block_size=msa.block_size, **slots
    )

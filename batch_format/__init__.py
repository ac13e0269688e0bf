"""What a batch is and what its vision and modality arrays mean, in one place for the code that
builds batches (`data/`) and the code that reads them (`m3jax/`, `pretrain/`). NumPy only: no jax,
no model.

- `batch.py`: the `Batch` type (with its optional `VisionBatch` part) and `make_batch`, the one
  constructor, which checks every field's shape and dtype.
- `modality.py`: the per-token modality codes (text, image, video).
- `vision.py`: the patch geometry (pixel features per patch row) and the ViT's (t, h, w) position
  of every patch row, in the M3 processor's block-major order (spec/m3_architecture.md §4.3).
"""

"""M3's mixture-of-experts layer, one file per job.

- router.py: sigmoid routing with the correction bias, and the bias update (aux-loss-free).
- layer.py: the `MoE` module (router, routed experts, shared expert) and its statistics.
- local.py: the routed experts on one device (dense reference, dropless grouped matmul, capacity).
- expert_parallel.py: the same inside `shard_map`, experts over the `expert` mesh axis, with one
  file per exchange of tokens between devices: padded.py, ragged.py, capacity.py.
"""

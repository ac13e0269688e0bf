"""Conversion between m3jax and MiniMax's / transformers' checkpoint formats (spec §2, §7).

`hf_config` translates config.json <-> ModelConfig; `layout` names every m3jax array in the
upstream safetensors layout; `memory_layout` reads transformers' in-memory layout as if it were the
upstream one; `safetensors_io` reads and writes sharded safetensors lazily; `pretrained` puts them
together (`load_pretrained`, `save_pretrained`, and the streaming pieces the CLIs use).
"""

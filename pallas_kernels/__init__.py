"""Attention and MoE kernels, each with a pure-`jnp` reference beside it that owns its signature.

Kernels know nothing about the model: they take arrays in the `[B, S, H, Dh]` layout and plain ints.
"""

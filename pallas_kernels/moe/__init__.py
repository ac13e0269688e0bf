"""Mixture-of-experts kernels: the grouped matmul of rows sorted by expert."""

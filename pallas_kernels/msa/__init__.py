"""MiniMax Sparse Attention: index scores, block selection and block-sparse attention."""

"""Dense (masked, GQA) softmax attention."""

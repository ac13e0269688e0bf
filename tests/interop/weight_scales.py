"""How to draw random weights for parity tests, by tensor name: shared by m3jax and the
transformers side (`hf_side.py` imports this file in the side venv; it needs nothing but math).

Every path must matter and stay numerically tame: Gemma norm offsets and LayerNorm scales far from
their init, non-zero biases and router correction biases, logits O(1), and SwiGLU-OAI
pre-activations of std ≈ 3, so that the ±7 clamps fire on a few percent of elements. Works for
upstream names (`…experts.3.w1.weight`) and transformers' in-memory ones (`…experts.gate_up_proj`).
"""

import math

MLP_SCALE = 3.0


def weight_scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the normal distribution to draw tensor `name` from."""
    if "layer_norm" in name or "layrnorm" in name:  # vision LayerNorm: the weight is a scale
        return (1.0, 0.2) if name.endswith("weight") else (0.0, 0.1)
    if name.endswith("norm.weight"):  # Gemma RMSNorm offsets: the scale is 1 + w
        return 0.0, 0.3
    if name.endswith("bias"):  # Linear biases and e_score_correction_bias
        return 0.0, 0.1
    if "embed_tokens" in name:
        return 0.0, 1.0
    fan_in = math.prod(shape[1:]) if len(shape) == 5 else shape[-1]  # Conv3d: C·T·P·P
    if "down_proj" in name or name.endswith("w2.weight"):
        return 0.0, 0.5 * fan_in**-0.5
    if any(part in name for part in ("gate_up_proj", "gate_proj", "up_proj", "w1.", "w3.")):
        return 0.0, MLP_SCALE * fan_in**-0.5
    return 0.0, fan_in**-0.5

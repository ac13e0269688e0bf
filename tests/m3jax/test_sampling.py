"""Next-token choice: greedy is the argmax; top-k, top-p and temperature sample from the
distribution transformers' warpers define (checked by frequencies over many draws)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.sampling import Sampling, sample

PROBS = np.array([0.5, 0.25, 0.15, 0.06, 0.04])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


def frequencies(sampling: Sampling, draws: int = 20000) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), draws)
    ids = jax.vmap(lambda key: sample(LOGITS, key, sampling)[0])(keys)
    return np.bincount(np.asarray(ids), minlength=len(PROBS)) / draws


def test_greedy_is_the_argmax_per_row():
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), Sampling()), [1, 0])


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (Sampling(temperature=1.0), PROBS),
        (Sampling(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0, 0]),
        # top_p 0.8: 0.5 + 0.25 < 0.8, so the third token (0.15) is needed too
        (Sampling(temperature=1.0, top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
        (Sampling(temperature=1.0, top_p=0.5), [1, 0, 0, 0, 0]),  # the most likely always stays
        (Sampling(temperature=2.0, top_k=3), np.sqrt(PROBS[:3]) / np.sqrt(PROBS[:3]).sum()),
    ],
)
def test_sampling_draws_from_the_filtered_distribution(sampling, expected):
    expected = np.pad(np.asarray(expected, float), (0, len(PROBS) - len(expected)))
    np.testing.assert_allclose(frequencies(sampling), expected, atol=0.015)


def test_sampling_is_reproducible_by_key():
    settings = Sampling(temperature=1.0, top_p=0.9)
    logits = jax.random.normal(jax.random.key(1), (4, 50))
    first = sample(logits, jax.random.key(7), settings)
    np.testing.assert_array_equal(first, sample(logits, jax.random.key(7), settings))
    assert (first != sample(logits, jax.random.key(8), settings)).any()


@pytest.mark.parametrize(
    "fields, message",
    [({"temperature": -1.0}, "temperature=-1.0"), ({"top_k": -2}, "top_k=-2"),
     ({"top_p": 1.5}, "top_p=1.5")],
)  # fmt: skip
def test_sampling_rejects_bad_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**fields)

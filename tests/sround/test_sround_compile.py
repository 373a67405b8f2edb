"""Keyed stochastic rounding under ``torch.compile``: :func:`keyinit.random.stochastic_round_words` (the key as a
tensor input, :func:`keyinit.random.key_words`) gives bitwise :func:`stochastic_round`'s values, eager and
compiled, and a compiled optimizer step that takes each step's key as an input compiles once."""

from __future__ import annotations

import pytest
import torch

import keyinit
from keyinit.random import key_words, stochastic_round, stochastic_round_words

SEED = 5


def _values(n, dtype=torch.float32):
    x = keyinit.random.normal(keyinit.key(1), (n,), std=3.0, dtype=torch.float64)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -7e5, 3e38], dtype=torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("source", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", keyinit.random.ROUND_TARGETS, ids=str)
def test_words_form_equals_stochastic_round(source, dtype):
    k = keyinit.key_for(keyinit.key(SEED), "w")
    x = _values(3 * 7 * 11, source).reshape(21, 11)
    assert torch.equal(stochastic_round_words(key_words(k), x, dtype).view(torch.uint8),
                       stochastic_round(k, x, dtype).view(torch.uint8))
    # a region of a larger tensor, at its global indices
    region = (slice(2, 9), [1, 4, 10])
    part = x[2:9][:, [1, 4, 10]]
    assert torch.equal(
        stochastic_round_words(key_words(k), part, dtype, global_shape=(21, 11), region=region).view(torch.uint8),
        stochastic_round(k, part, dtype, global_shape=(21, 11), region=region).view(torch.uint8))


def test_words_form_errors():
    x = torch.zeros(3)
    words = key_words(keyinit.key(0))
    with pytest.raises(TypeError, match=r"words must be an int64 tensor of shape \(2,\) \(key_words\(key\)\), got "
                                        r"torch.int32 of shape \(2,\)"):
        stochastic_round_words(words.to(torch.int32), x, torch.bfloat16)
    with pytest.raises(TypeError, match="x must be float32 or float64, got torch.bfloat16"):
        stochastic_round_words(words, x.bfloat16(), torch.bfloat16)
    with pytest.raises(TypeError, match="dtype must be one of"):
        stochastic_round_words(words, x, torch.int8)


@pytest.mark.slow  # one inductor compile: ~10 s on 2 cores
def test_a_compiled_step_with_keys_as_inputs_compiles_once_and_rounds_as_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def sgd_step(param, grad, lr, words):
        new = param.float() - lr * grad.float()
        return new, stochastic_round_words(words, new, torch.bfloat16)

    compiled = torch.compile(sgd_step, backend=counter, fullgraph=True, dynamic=False)
    param = keyinit.random.normal(keyinit.key(2), (37, 9), dtype=torch.bfloat16)
    base = keyinit.fold_in(keyinit.key(SEED), "stochastic_rounding")
    rng = torch.get_rng_state()
    rounded_away = 0
    for t in range(4):
        grad = keyinit.random.normal(keyinit.fold_in(keyinit.key(3), t), (37, 9), dtype=torch.bfloat16)
        k = keyinit.key_for(keyinit.fold_in(base, t), "w")
        lr = torch.tensor(0.05)
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            new, rounded = compiled(param, grad, lr, key_words(k))
        torch.testing.assert_close(new, param.float() - 0.05 * grad.float(), rtol=1e-6, atol=1e-7)
        want = stochastic_round(k, new, torch.bfloat16)  # eager, the C kernel: bitwise the compiled graph's
        assert torch.equal(rounded.view(torch.int16), want.view(torch.int16)), f"step {t}"
        rounded_away += int((want != new.to(torch.bfloat16)).sum())
        param = rounded
    assert counter.frame_count == 1  # every step's key was an input: one graph
    assert rounded_away > 0
    assert torch.equal(torch.get_rng_state(), rng)

"""The keys keyed() derives for each module and call (keyinit/nn/_ops/keys.py) are dropout_key's (docs/spec.md 14).

keyed() memoizes them and runs their Philox in C where the CPU fill library is loaded; dropout_key is
the spec's derivation in Python. They must agree bitwise, with the kernels and without them.
"""

from __future__ import annotations

import pytest

from keyinit.keys import fold_in, key
from keyinit.nn import dropout_key
from keyinit.nn._ops.keys import DROPOUT_DOMAIN, CallKeys, keyed_module_key

CASES = [
    (0, 0, "", 0),
    (7, 3, "layers.0.attention", 1),
    (2**64 - 1, 2**32, "h.11.attn.attn_dropout", 2**32 - 1),
    (123456789, 2**64 - 1, "encoder.layer.3.output.dropout", 2**64 - 1),
    (5, 2**32 - 1, "a.b.c.d.e", 17),
]


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_keyed_keys_are_dropout_keys(kernels, monkeypatch):
    if kernels == "off":
        monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")
    shift = 0 if kernels == "on" else 1  # other steps: keys keyed() memoized with the kernels are not asked again
    for seed, step, fqn, ordinal in CASES:
        step = (step + shift) % 2**64
        want = dropout_key(seed, step=step, fqn=fqn, ordinal=ordinal)
        keys = CallKeys(key(seed), step)
        assert keys(fqn, ordinal) == want
        assert keys(fqn, ordinal) == want  # the module's words remembered
        module = fold_in(fold_in(key(seed), DROPOUT_DOMAIN), step)
        for part in fqn.split(".") if fqn else ():
            module = fold_in(module, part)
        assert keyed_module_key(key(seed), step, fqn) == module
        assert keys.below(fqn, ("host", ordinal, "samples")) == fold_in(fold_in(fold_in(module, "host"), ordinal),
                                                                        "samples")

"""Stream v2 derives keys as v1 (docs/spec.md 14.8: sections 1-13 unchanged), so the kernel library's C
derivation (``keyinit_derive``) computes v2's keys too: the keys of keyed forwards, host generators and
keyed samples of a v2 root are ``fold_in``'s, and keep stream v2."""

from __future__ import annotations

import keyinit
from keyinit._bits.streams import derives_as_v1
from keyinit.data import _fill
from keyinit.nn._ops import keys as _keys

ROOT = keyinit.key(0x1234_5678_9ABC, stream="v2")
DATA = (0, 7, 2**32 - 1, 2**32, 2**64 - 1, "python.random", "layers.0", "")


def test_which_streams_derive_as_v1():
    assert derives_as_v1("v1") and derives_as_v1("v2")
    assert not derives_as_v1("no-such-stream")


def test_c_folds_of_v2_keys_are_fold_in():
    lib = _fill.kernel_library()
    assert lib is not None
    for data in DATA:
        want = keyinit.fold_in(ROOT, data)
        assert _fill.fold_words(lib, ROOT, data) == want.words, data
        got = _fill.fold_with(lib, ROOT, data)
        assert (got.words, got.stream) == (want.words, "v2"), data
        assert _keys._fold(ROOT.words, "v2", data, lib) == want.words, data


def test_keyed_forward_keys_of_a_v2_root_are_dropout_key():
    calls = _keys.CallKeys(ROOT, 5)
    assert calls.lib is not None  # the C path
    for fqn in ("", "layers.0.attn", "x"):
        for ordinal in (0, 3, 2**40):
            want = _keys.dropout_key(ROOT, step=5, fqn=fqn, ordinal=ordinal)
            got = calls(fqn, ordinal)
            assert (got.words, got.stream) == (want.words, "v2")
            # dropout_key by its definition (fold_in in Python), not through the memoized C words
            k = keyinit.fold_in(keyinit.fold_in(ROOT, _keys.DROPOUT_DOMAIN), 5)
            for part in _keys.check_fqn(fqn):
                k = keyinit.fold_in(k, part)
            assert keyinit.fold_in(k, ordinal).words == got.words

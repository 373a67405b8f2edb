"""Stream versions are registered objects (keyinit._bits.streams): a Key names one, and everything resolves through it."""

from __future__ import annotations

import pickle

import attrs
import pytest
import torch

import keyinit
from keyinit._bits import streams
from keyinit import random as kr
from keyinit._bits.streams import STREAMS, V1, V2, Stream
from keyinit._draw import dispatch
from keyinit._draw.dispatch import KERNELS, KernelRef, Kernels
from keyinit.nn import functional as KF


def test_v1_is_the_registered_default():
    assert STREAMS == {"v1": V1, "v2": V2} and streams.stream_names() == keyinit.STREAM_VERSIONS == ("v1", "v2")
    assert keyinit.keys.DEFAULT_STREAM == "v1"
    k = keyinit.key(7)
    assert k.stream == "v1" == keyinit.DEFAULT_STREAM and k.impl is V1
    assert keyinit.Key(1, 2, stream=V1) == keyinit.Key(1, 2) and keyinit.Key(1, 2, stream=V1).stream == "v1"
    assert keyinit.fold_in(k, "w").impl is V1 and keyinit.split(k, 2)[1].stream == "v1"
    assert pickle.loads(pickle.dumps(k)) == k and hash(k) == hash(keyinit.key(7))
    assert V1.seed(2**40 + 5) == (5, 256)
    assert V1.derive(k.words, 2, (0, 0, 0)) == keyinit.fold_in(k, 0).words  # tag 2: fold_in of an int


def test_unknown_versions_are_refused():
    with pytest.raises(ValueError, match=r"unknown stream version 'v3'; this release supports \['v1', 'v2'\]"):
        keyinit.key(0, stream="v3")
    with pytest.raises(ValueError, match="unknown stream version"):
        keyinit.Key(0, 0, "v9")
    with pytest.raises(ValueError, match="unknown stream version"):
        streams.get_stream(None)


def test_a_version_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        streams.register_stream(V1)
    with pytest.raises(TypeError):
        streams.register_stream("v1")


# A toy second version: everything of v1 except its key derivation and its dropout reference,
# enough to show that a version is one registration and that dropout keeps the key's version.
_DROPOUT_CALLS = []


def _toy_derive(parent, tag, data):
    k0, k1 = V1.derive(parent, tag, data)
    return k1, k0


def _toy_dropout(x, out, geometry):
    _DROPOUT_CALLS.append(geometry.stream)
    out.copy_(x)


TOY = attrs.evolve(V1, name="toy-test", derive=_toy_derive)
TOY_DROPOUT = Kernels(KernelRef(__name__, "_toy_dropout"), {})


@pytest.fixture
def toy():
    assert streams.register_stream(TOY) is TOY
    dispatch.register_family("toy-test", "fill", dispatch.kernels("v1", "fill"))
    dispatch.register_family("toy-test", "dropout", TOY_DROPOUT)
    yield TOY
    del STREAMS["toy-test"]
    del KERNELS["toy-test"]


def test_a_new_version_is_a_registration(toy):
    k = keyinit.key(3, stream="toy-test")
    assert k.impl is TOY and k.words == keyinit.key(3).words
    child = keyinit.fold_in(k, "layer")
    v1_child = keyinit.fold_in(keyinit.key(3), "layer")
    assert child.stream == "toy-test" and child.words == v1_child.words[::-1]
    assert k != keyinit.key(3) and repr(TOY) == "Stream('toy-test')"
    assert keyinit.STREAM_VERSIONS == keyinit.keys.STREAM_VERSIONS == ("v1", "v2", "toy-test")  # derived from the registry
    with pytest.raises(ValueError, match="already has its 'dropout' kernels"):
        dispatch.register_family("toy-test", "dropout", TOY_DROPOUT)
    with pytest.raises(ValueError, match="has no 'permutation' kernels registered"):
        dispatch.kernels("toy-test", "permutation")
    # its fills are v1's kernels here: the same values for the same words
    assert torch.equal(kr.normal(child, (100,)), kr.normal(keyinit.Key(*child.words), (100,)))


def test_dropout_keeps_the_keys_version(toy):
    _DROPOUT_CALLS.clear()
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = KF.dropout(x, 0.5, rng_key=keyinit.key(1, stream="toy-test"))
    y.sum().backward()
    assert torch.equal(y, x) and _DROPOUT_CALLS == ["toy-test", "toy-test"]  # forward and backward
    KF.dropout(x.detach(), 0.5, rng_key=keyinit.key(1))
    assert _DROPOUT_CALLS == ["toy-test", "toy-test"]  # a v1 key runs v1's kernels


def test_stream_objects_are_frozen():
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        V1.name = "v0"
    v1_fill = dispatch.kernels("v1", "fill")
    assert isinstance(V1, Stream) and isinstance(v1_fill.devices, type(TOY_DROPOUT.devices))
    with pytest.raises(TypeError):
        v1_fill.devices["cpu"] = None

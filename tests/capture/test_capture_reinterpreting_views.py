"""Views that read their memory otherwise than as its elements, in captured code: another dtype
(``x.view(torch.int32)``, ``view_as_real``, ``view_as_complex``, how safetensors makes a checkpoint's
tensors) or torch's lazy conjugate/negative bit (``c.conj()``). keyinit computes them as copies of the
values they view, bit for bit as eager torch (they were converted numerically, lost their conjugation,
or failed late); writing through one, or into what it views after it was taken, would tell the copy
apart from a view: a clear CaptureError naming the tensor, before anything is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from keyinit._engine.capture.capture import CaptureError


class BitViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        bits = torch.arange(4, dtype=torch.int32) + 0x3F800000  # the bits of 1.0f and its next floats
        self.register_buffer("floats", bits.view(torch.float32))
        self.register_buffer("words", torch.full((2,), 1.5).view(torch.int32))
        self.register_buffer("bytes", torch.full((2,), -2.0).view(torch.uint8))
        self.register_buffer("halves", torch.arange(4.0).view(torch.bfloat16)[1::2])
        angles = torch.polar(torch.ones(3), torch.arange(3.0))
        self.register_buffer("real", torch.view_as_real(angles))
        self.register_buffer("complex", torch.view_as_complex(torch.arange(6.0).reshape(3, 2)))
        self.register_buffer("conjugate", angles.conj())  # a view with torch's conjugate bit
        self.register_buffer("negative", torch.arange(3.0)._neg_view())
        self.w = nn.Parameter(torch.empty(3, 2))
        nn.init.normal_(self.w)
        self.register_buffer("drawn", torch.view_as_complex(self.w.detach()).conj())


def test_views_that_reinterpret_memory_give_eager_torchs_bits():
    model = keyinit.deferred(BitViews)
    keyinit.materialize(model, 0, device="cpu")
    eager = BitViews()
    for name in ("floats", "words", "bytes", "halves", "real", "complex", "conjugate", "negative"):
        assert torch.equal(getattr(model, name), getattr(eager, name)), name
    assert torch.equal(model.drawn, torch.view_as_complex(model.w.detach()).conj())  # a keyed draw, viewed


def test_a_view_that_reinterprets_memory_in_init_code_gives_the_same_bits():
    class Init(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("bits", torch.empty(3, dtype=torch.int32))

        def init_weights(self) -> None:
            with torch.no_grad():
                self.bits.copy_(torch.tensor([0.5, -1.0, 3.0]).view(torch.int32))

    with torch.device("meta"):
        model = Init()
    keyinit.materialize(model, 0, device="cpu", init_method="init_weights")
    assert torch.equal(model.bits, torch.tensor([0.5, -1.0, 3.0]).view(torch.int32))


class WritesThroughView(nn.Module):
    def __init__(self, when: str) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(2, 2))
        real_view = torch.view_as_complex(self.table)
        if when == "through":
            real_view.fill_(1 + 2j)  # eager torch writes table through the view
        else:
            self.table.add_(1.0)  # eager torch: the earlier view sees it
        self.register_buffer("seen", real_view.real.clone())


@pytest.mark.parametrize("when, match", [("through", r"writes into a view of .* that reinterprets its memory"),
                                         ("after", r"wrote into .* after taking a view of it that reinterprets")])
def test_writing_through_or_under_a_view_that_reinterprets_memory_is_a_clear_error(when, match):
    with pytest.raises(CaptureError, match=r"WritesThroughView\(\.\.\.\): init code " + match):
        keyinit.deferred(WritesThroughView, when)

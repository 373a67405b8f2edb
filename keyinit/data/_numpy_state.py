"""``numpy.random``'s global state, looked at and restored cheaply (keyed_samples, keyed_collate).

``get_state``/``set_state`` cost about 30 us each (a dict and a copy of 624 words). :class:`NumpyWatch`
takes one ``get_state`` before a keyed call and otherwise reads and writes the state's bytes in place.
"""

from __future__ import annotations

import ctypes
from typing import Optional

__all__ = ["NumpyWatch", "numpy_watch"]


class NumpyWatch:
    """Whether code drew from ``numpy.random``'s global state, and putting it back, cheaply.

    The legacy global generator's state is MT19937's 624 words and position (read here as bytes at
    the bit generator's state address: a 2.5 KB copy) plus a cached Gaussian (``has_gauss``, which only
    ``get_state`` tells). :meth:`look` takes one ``get_state`` (about 30 us) and the bytes. After the
    call, every draw has changed the bytes except one that took a cached Gaussian, so the bytes settle
    "did it draw" unless a Gaussian was cached before (then a second ``get_state``); and the state is
    put back by copying the bytes where nothing drew after seeding and no Gaussian was cached before
    (else ``set_state``). Where the state address is not MT19937's layout, ``get_state``/``set_state``
    do it all.
    """

    _KEY_BYTES = 624 * 4

    def __init__(self) -> None:
        import numpy

        self.numpy = numpy
        self.address: Optional[int] = None
        try:
            bitgen = numpy.random.mtrand._rand._bit_generator
            address = int(bitgen.ctypes.state_address)
            state = numpy.random.get_state(legacy=False)
            raw = ctypes.string_at(address, self._KEY_BYTES + 4)
            if bitgen.state["bit_generator"] == "MT19937" and raw == self._bytes(state):
                self.address = address
        except (AttributeError, KeyError, TypeError, ValueError):  # pragma: no cover - another numpy
            self.address = None

    def _bytes(self, state: dict) -> bytes:
        inner = state["state"]
        return self.numpy.asarray(inner["key"], dtype="<u4").tobytes() + int(inner["pos"]).to_bytes(4, "little")

    def _readable(self) -> bool:
        return self.address is not None and \
            self.numpy.random.mtrand._rand._bit_generator.ctypes.state_address == self.address

    def look(self) -> tuple[Optional[bytes], dict]:
        """``(bytes or None, full state)`` now."""
        state = self.numpy.random.get_state(legacy=False)
        return (ctypes.string_at(self.address, self._KEY_BYTES + 4) if self._readable() else None), state

    def drew(self, before: tuple[Optional[bytes], dict]) -> bool:
        raw, state = before
        if raw is not None and self._readable():
            if ctypes.string_at(self.address, self._KEY_BYTES + 4) != raw:
                return True
            if not state["has_gauss"]:
                return False  # no cached Gaussian to take: the bytes settle it
        return not _same_numpy_state(self.numpy.random.get_state(legacy=False), state)

    def snapshot(self) -> Optional[bytes]:
        """The state's bytes now (None where they cannot be read)."""
        return ctypes.string_at(self.address, self._KEY_BYTES + 4) if self._readable() else None

    def reseeded(self, before: tuple[Optional[bytes], dict], seeded: Optional[bytes]) -> None:
        """Put back the state ``before`` after ``numpy.random.seed`` (which left ``seeded`` bytes and no
        cached Gaussian): the bytes copied back where nothing drew since and no Gaussian was cached
        before, else ``set_state``."""
        raw, state = before
        if raw is not None and seeded is not None and not state["has_gauss"] and self._readable() and \
                ctypes.string_at(self.address, self._KEY_BYTES + 4) == seeded:
            ctypes.memmove(self.address, raw, self._KEY_BYTES + 4)
            return
        self.restore(before)

    def restore(self, before: tuple[Optional[bytes], dict]) -> None:
        self.numpy.random.set_state(before[1])


def _same_numpy_state(a: dict, b: Optional[dict]) -> bool:
    import numpy

    return b is not None and a["state"]["pos"] == b["state"]["pos"] and a["has_gauss"] == b["has_gauss"] and \
        a["gauss"] == b["gauss"] and numpy.array_equal(a["state"]["key"], b["state"]["key"])


_WATCH: list = []  # one NumpyWatch per process, made on first use (after a fork: the parent's, still valid)


def numpy_watch() -> "NumpyWatch":
    """This process's :class:`NumpyWatch` (call it holding the keyed-randomness lock)."""
    if not _WATCH:
        _WATCH.append(NumpyWatch())
    return _WATCH[0]



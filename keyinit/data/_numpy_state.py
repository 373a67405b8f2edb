"""``numpy.random``'s global state, looked at and restored cheaply (keyed_samples, keyed_collate).

``get_state``/``set_state`` cost about 30 us each (a dict and a copy of 624 words): more than the
rest of a keyed sample's fixed cost. :class:`NumpyWatch` reads the state's bytes in place instead
and needs ``get_state`` only when the bytes alone do not settle a question.
"""

from __future__ import annotations

import ctypes
from typing import Optional

__all__ = ["NumpyWatch", "numpy_watch"]


class NumpyWatch:
    """Whether code drew from ``numpy.random``'s global state, cheaply.

    The legacy global generator's state is MT19937's 624 words and position (read as bytes at the
    bit generator's state address, a copy of 2.5 KB) plus a cached Gaussian (``has_gauss``), which only
    ``get_state`` tells (about 30 us). Every draw changes the bytes, except one that takes a cached
    Gaussian (``has_gauss`` 1 to 0); and ``has_gauss`` goes 0 to 1 only with a draw that changes the
    bytes. So with the bytes of the last full look remembered (``_known``): equal bytes and no cached
    Gaussian then mean none now, and ``get_state`` is needed only when the bytes moved or a Gaussian
    was cached. Where the state address is not MT19937's layout, every look is a ``get_state``.
    """

    _KEY_BYTES = 624 * 4

    def __init__(self) -> None:
        import numpy

        self.numpy = numpy
        self.address: Optional[int] = None
        self.known: Optional[tuple[bytes, int]] = None  # (bytes, has_gauss) at the last full look
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

    def look(self) -> tuple[Optional[bytes], Optional[dict]]:
        """``(bytes, full state or None)``: the full state when the bytes alone do not settle it."""
        if self.address is None or self.numpy.random.mtrand._rand._bit_generator.ctypes.state_address != \
                self.address:
            return None, self.numpy.random.get_state(legacy=False)
        raw = ctypes.string_at(self.address, self._KEY_BYTES + 4)
        if self.known is not None and self.known == (raw, 0):
            return raw, None
        state = self.numpy.random.get_state(legacy=False)
        self.known = (raw, int(state["has_gauss"]))
        return raw, state

    def drew(self, before: tuple[Optional[bytes], Optional[dict]]) -> bool:
        raw, state = before
        if raw is not None:
            after = ctypes.string_at(self.address, self._KEY_BYTES + 4)
            if after != raw:
                return True
            if state is None or not state["has_gauss"]:
                return False  # no cached Gaussian to take: the bytes settle it
        now = self.numpy.random.get_state(legacy=False)
        if raw is not None:
            self.known = (raw, int(now["has_gauss"]))
        return not _same_numpy_state(now, state)

    def snapshot(self) -> Optional[bytes]:
        """The state's bytes now (None where they cannot be read)."""
        if self.address is None:
            return None
        return ctypes.string_at(self.address, self._KEY_BYTES + 4)

    def reseeded(self, before: tuple[Optional[bytes], Optional[dict]], seeded: Optional[bytes]) -> None:
        """Put back the state ``before`` after ``numpy.random.seed`` (which left ``seeded`` bytes and no
        cached Gaussian): the bytes copied back where nothing drew since and no Gaussian was cached
        before, else ``set_state``."""
        raw, state = before
        if raw is not None and seeded is not None and (state is None or not state["has_gauss"]) and \
                self.numpy.random.mtrand._rand._bit_generator.ctypes.state_address == self.address and \
                ctypes.string_at(self.address, self._KEY_BYTES + 4) == seeded:
            ctypes.memmove(self.address, raw, self._KEY_BYTES + 4)
            self.known = (raw, 0)
            return
        self.restore(before)

    def restore(self, before: tuple[Optional[bytes], Optional[dict]]) -> None:
        raw, state = before
        if state is None:  # known: those bytes and no cached Gaussian
            words = self.numpy.frombuffer(raw[:self._KEY_BYTES], dtype="<u4").copy()
            state = {"bit_generator": "MT19937", "state": {"key": words, "pos": int.from_bytes(raw[-4:], "little")},
                     "has_gauss": 0, "gauss": 0.0}
        self.numpy.random.set_state(state)
        self.known = None


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



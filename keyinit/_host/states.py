"""Python's ``random`` and ``numpy.random`` global states: saved, seeded and put back as bytes.

``keyed_samples`` seeds both from a sample's key for the call and puts them back afterwards;
``keyed_collate`` checks that a collate function drew from neither. Through their public APIs that
cost about 125 us a keyed call inside bench_data.py section 5's transforms.v2 pipeline (each call
timed with ``time.thread_time``: ``numpy.random.get_state`` copies the state into a dict,
``numpy.random.seed`` checks its array with several numpy operations, ``random.getstate`` makes 625
ints). Here instead:

- the states are read and written as bytes where they lie: Python's MT19937 (its index and 624 words)
  inside ``random``'s generator object; numpy's (624 words and the position) at its bit generator's
  ``ctypes.state_address``, and its cached Gaussian (``has_gauss``, ``gauss``) inside the
  ``RandomState`` object. The two offsets inside objects are not public API: they are found once per
  process on private instances of the same types (a state set through the public API, its bytes
  looked for) and checked by writing through them (a state written there is what the private
  instance's ``getstate``/``get_state`` report, and the Gaussian written there is what its next
  ``standard_normal()`` returns). Copies go through memoryviews, holding the GIL, so no other Python
  thread sees a state half-written. Where any of this fails (or outside CPython, where ``id()`` is not
  an address), the public APIs do the work (the same states);
- seeding writes the state ``random.seed(k0 | k1 << 32)`` and ``numpy.random.seed([k0, k1])`` make
  (MT19937's ``init_by_array``: ``keyinit_mt_seed`` in the compiled kernel library, which the library's
  self-test checks against ``random.seed``, and which is checked here against ``RandomState.seed``)
  without calling them, so numpy's bit generator also keeps its ``seed_seq`` (``numpy.random.seed``
  sets it to None for good). Without the kernel library the public seeding functions run.

Every method is called holding the process's keyed-randomness lock.
"""

from __future__ import annotations

import ctypes
import random as _py_random
import struct
import sys
from typing import Any, Optional

__all__ = ["GlobalStates", "global_states"]

_MT_WORDS = 624
_MT_BYTES = _MT_WORDS * 4 + 4  # numpy: 624 words, then the position; Python: the index, then 624 words


def _python_generator() -> Any:
    """The generator behind ``random``'s global functions (``random.getstate``'s instance)."""
    return getattr(_py_random.getstate, "__self__", None)


def _python_state_offset(inst: Any) -> Optional[int]:
    """The offset of ``(index, words)`` inside a ``random.Random`` object like ``inst``, checked, or None."""
    kind = type(inst)
    if kind is not _py_random.Random:
        return None
    probe = kind(0x243F6A8885A308D3)
    words = list(probe.getstate()[1])
    found = ctypes.string_at(id(probe), kind.__basicsize__).find(struct.pack(f"<i{_MT_WORDS}I", words[-1], *words[:-1]))
    if found < 0 or found + _MT_BYTES > kind.__basicsize__:
        return None
    other = list(kind(7).getstate()[1])
    ctypes.memmove(id(probe) + found, struct.pack(f"<i{_MT_WORDS}I", other[-1], *other[:-1]), _MT_BYTES)
    if list(probe.getstate()[1]) != other or probe.random() != kind(7).random():
        return None
    return found


def _numpy_generator(numpy: Any) -> Any:
    """The legacy generator behind ``numpy.random``'s global functions (``numpy.random.get_state``'s)."""
    return getattr(numpy.random.get_state, "__self__", None)


def _numpy_offsets(rand: Any) -> Optional[tuple[int, int]]:
    """The offsets of ``has_gauss`` (an int) and ``gauss`` (a double) inside a ``RandomState`` like ``rand``,
    found and checked on a private instance, or None."""
    kind = type(rand)
    probe = kind(5)
    size = kind.__basicsize__
    state = probe.get_state(legacy=False)
    first, second = (struct.unpack("<d", bytes(range(b, b + 8)))[0] for b in (0x11, 0x31))

    def memory(has_gauss: int, gauss: float) -> bytes:
        probe.set_state({**state, "has_gauss": has_gauss, "gauss": gauss})
        return ctypes.string_at(id(probe), size)

    on, off, moved = memory(1, first), memory(0, first), memory(1, second)
    flag = [i for i in range(size) if on[i] != off[i]]  # has_gauss 1 -> 0: its low byte
    value = [i for i in range(size) if on[i] != moved[i]]  # gauss: all 8 bytes differ
    if len(flag) != 1 or flag[0] % 4 or len(value) != 8 or value != list(range(value[0], value[0] + 8)):
        return None
    has_gauss, gauss = flag[0], value[0]
    if on[has_gauss:has_gauss + 4] != struct.pack("<i", 1) or on[gauss:gauss + 8] != struct.pack("<d", first):
        return None
    # written through the offsets: get_state reports it and standard_normal() returns the cached value
    probe.set_state({**state, "has_gauss": 0, "gauss": 0.0})
    ctypes.memmove(id(probe) + gauss, struct.pack("<d", 0.625), 8)
    ctypes.memmove(id(probe) + has_gauss, struct.pack("<i", 1), 4)
    after = probe.get_state(legacy=False)
    if after["has_gauss"] != 1 or after["gauss"] != 0.625 or probe.standard_normal() != 0.625:
        return None
    return has_gauss, gauss


def _view(address: int, size: int) -> memoryview:
    """``size`` bytes at ``address`` as a writable memoryview: copies through it hold the GIL (``ctypes.memmove``
    releases it), so no other Python thread sees a state half-written."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class _Numpy:
    """numpy's global legacy generator, read and written as bytes (see the module docstring)."""

    def __init__(self, numpy: Any, rand: Any) -> None:
        self.numpy, self.rand = numpy, rand
        self.bitgen = rand._bit_generator
        offsets = _numpy_offsets(rand)
        address = int(self.bitgen.ctypes.state_address)
        state = rand.get_state(legacy=False)
        raw = numpy.asarray(state["state"]["key"], dtype="<u4").tobytes() + struct.pack("<i", state["state"]["pos"])
        if state["bit_generator"] != "MT19937" or ctypes.string_at(address, _MT_BYTES) != raw:
            offsets = None
        self.offsets = offsets
        self.address = address
        if offsets is not None:
            self.state = _view(address, _MT_BYTES)  # 624 words, then the position
            self.has_gauss = _view(id(rand) + offsets[0], 4)
            self.gauss = _view(id(rand) + offsets[1], 8)
        self.seeding: dict[int, bool] = {}  # id(kernel library): keyinit_mt_seed seeds as RandomState.seed

    def current(self) -> bool:
        """The generator numpy.random's functions use is still this one, with its bit generator."""
        return _numpy_generator(self.numpy) is self.rand and self.rand._bit_generator is self.bitgen

    def seeds_like_numpy(self, lib: Any) -> bool:
        """``keyinit_mt_seed`` makes the state ``RandomState.seed([k0, k1])`` does (checked once per library)."""
        checked = self.seeding.get(id(lib))
        if checked is None:
            from keyinit._kernels.fill.cpu import mt_seed

            probe = type(self.rand)()
            checked = True
            for words in ([0, 0], [1, 0], [0x243F6A88, 0x85A308D3], [0xFFFFFFFF, 0xFFFFFFFF]):
                probe.seed(words)
                state = probe.get_state(legacy=False)
                checked &= state["state"]["pos"] == _MT_WORDS and list(state["state"]["key"]) == mt_seed(words, lib) \
                    and state["has_gauss"] == 0 and state["gauss"] == 0.0
            self.seeding[id(lib)] = checked
        return checked


class GlobalStates:
    """Save, seed, compare and restore Python's ``random`` and ``numpy.random`` global states.

    A saved state is ``("bytes", python bytes, gauss_next, numpy bytes, numpy's has_gauss and gauss
    bytes)`` (numpy's None without numpy) where both states can be read as bytes, else ``("api",
    random.getstate(), numpy.random.get_state(legacy=False) or None)``.
    """

    def __init__(self) -> None:
        self.inst = _python_generator()
        # id() is an address only in CPython
        self.python = None if self.inst is None or sys.implementation.name != "cpython" \
            else _python_state_offset(self.inst)
        if self.python is not None:
            self.python_state = _view(id(self.inst) + self.python, _MT_BYTES)  # the index, then 624 words
        # seeding scratch: Python's layout (index 624, words) and numpy's (words, position 624)
        self._py_seeded = (ctypes.c_uint32 * (_MT_WORDS + 1))(_MT_WORDS)
        self._np_seeded = (ctypes.c_uint32 * (_MT_WORDS + 1))()
        self._np_seeded[_MT_WORDS] = _MT_WORDS
        self.numpy: Optional[_Numpy] = None
        self.numpy_module: Any = None
        try:
            import numpy
        except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
            return
        self.numpy_module = numpy
        rand = _numpy_generator(numpy)
        if rand is not None and self.python is not None:
            self.numpy = _Numpy(numpy, rand)

    def _as_bytes(self) -> bool:
        """Both states can be read and written as bytes now."""
        if self.python is None or _python_generator() is not self.inst:
            return False
        if self.numpy_module is None:
            return True
        return self.numpy is not None and self.numpy.offsets is not None and self.numpy.current()

    def save(self) -> tuple:
        """The states now."""
        if self._as_bytes():
            np_ = self.numpy
            if np_ is None:
                return ("bytes", bytes(self.python_state), self.inst.gauss_next, None, None)
            return ("bytes", bytes(self.python_state), self.inst.gauss_next, bytes(np_.state),
                    bytes(np_.has_gauss) + bytes(np_.gauss))
        np_state = None if self.numpy_module is None else self.numpy_module.random.get_state(legacy=False)
        return ("api", _py_random.getstate(), np_state)

    def seed(self, lib: Any, python: tuple[int, int], numpy: tuple[int, int], saved: tuple) -> None:
        """Seed ``random`` as ``random.seed(k0 | k1 << 32)`` and ``numpy.random`` as
        ``numpy.random.seed([k0, k1])`` (``python``, ``numpy``: the ``(k0, k1)`` words) would; ``saved``
        is what :meth:`save` just returned."""
        np_ = self.numpy
        if lib is not None and saved[0] == "bytes" and (np_ is None or np_.seeds_like_numpy(lib)):
            k0, k1 = python
            # random.seed(int) seeds init_by_array with the int's 32-bit words (one word below 2**32)
            lib.keyinit_mt_seed(k0, k1, 2 if k1 else 1, ctypes.addressof(self._py_seeded) + 4)
            self.python_state[:] = memoryview(self._py_seeded).cast("B")
            self.inst.gauss_next = None
            if np_ is not None:
                lib.keyinit_mt_seed(numpy[0], numpy[1], 2, ctypes.addressof(self._np_seeded))
                np_.state[:] = memoryview(self._np_seeded).cast("B")
                np_.has_gauss[:] = _NO_GAUSS
                np_.gauss[:] = _ZERO_DOUBLE
            return
        _py_random.seed(python[0] | (python[1] << 32))
        if self.numpy_module is not None:
            self.numpy_module.random.seed(list(numpy))

    def restore(self, saved: tuple) -> None:
        """Put the states back as ``saved`` (from :meth:`save`)."""
        if saved[0] == "bytes":  # into the objects the bytes came from (kept alive here)
            _, py, gauss_next, np_bytes, np_gauss = saved
            self.python_state[:] = py
            self.inst.gauss_next = gauss_next
            np_ = self.numpy
            if np_bytes is not None and np_ is not None:
                np_.state[:] = np_bytes
                np_.has_gauss[:] = np_gauss[:4]
                np_.gauss[:] = np_gauss[4:]
            return
        _py_random.setstate(saved[1])
        if saved[2] is not None:
            self.numpy_module.random.set_state(saved[2])

    def drew(self, saved: tuple) -> list[str]:
        """The names (``"random"``, ``"numpy.random"``) of the generators whose state is not ``saved``."""
        now = self.save()
        if now[0] != saved[0]:  # pragma: no cover - a global generator replaced inside the call
            return ["random", "numpy.random"]
        if now[0] == "bytes":
            changed = [now[1] != saved[1] or not _same(now[2], saved[2]), now[3] != saved[3] or now[4] != saved[4]]
        else:
            changed = [now[1] != saved[1], not _same_numpy_state(now[2], saved[2])]
        return [name for name, moved in zip(("random", "numpy.random"), changed) if moved]


_NO_GAUSS = struct.pack("<i", 0)
_ZERO_DOUBLE = struct.pack("<d", 0.0)


def _same(a: Any, b: Any) -> bool:
    return a is b or a == b


def _same_numpy_state(a: Optional[dict], b: Optional[dict]) -> bool:
    if a is None or b is None:
        return a is b
    import numpy

    return a["state"]["pos"] == b["state"]["pos"] and a["has_gauss"] == b["has_gauss"] and \
        a["gauss"] == b["gauss"] and numpy.array_equal(a["state"]["key"], b["state"]["key"])


_STATES: list = []  # one GlobalStates per process, made on first use (a forked child inherits it: same layout)


def global_states() -> GlobalStates:
    """This process's :class:`GlobalStates` (call it holding the keyed-randomness lock)."""
    if not _STATES:
        _STATES.append(GlobalStates())
    return _STATES[0]

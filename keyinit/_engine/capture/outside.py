"""What a capture cannot record: Python's and numpy's global generators, and threads.

A :class:`~keyinit._engine.capture.capture.Capture` records the torch ops of the thread that runs the code.
Two things escape it:

- ``random.random()`` and ``numpy.random.permutation(...)`` draw from one global generator per
  process: their values depend on its state (different on two ranks) and advance it;
- a constructor that builds its layers in worker threads (``ThreadPoolExecutor``) runs them where
  the capture's dispatch mode is not (it is per-thread): the threads would draw real weights from
  torch's global RNG and advance it.

:func:`watched` runs a capture's block so that both are an :class:`keyinit.UnkeyedRandomnessError`
naming the code: the global generators are put back as they were when the block advanced them, and
every random torch op, or op on a stand-in, in a thread the block's code starts is refused before it
runs (nothing of torch's RNG is read); deterministic work on real tensors there (Hugging Face loads a
checkpoint's tensors in a pool) runs. A thread that was running before the block (a pool a library
keeps) cannot be given the refusal; what it draws is seen on torch's global CPU generator, which the
block's own thread never draws from. Such draws reach the model only as tensors made outside the capture
(real modules built in the pool, a pool's tensor copied into a weight): the capture notes each
(:func:`came_from_outside`), and a draw seen on the global generator while the block's result holds
one is refused and put back. Without one the draw was another thread's own (a model built eagerly
there, beside the capture): it is left as it is, and the block runs as alone. With one, keyinit cannot
tell the two apart and refuses, naming both (values that reach the record only through Python numbers
are not seen). A reseed the code itself makes (``torch.manual_seed`` in a constructor) is left, as
eager torch leaves it.

Only the threads the block's own thread starts are watched: while a block is open anywhere,
``threading.Thread.start`` is wrapped (put back when the last block closes), and a ``start`` called
from a thread with an open block runs the new thread under that block's refusal. A thread other code
starts meanwhile (a data loader, another ``init_model`` in its own thread) is not touched, so
concurrent captures in two threads each watch their own. (A process-global ``threading.setprofile``
reached every thread started anywhere while the block was open.)

Not seen: a generator object seeded from the operating system (``numpy.random.default_rng()``,
``random.Random()`` without a seed). Its values become constants of the record that differ in every
process; numpy's generators draw in compiled code no Python hook observes, and ``RandomState(seed)``
reads the same entropy as ``RandomState()`` before it seeds, so neither can be told apart without
patching numpy (docs/api.md says to seed them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keyinit._engine.programs.random_ops import is_random
from keyinit._engine.programs.refusal import RefuseDraws
from keyinit._host.draws import HostDrawsPutBack
from keyinit.errors import UnkeyedRandomnessError

__all__ = ["watched", "came_from_outside", "ThreadDrawsRefused"]


class _Watch:
    def __init__(self, site: str) -> None:
        self.site = site
        self.open = True
        self.refused: list[str] = []
        self.outside: list[str] = []  # (the first) tensors made outside the capture that its record or result holds


_starts_lock = threading.Lock()
#: thread ident -> (watch, mode class) of its open blocks, innermost last: the threads it starts run under it
_open_blocks: dict[int, list[tuple[_Watch, Callable[[_Watch], TorchDispatchMode]]]] = {}
_plain_start: Optional[Callable[[threading.Thread], None]] = None  # what ours wraps (kept once set)
_WATCHED = "_keyinit_watched_by"  # the attribute of a thread a block started: that block's (watch, mode)
_in_chain = False  # whether Thread.start reaches ours (it is ours, or other code wrapped ours since)


def _watched_start(self: threading.Thread) -> None:
    """``threading.Thread.start`` while a block is open: a thread started from a thread with an open
    block, or from a thread such a block started, runs under that block's mode for its whole life (the
    mode passes ops once the block closes); any other thread starts as it would."""
    blocks = [*getattr(threading.current_thread(), _WATCHED, ()), *_open_blocks.get(threading.get_ident(), ())]
    blocks = [block for block in blocks if block[0].open]
    if blocks:
        watch, mode = blocks[-1]
        run = self.run

        def run_watched() -> None:
            with mode(watch):
                run()

        setattr(self, _WATCHED, (blocks[-1],))  # the threads it starts while the block is open are watched too
        self.run = run_watched  # type: ignore[method-assign]
    assert _plain_start is not None
    _plain_start(self)


def _open_for_threads(watch: _Watch, mode: Callable[[_Watch], TorchDispatchMode]) -> None:
    """Threads this thread starts from now until :func:`_close_for_threads` run under ``mode(watch)``."""
    global _plain_start, _in_chain
    with _starts_lock:
        if not _in_chain:
            _plain_start = threading.Thread.start
            threading.Thread.start = _watched_start  # type: ignore[method-assign]
            _in_chain = True
        _open_blocks.setdefault(threading.get_ident(), []).append((watch, mode))


def _close_for_threads() -> None:
    """Ends this thread's innermost :func:`_open_for_threads`; the last one open puts ``Thread.start`` back
    (unless other code wrapped it since: then ours stays in its chain, passing every start through)."""
    global _in_chain
    with _starts_lock:
        ident = threading.get_ident()
        _open_blocks[ident].pop()
        if not _open_blocks[ident]:
            del _open_blocks[ident]
        if not _open_blocks and threading.Thread.start is _watched_start:
            threading.Thread.start = _plain_start  # type: ignore[method-assign]
            _in_chain = False


def came_from_outside(tensor: torch.Tensor, what: str = "") -> torch.Tensor:
    """Note that a real ``tensor`` made outside the capture running on this thread enters its record or
    result (it may hold a draw another thread made for it); returns ``tensor``."""
    blocks = _open_blocks.get(threading.get_ident())
    if blocks and len(blocks[-1][0].outside) < 3:  # (the first three: what an error names)
        blocks[-1][0].outside.append(what or f"a tensor of shape {tuple(tensor.shape)}")
    return tensor


def _torch_rng() -> tuple[int, torch.Tensor]:
    return torch.initial_seed(), torch.default_generator.get_state()


def _torch_rng_moved(before: tuple[int, torch.Tensor]) -> bool:
    """Whether torch's global CPU generator was drawn from since ``before``; a reseed alone
    (``torch.manual_seed`` in the code: a fresh state of the new seed) is not a draw."""
    seed, state = _torch_rng()
    if torch.equal(state, before[1]):
        return False
    if seed != before[0]:
        return not torch.equal(state, torch.Generator().manual_seed(seed).get_state())
    return True


def _refuse_in_thread(watch: _Watch) -> RefuseDraws:
    """Pushed in a thread started inside a capture: while the capture runs, every random torch op there, and
    every op on a stand-in, is refused; deterministic work on real tensors (loading a checkpoint's tensors,
    as Hugging Face's loader does in a pool) runs."""
    from keyinit._engine.capture.standin import LazyTensor, tensor_leaves

    def refused(func: Any, args: tuple, kwargs: dict) -> bool:
        return watch.open and (any(isinstance(x, LazyTensor) for x in tensor_leaves((args, kwargs)))
                               or is_random(func))

    def refuse(func: Any) -> None:
        name = threading.current_thread().name
        watch.refused.append(name)
        raise UnkeyedRandomnessError(_thread_message(watch.site, name, func))

    return RefuseDraws(refuse, refused)


def _thread_message(site: str, thread: str, func: Any = None) -> str:
    return (f"{site}: init code ran torch ops{f' ({func})' if func is not None else ''} in a thread it started "
            f"({thread}) that draw or use keyinit's stand-ins; keyinit records the ops of the thread that runs the "
            f"code, so a draw there would come from torch's global RNG and be kept as a constant: build the "
            f"modules and draw in the calling thread (deterministic work on real tensors, such as loading a "
            f"checkpoint, may use threads)")


_HOST_NAMES = {"random": "Python's random", "numpy.random": "numpy.random"}  # as the errors name them


@contextlib.contextmanager
def watched(site: str) -> Iterator[None]:
    """Run a capture's block; a draw from Python's, numpy's or torch's global generator, or a draw or a
    stand-in in a thread the block's code starts, is an :class:`UnkeyedRandomnessError` naming ``site`` (the
    generators put back)."""
    watch = _Watch(site)
    host = HostDrawsPutBack(hold=False)  # (the lock only to read and put back: the code may wait on keyed samples)
    torch_before = _torch_rng()
    try:
        with host:
            _open_for_threads(watch, _refuse_in_thread)  # the threads this thread starts in the block
            try:
                yield
            finally:
                _close_for_threads()
                watch.open = False
    finally:
        # a draw while nothing made outside entered: another thread's own (an eager model built beside)
        drawn_elsewhere = bool(watch.outside) and _torch_rng_moved(torch_before)
        if drawn_elsewhere:
            torch.default_generator.set_state(torch_before[1])
    advanced = [_HOST_NAMES[name] for name in host.drew]
    if advanced:
        raise UnkeyedRandomnessError(
            f"{site}: init code drew from the global generator of {' and '.join(advanced)}: its values would depend on "
            f"that generator's state (different on two ranks), and keyinit cannot key them; draw with torch (keyed "
            f"by the tensor it lands in) or keyinit.random; the generator's state was put back")
    if drawn_elsewhere:
        raise UnkeyedRandomnessError(
            f"{site}: torch's global RNG was drawn from while the code ran, by a thread the capture does not record, "
            f"and the code's result holds tensors made outside the capture (such as {', '.join(watch.outside)}): "
            f"keyinit cannot tell whether they hold those draws (a thread running before the capture, such as a pool "
            f"a library keeps, would have them kept as constants, different on two ranks) or another thread drew for "
            f"its own use (a model built eagerly there); build the modules and draw in the calling thread, and build "
            f"other models before or after, or on meta; torch's RNG was put back")
    if watch.refused:
        raise UnkeyedRandomnessError(_thread_message(site, watch.refused[0]))


def _refuse_draws_in_thread(watch: _Watch) -> RefuseDraws:
    """Pushed in a thread started inside a keyed sample: while the sample runs, every random op there is
    refused (deterministic ops, such as decoding, run)."""

    def refuse(func: Any) -> None:
        name = threading.current_thread().name
        watch.refused.append(name)
        raise UnkeyedRandomnessError(
            f"{watch.site}: a random op ({func}) in a thread started while the sample was read ({name}); "
            "keyinit keys the randomness of the thread that reads the sample, so this draw would come from "
            "torch's global RNG and differ on every read: augment in the calling thread")

    return RefuseDraws(refuse, lambda func, args, kwargs: watch.open and is_random(func))


class ThreadDrawsRefused:
    """Context manager: a random torch op in a thread that the block's thread starts inside the block is
    an :class:`UnkeyedRandomnessError` naming ``site`` (refused before it draws); threads other code
    starts meanwhile are not watched."""

    __slots__ = ("watch",)

    def __init__(self, site: str) -> None:
        self.watch = _Watch(site)

    def __enter__(self) -> "ThreadDrawsRefused":
        watch = self.watch
        _open_for_threads(watch, _refuse_draws_in_thread)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _close_for_threads()
        self.watch.open = False
        if self.watch.refused and exc_info[0] is None:  # the thread swallowed it (threading's excepthook)
            raise UnkeyedRandomnessError(
                f"{self.watch.site}: a random op in a thread started while the sample was read "
                f"({self.watch.refused[0]}) was refused; keyinit keys the randomness of the thread that reads the "
                f"sample: augment in the calling thread")

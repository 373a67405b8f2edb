"""The ground floor: the math of the random stream (docs/spec.md), importing nothing else of keyinit.

- :mod:`~keyinit._bits.philox`: Philox4x32-10 and the element stream's words;
- :mod:`~keyinit._bits.fp32math`: the correctly rounded binary32 operations the transforms use;
- :mod:`~keyinit._bits.hostmath`: the float64 host-side helpers (the normal CDF);
- :mod:`~keyinit._bits.streams`: a stream version's math (seed, derivation, words) and the registry of
  versions, :data:`~keyinit._bits.streams.STREAMS`.
"""

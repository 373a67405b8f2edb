"""keyinit's tests, one folder per feature (each folder's ``__init__.py`` says what it tests).

- ``stream/``: keys, Philox, the samplers, regions, stream v1's golden vectors, errors.
- ``kernels/``: the compiled C kernels against the Python reference; ``gpu/``: Triton and CUDA.
- ``init/``: ``init_model``/``materialize``, plans, layouts, rule precedence (one and many ranks).
- ``capture/``: init code captured on stand-ins; ``deferred/``: ``keyinit.deferred`` constructors.
- ``zoo/``: real model code (HF, vision, torchtitan-style, torchtune, OLMo-core, megatron-core).
- ``data/``: ``keyinit.data``; ``sround/``: stochastic rounding; ``cli/``: the command line.
- ``nn/``: keyed forwards: ``dropout/`` (the ops), ``stream/`` (golden vectors of spec 14),
  ``keyed/`` (``keyed()`` on whole models), ``batch/`` (batching rules, routing), ``checkpoint/``,
  ``compile/``, ``sweeps/`` (every HF architecture).
- ``project/``: runnable docs and examples, the import floors, module sizes.

Helpers the tests share live in ``_support/`` (real gloo ranks, the zoos, ``nets`` (small models),
``splits`` (the split-invariance check)); ``conftest.py`` holds the sampler cases and bit
comparisons. Every folder is a package, so a test module is ``tests.<folder>.<file>`` and two
folders may hold files of the same name. A golden vector file sits beside the test that reads it.
"""

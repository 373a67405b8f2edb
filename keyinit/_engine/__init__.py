"""The capture/replay engine (private): every way into keyinit becomes one program per tensor.

Modules, bottom up:

- ``program``: the IR of one tensor's values (allocations, writes through strided views,
  element-wise and whole nodes, keyed draws) and how draws get their keys (``assign_keys``);
- ``random_ops``: torch's random ops and their keyed equivalents (program nodes);
- ``capture``: a torch dispatch mode that runs code on global-shape stand-ins (``LazyTensor``,
  ``standin``; ``escape`` gives real values to the ones code keeps elsewhere) and records what it
  does to each tensor as program nodes;
- ``guard``: planning writes nothing to the model (``no_writes``);
- ``deferred``: ``keyinit.deferred``, a constructor recorded under the capture;
  ``megatron_records``: the whole of a megatron-core split parameter in such a record;
- ``init_code``: init methods, ``reset_parameters`` and parametrizations run under the capture;
- ``replay``: evaluates any region of a program (keyed draws through ``keyinit._draw.dispatch``);
- ``planned``: what planning decides (``PlannedTensor``, ``ModelPlan``);
- ``options``: the init options as one frozen value (``InitOptions``);
- ``plan``: the planner: rules, records, init code and torch.nn defaults in the documented
  precedence, checked before anything is allocated (``plan_checks``); ``shared_draws``: the
  pipeline-cut warning;
- ``writer``: writes a plan into the model, lowest precedence first, with its undo and its report
  (``InitReport``, ``TensorRecord``); ``progress``: the one progress bar (the writer's, ``verify``'s).

The public face is :func:`keyinit.plan_init` / :class:`keyinit.Plan` (``keyinit/model.py``),
``keyinit.init_model``, ``keyinit.materialize`` and ``keyinit.deferred``. Nothing here is API:
names and modules may change without notice.
"""

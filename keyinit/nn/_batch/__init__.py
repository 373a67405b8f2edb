"""The model of the batch: which sample each element of an activation belongs to, op by op.

- ``records.py``: the records (:class:`~keyinit.nn._batch.records.Batch`, ``Unknown``, ...) a tensor carries;
- ``rules.py``: the one table of batching rules, which refuses an op named twice, built from the op
  families ``rules_tensor.py`` and ``rules_nn.py``;
- ``routed.py``: rows of the batch picked by index values (a router's dispatch), followed on the values;
- ``propagate.py``: the records of one ATen op's outputs, from its rule (or the routed rules);
- ``memo.py``: the records of a pure torch function's outputs, remembered per call signature and set again
  without the per-op dispatch mode;
- ``functorch.py``: torch.func's wrapped tensors, keyed on the values under the wrappers.

Nothing here knows of a keyed forward: the modes of :mod:`keyinit.nn._forward` use these records.
"""

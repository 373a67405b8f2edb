"""Deferred construction: a model built with its constructor's init code recorded, not run
(``deferred``: ``keyinit.deferred``), the whole of a megatron-core split parameter in such a record
(``megatron_records``), and lazy modules, whose tensors have no shape yet, refused by name (``lazy``).
"""

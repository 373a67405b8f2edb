"""How frameworks shard a tensor, as index facts read without communicating: DTensor placements as sets
of global elements (``placements``) and megatron-core's tensor- and expert-parallel facts, read by duck
typing (``megatron``). :mod:`keyinit.layouts` turns both into a local tensor's global region.
"""

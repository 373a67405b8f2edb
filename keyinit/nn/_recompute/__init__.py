"""Recomputes of activation checkpointing in a keyed forward: ``keyinit.nn.checkpoint``'s keyed recompute
(``checkpoint.py``), the recomputes of torch's and megatron-core's checkpoints handed over to the keyed
context, and the draws keyinit could not follow into torch's own recompute (refused at their first execution).
"""

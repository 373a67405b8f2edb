"""Keyed ops with no context: the ``keyinit::dropout`` custom op (``op.py``), attention whose probability
dropout is keyed (``attention.py``) and the keys of dropout calls (``keys.py``).

The floor of ``keyinit.nn``: these modules import nothing else of it. :mod:`keyinit.nn.functional` (the public
functions) is built on them; a keyed forward (:mod:`keyinit.nn._forward`) calls them with the keys it derives.
"""

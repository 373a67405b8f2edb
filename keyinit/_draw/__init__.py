"""The floor that draws: from a key and a region (or an activation's geometry) to values, on any device.

- :mod:`~keyinit._draw.dispatch`: the one seam, the per-version table of kernel families (fill, dropout,
  permutation) that kernels register into; a family's reference runs where no kernel does;
- :mod:`~keyinit._draw.geometry`: a region (or an activation's layout) as strided runs of global indices;
- :mod:`~keyinit._draw.dropout_geometry`: where each element of a dropout input sits in the global tensor;
- the references, the executable spec every kernel must match bit for bit:
  :mod:`~keyinit._draw.reference_fill`, :mod:`~keyinit._draw.reference_dropout` and
  :mod:`~keyinit._draw.reference_permutation` (with the permutation key).
"""

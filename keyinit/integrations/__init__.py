"""keyinit where people train: frameworks' own training loops keyed with one call each.

- :mod:`keyinit.integrations.transformers`: Hugging Face ``Trainer`` (and its subclasses) keyed by
  ``keyed_trainer(trainer)``: data order, collate randomness and every training forward's randomness
  (``docs/trainer.md``).
- :mod:`keyinit.integrations.lightning`: a ``Callback`` for ``lightning.Trainer`` and the same pieces
  for ``Fabric`` (``docs/lightning.md``).

Importing this package imports no framework: each submodule imports its own when it is imported.
"""

"""keyinit where people train: frameworks' own training loops keyed with one call each.

- :mod:`keyinit.integrations.transformers`: Hugging Face ``Trainer`` (and its subclasses) keyed by
  ``keyed_trainer(trainer)``: data order, collate randomness and every training forward's randomness
  (``docs/trainer.md``).

Importing this package imports no framework: each submodule imports its own when it is imported.
"""

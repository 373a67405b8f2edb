"""keyinit where people train: one call each for the trainers that own the training loop.

- :mod:`keyinit.integrations.lightning`: a ``Callback`` for ``lightning.Trainer`` and the same pieces
  for ``Fabric`` (``docs/lightning.md``).

Each submodule imports its framework itself, when it is imported: ``import keyinit`` never does.
"""

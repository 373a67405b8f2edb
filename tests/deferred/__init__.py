"""keyinit.deferred: a model's constructor recorded and replayed keyed, and what it keeps, loads or refuses."""

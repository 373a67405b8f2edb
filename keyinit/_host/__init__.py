"""Python's ``random`` and ``numpy.random`` global generators as keyinit keys them: the process's one lock
for them (:mod:`keyinit._host.lock`) and their states saved, seeded and put back as bytes
(:mod:`keyinit._host.states`); a block's draws from them named and put back (:mod:`keyinit._host.draws`:
keyed collates and captures refuse them). Keyed samples and collates (``keyinit.data``) and keyed forwards
(``keyinit.nn``) seed them through this room."""

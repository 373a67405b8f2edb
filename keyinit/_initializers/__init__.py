"""The base of keyinit's initializers (``base``): the ``Initializer`` protocol, the checks of its
parameters, fans and gains from the GLOBAL shape, and the keyed fills every initializer shares.
:mod:`keyinit.init` (one floor up) holds the initializers themselves and re-exports the public names.
"""

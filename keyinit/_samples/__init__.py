"""Where a batch's rows sit in the run, as the sampler, the collate and ``keyinit.nn.keyed(samples=)`` all
read it: :mod:`keyinit._samples.positions` (``SamplePositions``, what a batch carries) and
:mod:`keyinit._samples.padding` (left padding, which moves a token to another coordinate). ``keyinit.data``
names both publicly."""

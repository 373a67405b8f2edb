"""Capture: running code once on global-shape stand-ins and recording what it does as programs.

The dispatch mode (``capture``), the stand-ins it hands to code (``standin``), what each aten op is to it
(``aten_kinds``), what it cannot record and refuses (``outside``: Python's and numpy's generators,
threads) and real values for the stand-ins code keeps outside parameters and buffers (``escape``).
"""

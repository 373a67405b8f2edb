"""``import_torchvision()``: torchvision beside the CPU torch of this environment (see tests/_support/vision.py).

Call it in DataLoader worker processes too, before they import torchvision.
"""

from __future__ import annotations

from tests._support.vision import define_torchvision_schemas


def import_torchvision():
    define_torchvision_schemas()
    import torchvision

    return torchvision

"""``import_torchvision()``: torchvision beside the CPU torch of this environment.

torchvision's import fails here until its ``nms``/``qnms`` op schemas exist; this
defines them once per process (the Library object is kept alive) and imports it.
Call it in DataLoader worker processes too, before they import torchvision.
"""

from __future__ import annotations

import torch

_LIBRARY = None


def import_torchvision():
    global _LIBRARY
    if _LIBRARY is None:
        try:
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor qdets, Tensor qscores, Tensor scale, float iou_threshold, int zero_point) -> Tensor")
            _LIBRARY = lib
        except RuntimeError:  # already defined in this process (e.g. by torchvision itself)
            _LIBRARY = False
    import torchvision

    return torchvision

"""Let ``import torchvision`` (and timm, open_clip, transformers' image code, which import it) work
beside a CPU torch build even when the installed torchvision wheel is a CUDA build.

Such a wheel's C++ library cannot load, so its two operator schemas are missing and the import
fails while registering their Python fake kernels. Defining the two schemas (no kernels: nothing
here calls them) lets the Python part load. On a matching install this does nothing.
"""

from __future__ import annotations

import importlib
import sys

import torch

_KEEP: list = []


def ensure_torchvision() -> None:
    """Import torchvision if it is installed, defining its two op schemas when its C++ part cannot load."""
    try:
        importlib.import_module("torchvision")
    except ImportError:
        return  # not installed: nothing imports it
    except (RuntimeError, AttributeError):
        for name in list(sys.modules):
            if name.startswith(("torchvision", "timm")):
                del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor qdets, Tensor qscores, Tensor scale, float iou_threshold, "
                       "int zero_point) -> Tensor")
        _KEEP.append(library)
        importlib.import_module("torchvision")

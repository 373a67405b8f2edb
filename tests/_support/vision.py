"""Importing torchvision (and timm, open_clip, which import it) beside the CPU torch build.

The torchvision wheel the registry serves is a CUDA build; its C++ library cannot load
beside CPU torch, so its two operator schemas are missing and ``import torchvision``
fails while registering their Python fake kernels. Defining the two schemas first (no
kernels: nothing here calls them) lets it import. Called only by tests, once per process.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch

_LIBRARY: Optional[torch.library.Library] = None


def define_torchvision_schemas() -> None:
    """Define torchvision's two C++ op schemas if no torchvision library did or can (idempotent)."""
    global _LIBRARY
    if _LIBRARY is not None or _defined("torchvision::nms") or _native_library_loads():
        return  # already defined here, or by a torchvision build that loads (a CUDA machine's)
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor qscores, Tensor scale, float iou_threshold, int zero_point) -> Tensor")
    _LIBRARY = library


def _native_library_loads() -> bool:
    """Whether torchvision's own C++ library loads beside this torch (it then defines the schemas)."""
    import glob
    import importlib.util
    import os

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    libraries = glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so"))
    if not libraries:
        return False
    try:
        torch.ops.load_library(libraries[0])
    except (OSError, RuntimeError):  # a build for another torch or CUDA: its symbols do not resolve
        return False
    return True


def _defined(name: str) -> bool:
    try:
        torch._C._get_schema(name, "")
    except RuntimeError:
        return False
    return True


def import_vision(name: str) -> ModuleType:
    """``import name`` (torchvision, timm, open_clip), or skip the test when it is not installed."""
    import pytest

    try:
        importlib.import_module("torchvision.version")  # cheap probe: is it installed at all?
    except ImportError:
        pytest.skip("torchvision is not installed (pip install -e '.[test]')")
    define_torchvision_schemas()
    return pytest.importorskip(name)

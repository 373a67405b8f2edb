"""An experiment, not part of keyinit: what a C++ autograd node for keyed dropout would buy.

    python benchmarks/native_dropout_node.py            # build (about 40 s), check, then 6 alternating pairs
    python benchmarks/native_dropout_node.py --pairs 3

keyinit's eager dropout op is a Python ``torch.autograd.Function`` around the C kernel
(``keyinit/_kernels/dropout/dropout_kernels.c``, called through ctypes). On the dim-16 toy of
``bench_dropout.py`` (section 4), where the model's compute is negligible, the op's Python
forward and backward are a large part of what keyed() adds. This script builds, in a temporary
directory, a torch C++ extension (``torch.utils.cpp_extension.load_inline``: torch's headers, a C++
compiler, ninja) holding a C++ ``torch::autograd::Function`` that calls the SAME C kernel through its
function pointer (forward, and the same kernel on the gradient in backward; nothing saved), then:

1. checks that a keyed forward+backward through it gives the Python op's outputs and gradients bit for
   bit (index-free geometries go to the node, the rest to the Python op);
2. times ``bench_keyed_model(dim=16, batch=(2, 8))`` (torch's dropout vs keyed(), forward+backward)
   with keyinit's ``_eager`` using the node and using the Python op, alternating, in one process.

keyinit itself never builds this: its kernels need only a C compiler (``keyinit/_kernels/common/build.py``),
not torch's headers. The numbers are what a decision to take that dependency would rest on
(docs/benchmarks.md, section 8).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

CPP = r"""
#include <torch/extension.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
// keyinit_dropout of dropout_kernels.c
typedef int (*kernel_fn)(int, uint32_t, uint32_t, int64_t, float, double, const void*, void*, int, int64_t,
                         const int64_t*, const int64_t*, void* const*, int);

static torch::Tensor run(const torch::Tensor& x, const std::vector<int64_t>& a, double s32, double s64,
                         const std::vector<int64_t>& sizes, const std::vector<int64_t>& gstrides) {
  // a = {kernel, dtype id, k0, k1, threshold, base}
  auto xc = x.contiguous();
  auto out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  void* no_index[8] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  int rc = reinterpret_cast<kernel_fn>(a[0])((int)a[1], (uint32_t)a[2], (uint32_t)a[3], a[4], (float)s32, s64,
      xc.data_ptr(), out.data_ptr(), (int)sizes.size(), a[5], sizes.data(), gstrides.data(), no_index, 1);
  TORCH_CHECK(rc == 0, "keyinit_dropout failed");
  return out;
}

struct KeyedDropout : public torch::autograd::Function<KeyedDropout> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, std::vector<int64_t> a, double s32,
                               double s64, std::vector<int64_t> sizes, std::vector<int64_t> gstrides) {
    ctx->saved_data["a"] = a;
    ctx->saved_data["s32"] = s32;
    ctx->saved_data["s64"] = s64;
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["gstrides"] = gstrides;
    return run(x, a, s32, s64, sizes, gstrides);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto a = ctx->saved_data["a"].toIntVector();
    auto sizes = ctx->saved_data["sizes"].toIntVector();
    auto gstrides = ctx->saved_data["gstrides"].toIntVector();
    double s32 = ctx->saved_data["s32"].toDouble(), s64 = ctx->saved_data["s64"].toDouble();
    // the same op on the gradient (differentiable again where the backward itself records)
    auto g = torch::autograd::GradMode::is_enabled() ? KeyedDropout::apply(grads[0], a, s32, s64, sizes, gstrides)
                                                     : run(grads[0], a, s32, s64, sizes, gstrides);
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

torch::Tensor keyed_dropout(torch::Tensor x, std::vector<int64_t> a, double s32, double s64,
                            std::vector<int64_t> sizes, std::vector<int64_t> gstrides) {
  return KeyedDropout::apply(x, a, s32, s64, sizes, gstrides);
}
"""


def build_node():
    from torch.utils.cpp_extension import load_inline

    start = time.perf_counter()
    ext = load_inline("keyinit_native_dropout_node", cpp_sources=[CPP], functions=["keyed_dropout"],
                      extra_cflags=["-O2"], build_directory=tempfile.mkdtemp(prefix="keyinit-node-"))
    return ext, time.perf_counter() - start


def native_eager(ext):
    """keyinit.nn._ops.op._eager with index-free CPU geometries (with a backward to plan for) on the C++ node."""
    from keyinit._kernels.dropout import cpu as dropout_cpu
    from keyinit.nn._ops import op as _op

    lib = dropout_cpu.library()
    if lib is None:
        sys.exit("the compiled CPU dropout kernel is unavailable here (no C compiler?)")
    kernel = ctypes.cast(lib.keyinit_dropout, ctypes.c_void_p).value
    ids = dropout_cpu.DTYPE_IDS
    python_eager = _op._eager
    grad_enabled = torch.is_grad_enabled

    def eager(x, geometry):
        if (x.requires_grad and grad_enabled() and x.is_cpu and x.dtype in ids
                and all(index is None for index in geometry.indices)):
            return ext.keyed_dropout(x, [kernel, ids[x.dtype], geometry.k0, geometry.k1, geometry.threshold,
                                         geometry.base], geometry.scale32, geometry.scale64,
                                     list(geometry.sizes), list(geometry.gstrides))
        return python_eager(x, geometry)

    return python_eager, eager


def check(python_eager, eager) -> None:
    from torch import nn

    import keyinit.nn as knn
    from keyinit.nn._ops import op as _op

    def step(use):
        _op._eager = use
        try:
            g = torch.Generator().manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.Linear(64, 16), nn.Dropout(0.2)).train()
            for p in model.parameters():
                p.data = torch.randn(p.shape, generator=g)
            x = torch.randn(4, 8, 16, generator=g, requires_grad=True)
            with knn.keyed(model, 0, step=3):
                out = model(x)
                out.square().sum().backward()
            return [out.detach(), x.grad] + [p.grad for p in model.parameters()]
        finally:
            _op._eager = python_eager

    a, b = step(python_eager), step(eager)
    if not all(torch.equal(u, v) for u, v in zip(a, b)):
        sys.exit("the C++ node's outputs or gradients differ from the Python op's")
    print("outputs and gradients of a keyed step: bit for bit the Python op's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=301)
    args = parser.parse_args()
    import bench_dropout
    from keyinit.nn._ops import op as _op

    ext, seconds = build_node()
    print(f"built the extension in {seconds:.1f} s")
    python_eager, eager = native_eager(ext)
    check(python_eager, eager)
    ratios: dict[str, list[float]] = {"Python op": [], "C++ node": []}
    for pair in range(args.pairs):
        for name in (("Python op", "C++ node") if pair % 2 == 0 else ("C++ node", "Python op")):
            _op._eager = eager if name == "C++ node" else python_eager
            try:
                result = bench_dropout.bench_keyed_model(args.repeats, 1, dim=16, batch=(2, 8))
            finally:
                _op._eager = python_eager
            ratios[name].append(result["ratio"])
    print("dim-16 toy, torch time / keyed time (forward+backward, 1 thread), alternating:")
    for name, values in ratios.items():
        print(f"  {name:9}: " + ", ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()

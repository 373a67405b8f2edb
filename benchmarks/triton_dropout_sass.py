"""The Triton dropout kernel's machine code for sm_90, compiled on this machine's CPU (no GPU needed).

    python benchmarks/triton_dropout_sass.py

For v1's run mode and v2's rows mode (three dims, rows of 16-byte vectors), bfloat16 and float32, under a
few ``Tuning``s: the SASS instructions of the whole kernel, of the loop over a row's tiles (the rows mode;
the run mode has no loop: one tile a program), the words a tile holds, the registers a thread takes and the
widths of the global loads. Instructions per tile word compare the modes' inner work (the Philox rounds,
the keep test, the scaling and rounding, the stores). Triton's own ``ptxas``, ``nvdisasm`` and
``cuobjdump`` (bundled with its NVIDIA backend) do the work. Counts, not times: see
benchmarks/triton_dropout_sweep.py for those.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from keyinit._kernels.dropout import triton as triton_dropout  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);")


def compile_kernel(dtype, mode: int, block: int, warps: int, tuning: triton_dropout.Tuning):
    fn = triton_dropout._dropout_kernel
    rows = mode == triton_dropout.ROWS
    constexprs = {"NDIM": 3 if rows else 1, "MODE": mode, "HIGH": rows, "GATHER": False,
                  "KIND": triton_dropout._KINDS[dtype], "CVT": tuning.bf16_cvt, "NAN": tuning.bf16_nan,
                  "BLOCK": block, "VEC": 16 // dtype.itemsize}
    pointer = {torch.float32: "*fp32", torch.bfloat16: "*i16"}[dtype]
    signature = {name: "constexpr" if name in constexprs else pointer if name in ("x_ptr", "out_ptr")
                 else "*i64" if name.endswith("_ptr") else "i64" for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                       attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                              for n in ("x_ptr", "out_ptr", "meta_ptr", "index_ptr")})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False, "num_warps": warps})


def tool(name: str, *args: str) -> str:
    return subprocess.run([str(TOOLS / name), *args], capture_output=True, text=True, check=True).stdout


def inspect(kernel) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = tool("nvdisasm", "-c", cubin)
        usage = tool("cuobjdump", "--dump-resource-usage", cubin)
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.match(line)
        if found:
            address = int(found.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append((address, found.group(2)))
    loops = []  # (first, last address) of each backward branch's body
    for address, text in instructions:
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), address + 1) <= address:
            loops.append((labels[target.group(1)], address))
    tile_loop = None
    for first, last in sorted(loops, key=lambda span: span[1] - span[0]):
        body = [t for a, t in instructions if first <= a <= last]
        if any("STG" in t for t in body):  # the innermost loop that stores: the tile loop
            tile_loop = len(body)
            break
    regs = re.search(r"REG:(\d+)", usage)
    ptx = kernel.asm["ptx"]
    return {"sass": len(instructions), "tile_loop": tile_loop, "regs": int(regs.group(1)) if regs else None,
            "loads": sorted(set(re.findall(r"ld\.global(?:\.v\d)?\.b\d+", ptx)) - {"ld.global.b64"})}


def main() -> None:
    Tuning = triton_dropout.Tuning
    cases = [("v1 run", triton_dropout.RUN, None, Tuning())]
    for tuning in (Tuning(), Tuning(bf16_cvt=False), Tuning(bf16_nan=False), Tuning(8192, 4), Tuning(4096, 8)):
        cases.append(("v2 rows", triton_dropout.ROWS, tuning.tile_bytes, tuning))
    print(f"{'dtype':9} {'mode':8} {'tuning (rows: tile bytes/warps; flags)':40} {'words':>5} {'regs':>4} "
          f"{'sass':>5} {'loop':>5} {'/word':>6}  loads")
    for dtype in (torch.bfloat16, torch.float32):
        seen = set()
        for name, mode, tile_bytes, tuning in cases:
            if dtype != torch.bfloat16 and (not tuning.bf16_cvt or not tuning.bf16_nan):
                continue  # (the bfloat16 flags change no other kernel)
            block = triton_dropout.BLOCK if tile_bytes is None else tile_bytes // dtype.itemsize
            warps = 4 if tile_bytes is None else max(1, min(tuning.warps, block // 256))
            if (mode, block, warps, tuning.bf16_cvt, tuning.bf16_nan) in seen:
                continue  # (the same kernel: the warps a tile allows)
            seen.add((mode, block, warps, tuning.bf16_cvt, tuning.bf16_nan))
            info = inspect(compile_kernel(dtype, mode, block, warps, tuning))
            per_tile = info["tile_loop"] or info["sass"]
            flags = ("" if tuning.bf16_cvt else " bits") + ("" if tuning.bf16_nan else " anynan")
            label = (f"{tile_bytes}/{warps}" if tile_bytes else "1024 words/4") + flags
            print(f"{str(dtype)[6:]:9} {name:8} {label:40} {block:5} {info['regs']:4} {info['sass']:5} "
                  f"{info['tile_loop'] or '-':>5} {per_tile / (block / (32 * warps)):6.1f}  "
                  f"{' '.join(info['loads'])}")
    print(f"\n/word: the tile loop's instructions (the run mode: the kernel's) per word a thread holds; "
          f"triton {triton.__version__}, sm_90")


if __name__ == "__main__":
    main()

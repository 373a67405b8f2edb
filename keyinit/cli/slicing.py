"""``keyinit slice MODULE:FACTORY 'FQN[rows, cols]'``: a virtual seed checkpoint.

Prints (or saves) any slice of any parameter exactly as a training run with
that seed would initialize it, without allocating the rest of the model: the
model is built on the meta device, every other tensor gets an empty region,
and ``keyinit.init_model`` computes only the requested elements.

Index syntax is Python's, applied to the GLOBAL tensor: ``[0:4, :8]``,
``[-1]``, ``[::2, 5]``, ``[..., 0]``, and lists of indices ``[[0, 7, 9], :]``
(lists index each dimension independently, like ``numpy.ix_``). An int drops
its dimension, as in torch. No brackets means the whole tensor.

Init code (``reset_parameters``, ``init_method``) is captured on stand-ins and
replayed for the selected region only, exactly as a training run's ranks do;
a tensor whose init code is not element-local (a reduction, QR) is computed
whole and then sliced.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import sys
from typing import Any, Optional

import torch

from keyinit.cli._common import CLIError, add_subcommand, build_model, digest, load_factory
from keyinit.regions import make_region

__all__ = ["add_parser", "run", "parse_selector", "compute_slice"]


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "slice", __doc__,
                       "print or save any slice of any parameter as a training run would initialize it, "
                       "without allocating the model")
    p.add_argument("factory", help="MODULE:FACTORY (or path/to/file.py:FACTORY), called under torch.device('meta')")
    p.add_argument("selector", help="FQN or 'FQN[index]', e.g. 'layers.0.attention.wq.weight[0:4, :8]'")
    p.add_argument("--seed", type=int, default=0, help="the seed (default 0)")
    p.add_argument("--init-method", default=None, help="existing init code to run keyed (init_model(init_method=...))")
    p.add_argument("--out", default=None, help="save to FILE.pt (torch.save) or FILE.npy (numpy) instead of printing")
    p.add_argument("--full", action="store_true", help="print every element (default: torch's summarized print)")
    p.set_defaults(run=run)


# --------------------------------------------------------------------------- selector parsing


def _literal_int(node: ast.AST, text: str) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal_int(node.operand, text)
        return -value if isinstance(node.op, ast.USub) else value
    raise CLIError(f"bad index {text!r}: expected integers, slices (a:b:c), '...' or [lists of ints]")


def _entry(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Slice):
        parts = [None if n is None else _literal_int(n, text) for n in (node.lower, node.upper, node.step)]
        if parts[2] == 0:
            raise CLIError(f"bad index {text!r}: slice step cannot be zero")
        return slice(*parts)
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return Ellipsis
    if isinstance(node, ast.List):
        return [_literal_int(n, text) for n in node.elts]
    return _literal_int(node, text)


def parse_selector(selector: str) -> tuple[str, Optional[list[Any]]]:
    """``'a.b.weight[0:4, 3]'`` -> ``('a.b.weight', [slice(0, 4), 3])``; no brackets -> ``(fqn, None)``."""
    text = selector.strip()
    if "[" not in text:
        if "]" in text or not text:
            raise CLIError(f"bad selector {selector!r}: expected FQN or FQN[index]")
        return text, None
    fqn, _, rest = text.partition("[")
    fqn = fqn.strip()
    if not fqn or not rest.endswith("]"):
        raise CLIError(f"bad selector {selector!r}: expected FQN[index], e.g. 'output.weight[0:4, :8]'")
    inner = rest[:-1]
    try:
        tree = ast.parse(f"_[{inner}]", mode="eval")
    except SyntaxError:
        raise CLIError(f"bad index [{inner}] in {selector!r}: not valid Python index syntax") from None
    node = tree.body.slice  # type: ignore[attr-defined]
    elements = node.elts if isinstance(node, ast.Tuple) else [node]
    if not inner.strip():
        raise CLIError(f"bad selector {selector!r}: empty index")
    return fqn, [_entry(e, f"[{inner}]") for e in elements]


def to_region(shape: tuple[int, ...], index: Optional[list[Any]], where: str) -> tuple[list[Any], list[int]]:
    """Region entries (one per dim) and the dims an int index drops."""
    if index is None:
        return [slice(None)] * len(shape), []
    if sum(e is Ellipsis for e in index) > 1:
        raise CLIError(f"bad index for {where}: at most one '...'")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        if fill < 0:
            raise CLIError(f"too many indices for {where} of shape {tuple(shape)}: {len(index) - 1}")
        index = index[:at] + [slice(None)] * fill + index[at + 1:]
    if len(index) > len(shape):
        raise CLIError(f"too many indices for {where} of shape {tuple(shape)}: {len(index)}")
    index = index + [slice(None)] * (len(shape) - len(index))
    entries, dropped = [], []
    for dim, (entry, size) in enumerate(zip(index, shape)):
        if isinstance(entry, int):
            if not -size <= entry < size:
                raise CLIError(f"index {entry} is out of bounds for dim {dim} of {where} (size {size})")
            entries.append([entry])
            dropped.append(dim)
        elif isinstance(entry, list):
            bad = [i for i in entry if not -size <= i < size]
            if bad:
                raise CLIError(f"index {bad[0]} is out of bounds for dim {dim} of {where} (size {size})")
            entries.append(entry)
        else:
            entries.append(entry)
    return entries, dropped


# --------------------------------------------------------------------------- computing


def compute_slice(spec: str, factory: Any, fqn: str, index: Optional[list[Any]], seed: int,
                  init_method: Any = None) -> dict[str, Any]:
    """The selected values and what produced them: ``{"tensor", "fqn", "key_fqn", "source", "shape", ...}``.

    Plans the model on the meta device (capturing its init code on stand-ins) and replays
    only the selected region of the selected tensor: nothing else is allocated.
    """
    import keyinit

    model, kwargs = build_model(factory, spec)
    if init_method:
        kwargs["init_method"] = init_method
    try:
        plan = keyinit.plan_init(model, seed, materializing=False, **kwargs)
    except (keyinit.PlanError, keyinit.UnkeyedRandomnessError) as exc:
        raise CLIError(f"cannot plan {spec}'s initialization: {exc}") from exc
    names = [name for e in plan.entries for name in e.names]
    try:
        wanted = plan.entry(fqn)
    except KeyError:
        close = difflib.get_close_matches(fqn, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {len(names)} tensors, e.g. {names[:3]}"
        raise CLIError(f"{spec}'s model has no parameter or buffer {fqn!r}{hint}") from None
    if wanted.fqn not in plan.fqns:
        raise CLIError(f"{fqn} is a buffer that no rule or init method initializes; its value comes from "
                       f"the model's constructor, not from the seed")
    entries, dropped = to_region(wanted.global_shape, index, fqn)
    region = make_region(wanted.global_shape, entries)
    try:
        values = plan.values(fqn, region)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's initializers
        raise CLIError(f"initialization failed: {type(exc).__name__}: {exc}") from exc
    for dim in reversed(dropped):
        values = values.squeeze(dim)
    return {"tensor": values, "fqn": fqn, "canonical": wanted.fqn, "key_fqn": wanted.key_fqn,
            "source": wanted.source, "shape": wanted.global_shape, "dtype": wanted.dtype,
            "region_shape": region.region_shape, "element_local": wanted.element_local}


def run(args: argparse.Namespace) -> int:
    import keyinit

    fqn, index = parse_selector(args.selector)  # syntax errors before importing the user's code
    factory = load_factory(args.factory)
    keyinit.key(args.seed)
    result = compute_slice(args.factory, factory, fqn, index, args.seed, args.init_method)
    tensor = result["tensor"]
    shape = "x".join(map(str, result["shape"])) or "scalar"
    header = (f"{args.selector.strip()}: {tuple(tensor.shape)} of {result['canonical']} ({shape}, "
              f"{str(result['dtype']).replace('torch.', '')}), seed {args.seed}, stream {keyinit.DEFAULT_STREAM}, "
              f"{result['source']}" + (f", keyed as {result['key_fqn']}" if result["key_fqn"] != result["canonical"] else ""))
    if args.out:
        path = args.out
        if path.endswith(".npy"):
            import numpy as np

            if tensor.dtype in (torch.bfloat16,):
                raise CLIError("numpy has no bfloat16; save to a .pt file instead")
            np.save(path, tensor.numpy())
        elif path.endswith(".pt"):
            torch.save(tensor.clone(), path)
        else:
            raise CLIError(f"--out must end in .pt or .npy, got {path!r}")
        print(header)
        print(f"saved to {os.path.abspath(path)} (sha256 {digest(tensor)[:16]})")
        return 0
    print(header)
    if not result["element_local"]:
        print("(its values are computed whole, then sliced: the init code is not element-local)", file=sys.stderr)
    if args.full:
        torch.set_printoptions(profile="full")
    print(tensor)
    print(f"sha256 {digest(tensor)[:16]}")
    return 0

"""``keyinit verify MODULE:FACTORY``: check your model initializes identically under other layouts.

In ONE process, with no process group: initialize the model once in a single
process (the reference), then simulate every rank of every ``--layouts``
entry. A simulated rank builds the model on the meta device, gives each tensor
a local tensor holding only the region that rank would hold (from the DTensor
placements FSDP2 / HSDP / TP / FSDP2xTP would give it, computed with
``keyinit.layouts.dtensor_region``, or the pipeline stage's share), declares
those regions as manual shards, and runs the real ``keyinit.init_model`` over
it. Every local tensor must equal the same region of the reference, bit for bit.

Layout names: ``fsdpN``, ``fsdpRxS`` / ``hsdpRxS`` (HSDP), ``tpN``, ``dpN``,
``ppN``, joined with ``x`` (``fsdp2xtp2``, ``pp2xfsdp4``). Tensor parallelism
shards ``nn.Linear`` column-wise, except layers whose leaf name is in
``--rowwise`` (row-wise); embeddings and other >=2-D tensors on dim 0.

Limitation: init code that reads a tensor's SHAPE (a custom
``reset_parameters`` computing a bound from ``self.weight.shape``) sees the
local shape here, as it would under hand-cut shards, whereas a DTensor reports
the global shape. Built-in rules, ``keyinit.init`` initializers and
``nn.init.*`` calls on the tensor are keyed with global shapes either way.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from keyinit.cli._common import CLIError, Progress, aliases, bitwise_equal, build_model, format_table, load_factory, take_region
from keyinit.cli._virtual import (
    ROWWISE_NAMES,
    LayoutSpec,
    cut_stage,
    parse_layout,
    shard_in_place,
    slots_of,
    stage_assignment,
)

__all__ = ["add_parser", "run", "verify"]

DEFAULT_LAYOUTS = "fsdp4,tp2,fsdp2xtp2,pp2,fsdp8x8"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check, in one process, that MODULE:FACTORY's model initializes bit-identically under "
             "FSDP/HSDP/TP/PP layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("factory", help="MODULE:FACTORY (or path/to/file.py:FACTORY); the factory returns an "
                                   "nn.Module, or (nn.Module, init_model kwargs); it is called under "
                                   "torch.device('meta')")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated layouts (default {DEFAULT_LAYOUTS})")
    p.add_argument("--seed", type=int, default=0, help="the seed (default 0)")
    p.add_argument("--init-method", default=None,
                   help="run this method as existing init code (init_model(init_method=...)), e.g. init_weights")
    p.add_argument("--rowwise", default=",".join(sorted(ROWWISE_NAMES)),
                   help="leaf names of Linear layers TP shards row-wise (default: %(default)s)")
    p.add_argument("--summary", action="store_true", help="print only the per-layout summary, not the per-parameter table")
    p.set_defaults(run=run)


def _init_kwargs(kwargs: dict[str, Any], init_method: Any) -> dict[str, Any]:
    out = dict(kwargs)
    if init_method:
        out["init_method"] = init_method
    return out


def verify(factory: Any, layouts: "list[LayoutSpec | str]", seed: int = 0, *, init_method: Any = None,
           progress: bool = True, label: "str | None" = None) -> dict[str, Any]:
    """What ``keyinit verify`` checks, from Python.

    ``factory()`` (called under ``torch.device("meta")``) returns an ``nn.Module`` or
    ``(module, init_model_kwargs)``; ``layouts`` are names such as ``"fsdp4"``,
    ``"fsdp2xtp2"``, ``"pp2"``. Returns ``{"ok": bool, "params": [per-tensor dicts with
    "fqn", "source", "bad" ({layout: [ranks]}) ...], "layouts": [per-layout summaries]}``,
    or ``{"ok": False, "plan_error": message}`` if some parameter has no initializer.
    """
    import keyinit

    spec = label or getattr(factory, "__qualname__", "factory")
    layouts = [parse_layout(layout) if isinstance(layout, str) else layout for layout in layouts]

    model, kwargs = build_model(factory, spec)
    kwargs = _init_kwargs(kwargs, init_method)
    ref_slots = slots_of(model)
    ref_aliases = aliases(model)
    try:
        with torch.no_grad():
            report = keyinit.materialize(model, seed, device="cpu", **kwargs)
    except keyinit.PlanError as exc:
        return {"plan_error": str(exc), "ok": False}
    reference = {slot.fqn: slot.locations[0][0]._parameters.get(slot.attr) if slot.kind == "parameter"
                 else slot.locations[0][0]._buffers.get(slot.attr) for slot in ref_slots}
    records = {r.fqn: r for r in report.records}

    cells: dict[str, dict[str, list[int]]] = {s.fqn: {} for s in ref_slots}  # fqn -> layout -> bad ranks
    held: dict[str, dict[str, int]] = {s.fqn: {} for s in ref_slots}  # fqn -> layout -> ranks holding it
    summaries = []
    total = sum(layout.world_size for layout in layouts)
    bar = Progress(total, "keyinit verify", enabled=None if progress else False)
    for layout in layouts:
        start = time.perf_counter()
        max_local = 0
        for rank, stage, coordinate in layout.ranks():
            rank_model, rank_kwargs = build_model(factory, spec)
            rank_kwargs = _init_kwargs(rank_kwargs, init_method)
            slots = slots_of(rank_model)
            if layout.pp > 1:
                assignment = stage_assignment(rank_model, slots, layout.pp)
                slots = cut_stage(rank_model, slots, assignment, stage)
                ties = dict(rank_kwargs.get("ties") or {})
                for slot in slots:
                    first = ref_aliases.get(slot.fqn)
                    if first is not None and first not in {s.fqn for s in slots}:
                        ties.setdefault(slot.fqn, first)  # tied across stages: key it as the first name
                rank_kwargs["ties"] = ties
                rank_kwargs["strict"] = False  # a stage holds only some of the FQNs the rules name
            shards = shard_in_place(rank_model, lambda s: layout.region(s, coordinate), slots)
            try:
                with torch.no_grad():
                    keyinit.init_model(rank_model, seed, **rank_kwargs)
            except (keyinit.PlanError, keyinit.InitError) as exc:
                raise CLIError(f"{layout.name} rank {rank}: init_model failed: {exc}") from exc
            local_numel = 0
            for fqn, (slot, region, local) in shards.items():
                ref_fqn = ref_aliases.get(fqn, fqn)
                local_numel += local.numel()
                expected = take_region(reference[ref_fqn], region)
                held[ref_fqn][layout.name] = held[ref_fqn].get(layout.name, 0) + 1
                bad = cells[ref_fqn].setdefault(layout.name, [])
                if not bitwise_equal(local, expected):
                    bad.append(rank)
            max_local = max(max_local, local_numel)
            bar.update(note=f"{layout.name} rank {rank}")
        seconds = time.perf_counter() - start
        good = sum(1 for fqn in cells if not cells[fqn].get(layout.name) and held[fqn].get(layout.name))
        missing = [fqn for fqn in cells if not held[fqn].get(layout.name)]
        summaries.append({"layout": layout.name, "description": layout.describe(), "ranks": layout.world_size,
                          "identical": good, "total": len(cells), "missing": missing,
                          "max_local_elements": max_local, "seconds": seconds})
    bar.close()
    params = []
    for slot in ref_slots:
        record = records.get(slot.fqn)
        params.append({"fqn": slot.fqn, "kind": slot.kind, "shape": slot.shape, "dtype": str(slot.dtype).replace("torch.", ""),
                       "source": record.source if record else "?", "element_local": record.element_local if record else True,
                       "tied": [n for n in slot.names if n != slot.fqn],
                       "bad": {name: ranks for name, ranks in cells[slot.fqn].items() if ranks},
                       "held": held[slot.fqn]})
    ok = all(not p["bad"] for p in params) and all(not s["missing"] for s in summaries)
    total_numel = sum(int(torch.Size(s.shape).numel()) for s in ref_slots)
    return {"params": params, "layouts": summaries, "ok": ok, "numel": total_numel, "seed": seed}


def run(args: argparse.Namespace) -> int:
    import keyinit

    factory = load_factory(args.factory)
    keyinit.key(args.seed)
    rowwise = frozenset(n.strip() for n in args.rowwise.split(",") if n.strip())
    layouts = [parse_layout(name, rowwise) for name in args.layouts.split(",") if name.strip()]
    if not layouts:
        raise CLIError("--layouts is empty")
    result = verify(factory, layouts, args.seed, init_method=args.init_method, label=args.factory)
    if "plan_error" in result:
        print(f"keyinit verify: {args.factory}: not every tensor has an initializer, so nothing was checked:",
              file=sys.stderr)
        print(f"  {result['plan_error']}", file=sys.stderr)
        return 1
    print(f"keyinit verify {args.factory}: seed {args.seed}, {len(result['params'])} tensors, "
          f"{result['numel']:,} elements")
    if not args.summary:
        headers = ["tensor", "shape", "initialized by"] + [s["layout"] for s in result["layouts"]]
        rows = []
        for p in result["params"]:
            source = p["source"] + ("" if p["element_local"] else " [draws full tensor]")
            name = p["fqn"] + (f" (= {', '.join(p['tied'])})" if p["tied"] else "")
            row = [name, "x".join(map(str, p["shape"])) or "scalar", source]
            for s in result["layouts"]:
                bad = p["bad"].get(s["layout"])
                if bad:
                    ranks = ",".join(map(str, bad[:6])) + ("..." if len(bad) > 6 else "")
                    row.append(f"DIFF (ranks {ranks})")
                elif not p["held"].get(s["layout"]):
                    row.append("MISSING")
                else:
                    row.append("ok")
            rows.append(row)
        print(format_table(headers, rows))
        print()
    rows = []
    for s in result["layouts"]:
        status = "ok" if s["identical"] == s["total"] else "MISMATCH"
        rows.append([s["description"], f"{s['identical']}/{s['total']}", f"{s['max_local_elements']:,}",
                     f"{s['seconds']:.2f}s", status])
    print(format_table(["layout", "tensors bit-identical", "max elements on a rank", "time", ""], rows,
                       align="lrrrl"))
    if result["ok"]:
        print("\nOK: every simulated rank of every layout holds exactly the single-process values.")
        return 0
    print("\nMISMATCH: some simulated ranks differ from the single-process values (see DIFF above).")
    return 1

"""``keyinit verify MODULE:FACTORY``: check your model initializes identically under other layouts,
and as its own code initializes it.

In ONE process, with no process group, verify runs the same machinery a real run
does. The factory is built with ``keyinit.deferred`` (its constructor captured on
global-shape stand-ins, the model on meta keeping what each constructor did) and
planned exactly as ``keyinit.materialize`` plans it with the factory's kwargs
(rules, init_method): what a training script that builds with ``deferred`` and
calls ``materialize`` gets. The single-process values are computed, and then every
distinct region a rank of each ``--layouts`` entry would hold (from the DTensor
placements FSDP2 / HSDP / TP / FSDP2xTP would give it, computed with
``keyinit.layouts.dtensor_region``) is replayed and compared bit for bit.
Pipeline stages are cut (FQNs kept, other stages' modules removed) and planned
on their own, as a real stage is. The cost grows with the number of distinct
shards, not with the number of ranks.

Fidelity: the keyed values are then compared with the model's own eager
construction: the factory built on CPU twice, with torch's RNG seeded 1 and 2
(the caller's RNG state is restored). A tensor identical in both eager builds must
be bit-identical keyed; a random one must pass a two-sample Kolmogorov-Smirnov
test and a test of its std (alpha 1e-6); one under 16 elements is checked for
shape, dtype and finiteness only. A difference on a tensor a rule or the
init_method of the factory writes is listed as explained by it; any other
difference fails the check. This builds the model eagerly twice: twice its memory
on CPU beside the keyed copy, and its constructor's time; ``--no-fidelity`` skips
it (large models).

``--build meta`` checks a script that builds on the meta device WITHOUT
``keyinit.deferred`` instead: constructors' init code is lost there (torch.nn
defaults, reset_parameters), and fidelity shows where.

Layout names: ``fsdpN``, ``fsdpRxS`` / ``hsdpRxS`` (HSDP), ``tpN``, ``dpN``,
``ppN``, joined with ``x`` (``fsdp2xtp2``, ``pp2xfsdp4``). Tensor parallelism
shards ``nn.Linear`` column-wise, except layers whose leaf name is in
``--rowwise`` (row-wise); embeddings and other >=2-D tensors on dim 0.

OK means: every simulated rank of every layout holds exactly the single-process
values, and every tensor follows the model's own eager init (or a rule/init_method
the factory gave explains the difference). Exit codes: 0 OK, 1 a difference or a
tensor nothing initializes, 2 a usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Optional

import torch

from keyinit._engine.writing.progress import Progress
from keyinit.cli._common import CLIError, add_subcommand, bitwise_equal, build_model, format_table, load_factory, take_region
from keyinit.cli._layout_specs import ROWWISE_NAMES, LayoutSpec, parse_layout
from keyinit.walk import StageError, aliases, cut_stage, stage_assignment, tensors

__all__ = ["add_parser", "run", "verify"]

DEFAULT_LAYOUTS = "fsdp4,tp2,fsdp2xtp2,pp2,fsdp8x8"


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "verify", __doc__,
                       "check, in one process, that MODULE:FACTORY's model initializes bit-identically under "
                       "FSDP/HSDP/TP/PP layouts")
    p.add_argument("factory", help="MODULE:FACTORY (or path/to/file.py:FACTORY); the factory returns an "
                                   "nn.Module, or (nn.Module, init_model kwargs); it is called through "
                                   "keyinit.deferred (see --build), and twice eagerly on CPU for fidelity")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated layouts (default {DEFAULT_LAYOUTS})")
    p.add_argument("--seed", type=int, default=0, help="the seed (default 0)")
    p.add_argument("--init-method", default=None,
                   help="run this method as existing init code (init_model(init_method=...)), e.g. init_weights")
    p.add_argument("--rowwise", default=",".join(sorted(ROWWISE_NAMES)),
                   help="leaf names of Linear layers TP shards row-wise (default: %(default)s)")
    p.add_argument("--no-fidelity", dest="fidelity", action="store_false",
                   help="skip comparing the keyed values with the model's own eager init (that check builds "
                        "the model eagerly on CPU twice: twice its memory beside the keyed copy, and its "
                        "constructor's time)")
    p.add_argument("--build", choices=("deferred", "meta"), default="deferred",
                   help="how the script being checked builds the model: with keyinit.deferred (default), or "
                        "on the meta device without it (constructors' init code is lost there)")
    p.add_argument("--summary", action="store_true", help="print only the per-layout summary, not the per-parameter table")
    p.set_defaults(run=run)


def _init_kwargs(kwargs: dict[str, Any], init_method: Any) -> dict[str, Any]:
    """The factory's kwargs plus ``--init-method``: exactly what ``materialize`` is given."""
    out = dict(kwargs)
    if init_method:
        out["init_method"] = init_method
    return out


def _check(plan: Any, entry: Any, layout: LayoutSpec, expected: torch.Tensor, stage_rank: int,
           stage_ranks: int) -> tuple[list[int], int, int]:
    """Replay ``entry``'s tensor for every distinct region ``layout`` gives it (``plan.values``);
    return (bad ranks, ranks holding it, largest region)."""
    bad, held, largest = [], 0, 0
    for region, coordinate, count in layout.distinct_regions(entry):
        rank = stage_rank * stage_ranks + (_ravel(coordinate, layout.mesh_shape) if coordinate else 0)
        out = plan.values(entry.fqn, region)
        held += count
        largest = max(largest, out.numel())
        if not bitwise_equal(out, take_region(expected, region)):
            bad.append(rank)
    return bad, held, largest


def _ravel(coordinate: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for c, s in zip(coordinate, shape):
        flat = flat * s + c
    return flat


def verify(factory: Any, layouts: "list[LayoutSpec | str]", seed: int = 0, *, init_method: Any = None,
           progress: bool = True, label: "str | None" = None, build: str = "deferred",
           fidelity: bool = True) -> dict[str, Any]:
    """What ``keyinit verify`` checks, from Python.

    ``factory()`` returns an ``nn.Module`` or ``(module, init_model_kwargs)``; it is built with
    ``keyinit.deferred`` (``build="meta"``: under ``torch.device("meta")`` without it).
    ``layouts`` are names such as ``"fsdp4"``, ``"fsdp2xtp2"``, ``"pp2"``. The model is planned
    exactly as ``materialize`` plans it with the factory's kwargs, the single-process values are
    computed once, and then every distinct region a rank of each layout would hold is replayed
    and compared bit for bit. Pipeline stages are cut and planned on their own, as a real stage
    is. With ``fidelity``, the single-process values are compared with the factory's eager
    builds (:mod:`keyinit.cli._fidelity`).

    Returns ``{"ok": bool, "layouts_ok": bool, "params": [per-tensor dicts with "fqn", "source",
    "bad" ({layout: [ranks]}) ...], "layouts": [per-layout summaries], "fidelity": Fidelity or
    None}``, or ``{"ok": False, "plan_error": message}`` if the model cannot be planned.
    """
    from keyinit.cli._fidelity import check_fidelity

    import keyinit

    spec = label or getattr(factory, "__qualname__", "factory")
    layouts = [parse_layout(layout) if isinstance(layout, str) else layout for layout in layouts]

    model, kwargs = build_model(factory, spec, build=build)
    kwargs = _init_kwargs(kwargs, init_method)
    ref_aliases = aliases(model)
    try:
        plan = keyinit.plan_init(model, seed, materializing=True, **kwargs)
    except (keyinit.PlanError, keyinit.UnkeyedRandomnessError) as exc:
        return {"plan_error": str(exc), "ok": False}
    written = set(plan.fqns)
    entries = [e for e in plan.entries if e.fqn in written]  # materializing: only empty tensors are kept
    reference = {e.fqn: plan.values(e.fqn) for e in entries}

    notes = list(plan.notes)
    cells: dict[str, dict[str, list[int]]] = {e.fqn: {} for e in entries}  # fqn -> layout -> bad ranks
    held: dict[str, dict[str, int]] = {e.fqn: {} for e in entries}  # fqn -> layout -> ranks holding it
    summaries = []
    bar = Progress(len(layouts), "keyinit verify", enabled=None if progress else False,
                   log=lambda line: print(line, file=sys.stderr))
    for layout in layouts:
        start = time.perf_counter()
        max_local = 0
        stage_elements: list[int] = []
        mesh_ranks = math.prod(layout.mesh_shape) if layout.mesh_shape else 1
        for stage in range(layout.pp):
            stage_plan, stage_tensors = plan, entries
            if layout.pp > 1:
                stage_plan, stage_tensors, stage_note = _stage_plan(factory, spec, layout, stage, seed, init_method,
                                                                    ref_aliases, plan, build)
                if stage_note:
                    notes.append(stage_note)
            local_numel = 0
            stage_elements.append(sum(math.prod(t.global_shape) for t in stage_tensors))
            for tensor in stage_tensors:
                ref_fqn = ref_aliases.get(tensor.fqn, tensor.fqn)
                if ref_fqn not in reference:
                    raise CLIError(f"{layout.name} stage {stage}: {tensor.fqn} is not a tensor of the full model")
                bad, count, largest = _check(stage_plan, tensor, layout, reference[ref_fqn], stage, mesh_ranks)
                held[ref_fqn][layout.name] = held[ref_fqn].get(layout.name, 0) + count
                cells[ref_fqn].setdefault(layout.name, []).extend(bad)
                local_numel += largest
            max_local = max(max_local, local_numel)
        seconds = time.perf_counter() - start
        good = sum(1 for fqn in cells if not cells[fqn].get(layout.name) and held[fqn].get(layout.name))
        missing = [fqn for fqn in cells if not held[fqn].get(layout.name)]
        summaries.append({"layout": layout.name, "description": layout.describe(), "ranks": layout.world_size,
                          "identical": good, "total": len(cells), "missing": missing,
                          "max_local_elements": max_local, "seconds": seconds, "stage_elements": stage_elements,
                          "unbalanced": _unbalanced(stage_elements)})
        bar.update(note=layout.name)
    bar.close()
    params = []
    for e in entries:
        params.append({"fqn": e.fqn, "kind": e.kind, "shape": e.global_shape,
                       "dtype": str(e.dtype).replace("torch.", ""), "source": e.source,
                       "element_local": e.element_local,
                       "tied": [n for n in e.names if n != e.fqn],
                       "bad": {name: ranks for name, ranks in cells[e.fqn].items() if ranks},
                       "held": held[e.fqn]})
    layouts_ok = all(not p["bad"] for p in params) and all(not s["missing"] for s in summaries)
    faithful = check_fidelity(plan, reference, factory, spec, kwargs=kwargs) if fidelity else None
    ok = layouts_ok and (faithful is None or faithful.ok)
    total_numel = sum(math.prod(e.global_shape) for e in entries)
    return {"params": params, "layouts": summaries, "ok": ok, "layouts_ok": layouts_ok, "fidelity": faithful,
            "numel": total_numel, "seed": seed, "notes": notes, "build": build}


#: A pipeline layout whose largest stage holds more than this share of the elements tested little of the cut.
UNBALANCED_SHARE = 0.9


def _unbalanced(stage_elements: list[int]) -> "str | None":
    """Why a pipeline cut is one stage holding nearly every element (``None`` if it is not, or not a cut)."""
    total = sum(stage_elements)
    if len(stage_elements) < 2 or not total:
        return None
    stage = max(range(len(stage_elements)), key=stage_elements.__getitem__)
    share = stage_elements[stage] / total
    if share <= UNBALANCED_SHARE:
        return None
    return f"stage {stage} holds {stage_elements[stage]:,} of {total:,} elements ({share:.0%})"


def _stage_plan(factory: Any, spec: str, layout: LayoutSpec, stage: int, seed: int, init_method: Any,
                ref_aliases: dict[str, str], full_plan: Any, build: str) -> tuple[Any, list[Any], Optional[str]]:
    """Cut a fresh model to pipeline stage ``stage`` (FQNs kept) and plan it as that stage's ranks would.

    Returns ``(plan, the stage's planned tensors, note)``. Init code that cannot run on the cut
    stage (it reaches into modules of other stages, as Hugging Face's root ``_init_weights``
    does) is a fact about the model, not about keyinit: the stage's tensors are then checked
    with the full model's plan, as when the whole model is planned on meta and then split.
    """
    import keyinit

    model, kwargs = build_model(factory, spec, build=build)
    kwargs = _init_kwargs(kwargs, init_method)
    found = tensors(model)
    try:
        assignment = stage_assignment(model, found, layout.pp)
    except StageError as exc:
        raise CLIError(str(exc)) from None
    kept = cut_stage(model, found, assignment, stage)
    ties = dict(kwargs.get("ties") or {})
    names = {s.fqn for s in kept}
    for tensor in kept:
        first = ref_aliases.get(tensor.fqn)
        if first is not None and first not in names:
            ties.setdefault(tensor.fqn, first)  # tied across stages: key it as the first name
    kwargs["ties"] = ties
    kwargs["strict"] = False  # a stage holds only some of the FQNs the rules name
    try:
        plan = keyinit.plan_init(model, seed, materializing=True, **kwargs)
    except (keyinit.PlanError, keyinit.UnkeyedRandomnessError) as exc:
        wanted = {ref_aliases.get(name, name) for name in names}
        note = (f"{layout.name} stage {stage}: the init code cannot run on the cut stage ({exc}); its "
                f"{len(wanted)} tensors were checked with the full model's plan instead")
        return full_plan, [e for e in full_plan.entries if e.fqn in wanted and e.fqn in full_plan.fqns], note
    return plan, [e for e in plan.entries if e.fqn in plan.fqns], None


def run(args: argparse.Namespace) -> int:
    import keyinit

    factory = load_factory(args.factory)
    keyinit.key(args.seed)
    rowwise = frozenset(n.strip() for n in args.rowwise.split(",") if n.strip())
    layouts = [parse_layout(name, rowwise) for name in args.layouts.split(",") if name.strip()]
    if not layouts:
        raise CLIError("--layouts is empty")
    result = verify(factory, layouts, args.seed, init_method=args.init_method, label=args.factory, build=args.build,
                    fidelity=args.fidelity)
    for note in result.get("notes", ()):
        print(f"keyinit verify: {note}", file=sys.stderr)
    if "plan_error" in result:
        print(f"keyinit verify: {args.factory}: not every tensor has an initializer, so nothing was checked:",
              file=sys.stderr)
        print(f"  {result['plan_error']}", file=sys.stderr)
        return 1
    built = "built with keyinit.deferred" if args.build == "deferred" else "built on meta without keyinit.deferred"
    print(f"keyinit verify {args.factory}: seed {args.seed}, {len(result['params'])} tensors, "
          f"{result['numel']:,} elements, {built}")
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
        if s["unbalanced"]:
            status += " (UNBALANCED: " + s["unbalanced"] + ")"
        stages = " / ".join(f"{n:,}" for n in s["stage_elements"]) if len(s["stage_elements"]) > 1 else "-"
        rows.append([s["description"], f"{s['identical']}/{s['total']}", f"{s['max_local_elements']:,}", stages,
                     f"{s['seconds']:.2f}s", status])
    print(format_table(["layout", "tensors bit-identical", "max elements on a rank", "elements per stage", "time",
                        ""], rows, align="lrrrrl"))
    faithful = result["fidelity"]
    if faithful is not None:
        _print_fidelity(faithful, summary=args.summary)
    return _verdict(result, faithful)


def _print_fidelity(faithful: Any, *, summary: bool = False) -> None:
    from keyinit.cli._fidelity import EAGER_SEEDS

    seeds = " and ".join(map(str, EAGER_SEEDS))
    print(f"\nfidelity: keyed values against the model's own eager init (the factory on CPU, "
          f"torch.manual_seed {seeds}), {faithful.seconds:.2f}s")
    if faithful.skipped:
        print(f"  not checked: {faithful.skipped}")
        return
    counts = faithful.counts()
    compared = {check: n for check, n in counts.items() if check != "not compared"}
    verdicts = {status: len(faithful.with_status(status)) for status in ("ok", "explained", "DIFFERS")}
    print(f"  {sum(compared.values())} tensors compared ("
          + ", ".join(f"{n} {'exactly' if check == 'exact' else 'by ' + check}" for check, n in compared.items())
          + "): "
          f"{verdicts['ok']} follow it, {verdicts['explained']} explained by the rules/init_method given, "
          f"{verdicts['DIFFERS']} differ" + (f"; {counts['not compared']} not compared" if "not compared" in counts
                                             else ""))
    listed = [t for t in faithful.tensors if t.status in (("DIFFERS",) if summary else ("DIFFERS", "explained"))]
    if listed:
        rows = [[t.fqn, "x".join(map(str, t.shape)) or "scalar", t.check,
                 "DIFFERS" if t.status == "DIFFERS" else f"explained by {t.explained_by}", t.difference]
                for t in listed]
        print(format_table(["tensor", "shape", "check", "verdict", "keyed vs eager"], rows))
    skipped = faithful.with_status("not compared")
    if skipped:
        shown = ", ".join(f"{t.fqn} ({t.why_not_compared})" for t in skipped[:4])
        print(f"  not compared: {shown}" + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""))


def _verdict(result: dict[str, Any], faithful: Any) -> int:
    layouts_ok = result["layouts_ok"]
    unbalanced = [f"{s['layout']} ({s['unbalanced']})" for s in result["layouts"] if s.get("unbalanced")]
    if unbalanced:
        print(f"\nUNBALANCED: a pipeline cut left nearly every element on one stage, so it tested little of the "
              f"cut: {'; '.join(unbalanced)}.")
    if not layouts_ok:
        print("\nMISMATCH: some simulated ranks differ from the single-process values (see DIFF above).")
    if faithful is not None and not faithful.ok:
        n = len(faithful.with_status("DIFFERS"))
        print(f"\nFIDELITY: {n} {'tensors do' if n != 1 else 'tensor does'} not follow the model's own eager init and no "
              f"rule or init_method given explains it (see DIFFERS above).")
    if not result["ok"]:
        print("\n" + _summary(result, faithful))
        return 1
    little = "".join(f" {s['layout']} left {_share(s['stage_elements'])} of the elements on one stage, so it tested "
                     f"little of its cut." for s in result["layouts"] if s.get("unbalanced"))
    if faithful is None:
        print("\nOK: bit-identical under every layout (not compared with the model's own eager init: --no-fidelity)."
              + little)
    elif faithful.skipped:
        print("\nOK: bit-identical under every layout (NOT compared with the model's own eager init: "
              "see 'not checked' above)." + little)
    else:
        explained = len(faithful.with_status("explained"))
        tail = (f", except {explained} tensor{'s' if explained != 1 else ''} that follow{'s' if explained == 1 else ''} "
                f"the rules/init_method given" if explained else "")
        print(f"\nOK: bit-identical under every layout, and every tensor follows the model's own eager init{tail}."
              + little)
    return 0


def _share(stage_elements: list[int]) -> str:
    """The largest stage's share of the elements, as a percentage."""
    return f"{max(stage_elements) / sum(stage_elements):.0%}"


def _summary(result: dict[str, Any], faithful: Any) -> str:
    """One line: what failed, then what passed (and what was not checked)."""
    n = len(result["layouts"])
    layouts = (f"bit-identical under every layout ({n})" if result["layouts_ok"] else
               f"bit-identical under {sum(1 for s in result['layouts'] if s['identical'] == s['total'])} of {n} "
               f"layouts")
    little = [f"{s['layout']} left {_share(s['stage_elements'])} on one stage" for s in result["layouts"]
              if s.get("unbalanced")]
    if little:
        layouts += f" ({'; '.join(little)}: little of the cut tested)"
    failed, passed = [], []
    (passed if result["layouts_ok"] else failed).append(layouts)
    if faithful is None:
        passed.append("fidelity not checked (--no-fidelity)")
    elif faithful.skipped:
        passed.append("fidelity not checked")
    else:
        differ = len(faithful.with_status("DIFFERS"))
        follow = len(faithful.tensors) - differ - len(faithful.with_status("not compared"))
        if differ:
            failed.append(f"fidelity: {differ} tensor{'s' if differ != 1 else ''} differ from the model's own eager "
                          f"init")
        passed.append(f"fidelity: {follow} tensor{'s' if follow != 1 else ''} follow it")
    return f"FAILED: {'; '.join(failed)}. Passed: {'; '.join(passed)}."

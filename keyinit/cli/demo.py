"""``keyinit demo``: the same weights under every parallel layout, with zero communication.

Spawns ``--world-size`` CPU processes (gloo; no torchrun) and initializes the
Llama-like model of :mod:`keyinit.cli.models` from a meta device under

* single process (the reference, computed in the parent process),
* FSDP2 (``fully_shard`` per block and at the root, 1-D mesh, uneven shards),
* HSDP (``fully_shard`` on a 2-D mesh: Replicate x Shard(0)),
* TP (``parallelize_module``, column/row-wise per Linear),
* FSDP2 x TP (2-D mesh; FSDP2 on TP shards gives ``_StridedShard``),
* PP (2 stages, torchtitan style: each stage keeps the original FQNs and
  deletes the layers it does not own).

For each layout it counts the collectives issued DURING ``keyinit.materialize``
with ``CommDebugMode`` (must be 0), then, outside the counted region, gathers
every parameter with ``full_tensor()`` (counted separately, as a control that
the counter sees collectives) and compares its bytes with the reference.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

from keyinit.cli._common import CLIError, add_subcommand, digest, format_table

__all__ = ["add_parser", "run", "LAYOUTS"]

#: name -> (description, ranks it needs: "all" or a divisibility rule)
LAYOUTS = ("fsdp", "hsdp", "tp", "fsdp_tp", "pp")


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "demo", __doc__,
                       "initialize a small Llama-like model under FSDP2, HSDP, TP, FSDP2xTP and PP on local CPU ranks "
                       "and check the weights are bit-identical to one process, with zero collectives")
    p.add_argument("--world-size", type=int, default=4, help="number of CPU ranks to spawn (default 4)")
    p.add_argument("--seed", type=int, default=0, help="the seed (default 0)")
    p.add_argument("--model-size", default="tiny", help="tiny (default), small, medium, large")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated subset of {','.join(LAYOUTS)} (default: all)")
    p.add_argument("--timeout", type=_seconds, default=300.0,
                   help="seconds before the ranks are killed (a positive number, default 300)")
    p.set_defaults(run=run)


def _seconds(text: str) -> float:
    """``--timeout``: a positive, finite number of seconds (gloo rejects anything else with its own enforce)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


_PRELOAD = ("torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.tensor.debug",
            "keyinit.cli.models")


def _build(size: str):
    from keyinit.cli.models import llama, llama_rules

    with torch.device("meta"):
        model = llama(size)
    return model, llama_rules(model.args)


def _check(model: torch.nn.Module, plan: Any, layout: str, world: int) -> tuple[dict[str, str], int, int, int]:
    """Gather every parameter (``full_tensor()``), outside the counted init.

    Returns the digests of the FULL values, the collectives the gather issued, and how
    many DTensor parameters' local shards ``keyinit verify``'s simulated layout predicts
    exactly (``full[predicted region] == local shard``), out of how many; ``plan`` is the
    :class:`keyinit.Plan` that initialized ``model``.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from keyinit.cli._common import bitwise_equal, take_region
    from keyinit.cli._layout_specs import LayoutSpec

    kinds = {"fsdp": ("fsdp",), "hsdp": ("replicate", "fsdp"), "tp": ("tp",), "fsdp_tp": ("fsdp", "tp")}.get(layout)
    digests: dict[str, str] = {}
    predicted = total = 0
    with CommDebugMode() as comm:
        for fqn, param in model.named_parameters():
            if not isinstance(param, DTensor):
                digests[fqn] = digest(param)
                continue
            full = param.full_tensor()
            digests[fqn] = digest(full)
            if kinds is None:
                continue
            mesh_shape = tuple(param.device_mesh.shape)
            # under FSDP2xTP, tensors TP leaves alone are sharded by FSDP2 on the 1-D dp mesh only
            spec = LayoutSpec(layout, 1, kinds[: len(mesh_shape)], mesh_shape)
            region = spec.region(plan.entry(fqn), tuple(param.device_mesh.get_coordinate()))
            total += 1
            predicted += bitwise_equal(take_region(full, region), param.to_local())
    return digests, comm.get_total_counts(), predicted, total


def _layout_model(layout: str, size: str, rank: int, world: int):
    """Build the model of ``layout`` for this rank on the meta device; returns (model, init kwargs, label)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from keyinit.cli.models import pipeline_stage, tp_plan

    model, rules = _build(size)
    kwargs: dict[str, Any] = {"rules": rules}
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, kwargs, f"FSDP2 ({world})"
    if layout == "hsdp":
        dp = _split(world)
        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("replicate", "shard"))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, kwargs, f"HSDP ({world // dp}x{dp})"
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, tp_plan(model))
        return model, kwargs, f"TP ({world})"
    if layout == "fsdp_tp":
        tp = _split(world)
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(model))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, kwargs, f"FSDP2xTP ({world // tp}x{tp})"
    if layout == "pp":
        stages = 2
        stage = rank * stages // world
        pipeline_stage(model, stage, stages)
        kwargs["strict"] = False  # a stage holds only some of the FQNs the rules name
        return model, kwargs, f"PP ({stages} stages)"
    raise ValueError(layout)


def _split(world: int) -> int:
    """The inner mesh dim of a 2-D mesh over ``world`` ranks: 2 if it divides, else 0."""
    return 2 if world % 2 == 0 and world >= 4 else 0


def applicable(layout: str, world: int) -> str:
    """Why ``layout`` cannot run on ``world`` ranks, or ``""``."""
    if layout in ("hsdp", "fsdp_tp") and not _split(world):
        return "needs an even world size >= 4"
    if layout == "pp" and world < 2:
        return "needs 2 or more ranks"
    return ""


def _worker(layouts: list[str], size: str, seed: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import keyinit

    import logging

    # full_tensor() of a _StridedShard parameter warns about sequential all-gathers; the check does not care.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    for layout in layouts:
        model, kwargs, label = _layout_model(layout, size, rank, world)
        dist.barrier()
        with CommDebugMode() as comm:
            start = time.perf_counter()
            plan = keyinit.plan_init(model, seed, materializing=True, **kwargs)  # materialize, keeping its plan
            plan.apply(device="cpu")
            seconds = time.perf_counter() - start
        init_comms = comm.get_total_counts()
        digests, gather_comms, predicted, dtensors = _check(model, plan, layout, world)
        results[layout] = {"label": label, "digests": digests, "init_comms": init_comms,
                           "gather_comms": gather_comms, "seconds": seconds, "predicted": predicted,
                           "dtensors": dtensors}
        if rank == 0:
            sys.stderr.write(f"keyinit demo: {label} done\n")
            sys.stderr.flush()
        del model
    return results


def summarize(reference: dict[str, str], results: list[dict[str, Any]], requested: list[str],
              skipped: dict[str, str], ref_seconds: float) -> tuple[list[list[str]], bool, int, int]:
    """Table rows and the verdict from the reference digests and every rank's results.

    A layout passes when every parameter's gathered digest, on every rank that has it,
    equals the reference, and no rank issued a collective during init.
    """
    rows = [["single process (reference)", f"{len(reference)}/{len(reference)}", "-", "-", f"{ref_seconds:.3f}s"]]
    ok = True
    predicted = checked = 0
    for name in requested:
        if name in skipped:
            rows.append([name, f"skipped: {skipped[name]}", "", "", ""])
            continue
        per_rank = [r[name] for r in results]
        seen: dict[str, set[str]] = {}
        for r in per_rank:
            for fqn, d in r["digests"].items():
                seen.setdefault(fqn, set()).add(d)
        identical = sum(1 for fqn, d in reference.items() if seen.get(fqn) == {d})
        init_comms = max(r["init_comms"] for r in per_rank)
        gather_comms = max(r["gather_comms"] for r in per_rank)
        seconds = max(r["seconds"] for r in per_rank)
        good = identical == len(reference) and init_comms == 0 and set(seen) <= set(reference)
        ok &= good
        dtensors = sum(r["dtensors"] for r in per_rank)
        predicted += sum(r["predicted"] for r in per_rank)
        checked += dtensors
        rows.append([per_rank[0]["label"], f"{identical}/{len(reference)}" + ("" if good else "  MISMATCH"),
                     str(init_comms), str(gather_comms) if dtensors else "- (plain tensors)", f"{seconds:.3f}s"])
    return rows, ok, predicted, checked


def run(args: argparse.Namespace) -> int:
    import keyinit
    from keyinit.cli._spawn import SpawnError, spawn
    from keyinit.cli.models import SIZES

    if args.model_size not in SIZES:
        raise CLIError(f"unknown --model-size {args.model_size!r}; choose one of {', '.join(SIZES)}")
    if args.world_size < 1:
        raise CLIError(f"--world-size must be >= 1, got {args.world_size}")
    requested = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in requested if name not in LAYOUTS]
    if unknown:
        raise CLIError(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    keyinit.key(args.seed)  # validates the seed with keyinit's own message

    print(f"keyinit demo: Llama-like model '{args.model_size}', seed {args.seed}, {args.world_size} CPU ranks (gloo)",
          flush=True)
    model, rules = _build(args.model_size)
    start = time.perf_counter()
    keyinit.materialize(model, args.seed, device="cpu", rules=rules)
    ref_seconds = time.perf_counter() - start
    reference = {fqn: digest(p) for fqn, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    print(f"{len(reference)} parameters, {numel:,} elements", flush=True)
    del model

    runnable = [name for name in requested if not applicable(name, args.world_size)]
    skipped = {name: applicable(name, args.world_size) for name in requested if applicable(name, args.world_size)}
    results: list[dict[str, Any]] = []
    if runnable:
        try:
            results = spawn(_worker, args.world_size, (runnable, args.model_size, args.seed), timeout=args.timeout,
                            preload=_PRELOAD)
        except SpawnError as exc:
            raise CLIError(f"the demo ranks failed: {exc.summary}") from exc

    rows, ok, predicted, checked = summarize(reference, results, requested, skipped, ref_seconds)
    print()
    print(format_table(["layout", "params bit-identical", "collectives during init",
                        "collectives in check (full_tensor)", "init time (max rank)"], rows, align="lllll"))
    print()
    if checked:
        print(f"keyinit verify's simulated layouts predict the real local shards of {predicted}/{checked} "
              f"(rank, DTensor parameter) pairs exactly.")
        ok &= predicted == checked
    if ok:
        print("OK: every layout produced the single-process weights bit for bit, with 0 collectives during init.")
        return 0
    print("FAILED: some layout differs from the single-process weights or communicated during init.")
    return 1

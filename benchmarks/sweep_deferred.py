"""Fidelity sweep of ``keyinit.deferred`` over models nobody wrote for keyinit (not a test; slow).

    python benchmarks/sweep_deferred.py --timm                       # ~50 timm models, default configs
    python benchmarks/sweep_deferred.py --hf MODEL_FOR_CAUSAL_LM_MAPPING_NAMES   # every HF causal LM
    python benchmarks/sweep_deferred.py --hf MODEL_MAPPING_NAMES --start 0 --count 100
    python benchmarks/sweep_deferred.py --hf all --layouts --seconds 300   # every model type, + layouts

For each model: build it eagerly twice (torch's RNG under two seeds, inside fork_rng), then
``keyinit.deferred`` + ``keyinit.materialize``, and compare every tensor with the model's own
init (deterministic tensors bitwise, random ones by a two-sample KS test: the check of
``tests/zoo/test_vision_zoo.py``). HF configs are the architecture's defaults shrunk field by field
(``SMALL`` in ``tests/_support/hf_arch.py``); architectures whose shrunk config does not build eagerly are counted, not checked.
Prints one line per problem and a summary.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import tests.conftest  # noqa: E402,F401 - the torchvision shim (see tests/_support/vision.py)
import torch  # noqa: E402

import keyinit  # noqa: E402
from tests.zoo.test_vision_zoo import full_state, unfaithful  # noqa: E402

TIMM = ["resnet18", "resnet50d", "resnext26ts", "seresnet18", "efficientnet_b0", "mobilenetv3_small_100",
        "mobilenetv2_050", "regnety_002", "convnext_atto", "convnextv2_atto", "vit_tiny_patch16_224",
        "deit_tiny_patch16_224", "beit_base_patch16_224", "eva02_tiny_patch14_224", "swin_tiny_patch4_window7_224",
        "swinv2_tiny_window8_256", "mixer_s16_224", "resmlp_12_224", "poolformer_s12", "convmixer_768_32",
        "coat_tiny", "crossvit_tiny_240", "levit_128s", "mobilevit_xxs", "efficientformer_l1", "ghostnet_100",
        "densenet121", "dla34", "dpn68", "hrnet_w18_small", "inception_v3", "nfnet_l0", "rexnet_100", "tinynet_e",
        "xcit_nano_12_p16_224", "cait_xxs24_224", "pit_ti_224", "twins_svt_small", "visformer_tiny",
        "maxvit_nano_rw_256", "coatnet_nano_rw_224", "fastvit_t8", "repvit_m1", "edgenext_xx_small",
        "gcvit_xxtiny", "sequencer2d_s", "volo_d1_224", "hiera_tiny_224", "efficientvit_b0"]

class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


def check(build, label: str, stats: dict, seconds: int) -> None:
    signal.alarm(seconds)
    start = time.perf_counter()
    try:
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                a = full_state(build())
                torch.manual_seed(1)
                b = full_state(build())
        except _Timeout:
            raise
        except Exception:  # noqa: BLE001 - the model itself does not build from this config
            stats["does not build eagerly"] += 1
            return
        before = torch.get_rng_state()
        try:
            model = keyinit.deferred(build)
            report = keyinit.materialize(model, 0, device="cpu")
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001 - reported
            stats["keyinit error"] += 1
            print(f"KEYINIT {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return
        wrong = unfaithful(full_state(model), a, b)
        rng_moved = not torch.equal(before, torch.get_rng_state())
        if wrong or rng_moved or report.defaults:
            stats["unfaithful"] += 1
            print(f"WRONG {label}: {wrong[:4]} defaults={report.defaults[:4]} rng_moved={rng_moved}", flush=True)
        else:
            stats["ok"] += 1
            print(f"ok {label} ({time.perf_counter() - start:.1f}s)", flush=True)
    except _Timeout:
        stats["timeout"] += 1
        print(f"TIMEOUT {label}", flush=True)
    finally:
        signal.alarm(0)


def _mapping(name: str) -> list[tuple[str, str]]:
    from transformers.models.auto import modeling_auto

    return sorted(getattr(modeling_auto, name).items())


def check_verify(factory, label: str, stats: dict, seconds: int, max_elements: int) -> None:
    """Like :func:`check`, through ``keyinit.cli.verify.verify`` (fidelity and FSDP(4)/TP(2) regions)."""
    from keyinit.cli.verify import verify

    signal.alarm(seconds)
    start = time.perf_counter()
    try:
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):  # sized without memory first
                probe = factory()
            elements = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
            del probe
            if elements > max_elements:
                stats["too large"] = stats.get("too large", 0) + 1
                print(f"too large {label}: {elements} elements", flush=True)
                return
            with torch.random.fork_rng(devices=[]):
                factory()
        except _Timeout:
            raise
        except Exception:  # noqa: BLE001 - the model itself does not build from this config
            stats["does not build eagerly"] += 1
            return
        try:
            result = verify(factory, ["fsdp4", "tp2"], progress=False, label=label)
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001 - reported
            stats["keyinit error"] += 1
            print(f"KEYINIT {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return
        if result["ok"]:
            stats["ok"] += 1
            print(f"ok {label} ({time.perf_counter() - start:.1f}s)", flush=True)
            return
        stats["unfaithful"] += 1
        fidelity = result.get("fidelity")
        differs = [(t.fqn, t.difference) for t in fidelity.with_status("DIFFERS")][:3] if fidelity else []
        layouts = [(p["fqn"], p["bad"]) for p in result.get("params", []) if p["bad"]][:3]
        print(f"WRONG {label}: {result.get('plan_error', '')[:300]} layouts={layouts} fidelity={differs}", flush=True)
    except _Timeout:
        stats["timeout"] += 1
        print(f"TIMEOUT {label}", flush=True)
    finally:
        signal.alarm(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm", action="store_true")
    parser.add_argument("--hf", default=None, help="a mapping of transformers.models.auto.modeling_auto, or 'all' "
                        "(one class per model type: tests/_support/hf_arch.py)")
    parser.add_argument("--layouts", action="store_true",
                        help="check with keyinit verify's engine: fidelity and fsdp4/tp2 regions bit for bit")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seconds", type=int, default=300, help="time limit per model")
    parser.add_argument("--max-elements", type=int, default=20_000_000,
                        help="with --layouts: skip (count) models whose tiny build is larger")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    stats = {"ok": 0, "unfaithful": 0, "keyinit error": 0, "timeout": 0, "does not build eagerly": 0}
    if args.timm:
        import timm

        for name in TIMM[args.start:args.start + args.count]:
            check(lambda name=name: timm.create_model(name, num_classes=10), f"timm:{name}", stats, args.seconds)
    if args.hf:
        from tests._support.hf_arch import architectures, tiny_factory

        chosen = architectures() if args.hf == "all" else _mapping(args.hf)
        for model_type, class_name in chosen[args.start:args.start + args.count]:
            try:
                factory = tiny_factory(model_type, class_name)
            except ValueError:
                stats["does not build eagerly"] += 1
                continue
            if args.layouts:
                check_verify(factory, f"hf:{model_type}", stats, args.seconds, args.max_elements)
            else:
                check(factory, f"hf:{model_type}", stats, args.seconds)
    print(stats, flush=True)


if __name__ == "__main__":
    main()

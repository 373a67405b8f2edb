"""Dynamic right padding under ``keyinit.nn.keyed`` over every causal-LM and masked-LM architecture of
transformers (not a test; a few minutes).

    python benchmarks/sweep_padding.py                    # every architecture, stream v2
    python benchmarks/sweep_padding.py --stream v1        # the control: v1's names depend on the padding
    python benchmarks/sweep_padding.py bert,opt,mixtral   # some

Each architecture is built from its tiny config (``tests/_support/hf_arch.py``: every dropout-like probability 0.1) with
two layers (one where two do not build or run; the line says which),
given 4 token sequences of real lengths 11/6/9/3 right-padded with an attention mask, and run in train mode
under ``keyed(model, 0, step=1, stream=...)``: the whole batch, a split padded to each part's own longest
(11 and 9), and each sample alone (a batch of one). ``tests/_support/hf_padding.py`` says what is compared: real-token
logits with a tolerance of 1e-5, every dropout kernel call's mask bitwise. One line per architecture that is
not kept, then the counts: kept, differ, refused (by reason) and skipped (by reason).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import tests.conftest  # noqa: E402,F401 - the torchvision shim (see tests/_support/vision.py)

from tests._support.hf_arch import lm_architectures  # noqa: E402
from tests._support.hf_padding import Outcome, check  # noqa: E402


class _Timeout(BaseException):  # (not caught as a refusal by the check)
    pass


def _alarm(*_):
    raise _Timeout()


def _family(reason: str) -> str:
    """A reason without its numbers and shapes, to count reasons together."""
    reason = re.sub(r"\([^()]*\)", "(...)", reason)
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", reason)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("only", nargs="?", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--stream", default="v2", choices=("v1", "v2"))
    parser.add_argument("--seconds", type=int, default=120, help="per architecture, then counted as a timeout")
    args = parser.parse_args()
    chosen = set(filter(None, args.only.split(",")))
    every = [(t, c) for t, c in lm_architectures() if not chosen or t in chosen]
    start = time.perf_counter()
    results: dict[str, Outcome] = {}
    signal.signal(signal.SIGALRM, _alarm)
    for model_type, class_name in every:
        signal.alarm(args.seconds)
        try:
            outcome = check(model_type, class_name, args.stream)
        except _Timeout:
            outcome = Outcome("skipped", f"over {args.seconds} s")
        finally:
            signal.alarm(0)
        results[model_type] = outcome
        if outcome.kind != "kept" or chosen:
            layers = f"{outcome.layers}L" if outcome.layers else ""
            print(f"{model_type:28s} {layers:3s} {outcome.kind:8s} {outcome.reason}", flush=True)
    kinds = collections.Counter(o.kind for o in results.values())
    print(f"\nstream {args.stream}: {len(results)} architectures in {time.perf_counter() - start:.0f} s")
    subjects = kinds["kept"] + kinds["differ"] + kinds["refused"]
    print(f"  subjects (build, run with an attention mask, honour it, draw): {subjects}")
    print(f"    kept:    {kinds['kept']}")
    print(f"    differ:  {kinds['differ']}")
    print(f"    refused: {kinds['refused']}")
    for kind in ("differ", "refused", "skipped"):
        reasons = collections.Counter(_family(o.reason) for o in results.values() if o.kind == kind)
        if reasons:
            print(f"  {kind} by reason:")
            for reason, count in reasons.most_common():
                print(f"    {count:4d}  {reason}")
    compared = sum(o.compared for o in results.values())
    unaligned = sum(o.unaligned for o in results.values())
    worst = max((o.worst for o in results.values() if o.kind == "kept"), default=0.0)
    print(f"  kernel calls of the parts compared bitwise: {compared}, not alignable (routed rows): {unaligned}")
    print(f"  largest real-token logit difference of a kept architecture: {worst:.2g}")


if __name__ == "__main__":
    main()

"""Running a test file's Triton kernels under Triton's interpreter: the file itself, as a script with
``--interpret-worker``, in a fresh process with ``TRITON_INTERPRET=1`` (set before triton is imported), whose
last stdout line is its results as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def interpreter_results(test_file: str, timeout: int = 900, enable_kernels: bool = False) -> dict:
    """The JSON results ``test_file`` prints when run with ``--interpret-worker`` under the interpreter
    (``enable_kernels``: without the caller's ``KEYINIT_DISABLE_KERNELS``); a worker that fails is an
    assertion error showing its output's tail."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    if enable_kernels:
        env.pop("KEYINIT_DISABLE_KERNELS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(Path(test_file).resolve()), "--interpret-worker"],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])

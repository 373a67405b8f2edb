"""examples/data_resume.py under torchrun: W=2 for steps 0-2, checkpoint, resume at W=4 for steps 3-5;
the printed global batches are KeyedSampler's (which tests/data/test_data_sampler.py checks on gloo ranks), and
the printed digests of the augmented inputs (made in 2 DataLoader workers per rank) are one process's.
``python examples/data_resume.py --check`` also compares the augmented inputs with a W=1 run (by hand:
it spawns three process groups, too slow for the suite)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import data_resume  # noqa: E402
from keyinit.data import KeyedSampler, keyed_samples  # noqa: E402


@pytest.mark.slow
def test_torchrun_two_then_four(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ckpt = tmp_path / "ckpt.pt"
    script = str(ROOT / "examples" / "data_resume.py")
    lines = []
    for world, steps, flag in ((2, "0:3", "--save"), (4, "3:6", "--load")):
        proc = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={world}", script, "--steps", steps,
                               flag, str(ckpt)], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines += re.findall(r"W=\d step (\d+): global batch (\[[^\]]*\])  augmented inputs sha256 (\w+)",
                            proc.stdout)
    sampler = KeyedSampler(data_resume.N, data_resume.SEED, global_batch_size=data_resume.BATCH)
    assert [(int(t), eval(b)) for t, b, _ in lines] == [(t, sampler.global_batch(t).tolist()) for t in range(6)]
    # the augmented inputs (made in 2 DataLoader workers per rank) are those of one process, by index
    data = keyed_samples(data_resume.Points(), data_resume.SEED)
    n, batch = data_resume.N, data_resume.BATCH
    for t, _, digest in lines:
        positions = range(int(t) * batch, (int(t) + 1) * batch)
        x = torch.stack([data[(int(i), p // n)][0] for i, p in zip(sampler.global_batch(int(t)), positions)])
        assert hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16] == digest, t

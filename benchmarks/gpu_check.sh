#!/usr/bin/env bash
# One prepared device session (issue brief: GPU checks in one script). Writes logs under $OUT (or /tmp/gpu_out).
#   bash benchmarks/gpu_check.sh
# 1. environment; 2. CUDA tests (tests/test_cuda.py, the Triton kernels on the device);
# 3. keyed dropout kernels v1/v2 vs torch (bench_dropout.py), attention; 4. bench.py's GPU targets;
# 5. a GPT-2-small bf16 training step plain / keyed / torch.compile / keyinit.nn.compile.
set -u
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY=python3
step() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -n 25 "$OUT/$name.log"; }
{ nvidia-smi -L; $PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.log" 2>&1; cat "$OUT/env.log"
step tests 170 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_dropout_triton_v2.py::test_gpu_kernel_gives_the_names_bit_for_bit \
  tests/test_dropout_triton.py::test_gpu_kernel_is_bit_exact_forward_and_backward
step drop_v1 50 $PY benchmarks/bench_dropout.py --device cuda --only ops --stream v1
step drop_v2 50 $PY benchmarks/bench_dropout.py --device cuda --only ops --stream v2
step attn_v2 50 $PY benchmarks/bench_dropout.py --device cuda --only attention --stream v2
step gpt2 110 $PY benchmarks/bench_gpt2_step.py --warmup 3 --steps 8
step bench6 60 $PY benchmarks/bench.py --only 6 --quick

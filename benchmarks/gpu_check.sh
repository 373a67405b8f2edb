#!/usr/bin/env bash
# One prepared device session (issue brief: GPU checks in one script). Writes logs under $OUT (or /tmp/gpu_out).
#   bash benchmarks/gpu_check.sh            # all steps
#   bash benchmarks/gpu_check.sh sweep gpt2 # some of them
# steps: env, sweep (Triton dropout launches v1/v2 vs torch, bits checked), tests (tests/gpu/test_cuda.py and the
# Triton kernels on the device), drop (bench_dropout v1/v2, attention v2), gpt2 (a GPT-2-small bf16 training
# step plain / keyed / torch.compile / keyinit.nn.compile), bench6 (bench.py's GPU targets), sround (stochastic
# rounding: bench_sround.py --device cuda, the Triton kernels against randint-and-mask and torch's AdamW), srtests
# (the SR tests on the device alone), droptests (test_cuda.py's keyed forwards and the Triton dropout GPU tests).
set -u
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY=python3
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests sround gpt2 bench6 sweep drop)
run() { local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -n 30 "$OUT/$name.log"; }
{ nvidia-smi -L; $PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.log" 2>&1; cat "$OUT/env.log"
for s in "${steps[@]}"; do case $s in
  sweep) run sweep 80 $PY benchmarks/triton_dropout_sweep.py --json "$OUT/sweep.json" ;;
  tests) run tests 150 $PY -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_cuda.py tests/gpu/test_sround_cuda.py \
           tests/gpu/test_dropout_triton_v2.py::test_gpu_kernel_gives_the_names_bit_for_bit \
           tests/gpu/test_dropout_triton.py::test_gpu_kernel_is_bit_exact_forward_and_backward \
           tests/gpu/test_sround_triton.py::test_gpu_kernel_equals_reference \
           tests/gpu/test_sround_fp4_triton.py::test_gpu_kernel_equals_reference \
           tests/gpu/test_kernels_triton.py::test_gpu_kernel_equals_reference \
           tests/gpu/test_data_triton.py::test_gpu_kernel_is_bit_exact_and_used_by_permutation ;;
  sround) run sround 70 $PY benchmarks/bench_sround.py --device cuda --quick --only ops
          run sround_adamw 60 $PY benchmarks/bench_sround.py --device cuda --quick --only adamw --profile ;;
  srtests) run srtests 120 $PY -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_sround_cuda.py tests/gpu/test_sround_many_triton.py \
             tests/gpu/test_sround_triton.py::test_gpu_kernel_equals_reference \
             tests/gpu/test_sround_fp4_triton.py::test_gpu_kernel_equals_reference ;;
  droptests) run droptests 120 $PY -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_cuda.py -k "dropout or keyed" \
           tests/gpu/test_dropout_triton_v2.py::test_gpu_kernel_gives_the_names_bit_for_bit \
           tests/gpu/test_dropout_triton.py::test_gpu_kernel_is_bit_exact_forward_and_backward ;;
  drop) run drop_v1 50 $PY benchmarks/bench_dropout.py --device cuda --only ops --stream v1
        run drop_v2 50 $PY benchmarks/bench_dropout.py --device cuda --only ops --stream v2
        run attn_v2 50 $PY benchmarks/bench_dropout.py --device cuda --only attention --stream v2 ;;
  gpt2) run gpt2 150 $PY benchmarks/bench_gpt2_step.py --warmup 2 --steps 5 \
          --variants plain,keyed,compiled,keyed-compiled,sr-fused,sr ;;
  bench6) run bench6 50 $PY benchmarks/bench.py --only 6 --quick ;;
esac; done

#!/usr/bin/env bash
# Every check of zeroshard that needs a GPU, in one run (README: "CUDA paths").
#
#   benchmarks/gpu_checks.sh OUTDIR [NAME=CSRC_DIR ...]
#
# 1. builds zeroshard._C in place (CUDA kernels where nvcc is found) and, in
#    parallel, each NAME=CSRC_DIR as its own module for an A/B of kernel and
#    host code (benchmarks/flatten_kernels.py --cu);
# 2. runs the CUDA tests and the extension's tests on that build;
# 3. times the flatten benchmark (flatten_bench.py --device cuda, with the
#    A/B modules beside the build), the kernels alone and single calls
#    (flatten_kernels.py: the A/B modules, or the build) and one training step
#    per engine (gpu_step.py).
# Each step has a time limit and writes OUTDIR/<step>.log; a failed step does
# not stop the later ones. Needs python3 with a CUDA torch, pytest, hypothesis.
set -u
out=${1:?usage: benchmarks/gpu_checks.sh OUTDIR [NAME=CSRC_DIR ...]}
shift
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the in-place build, for scripts run from benchmarks/

step() {  # step NAME SECONDS CMD...: run CMD under a limit, log to OUTDIR/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "   exit $? ($(date +%T))"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
echo "== build ($(date +%T))"
timeout 400 "$py" setup.py build_ext --inplace >"$out/build.log" 2>&1 &
for spec in "$@"; do
  timeout 400 "$py" benchmarks/flatten_kernels.py --build-only --cu "$spec" >"$out/build_${spec%%=*}.log" 2>&1 &
done
wait
"$py" -c "from zeroshard import ext; print('backend on cuda:', ext.ext_backend('cuda'))"

step tests 300 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_ext.py tests/test_copy_plan.py
tail -n 3 "$out/tests.log"
mods=() builds=()
for spec in "$@"; do mods+=(--cu "$spec"); builds+=(--csrc "$spec"); done
step flatten_bench 240 "$py" benchmarks/flatten_bench.py --device cuda "${builds[@]}"
step kernels 300 "$py" benchmarks/flatten_kernels.py "${mods[@]}"
step gpu_step 240 "$py" benchmarks/gpu_step.py
grep -h -A8 "median step" "$out/gpu_step.log" | head -12

#!/usr/bin/env bash
# The checks a lent GPU runs (never part of CI): the GPU test tier at full size (Triton
# kernels against torch, the NCCL backend at world size 1, @spmd.parallelize on CUDA),
# then the kernels' bandwidth against a device-to-device copy on the same card and the
# host work of a pack launch with and without a bucket's kept tables, then a compiled
# training step per strategy against the plan's predicted time and memory, then
# a ~1B Llama-style bfloat16 step against the plan for that card (benchmarks/gpu_llama.py).
#
#   bash benchmarks/gpu_checks.sh            # writes logs to $OUT (or /tmp/spmd-gpu)
#
# It uses the machine's own python3, torch and triton; spmd is installed editable, with
# no dependencies fetched (the GPU machines have no registry).
set -uo pipefail
out=${OUT:-/tmp/spmd-gpu}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' | tee -a "$out/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || { cat "$out/install.log"; exit 1; }
status=0
python3 -m pytest -q -p no:cacheprovider tests/gpu -rA 2>&1 | tee "$out/gpu_tests.log" \
    || status=1
python3 benchmarks/kernel_speed.py "$@" 2>&1 | tee "$out/kernels.md" || status=1
python3 benchmarks/kernel_speed.py --host 2>&1 | tee "$out/kernels_host.md" || status=1
python3 benchmarks/gpu_step.py ${GPU_STEP_ARGS:-} 2>&1 | tee "$out/gpu_step.md" || status=1
python3 benchmarks/gpu_llama.py ${GPU_LLAMA_ARGS:-} 2>&1 | tee "$out/gpu_llama.md" || status=1
exit $status

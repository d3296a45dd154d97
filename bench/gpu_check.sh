#!/usr/bin/env bash
# The GPU check: a few minutes on one GPU (about 7 on an H200), run whenever a GPU is at hand.
#
#   bench/gpu_check.sh [OUT_DIR]          # default ./gpu-check-out
#
# 0. fedcore simulate on the GPU (bench/simulation_gpu.py): client updates/s of issue 12's workload at 100 and
#    1,000 clients a round, in-process and batched, and their models against the CPU's (FedProx, SCAFFOLD, FedAvgM
#    with local momentum too); about 2 minutes; then bench/simulation_host.py on the GPU (one torch thread, 10 rounds:
#    wall time a batched round and updates/s, logistic regression and the 2NN), about 20 s, and again with --profile
#    for the 2NN (cProfile and torch.profiler of its rounds, into OUT_DIR/profile: where the round's time goes, and
#    how long the GPU is busy in it), about a minute;
# 1. the CUDA equivalence tests (tests/engine/test_cuda.py): engine vs single-device CPU training in fp32,
#    with torch.compile, and in bf16 autocast within the tolerance stated there; 2-GPU plans when 2 are visible;
#    and the prefetching loader's CUDA path (tests/engine/test_loader.py: pinned batches copied on a side stream
#    equal the CPU batches, survive a lagging compute stream, and train bit for bit as device-resident data);
#    and batched clients on the GPU (tests/simulations/test_presum.py, test_device.py: a batch's updates summed on
#    the device against one-by-one folding);
# 2. the throughput bench (bench/engine_gpu.py): GPT-2 small (124M, 16 x 1024 tokens, bf16), plain PyTorch loop
#    and the engine, eager and compiled; tokens/s, TFLOP/s, MFU, peak memory (plus dp2/tp2 with 2+ GPUs);
# 3. a short federated round with the engine on CUDA (the Shakespeare example: 2 clients, 1 round, bf16).
#
# Everything goes to OUT_DIR/gpu-check.txt (and the benches' figures to OUT_DIR/simulation_gpu.json, engine_gpu.json). Each step has
# its own time limit; the script runs every step even if one fails, and exits 1 if any did.
# PYTHON overrides the interpreter (default: .venv/bin/python when present, else python3).
set -u -o pipefail

OUT=${1:-./gpu-check-out}
mkdir -p "$OUT"
LOG="$OUT/gpu-check.txt"
: >"$LOG"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
FAILED=()

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S) UTC, limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$status" -eq 0 ] || FAILED+=("$name")
}

{
    echo "fedcore engine GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; else echo "nvidia-smi: not installed"; fi
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$LOG"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device is visible to $PYTHON: nothing to check" | tee -a "$LOG"
    exit 1
fi

step "simulation on cuda" 300 "$PYTHON" bench/simulation_gpu.py --json "$OUT/simulation_gpu.json"
step "batched round's host work on cuda" 120 "$PYTHON" bench/simulation_host.py --device cuda --rounds 10
step "batched round's profile on cuda" 180 "$PYTHON" bench/simulation_host.py --device cuda --rounds 6 --model 2nn \
    --per-round 100 1000 --profile "$OUT/profile"
step "cuda equivalence tests" 300 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/engine/test_cuda.py
step "prefetching loader on cuda" 120 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/engine/test_loader.py
step "batched clients on cuda" 180 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/simulations/test_presum.py tests/simulations/test_device.py
step "throughput bench" 600 "$PYTHON" bench/engine_gpu.py --plans dp2,tp2 --json "$OUT/engine_gpu.json"
step "federated round on cuda" 300 "$PYTHON" -m simulations.shakespeare --clients 2 --rounds 1 --max-samples 2048 \
    --parallel device=cuda precision=bf16

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]} (see $LOG)" | tee -a "$LOG"
    exit 1
fi
echo "all steps passed; output in $LOG" | tee -a "$LOG"

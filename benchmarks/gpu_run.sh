#!/bin/bash
# The GPU session's script (issue 12), run on the lent machine from a folder holding copies of compiled_psg/ and
# benchmarks/ (and wheels under whl/): bash benchmarks/gpu_run.sh PHASE SECONDS INSPECT_MODEL "MODELS" "METHODS" "SIZES"
# Writes under $OUT: log_PHASE.txt, scratch_PHASE.tgz (each model's raw JSON lines), and with INSPECT_MODEL
# (not "-") Inductor's generated code for compile_step's DP step (output_code_MODEL.log) and a profile.
phase=$1; budget=$2; inspect=$3; models=$4; methods=$5; sizes=${6:-"64 256"}; margin=${7:-100}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
log=$OUT/log_$phase.txt
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  python3 -m pip show opacus backpack-for-pytorch torchjd unfoldNd einops 2>&1 | grep -E "^(Name|Version|WARNING)"
} >> "$log" 2>&1
if ls whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl >> "$log" 2>&1 \
    && export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import compiled_psg, compiled_psg._train.step; print('compiled_psg imports')" >> "$log" 2>&1
if [ "$inspect" != "-" ]; then
  mkdir -p /tmp/ic_inspect
  TORCHINDUCTOR_CACHE_DIR=/tmp/ic_inspect TORCH_LOGS=output_code timeout 200 \
    python3 -m benchmarks.probes.gpu_inspect "$inspect" 64 "$OUT" 2> "$OUT/output_code_$inspect.log" | tee -a "$log"
  echo "inspect rc=$? after ${SECONDS}s" >> "$log"
fi
left=$((budget - SECONDS))
export BENCH_DEADLINE=$(( $(date +%s) + left - margin ))
mkdir -p /tmp/scr_$phase
timeout $((left - 15)) python3 -m benchmarks --device cuda --models $models --methods $methods --sizes $sizes \
  --no-sequence --scratch /tmp/scr_$phase --out /tmp/o_$phase 2>&1 | tee -a "$log"
echo "bench rc=$? after ${SECONDS}s" >> "$log"
(cd /tmp/scr_$phase && tar czf "$OUT/scratch_$phase.tgz" *.jsonl)
cp /tmp/o_$phase/benchmarks-gpu.md "$OUT/benchmarks-gpu_$phase.md" 2>/dev/null
date -u >> "$log"

#!/bin/bash
# The GPU run of benchmarks.scale, on a lent machine, from the repository root (wheels of missing peers under .whl/):
#   [MODELS="m ..."] [METHODS="m ..."] [PROFILE="m ..."] [CHECK_S=s] bash benchmarks/gpu_scale.sh [TIMEOUT_S] [BUDGET_S]
# Runs `python -m benchmarks.scale --device cuda --parallel` over MODELS (default: every model of
# benchmarks/scale_models.py) and METHODS (default: all; no method is set up past BUDGET_S), with a kernel profile
# and Inductor's generated code for the PROFILE models (default gpt2), and writes under $OUT: env.txt (machine,
# versions), correctness.json (python -m benchmarks.gpu_correctness), report.md (the tables), scale.tgz (records,
# logs, profiles, code).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
start=$SECONDS
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >> "$OUT/env.txt" 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import compiled_psg, opacus; print('compiled_psg and opacus', opacus.__version__, 'import')" >> "$OUT/env.txt" 2>&1
# shellcheck disable=SC2086  # the lists are word-split on purpose
timeout "${1:-450}" python3 -m benchmarks.scale --device cuda --out /tmp/scale --parallel ${MODELS:+--models $MODELS} \
  ${METHODS:+--methods $METHODS} --profile ${PROFILE:-gpt2} --output-code --budget "${2:-270}" > "$OUT/report.md" 2>&1
echo "rc=$? after $((SECONDS - start)) s" >> "$OUT/report.md"
# after the models, not beside their compiles: the host's cores go to the compiles, which bound what a session
# measures (the DP step's compile ran past its deadline beside these checks)
timeout "${CHECK_S:-120}" python3 -m benchmarks.gpu_correctness > "$OUT/correctness.json" 2>&1
python3 -m benchmarks.scale --report --out /tmp/scale >> "$OUT/report.md" 2>&1
(cd /tmp/scale && tar czf "$OUT/scale.tgz" ./*.jsonl ./stderr_*.txt ./profile_* ./kernels_* ./memory_* 2> /dev/null)
date -u >> "$OUT/env.txt"

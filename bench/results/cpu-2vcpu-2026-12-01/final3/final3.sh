#!/bin/bash
# Alternated side-by-side runs on this machine (2026-12-01, Zen 5 VM), locked and boosted.
echo -19 > /proc/self/autogroup
cd /work/main
OUT=/work/lead/final3
for round in 1 2; do
  for c in "110m bfloat16" "110m float32" "19m bfloat16" "19m float32"; do
    set -- $c
    echo "== round $round $1 $2 load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
    .venv/bin/python -m bench.offline --config $1 --dtype $2 --workload side-by-side --peer-vllm /tmp/vcpu --skip-hf --output $OUT/offline_${1}_${2}_r$round.json 2>&1 | grep "^\["
  done
done
echo "== serving load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
.venv/bin/python -m bench.serve_side_by_side --config 110m --dtype bfloat16 --peer-vllm /tmp/vcpu --matmul-dtype model --rates 1,4,8,inf --output $OUT/serve_r2.json 2>&1 | grep -v "it/s\]"
echo "== done $(date +%T)"

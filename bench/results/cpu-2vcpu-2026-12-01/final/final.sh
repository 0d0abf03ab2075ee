#!/bin/bash
echo -19 > /proc/self/autogroup
cd /work/main
export PYTHONPATH=$PWD
PY=/work/main/.venv/bin/python
for cfg in "110m bfloat16" "110m float32" "19m bfloat16" "19m float32"; do
  set -- $cfg
  echo "== $1 $2 load $(cat /proc/loadavg)"
  $PY -m bench.offline --config $1 --dtype $2 --workload side-by-side --peer-vllm /tmp/vcpu --skip-hf --output /work/lead/final-sbs-$1-$2.json 2>&1 | grep "^\[" 
done
echo "== serve load $(cat /proc/loadavg)"
$PY -m bench.serve_side_by_side --config 110m --dtype bfloat16 --peer-vllm /tmp/vcpu --matmul-dtype model --rates 1,4,8,inf --servers baton,baton-pd,vllm --output /work/lead/final-serve.json 2>&1 | grep -v "it/s\]" | tail -40
echo "== serve mixed load $(cat /proc/loadavg)"
$PY -m bench.serve_side_by_side --config 110m --dtype bfloat16 --matmul-dtype model --rates 1,4,8,inf --servers baton --baton-flags="--schedule-policy mixed" --output /work/lead/final-serve-mixed.json 2>&1 | grep -v "it/s\]" | tail -20
echo "== end load $(cat /proc/loadavg)"

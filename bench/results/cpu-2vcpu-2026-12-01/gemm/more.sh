cd /work/main
O=/tmp/gemm/final
for r in 3 4 5; do for d in bfloat16 float32; do
  flock /tmp/baton-bench.lock .venv/bin/python -m bench.offline --config 110m --dtype $d --workload side-by-side --peer-vllm /tmp/vcpu --skip-hf --output $O/offline_110m_${d}_r$r.json 2>&1 | grep "^\[110m" >> $O/offline_more.txt
done; done
echo finished >> $O/offline_more.txt

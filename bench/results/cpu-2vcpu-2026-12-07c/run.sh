#!/usr/bin/env bash
# This session's timings on the idle machine, one after another (logs in /tmp/timing-c).
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=bench/results/cpu-2vcpu-2026-12-07c
mkdir -p /tmp/timing-c
step() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; timeout $limit "$@" > /tmp/timing-c/$name.log 2>&1; echo "== $name rc $? $(date +%T)"; tail -n 6 /tmp/timing-c/$name.log; }
step decode_step 900 $PY -m baton.bench.offline.decode_step --rounds 3 --tokens 128 --output $R/decode_step.json
step tp 900 $PY -m baton.bench.offline.tp --config 19m --batch 8 --steps 32 --handover --output $R/tp.json
step tp_b1 900 $PY -m baton.bench.offline.tp --config 19m --batch 1 --steps 64 --handover --output $R/tp_b1.json
step lfm3_mixed 1200 $PY -m baton.bench.offline.run --config lfm3_100m --dtype float32 --workload mixed --hf-batch-sizes 8,32 --output $R/lfm3_100m_mixed.json
step decode_step_1thread 900 env OMP_NUM_THREADS=1 $PY -m baton.bench.offline.decode_step --rounds 3 --tokens 128 --no-mtp --output $R/decode_step_1thread.json
echo "== all done $(date +%T)"

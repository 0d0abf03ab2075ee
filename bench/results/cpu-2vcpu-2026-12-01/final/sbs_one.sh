#!/bin/bash
echo -19 > /proc/self/autogroup
cd ${TREE:-/work/main}
export PYTHONPATH=$PWD
cat /proc/loadavg
/work/main/.venv/bin/python -m bench.offline --config $1 --dtype $2 --workload side-by-side --peer-vllm /tmp/vcpu --skip-hf --output /work/lead/sbs-$1-$2-$3.json 2>&1 | grep -v Warning | tail -25
cat /proc/loadavg

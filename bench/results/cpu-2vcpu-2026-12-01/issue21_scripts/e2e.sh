#!/bin/bash
echo -19 > /proc/self/autogroup
# usage: e2e.sh CONFIG DTYPE ORDER...   (ORDER: before|after, alternated by the caller)
config=$1; dtype=$2; shift 2
for tree in "$@"; do
  if [ "$tree" = before ]; then dir=/tmp/w21e/before; else dir=/work/wt21e; fi
  echo "== $tree $config $dtype $(date -u +%H:%M:%S) loadavg $(cat /proc/loadavg)"
  (cd $dir && PYTHONPATH=$dir timeout 170 /work/main/.venv/bin/python -m bench.offline --config $config --dtype $dtype --workload side-by-side --skip-hf 2>&1 | grep "^\[")
done
echo "== end $(date -u +%H:%M:%S) loadavg $(cat /proc/loadavg)"

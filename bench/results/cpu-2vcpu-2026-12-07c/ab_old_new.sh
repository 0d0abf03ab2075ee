#!/usr/bin/env bash
# old (13309a1) and new (main) decode_step alternated, on the idle machine
for i in 1 2; do
  for side in old new; do
    dir=/work/main; [ $side = old ] && dir=/work/wt_old
    cd $dir
    echo "== $side round $i $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$dir timeout 600 /work/main/.venv/bin/python -m baton.bench.offline.decode_step --rounds 3 --tokens 128 --output /tmp/ab_${side}_$i.json 2>&1 | grep -E "over|tok/s" | head -8
  done
done

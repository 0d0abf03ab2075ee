#!/bin/bash
# A/B: bench.serve_vs_offline with the httpx client (tree before) and the aiohttp one (main), alternated.
echo -19 > /proc/self/autogroup
for i in 1 2; do
  for tree in /tmp/wt_old /work/main; do
    echo "== $tree load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.serve_vs_offline --config ${CONFIG:-110m} --dtype bfloat16 --rounds 2 --port $((8731 + i)) 2>&1 | grep -E "^round|^\[")
  done
done

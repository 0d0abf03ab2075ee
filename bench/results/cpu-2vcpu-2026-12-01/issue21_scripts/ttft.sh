#!/bin/bash
echo -19 > /proc/self/autogroup
echo "loadavg $(cat /proc/loadavg)"
for tree in before after before after; do
  if [ "$tree" = before ]; then dir=/tmp/w21e/before; else dir=/work/wt21e; fi
  (cd $dir && PYTHONPATH=$dir timeout 100 /work/main/.venv/bin/python /tmp/w21e/ttft.py 110m bfloat16 2>&1 | tail -1)
done
echo "loadavg $(cat /proc/loadavg)"

#!/bin/bash
echo -19 > /proc/self/autogroup
# usage: comp.sh OLD.c NEW.c THREADS [SCANONLY]
echo "start $(date -u +%H:%M:%S) loadavg $(cat /proc/loadavg)"
cd /tmp/w21e && SCANONLY=$4 OMP_NUM_THREADS=$3 timeout 170 /work/main/.venv/bin/python ab.py $1 $2 $3 5 2>&1 | tail -25
echo "end $(date -u +%H:%M:%S) loadavg $(cat /proc/loadavg)"

#!/usr/bin/env bash
# Every GPU check and benchmark in one run, for a lent CUDA machine with its own torch and
# Triton (nothing installed by this script):
#
#     OUT=/tmp/baton-gpu PYTHON=python3 bash tests/gpu/run_all.sh
#
# Each step has its own time limit, so a hang costs that step only; logs and JSON land in $OUT.
# pyzmq is the only package the GPU tests need beyond torch/triton/transformers/msgpack
# (tests/gpu/test_disagg_gpu.py skips without it). On a machine without a registry, carry its
# wheel: here `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation
# cp --platform manylinux_2_28_x86_64 -d .whl pyzmq`, there `pip install --no-index --no-deps
# --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site` before this script.
set -u
out=${OUT:-/tmp/baton-gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1

step() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    tail -n 60 "$out/$name.txt"
    echo "== $name: rc $rc in $((SECONDS - start)) s"
}

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
    $py -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, \
    transformers.__version__, torch.cuda.get_device_name())'"
step pytest "${PYTEST_LIMIT:-300}" "$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    --durations=8 ${PYTEST_ARGS:-}
step kernels "${KERNELS_LIMIT:-150}" "$py" -m baton.bench.kernels.triton_ops --json "$out/kernels.json"
step gdn_kernels "${GDN_KERNELS_LIMIT:-120}" "$py" -m baton.bench.kernels.gdn_kernels --dtype bfloat16 \
    --json "$out/gdn_kernels.json"
# Quantized linears (Triton w8a8 FP8, FP8 and NVFP4 weight-only) against bf16 torch.mm; their
# correctness (and the row quantizer's e4m3 codes) is tests/gpu/test_quant_gpu.py, above.
step quant "${QUANT_LIMIT:-120}" "$py" -m baton.bench.kernels.quant_kernels --json "$out/quant.json"
step graphs "${GRAPHS_LIMIT:-180}" "$py" -m baton.bench.offline.decode_graphs --output "$out/graphs.json"
# The prefill -> decode handover against raw ZMQ, on this machine's CPUs (#6's 0.7 target could
# not be shown on the 2-vCPU development VM, where raw ZMQ alone keeps both vCPUs busy).
step transfer "${TRANSFER_LIMIT:-200}" "$py" -m baton.bench.serving.transfer --config 110m \
    --lengths 128,512,1024,2048,4096 --threads 4 --no-ttft --output "$out/transfer.json"

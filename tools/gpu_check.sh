#!/usr/bin/env bash
# One command for a GPU machine: every gpu test (a skipped one fails), compute-sanitizer's
# memcheck, racecheck and synccheck on them, --device cuda == --device cpu on the checked-in
# models (under memcheck), gpu_bench (the link from pageable, pinned and mapped memory; device and
# host gathers against a bulk copy at 1, 5, 10 and 30% selection; the ops at OPT-13B shapes) and
# the throughput of each policy at the Fig. 14 point and at batch 8, written to OUT/results.json
# and OUT/summary.md (logs in OUT/logs).
#
# The GPU machine needs the NVIDIA driver and CUDA 13's cuBLAS (a toolkit, or CUDA's Python
# wheels); the engine's other libraries travel in the bundle, whose `env` step lists any that are
# still missing. Made on a development machine:
#   cmake --preset test && cmake --build build/test && tools/gpu_bundle.sh build/test gpu.tar.xz
# then, on the GPU machine, from a checkout of the same commit:
#   tools/gpu_check.sh --bundle gpu.tar.xz --out gpu-check [--steps tests,sanitize,...]
# --quick runs tiny shapes without sanitizers: with --build build/emulate it checks the script
# itself on the emulated device.
exec python3 "$(dirname "$0")/gpu_check.py" "$@"

#!/usr/bin/env python3
"""Plants bugs in the CUDA code one at a time and checks that the `gpu` test suite, run on the
emulated device (the `emulate` preset), fails for each: the measure of what the emulation proves.

The plants are the kinds of mistake a GPU run would find: a skipped warp-reduction level, missing
barriers, an off-by-one row, a wrong tile stride, a transposed GEMM, a wrong cache layout, a wrong
grouped-query head mapping, a one-pass LayerNorm, a missing wait between two streams and a host
pointer handed to a kernel. Each is applied to a copy of the source tree, the gpu tests are
rebuilt and run there, and the plant is removed again; the working tree is never touched.

    tools/plant_cuda_bugs.py [--work DIR] [--only NAME ...] [--keep]

Prints one line per plant and a summary; exits 1 when a plant went uncaught (or the unplanted
suite fails), 0 when every plant was caught. About 1 minute per plant on 2 cores after the first
build (a few minutes).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, file, text to replace (exactly once), replacement, what the bug is
PLANTS = [
    ("warp-reduction-level", "kernels/cuda/common.cuh",
     "  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)\n    value += ",
     "  for (int offset = kWarpSize / 2; offset > 1; offset /= 2)\n    value += ",
     "warp_sum skips its last butterfly level"),
    ("block-sum-leading-barrier", "kernels/cuda/common.cuh",
     "  value = warp_sum(value);\n  __syncthreads();\n",
     "  value = warp_sum(value);\n",
     "block_sum overwrites the partials before the previous call's readers are done"),
    ("block-sum-barrier", "kernels/cuda/common.cuh",
     "  if (lane == 0) partials[warp] = value;\n  __syncthreads();\n",
     "  if (lane == 0) partials[warp] = value;\n",
     "block_sum reads the partials before every warp has written its own"),
    ("prefill-tile-barrier", "kernels/cuda/attention.cu",
     "      v_tile[j * d + c] = present ? v[kv_base + t * D_kv + c] : 0.0f;\n    }\n    __syncthreads();\n",
     "      v_tile[j * d + c] = present ? v[kv_base + t * D_kv + c] : 0.0f;\n    }\n",
     "prefill reads the key tile before every thread has loaded its part"),
    ("decode-off-by-one-row", "kernels/cuda/attention.cu",
     "const int64_t end = length - n + i + 1;",
     "const int64_t end = length - n + i;",
     "decode attention leaves out the query's own row"),
    ("key-tile-stride", "kernels/cuda/attention.cu",
     "const float* k_row = k_tile + lane * (d + 1);",
     "const float* k_row = k_tile + lane * d;",
     "prefill reads the key tile with the unpadded stride it was not written with"),
    ("gemm-transpose", "kernels/cuda/linear.cu",
     "cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, type, K, x,",
     "cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, w, type, K, x,",
     "linear multiplies by W instead of W^T"),
    ("cache-layout", "kernels/cuda/attention.cu",
     "cache[((b * H + h) * capacity + offset + t) * d + c]",
     "cache[((b * capacity + offset + t) * H + h) * d + c]",
     "cache_store writes (B, capacity, H, d) where (B, H, capacity, d) is read"),
    ("gqa-head-mapping", "kernels/cuda/attention.cu",
     "const int64_t kv_index = h / (H / H_kv);",
     "const int64_t kv_index = h % H_kv;",
     "decode maps query heads to KV heads round-robin instead of in groups"),
    ("one-pass-layer-norm", "kernels/cuda/layer_norm.cu",
     "    const float centred = in[c] - mean;\n    sq += centred * centred;\n",
     "    sq += in[c] * in[c];\n",
     "LayerNorm's variance as E[x^2] - mean^2 (cancellation on rows with a large mean)"),
    ("missing-stream-event-wait", "tests/cuda_emulation_test.cu",
     "  ASSERT_EQ(cudaStreamWaitEvent(b, filled, 0), cudaSuccess);\n",
     "",
     "a stream reads what another writes without waiting for its event"),
    ("host-pointer-to-kernel", "core/ops_cuda.cc",
     "B, n, H, H_kv, d, lease.upload({first_valid}), lease.stream()));",
     "B, n, H, H_kv, d, first_valid.data(), lease.stream()));",
     "prefill's first_valid handed to the kernel from host memory"),
]
# The one-pass LayerNorm also needs its mean subtracted where the variance is formed.
EXTRA = {
    "one-pass-layer-norm": ("kernels/cuda/layer_norm.cu",
                            "detail::block_sum(sq, partials) / static_cast<float>(cols) + eps",
                            "detail::block_sum(sq, partials) / static_cast<float>(cols) - mean * mean + eps"),
}


def run(command, cwd, log, timeout=None):
    with open(log, "a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        try:
            return subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write("timed out\n")
            return 124


def replace_once(path, old, new):
    with open(path) as f:
        text = f.read()
    if text.count(old) != 1:
        sys.exit(f"plant_cuda_bugs: {os.path.relpath(path)}: the text to replace occurs "
                 f"{text.count(old)} times (expected once): the plant list needs updating")
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    return text


def copy_tree(work):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for name in files:
        if not name or not os.path.isfile(os.path.join(ROOT, name)):
            continue
        target = os.path.join(work, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target) or open(os.path.join(ROOT, name), "rb").read() != open(target, "rb").read():
            shutil.copy2(os.path.join(ROOT, name), target)


def gpu_suite(work, log):
    """Builds the gpu tests and runs them; returns (built, passed)."""
    if run(["cmake", "--build", "--preset", "emulate"], work, log) != 0:
        return False, False
    code = run(["ctest", "--preset", "emulate", "--timeout", "120"], work, log, timeout=1200)
    return True, code == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="scratch copy of the tree (kept between runs; default: a "
                        "temporary folder)")
    parser.add_argument("--only", nargs="*", help="plant names to run (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()
    names = [p[0] for p in PLANTS]
    for name in args.only or []:
        if name not in names:
            sys.exit(f"plant_cuda_bugs: unknown plant '{name}' (known: {', '.join(names)})")
    work = args.work or tempfile.mkdtemp(prefix="infinigen-plants-")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "plants.log")
    print(f"plant_cuda_bugs: scratch tree {work}, log {log}", flush=True)
    copy_tree(work)
    if not os.path.exists(os.path.join(work, "build", "emulate", "CMakeCache.txt")):
        if run(["cmake", "--preset", "emulate"], work, log) != 0:
            sys.exit(f"plant_cuda_bugs: configuring the emulate preset failed (see {log})")
    built, passed = gpu_suite(work, log)
    if not (built and passed):
        sys.exit(f"plant_cuda_bugs: the gpu suite fails without any plant (see {log})")
    print("unplanted: the gpu suite passes", flush=True)

    caught = 0
    selected = [p for p in PLANTS if not args.only or p[0] in args.only]
    for name, path, old, new, what in selected:
        start = time.time()
        full = os.path.join(work, path)
        original = replace_once(full, old, new)
        if name in EXTRA:
            extra_path, extra_old, extra_new = EXTRA[name]
            extra_original = replace_once(os.path.join(work, extra_path), extra_old, extra_new)
        try:
            built, passed = gpu_suite(work, log)
        finally:
            with open(full, "w") as f:
                f.write(original)
            if name in EXTRA:
                with open(os.path.join(work, extra_path), "w") as f:
                    f.write(extra_original)
        if not built:
            verdict = "DID NOT BUILD (fix the plant)"
        elif passed:
            verdict = "MISSED"
        else:
            verdict = "caught"
            caught += 1
        print(f"{name:28s} {verdict:8s} {time.time() - start:5.0f} s  {what}", flush=True)
    gpu_suite(work, log)  # leave the scratch build unplanted
    print(f"plant_cuda_bugs: {caught} of {len(selected)} plants caught by the gpu suite on the "
          "emulated device")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if caught == len(selected) else 1


if __name__ == "__main__":
    sys.exit(main())

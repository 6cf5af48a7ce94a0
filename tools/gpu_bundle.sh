#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that has the NVIDIA driver and a CUDA 13 toolkit (cuBLAS)
# but none of the engine's other libraries, as one archive that tools/gpu_check.sh --bundle runs:
#   bin/      the CLI, gpu_bench and every suite with a `gpu` test, stripped;
#   lib/      the shared libraries they load, except glibc's, the C++ runtime's and CUDA's (the
#             GPU machine's driver and toolkit must provide those, matched to each other);
#   gpu-tests.json   `ctest --show-only=json-v1 -L gpu`: each gpu test and its command;
#   build.env        where the build was made (its tests have these paths compiled in) and from
#                    which commit.
#
#   cmake --preset test && cmake --build build/test && tools/gpu_bundle.sh build/test OUT.tar.xz
set -euo pipefail

build=${1:?usage: gpu_bundle.sh BUILD_DIR OUT.tar.xz}
archive=${2:?usage: gpu_bundle.sh BUILD_DIR OUT.tar.xz}
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$build" && pwd)
[ -x "$build/bin/infinigen" ] || { echo "gpu_bundle: $build/bin/infinigen is missing: build $build first" >&2; exit 1; }
# ldd into a variable first: `grep -q` closing the pipe early would fail it under pipefail.
linked=$(ldd "$build/bin/infinigen")
grep -q libcublas <<<"$linked" ||
  { echo "gpu_bundle: $build is not a CUDA build (configure it with nvcc found, e.g. --preset test)" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"

ctest --test-dir "$build" -L gpu --show-only=json-v1 > "$stage/gpu-tests.json"
mapfile -t suites < <(python3 - "$stage/gpu-tests.json" <<'EOF'
import json, os, sys
tests = json.load(open(sys.argv[1]))["tests"]
print("\n".join(sorted({os.path.basename(t["command"][0]) for t in tests if t.get("command")})))
EOF
)
[ ${#suites[@]} -gt 0 ] || { echo "gpu_bundle: $build has no gpu-labelled tests (built with tests?)" >&2; exit 1; }

programs=(infinigen "${suites[@]}")
[ -x "$build/bin/gpu_bench" ] && programs+=(gpu_bench)
for program in "${programs[@]}"; do
  strip -o "$stage/bin/$program" "$build/bin/$program"
done

# Every library the programs load, less the ones the GPU machine must bring itself.
system='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt)\.so'
for program in "${programs[@]}"; do
  ldd "$build/bin/$program" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r name path; do
  [[ $name =~ $system ]] && continue
  cp -L "$path" "$stage/lib/$name"
done

{
  echo "BUILD_SOURCE_DIR=$root"
  echo "BUILD_BINARY_DIR=$build"
  echo "BUILD_COMMIT=$(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD -- . ':!build' || echo -dirty)"
  echo "BUILD_CUDA=$(sed -n 's/^set(CMAKE_CUDA_COMPILER_VERSION "\(.*\)")/\1/p' "$build/CMakeFiles"/*/CMakeCUDACompiler.cmake | head -1)"
  echo "BUILD_ARCHITECTURES=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build/CMakeCache.txt")"
} > "$stage/build.env"

mkdir -p "$(dirname "$archive")"
tar -C "$stage" -cf - . | xz -9 -T0 > "$archive"
echo "gpu_bundle: $archive ($(du -h "$archive" | cut -f1)): ${#programs[@]} programs, $(ls "$stage/lib" | wc -l) libraries: $(ls "$stage/lib" | tr '\n' ' ')"

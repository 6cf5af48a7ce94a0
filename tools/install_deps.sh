#!/usr/bin/env bash
# Installs what building and testing infinigen needs on Debian 12 (bookworm) or Ubuntu 22.04+.
# The CUDA toolkit is optional and not installed here: with nvcc on PATH (or in /usr/local/cuda)
# the build adds the CUDA backend by itself. Boost.Context runs the emulated CUDA device's
# threads as fibers (the `emulate` preset: the CUDA code on the CPU, no toolkit needed).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libeigen3-dev libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libpcre2-dev libicu-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libboost-context-dev
  python3-matplotlib
  clang libclang-rt-dev libomp-dev
)

run_as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages are present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
run_as_root apt-get update -qq
run_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"

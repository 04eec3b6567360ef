#!/usr/bin/env bash
# llama.cpp peers for the side-by-side benchmarks, compiled from source (llama-cpp-python, pinned in
# .ci/constraints.txt; ~9 minutes each on 2 cores):
#   benchmarks/build_peers.sh native   # into .venv, GGML_NATIVE: every vector extension of this host but AMX
#   benchmarks/build_peers.sh avx2     # into .venv-peers-avx2/ (pip --target, no deps): AVX2/FMA/F16C only,
#                                      # the code path of an AVX2-only CPU, for `decode.py --isa avx2`
#   benchmarks/build_peers.sh          # both
# Each build ends by printing llama.cpp's system info, so the instruction sets it uses are on record
# (the AVX2 build must show AVX512 = 0). --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS, so a
# cached native wheel would otherwise be reused as the "AVX2" one.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=$(grep '^llama-cpp-python==' .ci/constraints.txt)
PIP=(nice .venv/bin/python -m pip install --no-cache-dir --constraint .ci/constraints.txt)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

# Native, less AMX: on this (virtualised) Sapphire-Rapids-class host a native build with AMX repacks
# the weights into AMX buffers and segfaults in the first llama_decode (seen 2026-12-01; ggml-org/
# llama.cpp#20824); with extra buffer types off it runs. minillm has no AMX path either, so the peer
# keeps every other extension of the host. -march=native would define __AMX_INT8__; an explicit
# -mno-amx-* wins over it in GCC whatever the order.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

native() {
    CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" \
        "${PIP[@]}" --force-reinstall --no-deps "$PIN"
    "${PIP[@]}" "llama-cpp-python[server]"  # the server's dependencies (serving.py); the build above stays
    .venv/bin/python -c "
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
print('native:', info)
assert 'AMX_INT8 = 1' not in info, 'the native build still has AMX'"
}

avx2() {
    rm -rf .venv-peers-avx2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        "${PIP[@]}" --no-deps --target .venv-peers-avx2 "$PIN"
    PYTHONPATH=.venv-peers-avx2 .venv/bin/python -c "
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
print('avx2:', info)
assert 'AVX512 = 1' not in info and 'AVX2 = 1' in info, 'the AVX2 build uses AVX-512 or lacks AVX2'"
}

case "${1:-all}" in
    native) native ;;
    avx2) avx2 ;;
    all) native; avx2 ;;
    *) echo "usage: $0 [native|avx2|all]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Every side-by-side benchmark, each contender in a process of its own (benchmarks/common.py), on a
# quiet machine - nothing else running: on a busy 2-core machine a thread that waits at a barrier
# loses its core for milliseconds, and 2-thread runs measure the neighbours.
#
#   benchmarks/run_all_fair.sh                # results into benchmarks/results/
#   benchmarks/run_all_fair.sh /tmp/results   # anywhere else
#   benchmarks/run_all_fair.sh /tmp/r decode  # only some: decode profile quant_quality quant_matvec kernels_cpu throughput
#
# Wall time on the 2-core Xeon, quiet (estimates): decode, both code paths, ~8 min; decode --profile,
# both code paths, ~2 min; quant_quality ~1 min; quant_matvec ~4 min; kernels_cpu ~8 min; throughput ~40 min (transformers'
# padded batch of 64 requests takes ~8 min a repeat, 3 repeats). The llama.cpp peers must be built
# first (~9 minutes each): `make bench-peers` and `benchmarks/build_peers.sh avx2`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
shift || true
WHICH=${*:-decode profile quant_quality quant_matvec kernels_cpu throughput}
PY=".venv/bin/python -u"  # unbuffered: progress shows as it happens

.venv/bin/python -c "import llama_cpp" 2>/dev/null || { echo "llama.cpp is not installed: make bench-peers" >&2; exit 1; }
[ -d .venv-peers-avx2 ] || { echo "no AVX2 build of llama.cpp: benchmarks/build_peers.sh avx2" >&2; exit 1; }

for bench in $WHICH; do
    echo "=== $bench ($(date +%T))"
    case $bench in
        decode) $PY benchmarks/decode.py --isa native,avx2 --modes fp32,int8 --out "$OUT" ;;
        profile) $PY benchmarks/decode.py --profile --isa native,avx2 --out "$OUT" ;;
        quant_quality) $PY benchmarks/quant_quality.py --out "$OUT" ;;
        quant_matvec) $PY benchmarks/quant_matvec.py --out "$OUT" ;;
        kernels_cpu) $PY benchmarks/kernels_cpu.py --out "$OUT" ;;
        throughput) $PY benchmarks/throughput.py --out "$OUT" ;;
        *) echo "unknown benchmark $bench" >&2; exit 2 ;;
    esac
done
echo "=== done ($(date +%T)); results in $OUT"

#!/usr/bin/env bash
# Every side-by-side benchmark, each contender in a process of its own (benchmarks/common.py), on a
# quiet machine - nothing else running: on a busy 2-core machine a thread that waits at a barrier
# loses its core for milliseconds, and 2-thread runs measure the neighbours.
#
#   benchmarks/run_all_fair.sh                # results into benchmarks/results/
#   benchmarks/run_all_fair.sh /tmp/results   # anywhere else
#   benchmarks/run_all_fair.sh /tmp/r decode  # only some (names below)
#
# Every file in benchmarks/results/ comes from one of these (chat_page.png from tests/test_chat_page.py),
# stamped with the machine (CPU, microarchitecture, Numba's ISA, cores) and the package fingerprint
# (benchmarks/common.py save_result). A run on another microarchitecture than the committed files'
# goes into a folder of its own and is committed as <name>_<machine>.json (decode_zen5.json,
# decode_xeon.json): the chapters pick the file of the learner's microarchitecture.
#
# Wall time on the 2-core Xeon, quiet (estimates): decode, both code paths, ~8 min; decode --profile,
# both code paths, ~2 min; quant_quality ~1 min; quant_matvec, on all cores and on one, ~10 min; kernels_cpu ~8 min; throughput ~10 min a mode, fp32 and int8 (transformers'
# padded batch of 64 requests takes ~1.5 min a repeat, 3 repeats); prefix_cache ~3 min; serving ~15 min;
# speculative ~10 min, its --crossover run ~1 min (both again in int8 mode); structured ~10 min, its --coverage run ~4 min (25 schemas, measured on a 2-core Zen 5); scale_out ~10 min; soak 10 min; abuse ~5 min; regression (against
# REGRESSION_BASELINE), both modes and code paths, ~24 min. The llama.cpp peers must be built
# first (~9 minutes each): `make bench-peers` and `benchmarks/build_peers.sh avx2`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
shift || true
WHICH=${*:-decode profile quant_quality quant_matvec kernels_cpu throughput prefix_cache serving speculative structured scale_out soak abuse regression}
PY=".venv/bin/python -u"  # unbuffered: progress shows as it happens
REGRESSION_BASELINE=${REGRESSION_BASELINE:-4910e0a}  # stop 46's last commit: before the one-call layers and the vector activation quantizer

# prefix_cache, serving and speculative write into benchmarks/results/ only: move their files to OUT
into_out() { [ "$OUT" -ef benchmarks/results ] || { mkdir -p "$OUT" && mv "benchmarks/results/$1.json" "$OUT/"; }; }

.venv/bin/python -c "import llama_cpp" 2>/dev/null || { echo "llama.cpp is not installed: make bench-peers" >&2; exit 1; }
[ -d .venv-peers-avx2 ] || { echo "no AVX2 build of llama.cpp: benchmarks/build_peers.sh avx2" >&2; exit 1; }

for bench in $WHICH; do
    echo "=== $bench ($(date +%T))"
    case $bench in
        decode) $PY benchmarks/decode.py --isa native,avx2 --modes fp32,int8 --out "$OUT" ;;
        profile) $PY benchmarks/decode.py --profile --isa native,avx2 --modes fp32,int8 --out "$OUT" ;;
        quant_quality) $PY benchmarks/quant_quality.py --out "$OUT" ;;
        quant_matvec) $PY benchmarks/quant_matvec.py --out "$OUT" && NUMBA_NUM_THREADS=1 $PY benchmarks/quant_matvec.py --out "$OUT" ;;
        kernels_cpu) $PY benchmarks/kernels_cpu.py --out "$OUT" ;;
        throughput) $PY benchmarks/throughput.py --out "$OUT" && $PY benchmarks/throughput.py --activations int8 --out "$OUT" ;;
        prefix_cache) $PY benchmarks/prefix_cache.py && into_out prefix_cache ;;
        serving) $PY benchmarks/serving.py && into_out serving ;;
        # the crossover weighs verify against plain forwards with the acceptance the first run measured;
        # then both again in int8 mode, where a verify's rows run the T-row integer kernel
        speculative) $PY benchmarks/speculative.py && $PY benchmarks/speculative.py --crossover \
                         && $PY benchmarks/speculative.py --activations int8 \
                         && $PY benchmarks/speculative.py --crossover --activations int8 \
                         && for f in speculative speculative_crossover speculative_int8 speculative_crossover_int8; do
                                into_out $f; done ;;
        structured) $PY benchmarks/structured.py --out "$OUT" && $PY benchmarks/structured.py --coverage --out "$OUT" ;;
        scale_out) $PY benchmarks/scale_out.py --out "$OUT" ;;
        soak) $PY benchmarks/soak.py --note "run_all_fair.sh, quiet machine" --out "$OUT" ;;
        abuse) $PY benchmarks/abuse.py --note "run_all_fair.sh, quiet machine" --out "$OUT" ;;
        # against the commit before the last kernel change (REGRESSION_BASELINE), in both modes and code paths
        regression) for mode in fp32 int8; do for isa in native avx2; do
                        $PY benchmarks/regression.py --baseline "$REGRESSION_BASELINE" --activations $mode --isa $isa --out "$OUT"
                    done; done ;;
        *) echo "unknown benchmark $bench" >&2; exit 2 ;;
    esac
done
echo "=== done ($(date +%T)); results in $OUT"

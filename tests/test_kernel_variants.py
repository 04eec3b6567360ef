"""Every compiled variant of a kernel (one per set of constants) keeps its own disk-cache index
(minillm/kernels/cpu/variants.py): Numba numbers the variants of one function name in one index,
and two processes compiling different variants at once can swap them - a kernel unrolled for
other constants, which segfaulted here. Checked on each variant factory of the package."""
import numpy as np

from minillm.kernels.cpu import fused_decode, paged_attention, quant_fp32, quant_int8
from minillm.kernels.cpu.quant import quantize
from minillm.kernels.cpu.quant_repack import repack
from minillm.kernels.cpu.variants import compile_variant

Q4, Q8 = quant_fp32.Q4_CODE, quant_fp32.Q8_0_CODE


def index_path(dispatcher) -> str:
    return str(dispatcher._cache._cache_file._index_path)


def test_each_variant_of_each_factory_has_its_own_index():
    variants = [quant_fp32._kernel(Q4, 8, 1), quant_fp32._kernel(Q4, 8, 2), quant_fp32._kernel(Q8, 8, 1),
                quant_fp32._kernel(Q4, 4, 1),
                quant_int8._kernel(Q4, 8, 1, quant_int8.TARGET_ISA), quant_int8._kernel(Q4, 8, 3, quant_int8.TARGET_ISA),
                paged_attention.decode_kernel(3, 64), paged_attention.decode_kernel(2, 16),
                fused_decode.stack_kernel(1, (Q4, Q4, Q4, Q4), 8, fused_decode.EXACT, (3, 64)),
                fused_decode.stack_kernel(2, (Q4, Q4, Q4, Q4), 8, fused_decode.EXACT, (3, 64)),
                fused_decode.stack_kernel(1, (Q8, Q4, Q4, Q8), 8, fused_decode.EXACT, (3, 64))]
    paths = [index_path(v) for v in variants]
    assert len(set(paths)) == len(paths), paths


def test_a_named_variant_computes_what_its_closure_says():
    """The renaming touches the cache's file name only: the T = 2 variant is still the T = 2 kernel."""
    rng = np.random.default_rng(0)
    w = repack(quantize(rng.standard_normal((16, 64)).astype(np.float32), "Q4_1"), "fp32")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    out = np.empty((2, w.groups * w.rows_per_group), dtype=np.float32)
    quant_fp32._kernel(Q4, w.rows_per_group, 2)(w.quants, w.scales, w.mins, x, out)
    np.testing.assert_allclose(out[:, :16], x @ w.dequantize().T, rtol=1e-5, atol=1e-5)

    def scaled(a):
        return a * factor
    factor = 3.0
    kernel = compile_variant(scaled, factor=factor, shape=(2, 1))
    assert "scaled_factor3.0_shape2-1" in index_path(kernel)
    assert kernel(2.0) == 6.0

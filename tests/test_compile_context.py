"""A kernel's results must not depend on how its machine code came to be: compiled in this process,
or loaded from Numba's disk cache (where callers link their callees otherwise).

The fused decode layer and the per-op forward call the same row and attention kernels from different
compiled callers, and their logits are compared bit for bit (test_fused_decode.py). With LLVM free
to reassociate a sum, a kernel compiled in the process and the same kernel loaded from the cache
added a softmax's weights in different orders - one ulp on one head of SmolLM2's attention, which
int8 mode's rounding of every activation turned into logits 0.4 apart (the fused int8 test failed
whenever one path's kernel came from the cache and the other's had just been compiled). The sums
those kernels share are now written in a fixed order (cpu/rows.py, ``fixed_order_sum``).

Each kernel runs twice on the same inputs, each time in a fresh process over one empty cache folder:
the first compiles (and saves), the second loads; the results must be the same bits.
"""
import os
import subprocess
import sys

import numpy as np

PROGRAM = r"""
import sys
import numpy as np
from minillm.kernels import cpu

rng = np.random.default_rng(7)
out = {}
x = rng.standard_normal((5, 576)).astype(np.float32) * 3
out["rms_norm"] = cpu.rms_norm(x, rng.standard_normal(576).astype(np.float32), 1e-5)
num_blocks, block_size, n_kv_heads, head_dim, group = 40, 16, 3, 64, 3
k = rng.standard_normal((num_blocks, block_size, n_kv_heads, head_dim)).astype(np.float32)
v = rng.standard_normal((num_blocks, block_size, n_kv_heads, head_dim)).astype(np.float32)
tables = rng.permutation(num_blocks).astype(np.int32).reshape(4, 10)            # (B, max_blocks)
keys = np.array([32, 47, 150, 160])                                                # (B,) a few block shapes
q = rng.standard_normal((4, n_kv_heads * group, head_dim)).astype(np.float32) * 2  # (B, H, Dh)
out["decode"] = cpu.paged_attention_decode(q, k, v, tables, keys)
lens = np.array([20, 33, 9, 70])
q = rng.standard_normal((lens.sum(), n_kv_heads * group, head_dim)).astype(np.float32) * 2
out["prefill"] = cpu.paged_attention_prefill(q, k, v, tables, np.concatenate(([0], np.cumsum(lens))), np.array([12, 0, 50, 80]))
np.savez(sys.argv[1], **out)
"""


def test_row_and_attention_kernels_give_the_same_bits_compiled_or_loaded_from_the_cache(tmp_path):
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    results = []
    for run in ("compiled", "loaded"):
        path = tmp_path / f"{run}.npz"
        done = subprocess.run([sys.executable, "-c", PROGRAM, str(path)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(np.load(path))
    compiled, loaded = results
    for name in compiled.files:
        np.testing.assert_array_equal(compiled[name], loaded[name], err_msg=name)

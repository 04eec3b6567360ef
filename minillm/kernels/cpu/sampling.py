"""Sampling's filters and draw over a (B, V) logits batch, compiled: a few vectorised passes over
each row instead of a chain of NumPy calls that each walk the vocabulary (and a sort for top-p).

The specification is the NumPy pipeline in minillm/generation/sampling.py (``apply_penalties``,
``min_p_filter``, ``top_k_filter``, ``top_p_filter``, ``draw``; tests check those against
transformers' warpers and these kernels against them). The same semantics, in float64:

    x / temperature -> min_p -> top_k -> top_p -> draw by inverting the CDF at u

Per row (V = 49152 on SmolLM2; the row is read from memory once, then from the core's cache):
- its max, by NumPy (SIMD): max(x) / T is max(x / T), as rounding a division is monotone.
- one vectorised pass: e_j = x_j / T - top (NumPy's two roundings), w_j = exp(e_j), min_p's drops
  (w_j < min_p, i.e. p_j < min_p * p_max: no normalising sum needed), and at once the total and the
  masses (for top_p; the counts for top_k) of the tokens within 1, 2, 3, 4.5, 6.5 and 10 nats of
  the top: masked sums, no scatter. Each threshold costs ~3 vector operations per 8 tokens
  (measured on one row of SmolLM2 logits: ~28 us for the exp and the total alone, ~58 us with six
  thresholds; eight took ~88 us, their sums no longer fitting the vector registers beside the exp's
  constants - and keeping the exp's results in an L1 buffer between two loops was slower still).
  The pass runs over ROW_CHUNKS fixed chunks: a lone row (decode at batch 1) spreads them over
  every thread (~85 -> ~52 us on 2 threads), a batch gives each row its own thread.
- the smallest of those distances whose mass reaches top_p * total (or count reaches top_k; on a
  peaked row fewer than k tokens lie within 10 nats, and a second count goes out to 110) bounds
  the candidates; a chunked branchless scan collects their ids (a raw-logit bound), their logits
  are copied side by side so that their weights are computed in one vectorised loop (gathered
  loads do not vectorise: ~5x slower), then the exact test drops the few the bound let through.
  A peaked row has a handful; a flat one (a random-token prompt) up to ~10 000.
- the candidates go into 256 fine bins of distance (a counting sort: ids stay ascending in a bin).
  top_k: the bin holding the k-th token is ranked (largest first, ties to the lower id), every token
  tied with the k-th stays. top_p: whole bins are taken while the mass before the next token stays
  below top_p; only the bin where it crosses is ranked, and walked token by token (a token is kept
  while the mass ranked above it is below top_p). If rounding leaves the candidates short of top_p,
  the next distance's candidates are taken.
- the draw adds the kept tokens' weights in id order, as ``numpy.cumsum`` does (dropped tokens
  weigh 0 there and adding 0.0 changes no sum), so the same uniform picks the same token as ``draw``.

Honest limits (rounding only; the tests compare kept sets and draws with the NumPy chain exactly):
- ``exp_nonpositive`` is not np.exp bit for bit: within 1 ulp of it on [-708.39, 0] (a dense sweep
  in the tests), and 0 below -708.39, where np.exp returns subnormals (< 2**-1022; a sum that holds
  the top token's 1.0 cannot see them). A 1-ulp weight moves a sum by ~1e-16 relative: it changes a
  kept set or a draw only when top_p or u * total lies that close to a cumulative mass; a subnormal
  token (more than 708 nats below the top) can differ only at u == 0.
- the total is summed in vector order (NumPy's sum is pairwise), and the mass above the cut bin is
  added bin by bin in id order (the spec's cumsum adds in rank order): again a few ulps, which
  decide only a token whose mass-before lies within them of top_p.

Rows with no finite logit are left as they are (all -inf) and draw token 0, as ``draw`` does.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.kernels.cpu.rows import bits_from_float, float_from_bits

# EXACT: every operation rounds as NumPy's does (exp_nonpositive's split of ln 2 and its 1.5 * 2**52
# rounding trick must not be reassociated away). SUMS: additions may be reordered, so sums vectorise.
# error_model="numpy": x / 0 gives inf; Python's model adds a zero test that stops vectorisation.
EXACT = {"cache": True, "error_model": "numpy"}
SUMS = {"cache": True, "error_model": "numpy", "fastmath": {"reassoc"}}

# -----------------------------------------------------------------------------------------------
# exp on float64, arithmetic only (so a loop over it vectorises: Numba calls libm's scalar exp)
#   exp(d) = 2**n * exp(r),  n = round(d / ln 2),  r = d - n ln 2 in [-ln2/2, ln2/2]
# ln 2 in two parts (the product n * LN2_HI is exact in the fma, LN2_LO restores the rest), exp(r) by
# its Taylor polynomial to degree 13 (truncation < 4e-18 on |r| <= ln2/2) in fma Horner form, and
# 2**n built as the bits of a float64 (exponent field n + 1023, mantissa 0).

INV_LN2 = 1.4426950408889634
LN2_HI = 0.6931471805599453          # ln 2 rounded to float64
LN2_LO = 2.3190468138462996e-17      # ln 2 - LN2_HI
ROUNDING_SHIFT = 6755399441055744.0  # 1.5 * 2**52: (d + it) - it is d rounded to an integer
ROUNDING_SHIFT_BITS = int(np.float64(ROUNDING_SHIFT).view(np.int64))
SMALLEST_NORMAL_EXP = -708.3964185322641  # -1022 ln 2: below it exp underflows into subnormals
EXP_FLOOR = -746.0                   # inputs are clamped here, so n stays a valid exponent field
TAYLOR = tuple(1.0 / np.prod(np.arange(1.0, k + 1)) for k in range(13, -1, -1))  # 1/13!, ..., 1/1!, 1/0!


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma: one instruction, vectorisable)."""
    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64, f64, f64]), "llvm.fma.f64")
        return builder.call(fn, args)
    return types.float64(types.float64, types.float64, types.float64), codegen


@njit(**EXACT)
def exp_nonpositive(d):
    """exp(d) for d <= 0 (or -inf), within 1 ulp of np.exp; 0 where np.exp is subnormal (d < -708.39)."""
    dc = d if d > EXP_FLOOR else EXP_FLOOR
    shifted = dc * INV_LN2 + ROUNDING_SHIFT  # in [2**52, 2**53), where a float's bits are its value + a constant
    n = shifted - ROUNDING_SHIFT
    r = fma(n, -LN2_LO, fma(n, -LN2_HI, dc))
    p = TAYLOR[0]
    for c in TAYLOR[1:]:
        p = fma(p, r, c)
    # n as an int64 from shifted's bits, not by converting n: AVX2 has no vector float64 -> int64
    # conversion, and LLVM converted lane by lane (one SmolLM2 row's pass on one thread, AVX2 code:
    # 175 -> 157 us; the same bits)
    scaled = p * float_from_bits((bits_from_float(shifted) - ROUNDING_SHIFT_BITS + 1023) << 52)
    return scaled if d >= SMALLEST_NORMAL_EXP else 0.0


@njit(**EXACT)
def exp_rows(d, out):
    """out = exp_nonpositive(d), elementwise over 1-D arrays (the tests check it against np.exp)."""
    for i in range(d.shape[0]):
        out[i] = exp_nonpositive(d[i])


@njit(**EXACT)
def _weight(x_j, temperature, top, min_p):
    """A token's distance e = x_j / temperature - top (<= 0; -inf for a masked token) and weight
    exp(e), both -inf / 0 when min_p drops it. One home for both, so every pass agrees on them."""
    e = x_j / temperature - top
    w = exp_nonpositive(e)
    return (e, w) if w >= min_p else (-np.inf, 0.0)


# -----------------------------------------------------------------------------------------------
# The pass over the row: total and masses (or counts) within a few distances of the top

DISTANCES = (1.0, 2.0, 3.0, 4.5, 6.5, 10.0)  # nats below the top; the nuclei measured on
LEVELS = len(DISTANCES)                                 # SmolLM2 reach 0-10 nats at T = 0.8
# top_k on a peaked row: fewer than k tokens lie within 10 nats (on SmolLM2's rows at T = 0.8, k = 50
# often does), and gathering the whole vocabulary took ~1.5-1.9 ms. A second count, further out,
# bounds the candidates instead (~0.05 ms).
WIDE_DISTANCES = (15.0, 22.0, 33.0, 50.0, 75.0, 110.0)
FINE_BINS = 256
NO_SUMS = (0.0,) * LEVELS


@njit(inline="always")
def _add_within(sums, e, amount, d):
    """sums[t] + amount where e >= -d[t], d = DISTANCES or WIDE_DISTANCES: masked adds (a tuple stays
    in registers)."""
    return (sums[0] + (amount if e >= -d[0] else 0.0), sums[1] + (amount if e >= -d[1] else 0.0),
            sums[2] + (amount if e >= -d[2] else 0.0), sums[3] + (amount if e >= -d[3] else 0.0),
            sums[4] + (amount if e >= -d[4] else 0.0), sums[5] + (amount if e >= -d[5] else 0.0))


@njit(**SUMS)
def _masses_within(x, temperature, top, min_p):
    """(the total weight, the weight within each of DISTANCES) of the tokens min_p keeps."""
    total, masses = 0.0, NO_SUMS
    for j in range(x.shape[0]):
        e, w = _weight(x[j], temperature, top, min_p)
        total += w
        masses = _add_within(masses, e, w, DISTANCES)
    return total, masses


# Chunks of a row, for the two passes over the whole vocabulary. A fixed number, not one per thread:
# a sum over chunks then adds in the same order on every machine, whichever kernel runs the row.
# A lone row runs them on every thread (_rows_split: ~85 -> ~52 us for the sums of one SmolLM2 row
# on 2 threads); in a batch each row runs them serially on its own thread (_rows_parallel).
ROW_CHUNKS = 8


@njit(inline="always")
def _within_chunks(x, temperature, top, min_p, counts, distances):
    """_counts_within (``counts``, within ``distances``) or _masses_within (within DISTANCES) over
    the row, summed chunk by chunk -> (1 + LEVELS,): the total, then the sum within each distance.
    Inlined, so that its prange runs on threads in a parallel caller and as a plain loop in a
    serial one."""
    size = -(-x.shape[0] // ROW_CHUNKS)
    sums = np.empty((ROW_CHUNKS, 1 + LEVELS))  # (chunks, the total and the LEVELS sums)
    for c in prange(ROW_CHUNKS):
        chunk = x[c * size:(c + 1) * size]
        if counts:
            total, within = _counts_within(chunk, temperature, top, min_p, distances)
        else:
            total, within = _masses_within(chunk, temperature, top, min_p)
        sums[c, 0] = total
        for level in range(LEVELS):
            sums[c, 1 + level] = within[level]
    s = sums[0].copy()
    for c in range(1, ROW_CHUNKS):
        s += sums[c]
    return s


@njit(**SUMS)
def _counts_within(x, temperature, top, min_p, distances):
    """(the number of finite tokens min_p keeps, the number within each of ``distances``)."""
    live, counts = 0.0, NO_SUMS
    for j in range(x.shape[0]):
        e, _ = _weight(x[j], temperature, top, min_p)
        live += 1.0 if e > -np.inf else 0.0
        counts = _add_within(counts, e, 1.0, distances)
    return live, counts


@njit(**EXACT)
def _first_level(sums, needed):
    """The first distance whose sum reaches ``needed``; LEVELS (every token) if none does."""
    for level in range(LEVELS):
        if sums[level] >= needed:
            return level
    return LEVELS


# -----------------------------------------------------------------------------------------------
# The candidates: gathered, binned finely, and cut


# Blocks of tokens counted before any id is written: a peaked row's few candidates lie in a few of
# them. One thread, a SmolLM2 row (49152 tokens), 2-core Xeon VM: writing an id for every token
# takes ~23 us whatever the row; counting the row, then each block, and scanning only the blocks
# that hold a candidate takes ~9 us for a handful of them. A flat row (candidates in most blocks) is
# scanned whole and pays the count on top (~34 us for 7830 candidates). The loops index a slice from
# 0: over range(lo, hi), Numba's wrap-around of negative indices kept LLVM from vectorising the
# count (~18 us instead of ~4). In a decode step (one row on 2 threads) the sampler went from ~100
# to ~80 us with the caches warm.
SCAN_BLOCK = 64


@njit(**EXACT)
def _write_ids(part, bound, ids, n, first_id):
    """ids[n:] = first_id + the j with part[j] >= bound, ascending -> the new n. Branchless: the
    store is cheaper than a mispredicted jump on flat rows."""
    for j in range(part.shape[0]):
        ids[n] = first_id + j
        n += part[j] >= bound
    return n


@njit(**EXACT)
def _ids_at_least(x, bound, ids, lo, hi):
    """Write the ids j in [lo, hi) with x[j] >= bound, ascending, into ids[lo:] -> how many."""
    chunk = x[lo:hi]
    size = chunk.shape[0]
    count = 0
    for j in range(size):
        count += chunk[j] >= bound
    if count * SCAN_BLOCK > size:  # more than one a block on average: nearly every block holds some
        return _write_ids(chunk, bound, ids, lo, lo) - lo
    n, blocks = lo, size // SCAN_BLOCK
    for b in range(blocks):
        found = 0
        for j in range(SCAN_BLOCK):
            found += chunk[b * SCAN_BLOCK + j] >= bound
        if found:
            n = _write_ids(chunk[b * SCAN_BLOCK:(b + 1) * SCAN_BLOCK], bound, ids, n, lo + b * SCAN_BLOCK)
    return _write_ids(chunk[blocks * SCAN_BLOCK:], bound, ids, n, lo + blocks * SCAN_BLOCK) - lo


@njit(inline="always")
def _ids_at_least_chunks(x, bound, ids):
    """_ids_at_least over the whole row, chunk by chunk (see _within_chunks), then the chunks' ids
    moved together -> how many."""
    size = -(-x.shape[0] // ROW_CHUNKS)
    found = np.empty(ROW_CHUNKS, dtype=np.int64)
    for c in prange(ROW_CHUNKS):  # chunk c writes only ids[c size:(c + 1) size]
        found[c] = _ids_at_least(x, bound, ids, c * size, min(x.shape[0], (c + 1) * size))
    n = found[0]
    for c in range(1, ROW_CHUNKS):
        for i in range(found[c]):
            ids[n + i] = ids[c * size + i]
        n += found[c]
    return n


@njit(inline="always")
def _gather(x, temperature, top, min_p, distance, ids):
    """The live tokens within ``distance`` of the top -> (n, their ids ascending in ids[:n],
    x / temperature (n,), e (n,), w (n,)). Inlined (see _within_chunks)."""
    # a bound on the raw logit a little below the exact one (x / T - top >= -distance is monotone in x)
    bound = temperature * (top - distance) - 1e-9 * temperature * (abs(top) + distance + 1.0)
    n = _ids_at_least_chunks(x, bound, ids)
    scaled, e, w = np.empty(n), np.empty(n), np.empty(n)
    for i in range(n):  # the candidates' logits side by side first: a loop over gathered loads does
        scaled[i] = x[ids[i]]  # not vectorise, the exp below on contiguous ones does (~5x faster)
    for i in range(n):
        e[i], w[i] = _weight(scaled[i], temperature, top, min_p)
        scaled[i] /= temperature
    kept = 0
    for i in range(n):  # the exact test; nearly every candidate passes it (a well-predicted branch)
        if e[i] > -np.inf and e[i] >= -distance:
            ids[kept], scaled[kept], e[kept], w[kept] = ids[i], scaled[i], e[i], w[i]
            kept += 1
    return kept, scaled[:kept], e[:kept], w[:kept]


@njit(**EXACT)
def _fine_bins(e):
    """Candidates' distances e (n,) -> (bin starts (FINE_BINS + 1,), candidate order (n,) grouped by
    bin, nearest bin first): a counting sort into FINE_BINS equal bins over [min(e), 0], stable
    (ascending ids within a bin). Equal logits share a bin, and bins keep the logits' order."""
    n = e.shape[0]
    lowest = e.min() if n else 0.0
    scale = FINE_BINS / -lowest if lowest < 0 else 0.0
    bins = np.empty(n, dtype=np.int64)
    starts = np.zeros(FINE_BINS + 1, dtype=np.int64)
    for i in range(n):
        bins[i] = min(int(-e[i] * scale), FINE_BINS - 1)
        starts[bins[i] + 1] += 1
    for b in range(FINE_BINS):
        starts[b + 1] += starts[b]
    order = np.empty(n, dtype=np.int64)
    filled = starts[:FINE_BINS].copy()
    for i in range(n):
        order[filled[bins[i]]] = i
        filled[bins[i]] += 1
    return starts, order


@njit(**EXACT)
def _ranked(members, scaled):
    """Candidate indices ``members`` (ascending ids) by logit, largest first, ties to the lower id."""
    return members[np.argsort(-scaled[members], kind="mergesort")]  # stable: ties keep ascending ids


@njit(**EXACT)
def _top_k(scaled, starts, order, top_k, keep):
    """keep[i] = candidate i is at or above the k-th largest logit (ties with it stay)."""
    b, seen = 0, 0
    while seen + starts[b + 1] - starts[b] < top_k:
        seen += starts[b + 1] - starts[b]
        b += 1
    kth = scaled[_ranked(order[starts[b]:starts[b + 1]], scaled)[top_k - seen - 1]]
    for i in range(scaled.shape[0]):
        keep[i] = scaled[i] >= kth


@njit(**EXACT)
def _top_p(scaled, w, total, starts, order, top_p, keep):
    """Clear keep[i] for the candidates top_p drops: a token stays while the mass (w / total) ranked
    above it is below top_p. Whole bins are added in id order; the bin where the mass crosses top_p
    is ranked and walked. -> whether the cut was found (False: every candidate stays and the mass
    is still short of top_p, so tokens beyond the candidates may stay too)."""
    before, cut = 0.0, False
    for b in range(FINE_BINS):
        members = order[starts[b]:starts[b + 1]]  # a view: most bins are passed over without a copy
        if cut:
            keep[members] = False
            continue
        through = before
        for i in members:
            through += w[i] / total if keep[i] else 0.0
        if through < top_p:
            before = through
            continue
        for i in _ranked(members[keep[members]], scaled):
            if before < top_p:
                before += w[i] / total
            else:
                keep[i], cut = False, True
        cut = cut or before >= top_p  # the bin's last token crossed top_p: the next one is dropped
    return cut


@njit(inline="always")
def _filter_row(x, temperature, top, min_p, top_k, top_p, ids, weights):
    """One row (V,), top = max(x) / temperature > -inf -> the number n of tokens min_p, top_k and
    top_p keep, their ids ascending in ids[:n] and weights exp(x / T - top) in weights[:n]; -1 when
    top_k and top_p keep every token min_p keeps. Inlined (see _within_chunks)."""
    V = x.shape[0]
    use_k, use_p = 0 < top_k < V, top_p < 1
    level, total, distances = LEVELS, 0.0, DISTANCES
    if use_k:
        counts = _within_chunks(x, temperature, top, min_p, True, DISTANCES)  # (1 + LEVELS,) the live ones first
        use_k = top_k < counts[0]  # fewer live tokens than k: top_k drops nothing
        level = _first_level(counts[1:], top_k)
        if use_k and level == LEVELS:  # a peaked row: count further out (see WIDE_DISTANCES)
            distances = WIDE_DISTANCES
            level = _first_level(_within_chunks(x, temperature, top, min_p, True, WIDE_DISTANCES)[1:], top_k)
    if not use_k:
        if not use_p:
            return -1
        masses = _within_chunks(x, temperature, top, min_p, False, DISTANCES)  # (1 + LEVELS,) the total first
        total = masses[0]
        level = _first_level(masses[1:], top_p * total)
    while True:
        n, scaled, e, w = _gather(x, temperature, top, min_p, distances[level] if level < LEVELS else np.inf, ids)
        starts, order = _fine_bins(e)
        keep = np.ones(n, dtype=np.bool_)
        if use_k:
            _top_k(scaled, starts, order, top_k, keep)
            total = 0.0
            for i in range(n):  # top_p normalises over the tokens top_k keeps
                total += w[i] if keep[i] else 0.0
        if not use_p or _top_p(scaled, w, total, starts, order, top_p, keep) or use_k or level == LEVELS:
            break
        level += 1  # rounding left the candidates' mass just short of top_p: take the next distance's too
    n_kept = 0
    for i in range(n):
        if keep[i]:
            ids[n_kept], weights[n_kept] = ids[i], w[i]
            n_kept += 1
    return n_kept


@njit(**EXACT)
def _draw_row(x, temperature, top, min_p, ids, weights, n_kept, u):
    """The first token whose running weight (added in id order, as numpy.cumsum adds) exceeds
    u * the total: ``draw`` exactly, up to exp's last ulp. Only the n_kept tokens in ids / weights
    when a filter chose them (n_kept >= 0), else every token min_p keeps."""
    if n_kept < 0:
        n_kept = x.shape[0]
        for j in range(n_kept):  # vectorises; the sums below cannot (their order is the answer)
            ids[j] = j
            weights[j] = _weight(x[j], temperature, top, min_p)[1]
    total = 0.0
    for i in range(n_kept):
        total += weights[i]
    target = u * total
    cdf = 0.0
    for i in range(n_kept):
        cdf += weights[i]
        if cdf > target:
            return ids[i]
    return x.shape[0]


@njit(**EXACT)
def _write_filtered(x, temperature, top, min_p, ids, n_kept, out):
    """out (V,) = x / temperature with every token the filters drop at -inf."""
    if n_kept < 0:
        for j in range(x.shape[0]):
            out[j] = x[j] / temperature if _weight(x[j], temperature, top, min_p)[0] > -np.inf else -np.inf
        return
    out[:] = -np.inf
    for i in range(n_kept):
        out[ids[i]] = x[ids[i]] / temperature


# A row's sampling settings, the columns of the (R, 5) float64 array the kernel reads: the Sampler
# builds it with one np.array call a step (five (R,) arrays cost five, each several us in a decode
# step, whose weights have pushed the interpreter out of the CPU caches). top_k is a whole number.
SETTINGS = ("temperature", "min_p", "top_k", "top_p", "uniform")


@njit(inline="always")
def _rows(x, maxima, settings, tokens, filtered):
    """Each row: filtered, then drawn into tokens when it has a slot per row, else written into
    ``filtered`` (R, V). maxima (R,) each row's max; settings (R, 5) as SETTINGS. Inlined into the
    two entries below."""
    V = x.shape[1]
    ids, weights = np.empty(V, dtype=np.int64), np.empty(V)  # (V,) scratch, reused by every row
    for r in range(x.shape[0]):
        temperature, min_p, top_p, u = settings[r, 0], settings[r, 1], settings[r, 3], settings[r, 4]
        top_k = np.int64(settings[r, 2])
        top = np.float64(maxima[r]) / temperature  # max(x / T), as rounding a division is monotone
        if top == -np.inf:  # no finite logit: nothing to filter, and draw's answer is 0
            if tokens.shape[0]:
                tokens[r] = 0
            else:
                filtered[r, :] = -np.inf
            continue
        n_kept = _filter_row(x[r], temperature, top, min_p, top_k, top_p, ids, weights)
        if tokens.shape[0]:
            tokens[r] = _draw_row(x[r], temperature, top, min_p, ids, weights, n_kept, u)
        else:
            _write_filtered(x[r], temperature, top, min_p, ids, n_kept, filtered[r])


@njit(**EXACT)
def _rows_serial(x, maxima, settings, tokens, filtered):
    """_rows on the calling thread (each row of _rows_parallel)."""
    _rows(x, maxima, settings, tokens, filtered)


# Only the pranges run on threads: Numba's other parallel rewrites would put each small array
# operation of the row's tail on the pool too.
PRANGE_ONLY = {"prange": True, "comprehension": False, "reduction": False, "inplace_binop": False,
               "setitem": False, "numpy": False, "stencil": False, "fusion": False}


@njit(parallel=PRANGE_ONLY, **EXACT)
def _rows_split(x, maxima, settings, tokens, filtered):
    """_rows with each pass over the vocabulary on every thread: a lone row (decode at batch 1)."""
    _rows(x, maxima, settings, tokens, filtered)


@njit(cache=True, parallel=True)
def _rows_parallel(x, maxima, settings, tokens, filtered):
    for r in prange(x.shape[0]):
        _rows_serial(x[r:r + 1], maxima[r:r + 1], settings[r:r + 1], tokens[r:r + 1] if tokens.shape[0] else tokens,
                     filtered[r:r + 1] if filtered.shape[0] else filtered)


NO_TOKENS, NO_ROWS = np.empty(0, dtype=np.int64), np.empty((0, 0))  # the output a call does not write


def _as_rows(logits) -> np.ndarray:
    """(R, V) float32 or float64, C-contiguous: read as given (no float64 copy of the batch)."""
    raw = np.asarray(logits)
    if raw.ndim != 2:
        raise ValueError(f"logits must be (rows, vocab), got shape {raw.shape}")
    if raw.dtype in (np.float32, np.float64) and raw.flags.c_contiguous:
        return raw
    return np.ascontiguousarray(raw if raw.dtype in (np.float32, np.float64) else raw.astype(np.float64))


def _run(raw: np.ndarray, settings: np.ndarray, draws: bool) -> np.ndarray:
    """The row maxima in NumPy (SIMD, and the first read of the logits), the rest in the kernel ->
    (R,) tokens when ``draws``, else the (R, V) filtered logits."""
    rows, V = raw.shape
    if settings.shape != (rows, len(SETTINGS)) or settings.dtype != np.float64 or not settings.flags.c_contiguous:
        raise ValueError(f"settings must be a C-contiguous float64 ({rows}, {len(SETTINGS)}) array {SETTINGS}, "
                         f"got {settings.dtype} {settings.shape}")
    out = np.empty(rows, dtype=np.int64) if draws else np.empty((rows, V))
    args = (raw, raw.max(axis=1), settings, *((out, NO_ROWS) if draws else (NO_TOKENS, out)))
    (_rows_parallel if rows > 1 else _rows_split)(*args)
    return out


def row_settings(rows: int, temperature, min_p, top_k, top_p, uniforms=0.0) -> np.ndarray:
    """The (rows, 5) settings array (SETTINGS) of per-row (rows,) values or one value for every row."""
    settings = np.empty((rows, len(SETTINGS)))
    for column, values in enumerate((temperature, min_p, top_k, top_p, uniforms)):
        settings[:, column] = values
    return settings


def filter_rows(logits: np.ndarray, temperature, min_p, top_k, top_p) -> np.ndarray:
    """logits (R, V) and per-row (R,) parameters -> float64 logits / temperature with every token
    min_p, top_k and top_p drop at -inf (``generation.sampling``'s filter chain)."""
    raw = _as_rows(logits)
    return _run(raw, row_settings(raw.shape[0], temperature, min_p, top_k, top_p), draws=False)


def sample_rows(logits: np.ndarray, temperature, min_p, top_k, top_p, uniforms) -> np.ndarray:
    """logits (R, V) -> (R,) int64: each row filtered as ``filter_rows`` does, then drawn at its
    uniform u in [0, 1) as ``generation.sampling.draw`` draws."""
    raw = _as_rows(logits)
    return draw_rows(raw, row_settings(raw.shape[0], temperature, min_p, top_k, top_p, uniforms))


def draw_rows(logits: np.ndarray, settings: np.ndarray) -> np.ndarray:
    """``sample_rows`` with each row's parameters and uniform in one (R, 5) float64 array (SETTINGS):
    the Sampler's entry, one array built a step."""
    return _run(_as_rows(logits), settings, draws=True)


@njit(cache=True)
def _penalise(x, prompt_ids, prompt_starts, output_ids, output_starts, presence, frequency, repetition):
    counts = np.zeros(x.shape[1], dtype=np.int64)  # (V,) reset after each row, only where touched
    seen = np.zeros(x.shape[1], dtype=np.bool_)    # (V,)
    for r in range(x.shape[0]):
        output = output_ids[output_starts[r]:output_starts[r + 1]]
        prompt = prompt_ids[prompt_starts[r]:prompt_starts[r + 1]]
        for i in output:
            counts[i] += 1
            seen[i] = True
        for i in prompt:
            seen[i] = True
        for ids in (prompt, output):
            for i in ids:
                if not seen[i]:
                    continue  # this token's penalty is already applied
                v = x[r, i]
                v = v / repetition[r] if v > 0 else v * repetition[r]
                v -= frequency[r] * counts[i]
                v -= presence[r] * (1.0 if counts[i] > 0 else 0.0)
                x[r, i] = v
                seen[i] = False
                counts[i] = 0


def apply_penalties(logits: np.ndarray, prompt_ids, output_ids, presence, frequency, repetition) -> np.ndarray:
    """The compiled ``generation.sampling.apply_penalties``: a penalised float64 copy of logits (B, V),
    touching only the tokens of each row's prompt and output (same arguments, same float64 operations)."""
    x = np.array(logits, dtype=np.float64, order="C")  # (B, V)
    V = x.shape[1]

    def flat(lists):
        ids = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in lists]
        for row in ids:
            if row.size and (row.min() < 0 or row.max() >= V):
                raise ValueError(f"token ids must lie in [0, {V}) for penalties, got {row.min()}..{row.max()}")
        starts = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum([len(row) for row in ids], out=starts[1:])
        return (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)), starts

    prompt, prompt_starts = flat(prompt_ids)
    output, output_starts = flat(output_ids)
    per_row = [np.ascontiguousarray(a, dtype=np.float64) for a in (presence, frequency, repetition)]
    _penalise(x, prompt, prompt_starts, output, output_starts, *per_row)
    return x

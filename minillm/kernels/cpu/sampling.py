"""Sampling's filters and draw over a (B, V) logits batch, compiled: one Numba pass per step instead
of a chain of NumPy calls that each walk the vocabulary (and a sort for top-p).

The specification is the NumPy pipeline in minillm/generation/sampling.py (``apply_penalties``,
``min_p_filter``, ``top_k_filter``, ``top_p_filter``, ``draw``; tests check those against
transformers' warpers and these kernels against them). The same semantics, in float64:

    x / temperature -> min_p -> top_k -> top_p -> draw by inverting the CDF at u

- x / temperature, its row max and exp(x - max) are computed by NumPy, as in the NumPy pipeline.
- min_p keeps p_j >= min_p * p_max, i.e. exp(x_j - max) >= min_p: no normalising sum needed.
- top_k and top_p without a sort of the vocabulary: one pass files every token in a histogram of
  its distance to the largest logit (bins of 1/8 nat; the last bin holds everything 32 nats down),
  counting tokens and adding their weights exp(x_j - max). Walking the bins from the top finds the
  bin where the k-th token (or the mass top_p) is reached; only the tokens of that bin and those
  above it - usually a few dozen - are gathered and sorted (largest first, ties to the lower id).
  If rounding leaves the walk short of top_p, one more bin is taken. The filter is then one pass:
  a token is kept if it ranks at or above the last kept one.
- the draw adds the weights in id order, as ``numpy.cumsum`` does, over the same weights (the
  maximum survives every filter), so the same uniform picks the same token as ``draw``.

Rows with no finite logit are left as they are (all -inf) and draw token 0, as ``draw`` does.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

BINS_PER_NAT = 8
HISTOGRAM_BINS = 32 * BINS_PER_NAT + 1  # the last one: every token 32 nats or more below the top


@njit(cache=True, inline="always")
def _bin(distance):
    """The histogram bin of a token ``distance`` nats below the largest logit (distance >= 0)."""
    if distance >= HISTOGRAM_BINS - 1:  # also inf
        return HISTOGRAM_BINS - 1
    return min(int(distance * BINS_PER_NAT), HISTOGRAM_BINS - 1)


@njit(cache=True)
def _filter_row(x, weights, top, min_p, top_k, top_p, ids):
    """One row: x (V,) float64 logits already divided by the temperature, weights (V,) their
    exp(x - top), top = max(x) > -inf -> the number n of tokens top_k and top_p keep, their ids
    ascending in ids[:n]; -1 when they keep every finite token. min_p's drops are written in place
    (x = -inf, weight 0)."""
    V = x.shape[0]
    if min_p > 0:
        for j in range(V):
            if weights[j] < min_p:
                x[j], weights[j] = -np.inf, 0.0
    use_k, use_p = 0 < top_k < V, top_p < 1
    if not (use_k or use_p):
        return -1
    counts = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
    mass = np.zeros(HISTOGRAM_BINS)
    finite, total = 0, 0.0
    for j in range(V):
        if x[j] > -np.inf:
            b = _bin(top - x[j])
            counts[b] += 1
            mass[b] += weights[j]
            finite += 1
            total += weights[j]
    use_k = use_k and top_k < finite  # fewer finite tokens than k: top_k drops nothing
    if not (use_k or use_p):
        return -1
    # the bin where the walk from the top first reaches k tokens (top_k) or the mass top_p
    cut, seen_count, seen_mass = 0, counts[0], mass[0]
    while cut < HISTOGRAM_BINS - 1 and (seen_count < top_k if use_k else seen_mass < top_p * total):
        cut += 1
        seen_count += counts[cut]
        seen_mass += mass[cut]
    while True:
        n = 0  # gather the candidates (ascending ids), then rank them: largest first, ties to the lower id
        for j in range(V):
            if x[j] > -np.inf and _bin(top - x[j]) <= cut:
                ids[n] = j
                n += 1
        order = np.argsort(-x[ids[:n]], kind="mergesort")  # stable: equal logits keep ascending ids
        ranked = ids[:n][order].copy()                     # (n,)
        n_kept = n
        kept_total = total
        if use_k:  # every token tied with the k-th stays
            kth = x[ranked[top_k - 1]]
            n_kept, kept_total = 0, 0.0
            while n_kept < n and x[ranked[n_kept]] >= kth:
                kept_total += weights[ranked[n_kept]]
                n_kept += 1
        if not use_p:
            break  # top_k alone keeps every tie of the k-th
        before, i = 0.0, 0  # keep a token while the mass ranked above it is below top_p
        while i < n_kept and before < top_p:
            before += weights[ranked[i]] / kept_total
            i += 1
        if before >= top_p or use_k or n == finite or cut == HISTOGRAM_BINS - 1:
            n_kept = i
            break
        cut += 1  # rounding left the candidates' mass just short of top_p: take the next bin too
    kept = ids[:n_kept]
    kept[:] = np.sort(ranked[:n_kept])  # the kept tokens, in id order (the draw adds them that way)
    return n_kept


@njit(cache=True)
def _draw_row(weights, kept, n_kept, u):
    """The first token whose running weight (added in id order, as numpy.cumsum adds) exceeds
    u * the total: ``draw`` exactly, as the dropped tokens' weights are 0 and adding 0.0 changes
    no sum. Only the n_kept tokens in ``kept`` when a filter chose them (n_kept >= 0), else all."""
    V = weights.shape[0]
    total = 0.0
    for i in range(n_kept if n_kept >= 0 else V):
        total += weights[kept[i] if n_kept >= 0 else i]
    target = u * total
    cdf = 0.0
    for i in range(n_kept if n_kept >= 0 else V):
        j = kept[i] if n_kept >= 0 else i
        cdf += weights[j]
        if cdf > target:
            return j
    return V


@njit(cache=True)
def _rows_serial(x, weights, top, min_p, top_k, top_p, uniforms, out):
    """Each row: filtered, then drawn when ``out`` has a slot per row, else written back with the
    dropped tokens at -inf. One row: no threads to wake."""
    ids = np.empty(x.shape[1], dtype=np.int64)  # (V,) scratch
    for r in range(x.shape[0]):
        if top[r] == -np.inf:  # no finite logit: nothing to filter, and draw's answer is 0
            if out.shape[0]:
                out[r] = 0
            continue
        n_kept = _filter_row(x[r], weights[r], top[r], min_p[r], top_k[r], top_p[r], ids)
        if out.shape[0]:
            out[r] = _draw_row(weights[r], ids, n_kept, uniforms[r])
        elif n_kept >= 0:
            values = x[r][ids[:n_kept]]
            x[r, :] = -np.inf
            x[r][ids[:n_kept]] = values


@njit(cache=True, parallel=True)
def _rows_parallel(x, weights, top, min_p, top_k, top_p, uniforms, out):
    for r in prange(x.shape[0]):
        _rows_serial(x[r:r + 1], weights[r:r + 1], top[r:r + 1], min_p[r:r + 1], top_k[r:r + 1], top_p[r:r + 1],
                     uniforms[r:r + 1], out[r:r + 1] if out.shape[0] else out)


def _run(logits, temperature, min_p, top_k, top_p, uniforms, draws: bool):
    """x / temperature, its row max and exp(x - max) in NumPy (the operations the NumPy pipeline
    runs, vectorised: Numba's scalar exp is 6x slower here), the rest in the kernel."""
    raw = np.asarray(logits)
    if raw.ndim != 2:
        raise ValueError(f"logits must be (rows, vocab), got shape {raw.shape}")
    rows = raw.shape[:1]

    def per_row(a, dtype):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(a, dtype=dtype), rows))

    x = np.ascontiguousarray(raw / per_row(temperature, np.float64)[:, None], dtype=np.float64)  # (R, V)
    top = x.max(axis=1)                                                                            # (R,)
    with np.errstate(invalid="ignore"):  # a row of -inf only: nan weights, never read
        weights = np.exp(x - top[:, None])                                                         # (R, V)
    out = np.empty(rows[0] if draws else 0, dtype=np.int64)
    kernel = _rows_parallel if rows[0] > 1 else _rows_serial
    kernel(x, weights, top, per_row(min_p, np.float64), per_row(top_k, np.int64), per_row(top_p, np.float64),
           per_row(0.0 if uniforms is None else uniforms, np.float64), out)
    return x, out


def filter_rows(logits: np.ndarray, temperature, min_p, top_k, top_p) -> np.ndarray:
    """logits (R, V) and per-row (R,) parameters -> float64 logits / temperature with every token
    min_p, top_k and top_p drop at -inf (``generation.sampling``'s filter chain)."""
    return _run(logits, temperature, min_p, top_k, top_p, None, draws=False)[0]


def sample_rows(logits: np.ndarray, temperature, min_p, top_k, top_p, uniforms) -> np.ndarray:
    """logits (R, V) -> (R,) int64: each row filtered as ``filter_rows`` does, then drawn at its
    uniform u in [0, 1) as ``generation.sampling.draw`` draws."""
    return _run(logits, temperature, min_p, top_k, top_p, uniforms, draws=True)[1]


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

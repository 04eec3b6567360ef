"""Sampling: the next-token logits of a batch of sequences -> one token per sequence.

Each row of the logits goes through the same pipeline, in vLLM's order, with its own parameters:

    raw logits (B, V) ---------------------------------------------> logprobs (if asked)
      -> min_tokens      eos and stop ids get -inf until min_tokens tokens are out
      -> penalties       repetition (prompt + output), frequency and presence (output only)
      -> temperature 0:  argmax (ties go to the lowest id)                   -> token
         otherwise:      / temperature -> min_p -> top_k -> top_p -> draw   -> token

The draw uses the row's own `numpy.random.Generator`, seeded from `SamplingParams.seed`: a seeded
request gives the same tokens whatever else shares its batch. Logprobs are the log-softmax of the
raw logits, before penalties and temperature - what vLLM returns by default
(`logprobs_mode="raw_logprobs"`), and what the model itself believes.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minillm.generation.constrained import Guide, guided_pattern
from minillm.kernels.cpu import sampling as compiled

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)

# -----------------------------------------------------------------------------------------------
# Parameters


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop - vLLM's names, defaults and meanings.

    top_k -1 or 0 and top_p 1 switch those filters off; temperature 0 is greedy decoding.
    `stop` (strings) and `stop_token_ids` are normalised to lists. `max_tokens=None` means "until
    the context is full". `logprobs=N` returns the chosen token's logprob and the N most likely.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Structured output (vLLM's names): at most one; the output is then a full match of it.
    guided_regex: str | None = None
    guided_json: dict | str | None = None        # a JSON Schema (chapter 11 lists the subset)
    guided_choice: list[str] | None = None
    guided_json_object: bool = False             # any JSON object (OpenAI's json_object mode)

    def __post_init__(self):
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0",
                 self.temperature)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer >= -1 (-1 or 0: all tokens)",
                 self.top_k)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 "a number > 0 (1 = off)", self.repetition_penalty)
        _require(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _require(stop is None or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)),
                 "stop", "a non-empty string or a list of them", self.stop)
        self.stop = list(stop or [])
        ids = self.stop_token_ids
        _require(ids is None or (isinstance(ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in ids)),
                 "stop_token_ids", "a list of token ids (integers >= 0)", ids)
        self.stop_token_ids = list(ids or [])
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "True or False", self.ignore_eos)
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 "an integer >= 1 or None", self.max_tokens)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0",
                 self.min_tokens)
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _require(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
                 "an integer >= 0 or None", self.logprobs)
        _require(isinstance(self.guided_json_object, bool), "guided_json_object", "True or False",
                 self.guided_json_object)
        try:  # compile the constraint (a regex, or a JSON grammar) within a compile budget now: a bad one fails here
            self.guided_pattern = guided_pattern(self.guided_regex, self.guided_json, self.guided_choice,
                                                 self.guided_json_object)
        except ValueError as e:
            raise ValueError(f"{self.constraint_field} is not supported: {e}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def constraint_field(self) -> str:
        """The field that holds the request's constraint: what an error about it names."""
        return next((n for n in ("guided_regex", "guided_json", "guided_choice") if getattr(self, n) is not None),
                    "guided_json_object")


@dataclass
class SamplingState:
    """One sequence being sampled: its parameters, its history and its random generator.

    `output_ids` is the caller's list of generated ids (pass the request's own list and append
    each sampled token to it): penalties and min_tokens read it. `choice` numbers the n sequences
    of one request; choice i draws from seed + i, as vLLM seeds a request's n children.
    """
    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    choice: int = 0
    guide: Guide | None = None   # structured output: the allowed tokens of each step
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        seed = self.params.seed
        self.rng = np.random.default_rng(None if seed is None else (seed + self.choice) % 2**64)


@dataclass
class TokenLogprobs:
    """The chosen token's logprob, its rank (1 = most likely) and the top-N alternatives."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SampleResult:
    token_ids: np.ndarray                   # (B,) int64, one chosen token per row
    logprobs: list[TokenLogprobs | None]    # per row; None where params.logprobs is None
    errors: dict[int, str] = field(default_factory=dict)   # row -> why no token was allowed (its token is
                                                           # meaningless): that sequence cannot go on


# -----------------------------------------------------------------------------------------------
# The steps, each on a batch of rows: (B, V) logits and (B,) per-row parameters


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities along the last axis, in float64; -inf logits get probability 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))      # (..., V) the max entry is exp(0) = 1
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)         # (..., V)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def apply_penalties(logits: np.ndarray, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    presence: np.ndarray, frequency: np.ndarray, repetition: np.ndarray) -> np.ndarray:
    """Penalised copy of `logits` (B, V).

    repetition r (tokens in prompt or output): positive logits / r, negative ones * r;
    frequency f: minus f * (count in the output); presence p: minus p once per token in the output.
    """
    B, V = logits.shape
    counts = np.zeros((B, V))                           # (B, V) occurrences in the generated tokens
    seen = np.zeros((B, V), dtype=bool)                 # (B, V) in the prompt or the output
    for row in range(B):
        counts[row] = np.bincount(np.asarray(output_ids[row], dtype=np.int64), minlength=V)
        seen[row, np.asarray(prompt_ids[row], dtype=np.int64)] = True
    seen |= counts > 0
    r = np.asarray(repetition, dtype=np.float64)[:, None]          # (B, 1)
    out = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
    out -= np.asarray(frequency, dtype=np.float64)[:, None] * counts
    out -= np.asarray(presence, dtype=np.float64)[:, None] * (counts > 0)
    return out


def min_p_filter(logits: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Keep tokens with p >= min_p * p_max, per row; the rest get -inf."""
    probs = softmax(logits)                                                      # (B, V)
    threshold = np.asarray(min_p, dtype=np.float64)[:, None] * probs.max(axis=-1, keepdims=True)  # (B, 1)
    return np.where(probs >= threshold, logits, -np.inf)


def top_k_filter(logits: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Keep the k largest logits per row (and any tied with the k-th); k <= 0 keeps all."""
    out = np.array(logits, dtype=np.float64)            # (B, V)
    V = out.shape[-1]
    for row, k in enumerate(np.asarray(top_k)):
        if 0 < k < V:
            kth_largest = np.partition(out[row], V - k)[V - k]
            out[row, out[row] < kth_largest] = -np.inf
    return out


NUCLEUS_CANDIDATES = 256  # top_p_filter ranks this many tokens first, more only if they hold < top_p


def top_p_filter(logits: np.ndarray, top_p: float | np.ndarray) -> np.ndarray:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches top_p.

    `logits` (..., V); `top_p` a number or one per row (...). Walking down the tokens by
    probability, a token is kept while the mass of the tokens before it is still below top_p - so
    the token that crosses top_p is kept, and the most likely token always is. Ties are ranked by
    lower id first. Returns a copy with the dropped tokens at -inf.

    Sorting a 49k vocabulary costs milliseconds, more than a decode step's matvecs, and the nucleus
    is usually a few dozen tokens. So only the NUCLEUS_CANDIDATES most likely are ranked (`top_n`);
    if they hold at least top_p of the mass, no token below them can be kept. If not (a flat
    distribution), the candidates grow eightfold, up to the whole vocabulary.
    """
    logits = np.asarray(logits, dtype=np.float64)
    rows = logits.reshape(-1, logits.shape[-1])                                     # (R, V)
    top_p = np.broadcast_to(np.asarray(top_p, dtype=np.float64), logits.shape[:-1]).reshape(-1)  # (R,)
    out = np.full_like(rows, -np.inf)                                               # (R, V)
    for row, (x, p) in enumerate(zip(rows, top_p)):
        probs = softmax(x)                                                          # (V,)
        n = NUCLEUS_CANDIDATES
        while True:
            ranked = top_n(x, n)                                                    # (n,) most likely first
            mass_before = np.cumsum(probs[ranked]) - probs[ranked]                  # (n,) mass ranked above
            if len(ranked) == x.size or mass_before[-1] + probs[ranked[-1]] >= p:
                break
            n *= 8
        kept = ranked[mass_before < p]
        out[row, kept] = x[kept]
    return out.reshape(logits.shape)


def top_n(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, largest first, ties to the lower index.

    The same as np.argsort(-values, kind="stable")[:n] without sorting the whole vocabulary:
    partition finds the n-th largest value, and only the candidates at or above it are sorted.
    """
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    n = min(n, values.size)
    nth_largest = np.partition(values, values.size - n)[values.size - n]
    candidates = np.flatnonzero(values >= nth_largest)                       # ascending ids, ties included
    return candidates[np.argsort(-values[candidates], kind="stable")][:n]


def draw(logits: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """One token per row from softmax(logits), by inverting the CDF at a uniform u in [0, 1).

    With weights w and cumulative sums c, token j is chosen when c[j-1] <= u * c[-1] < c[j]:
    a token of weight 0 has c[j] = c[j-1] and can never be chosen. u < 1 keeps u * c[-1] below
    c[-1] even after rounding, so the index stays inside the vocabulary.
    """
    x = np.asarray(logits, dtype=np.float64)
    weights = np.exp(x - x.max(axis=-1, keepdims=True))                      # (B, V) unnormalised
    cdf = np.cumsum(weights, axis=-1)                                        # (B, V)
    target = np.asarray(uniforms, dtype=np.float64) * cdf[:, -1]             # (B,)
    return (cdf <= target[:, None]).sum(axis=-1)                             # (B,) first c[j] > target


def filter_chain(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Temperature, then min_p, top_k and top_p, each on the rows that use it -> (R, V): the
    specification the compiled filters (kernels/cpu/sampling.py) are checked against."""
    x = x / np.array([p.temperature for p in params])[:, None]             # (R, V)
    for name, filter_, off in (("min_p", min_p_filter, 0), ("top_k", top_k_filter, 0), ("top_p", top_p_filter, 1)):
        values = np.array([getattr(p, name) for p in params])               # (R,)
        if (use := values != off).any():                                    # sorts cost: only where asked for
            x[use] = filter_(x[use], values[use])
    return x


SPEC_FILTERS = (min_p_filter, top_k_filter, top_p_filter)


def filters_replaced() -> bool:
    """Whether a filter function of this module was replaced (the course seats a learner's there):
    then the Sampler runs ``filter_chain`` through the replacements, not the compiled kernel."""
    return (min_p_filter, top_k_filter, top_p_filter) != SPEC_FILTERS


def mask_tokens(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A copy of one row of logits (V,) with every token outside `allowed` (K,) at -inf: the
    structured-output mask. Building the row from the K allowed entries costs O(V) once."""
    out = np.full(logits.shape, -np.inf)                                     # (V,)
    out[allowed] = logits[allowed]
    return out


# -----------------------------------------------------------------------------------------------
# The batched sampler


def _argmax_only(state: SamplingState) -> bool:
    """Greedy with nothing that changes the logits first (penalties, min_tokens) and no logprobs."""
    p = state.params
    return (p.greedy and p.logprobs is None and len(state.output_ids) >= p.min_tokens
            and not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1))


def _adjusts_logits(state: SamplingState) -> bool:
    """Whether ``Sampler._adjusted`` changes this row: min_tokens still masking, a structured-output
    guide, or a penalty."""
    p = state.params
    return (state.guide is not None or len(state.output_ids) < p.min_tokens
            or bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1))


class Sampler:
    """Samples one token for each row of a (B, V) logits batch, each row with its own parameters."""

    def __init__(self, eos_token_ids: Iterable[int] = ()):
        self.eos_token_ids = tuple(eos_token_ids)  # masked by min_tokens unless ignore_eos

    def sample(self, logits: np.ndarray, states: Sequence[SamplingState]) -> SampleResult:
        raw = np.asarray(logits)
        if raw.ndim != 2 or raw.shape[0] != len(states):
            raise ValueError(f"logits must be (batch, vocab) with one row per state; got {raw.shape} "
                             f"for {len(states)} states")
        if all(_argmax_only(s) for s in states):
            # The greedy fast path: argmax of the raw logits is the whole answer. It skips the
            # float64 copy of the (B, V) logits and the per-row pipeline: at B = 1 on SmolLM2
            # (V = 49152) the general path takes ~30 us, this one ~5 us.
            chosen, errors = np.argmax(raw, axis=-1), {}                        # (B,) ties: lowest id
            for row, state in enumerate(states):
                if state.guide is not None:  # the argmax among the allowed (sorted: ties to the lowest id)
                    allowed = state.guide.allowed()                             # (K,)
                    if allowed.size:
                        chosen[row] = allowed[np.argmax(raw[row, allowed])]
                    else:
                        errors[row] = self._why_stuck(state)
            return SampleResult(chosen, [None] * len(states), errors)
        params = [s.params for s in states]
        # Rows nothing adjusts are read as they are (the compiled draw reads float32): no float64
        # copy of the batch, one pass over the logits fewer in a step whose caches are cold.
        x = self._adjusted(raw, states) if any(map(_adjusts_logits, states)) else raw  # (B, V)
        # A row the constraint and min_tokens leave no token: its sequence alone ends (the engine
        # finishes it with an error), instead of drawing a token that breaks the constraint.
        errors = {row: self._why_stuck(state) for row, state in enumerate(states)
                  if (state.guide is not None or len(state.output_ids) < state.params.min_tokens)
                  and np.isneginf(x[row]).all()}

        rows = [i for i, p in enumerate(params) if not p.greedy and i not in errors]
        if len(rows) == len(states):  # every row draws: no argmax, no copy of the rows
            chosen = self._sample_random(x, states)                             # (B,)
        else:
            # Every row's argmax (first max: lowest id) is the greedy rows' answer; the others are
            # drawn below. Cheaper than first copying the greedy rows out of a (B, V) array.
            chosen = np.argmax(x, axis=-1)                                      # (B,)
            if rows:
                chosen[rows] = self._sample_random(x[rows], [states[i] for i in rows])
        return SampleResult(chosen, self.logprobs(raw, chosen, params), errors)

    def stuck(self, logits: np.ndarray, state: SamplingState) -> str | None:
        """Why no token may continue ``state`` at this (1, V) row, or None (``sample`` would draw one)."""
        if state.guide is None and len(state.output_ids) >= state.params.min_tokens:
            return None
        return self._why_stuck(state) if np.isneginf(self._adjusted(np.asarray(logits), [state])[0]).all() else None

    @staticmethod
    def _why_stuck(state: SamplingState) -> str:
        """The message for a sequence that no token may continue."""
        p, done = state.params, len(state.output_ids)
        if state.guide is None:
            return (f"min_tokens = {p.min_tokens}: the tokens it masks before {p.min_tokens} tokens (EOS and "
                    f"stop_token_ids) leave no token to draw")
        if not state.guide.allowed().size:
            return f"{p.constraint_field}: the constraint allows no token after {done} tokens"
        return (f"min_tokens = {p.min_tokens}: after {done} tokens the constraint allows only the end of the text, "
                f"which min_tokens forbids before {p.min_tokens} tokens (a shorter min_tokens, or a constraint "
                f"with longer texts, would do)")

    def probabilities(self, logits: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
        """The distribution ``sample`` draws each row's token from -> (B, V) float64.

        Speculative sampling needs the target's distribution itself, not one draw from it. A
        greedy row is a point mass on the token ``sample`` picks.
        """
        x = self._adjusted(np.asarray(logits), states)                          # (B, V)
        probs = np.zeros_like(x)                                                # (B, V)
        greedy = np.array([s.params.greedy for s in states])                    # (B,)
        probs[greedy, np.argmax(x[greedy], axis=-1)] = 1.0
        if (~greedy).any():
            probs[~greedy] = softmax(self._filtered(x[~greedy], [s for s in states if not s.params.greedy]))
        return probs

    def _adjusted(self, raw: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
        """The logits after min_tokens, the structured-output mask and the penalties -> (B, V) float64."""
        params = [s.params for s in states]
        x = self._mask_stop_tokens(raw.astype(np.float64), states)              # (B, V)
        for row, state in enumerate(states):
            if state.guide is not None:
                x[row] = mask_tokens(x[row], state.guide.allowed())
        penalised = [i for i, p in enumerate(params)
                     if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1]
        if penalised:
            x[penalised] = compiled.apply_penalties(
                x[penalised], [states[i].prompt_ids for i in penalised], [states[i].output_ids for i in penalised],
                np.array([params[i].presence_penalty for i in penalised]),
                np.array([params[i].frequency_penalty for i in penalised]),
                np.array([params[i].repetition_penalty for i in penalised]))
        return x

    def _mask_stop_tokens(self, x: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
        """min_tokens: the request may not end before it has produced min_tokens tokens."""
        for row, state in enumerate(states):
            p = state.params
            if len(state.output_ids) < p.min_tokens:
                stops = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
                if any(i >= x.shape[1] for i in stops):
                    raise ValueError(f"stop token ids {stops} reach outside the vocabulary ({x.shape[1]} tokens)")
                x[row, stops] = -np.inf
        return x

    @staticmethod
    def _sample_random(x: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
        """_filtered, then draw, compiled in one pass (kernels/cpu/sampling.py: the same tokens)."""
        if filters_replaced():
            uniforms = np.array([s.rng.random() for s in states])              # (R,) one draw per row
            return draw(filter_chain(x, [s.params for s in states]), uniforms)
        settings = np.array([(s.params.temperature, s.params.min_p, s.params.top_k, s.params.top_p, s.rng.random())
                             for s in states])                                 # (R, 5) as compiled.SETTINGS
        return compiled.draw_rows(x, settings)

    @staticmethod
    def _filtered(x: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
        """Temperature, then min_p, top_k and top_p, on rows that sample at random -> (R, V).
        Compiled (kernels/cpu/sampling.py); ``filter_chain`` is its specification."""
        params = [s.params for s in states]
        if filters_replaced():
            return filter_chain(x, params)
        return compiled.filter_rows(x, *Sampler._filter_parameters(params))

    @staticmethod
    def _filter_parameters(params: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
        """(temperature, min_p, top_k, top_p), each (R,)."""
        return tuple(np.array([getattr(p, name) for p in params])
                     for name in ("temperature", "min_p", "top_k", "top_p"))

    @staticmethod
    def logprobs(raw: np.ndarray, chosen: np.ndarray, params: Sequence[SamplingParams]) -> list:
        """Each row's chosen token and top candidates under the raw logits (B, V), for rows that asked.

        Public because a token may be chosen elsewhere (a speculative verify's accept rule) and
        still owes the caller the logprobs plain sampling would have reported.
        """
        out: list[TokenLogprobs | None] = [None] * len(params)
        for row, p in enumerate(params):
            if p.logprobs is None:
                continue
            lp = log_softmax(raw[row])                                         # (V,)
            token = int(chosen[row])
            top = top_n(lp, p.logprobs)                                        # (N,) most likely first
            out[row] = TokenLogprobs(token_id=token, logprob=float(lp[token]), rank=int((lp > lp[token]).sum()) + 1,
                                     top_ids=top.tolist(), top_logprobs=lp[top].tolist())
        return out

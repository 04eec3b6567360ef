"""What a cheaper model costs in quality: next-token distributions compared with a reference.

A quantization format or an activation mode is judged on the model's output, not on the weights'
RMS error: over a held-out text, fed one token at a time, each position's logits give

- perplexity: exp(mean negative log-likelihood of the text's actual next tokens); lower is better;
- KL divergence KL(reference || candidate) of the next-token distributions, in nats: how much
  probability mass moved, even where the top token did not change;
- top-1 agreement: the share of positions where both pick the same most likely token (what greedy
  decoding sees).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(T, V) logits -> (T, V) log-probabilities, in float64 so that tiny KLs are not rounding noise."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, token_ids) -> float:
    """exp(mean NLL) of token_ids[1:] under logits[:-1] (row t predicts token t + 1)."""
    ids = np.asarray(token_ids)
    if logits.shape[0] != len(ids) or len(ids) < 2:
        raise ValueError(f"need one logits row per token and at least 2 tokens, got {logits.shape} for {len(ids)} ids")
    logp = log_softmax(logits[:-1])                                   # (T - 1, V)
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


@dataclass(frozen=True)
class Agreement:
    mean_kl: float       # nats, averaged over positions
    max_kl: float
    top1: float          # share of positions with the same argmax, 0..1
    positions: int


def agreement(reference: np.ndarray, candidate: np.ndarray) -> Agreement:
    """KL(reference || candidate) per position and top-1 agreement of two (T, V) logits arrays."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logits shapes differ: {reference.shape} vs {candidate.shape}")
    p_log, q_log = log_softmax(reference), log_softmax(candidate)      # (T, V) each
    kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)               # (T,)
    same = reference.argmax(axis=-1) == candidate.argmax(axis=-1)     # (T,)
    return Agreement(float(kl.mean()), float(kl.max()), float(same.mean()), len(kl))

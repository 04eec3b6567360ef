"""The quality measures of minillm.model.quality against PyTorch's own definitions."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minillm.model.quality import agreement, perplexity


def logits(seed, T=7, V=50, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((T, V)) * scale).astype(np.float32)


def test_perplexity_is_exp_of_torch_cross_entropy():
    x, ids = logits(0), np.random.default_rng(1).integers(0, 50, 7)
    want = torch.exp(F.cross_entropy(torch.tensor(x[:-1], dtype=torch.float64), torch.tensor(ids[1:]))).item()
    assert perplexity(x, ids) == pytest.approx(want, rel=1e-9)


def test_kl_and_top1_match_torch():
    p, q = logits(2), logits(3)
    q[:3] = p[:3] + 0.01  # three positions nearly equal: same argmax
    want = F.kl_div(torch.log_softmax(torch.tensor(q, dtype=torch.float64), -1),
                    torch.log_softmax(torch.tensor(p, dtype=torch.float64), -1),
                    log_target=True, reduction="none").sum(-1).numpy()
    got = agreement(p, q)
    assert got.mean_kl == pytest.approx(want.mean(), rel=1e-9)
    assert got.max_kl == pytest.approx(want.max(), rel=1e-9)
    assert got.top1 == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean())
    assert agreement(p, p).mean_kl == pytest.approx(0.0, abs=1e-12)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="shapes differ"):
        agreement(logits(0), logits(0, T=6))
    with pytest.raises(ValueError, match="one logits row per token"):
        perplexity(logits(0), [1, 2])

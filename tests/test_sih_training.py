"""SIH's training target: a head learns a token's expected importance (Poisson regression), so the
tokens it ranks lowest cost little even when the importance is heavy-tailed and noisy."""
import torch

from zeroedge.export.calibrate import per_sequence_normalised, train_sih
from zeroedge.export.importance import spearman


def _tokens(n, w, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w.shape[0], generator=g)
    mean = torch.exp(2.0 * torch.tanh(x @ w))                     # expected importance, a function of x
    noise = torch.empty(n).exponential_(generator=g)
    spikes = torch.where(torch.rand(n, generator=g) < 0.02, 30.0, 1.0)     # rare, 30x outliers
    return x, mean, mean * noise * spikes


def test_head_ranks_tokens_by_expected_importance():
    w = torch.randn(32, generator=torch.Generator().manual_seed(0)) / 32 ** 0.5
    x, _, imp = _tokens(8000, w, 1)
    head = train_sih(x, imp / imp.mean(), width=10, steps=600, seed=0)
    xt, mean_t, _ = _tokens(4000, w, 2)
    with torch.no_grad():
        score = head.logits(xt)
    assert spearman(score, mean_t) > 0.85
    # skipping the 30 % it ranks lowest costs under half of what 30 % at random costs
    k = int(0.3 * len(score))
    assert mean_t[score.argsort()[:k]].sum() < 0.5 * mean_t.mean() * k


def test_each_sequence_divided_by_its_own_mean():
    v = torch.tensor([1.0, 3.0, 10.0, 30.0, 5.0])
    out = per_sequence_normalised(v, rows=2)
    assert torch.allclose(out, torch.tensor([0.5, 1.5, 0.5, 1.5, 1.0]))

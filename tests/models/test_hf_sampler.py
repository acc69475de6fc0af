"""The hf: backend's batched sampler draws from the (top-p truncated) tempered distribution."""

import torch

from closedloop.models.hf import HFClient


def test_inverse_cdf_draws_match_the_distribution_and_top_p_support():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(2, 40, generator=gen) * 1.5, dim=-1)
    n = 100_000
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    rows = logp.repeat_interleave(n // 2, dim=0)
    top_p = torch.tensor([[1.0], [0.6]]).repeat_interleave(n // 2, dim=0)
    tokens = HFClient._draw(rows, top_p, u).view(2, n // 2)
    p = logp.double().exp()
    for r, cut in enumerate((1.0, 0.6)):
        sp, order = torch.sort(p[r], descending=True)
        keep = (sp.cumsum(0) - sp) < cut
        q = torch.zeros_like(p[r])
        q[order[keep]] = sp[keep]
        q /= q.sum()
        freq = torch.bincount(tokens[r], minlength=40).double() / (n // 2)
        assert (freq[q == 0] == 0).all(), "drew a token outside the top-p set"
        sigma = (q * (1 - q) / (n // 2)).sqrt()
        assert ((freq - q).abs() <= 5 * sigma + 1e-12).all(), (freq - q).abs().max()


def test_a_uniform_at_the_top_never_picks_an_excluded_token():
    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, -1.0, -50.0]]), dim=-1)
    almost_one = torch.tensor([1.0 - 2 ** -53], dtype=torch.float64)
    assert int(HFClient._draw(logp, torch.tensor([[0.5]]), almost_one)) == 0  # top-p keeps only token 0
    assert int(HFClient._draw(logp, None, almost_one)) in {2, 3}

"""Evaluation pieces: probes, kNN, effective rank (eq. 6), samplers, FID message, PNG grids."""

import math

import pytest
import torch

from dres.eval import (VPSDE, FIDUnavailable, dpm_solver, effective_rank, euler_maruyama, frechet_distance,
                       knn_accuracy, linear_probe, load_inception, make_grid, save_grid, tsne_plot)


def _blobs(n=600, d=16, c=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(c, d, generator=g) * 3
    y = torch.randint(0, c, (n,), generator=g)
    return centers[y] + torch.randn(n, d, generator=g), y


def test_linear_probe_and_knn_separate_blobs_and_fail_on_noise():
    x, y = _blobs()
    r = linear_probe(x[:400], y[:400], x[400:], y[400:], epochs=30, batch_size=128)
    assert r["linear_probe_acc"] > 0.95
    assert knn_accuracy(x[:400], y[:400], x[400:], y[400:], k=20) > 0.95
    noise = torch.randn_like(x)
    r = linear_probe(noise[:400], y[:400], noise[400:], y[400:], epochs=30, batch_size=128)
    assert r["linear_probe_acc"] < 0.45  # chance is 0.2


def test_effective_rank_eq6():
    g = torch.Generator().manual_seed(0)
    iso = torch.randn(20000, 8, generator=g)
    assert effective_rank(iso)["effective_rank"] == pytest.approx(8, rel=0.05)
    one = torch.randn(500, 1, generator=g) * torch.randn(1, 8, generator=g)
    assert effective_rank(one)["effective_rank"] == pytest.approx(1.0, abs=1e-3)
    # two equal directions: entropy log 2
    two = torch.cat([torch.randn(20000, 2, generator=g), torch.zeros(20000, 6)], 1)
    assert effective_rank(two)["entropy"] == pytest.approx(math.log(2), rel=0.02)


class _GaussianEps(torch.nn.Module):
    """The exact noise prediction for data x0 ~ N(mu, s^2 I): eps = sigma_t (x - a_t mu) / (a_t^2 s^2 + sigma_t^2)."""

    def __init__(self, sde, mu, s):
        super().__init__()
        self.sde, self.mu, self.s = sde, mu, s

    def forward(self, x, t999):
        t = t999[0].item() / 999
        a, sig = self.sde.alpha_sigma(t)
        return sig * (x - a * self.mu) / (a ** 2 * self.s ** 2 + sig ** 2)


@pytest.mark.parametrize("sampler,steps", [(dpm_solver, 20), (euler_maruyama, 200)])
def test_samplers_recover_gaussian_data_distribution(sampler, steps):
    sde = VPSDE()
    net = _GaussianEps(sde, mu=0.7, s=0.3)
    x = sampler(net, (4000, 1, 2, 2), sde, steps=steps, generator=torch.Generator().manual_seed(0))
    assert x.mean().item() == pytest.approx(0.7, abs=0.03)
    assert x.std().item() == pytest.approx(0.3, abs=0.04)


def test_vpsde_log_snr_inverse():
    sde = VPSDE()
    for t in (1e-3, 0.1, 0.5, 1.0):
        assert sde.t_of_lambda(sde.lam(t)) == pytest.approx(t, rel=1e-6)


def test_fid_needs_weights_path_with_clear_message(tmp_path):
    with pytest.raises(FIDUnavailable, match="no Inception weights given"):
        load_inception("")
    with pytest.raises(FIDUnavailable, match="not found"):
        load_inception(str(tmp_path / "inception.pt"))
    import numpy as np

    mu, cov = np.zeros(3), np.eye(3)
    assert frechet_distance(mu, cov, mu, cov) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(mu, cov, mu + 1, cov) == pytest.approx(3.0, abs=1e-6)


def test_grids_and_tsne_png(tmp_path):
    imgs = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8)
    g = make_grid(imgs, nrow=4, pad=1)
    assert g.shape == (3 * 9 + 1, 4 * 9 + 1, 3)
    assert (g[1:9, 1:9] == imgs[0].permute(1, 2, 0).numpy()).all()
    p = save_grid(imgs, tmp_path / "g.png")
    from PIL import Image

    assert Image.open(p).size == ((8 * 9 + 1) * 8, (2 * 9 + 1) * 8)  # 8 per row, 8x8 tiles enlarged 8x
    x, y = _blobs(200)
    tsne_plot(x, y, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000

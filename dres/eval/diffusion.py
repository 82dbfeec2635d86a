"""Continuous VP-SDE (linear beta from 0.1 to 20, as U-ViT / score_sde) with noise-prediction
training and two samplers: Euler-Maruyama on the reverse SDE and DPM-Solver (2nd order, singlestep,
uniform in log-SNR).

The network is called as ``net(x, t * 999, y)`` — U-ViT's convention for continuous time.
"""

from __future__ import annotations

import math

import torch


class VPSDE:
    def __init__(self, beta_min=0.1, beta_max=20.0):
        self.b0, self.b1 = beta_min, beta_max

    def beta(self, t):
        return self.b0 + t * (self.b1 - self.b0)

    def log_mean_coeff(self, t):
        return -0.25 * t ** 2 * (self.b1 - self.b0) - 0.5 * t * self.b0

    def alpha_sigma(self, t):
        lm = self.log_mean_coeff(t)
        a = torch.exp(lm) if torch.is_tensor(lm) else math.exp(lm)
        s = torch.sqrt(1 - a ** 2) if torch.is_tensor(a) else math.sqrt(1 - a ** 2)
        return a, s

    def lam(self, t):
        a, s = self.alpha_sigma(t)
        return (torch.log(a) - torch.log(s)) if torch.is_tensor(a) else math.log(a) - math.log(s)

    def t_of_lambda(self, lam):
        """Inverse of log-SNR for the linear schedule (closed form)."""
        tmp = 2 * (self.b1 - self.b0) * math.log1p(math.exp(-2 * lam))
        return tmp / (math.sqrt(self.b0 ** 2 + tmp) + self.b0) / (self.b1 - self.b0)

    def perturb(self, x0, t, noise):
        a, s = self.alpha_sigma(t)
        return a.view(-1, 1, 1, 1) * x0 + s.view(-1, 1, 1, 1) * noise


def noise_prediction_loss(net, x0, sde: VPSDE, y=None, eps=1e-5):
    """MSE between the added noise and the prediction at a uniform time in (eps, 1]."""
    b = x0.shape[0]
    t = torch.rand(b, device=x0.device) * (1 - eps) + eps
    noise = torch.randn_like(x0)
    xt = sde.perturb(x0, t, noise)
    pred = net(xt, t * 999, y) if y is not None else net(xt, t * 999)
    return (pred.float() - noise.float()).pow(2).mean()


def _eps(net, x, t, y):
    tt = torch.full((x.shape[0],), float(t), device=x.device)
    return (net(x, tt * 999, y) if y is not None else net(x, tt * 999)).float()


@torch.no_grad()
def euler_maruyama(net, shape, sde: VPSDE, steps=1000, y=None, device="cpu", eps=1e-3, generator=None):
    """Reverse SDE ``dx = [-beta/2 x - beta * score] dt + sqrt(beta) dw`` with score = -eps/sigma,
    from t=1 to ``eps``; the last step returns the mean (no noise)."""
    x = torch.randn(shape, device=device, generator=generator)
    ts = torch.linspace(1.0, eps, steps + 1).tolist()
    for i in range(steps):
        t, dt = ts[i], ts[i] - ts[i + 1]
        _, s = sde.alpha_sigma(t)
        beta = sde.beta(t)
        score = -_eps(net, x, t, y) / s
        mean = x + (0.5 * beta * x + beta * score) * dt
        x = mean + (math.sqrt(beta * dt) * torch.randn(shape, device=device, generator=generator)
                    if i < steps - 1 else 0)
    return x


@torch.no_grad()
def dpm_solver(net, shape, sde: VPSDE, steps=50, y=None, device="cpu", eps=1e-3, generator=None):
    """DPM-Solver-2 (singlestep, r=1/2) with ``steps`` network evaluations (steps//2 2nd-order
    steps, plus a 1st-order one when odd), time steps uniform in log-SNR from t=1 to ``eps``."""
    x = torch.randn(shape, device=device, generator=generator)
    n2, n1 = steps // 2, steps % 2
    lams = torch.linspace(sde.lam(1.0), sde.lam(eps), n2 + n1 + 1).tolist()
    ts = [sde.t_of_lambda(lv) for lv in lams]
    ts[0], ts[-1] = 1.0, eps
    for i in range(n2 + n1):
        s, t = ts[i], ts[i + 1]
        a_s, s_s = sde.alpha_sigma(s)
        a_t, s_t = sde.alpha_sigma(t)
        h = lams[i + 1] - lams[i]
        e_s = _eps(net, x, s, y)
        if i < n2:
            lm = lams[i] + 0.5 * h
            s1 = sde.t_of_lambda(lm)
            a_1, s_1 = sde.alpha_sigma(s1)
            u = (a_1 / a_s) * x - s_1 * math.expm1(0.5 * h) * e_s
            x = (a_t / a_s) * x - s_t * math.expm1(h) * _eps(net, u, s1, y)
        else:  # DDIM / DPM-Solver-1
            x = (a_t / a_s) * x - s_t * math.expm1(h) * e_s
    return x

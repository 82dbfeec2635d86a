"""U-ViT diffusion training (continuous VP-SDE, noise prediction, EMA) and evaluation: a sample
grid (DPM-Solver or Euler-Maruyama), a linear probe of features at a chosen block and noise level,
and FID when the Inception weights are given.

    dres-train uvit --preset uvit_cifar10
"""

from __future__ import annotations

import sys

import torch

from dres.train.common import eval_loader, features, model_kwargs


class UViTTask:
    name = "uvit"

    def __init__(self):
        from dres.eval import VPSDE

        self.sde = VPSDE()

    def build_model(self, cfg):
        from dres.models import UViT

        return UViT(**model_kwargs(UViT, cfg))

    def _labels(self, cfg, batch):
        return batch["label"] if cfg.model.num_classes > 0 else None

    def loss(self, model, batch, cfg):
        from dres.eval import noise_prediction_loss

        return noise_prediction_loss(model, batch["image"], self.sde, y=self._labels(cfg, batch)), {}

    def evaluate(self, tr) -> dict:
        from dres.eval import FIDUnavailable, dpm_solver, euler_maruyama, linear_probe, save_grid, to_uint8
        from dres.eval import fid as fid_fn

        cfg, e, d = tr.cfg, tr.cfg.eval, tr.cfg.data
        model = tr.full_state_copy()  # EMA weights when kept
        if not tr.main:
            return {}
        model.eval()
        res = {}
        mean, std = (d.mean, d.std) if d.normalize else (None, None)
        shape = (e.n_samples, d.in_chans, d.img_size, d.img_size)
        g = torch.Generator(device=tr.device).manual_seed(cfg.seed)
        y = (torch.arange(e.n_samples, device=tr.device) % cfg.model.num_classes) if cfg.model.num_classes > 0 else None
        sampler = dpm_solver if e.sampler == "dpm" else euler_maruyama
        with tr.autocast():
            x = sampler(model, shape, self.sde, steps=e.steps, y=y, device=tr.device, generator=g)
        res["samples_png"] = save_grid(to_uint8(x, mean, std), tr.out / f"samples_step{tr.step}_{e.sampler}{e.steps}.png")
        if e.probe:
            train, val = eval_loader(tr, "train", 256), eval_loader(tr, "val", 256)
            if train is not None and val is not None:
                def fn(img):
                    # a fixed noise draw per batch position keeps the probe deterministic
                    gen = torch.Generator(device=img.device).manual_seed(cfg.seed + 17)
                    noise = torch.randn(img.shape, generator=gen, device=img.device)
                    t = torch.full((img.shape[0],), e.probe_t, device=img.device)
                    xt = self.sde.perturb(img, t, noise)
                    block = e.probe_block if e.probe_block >= 0 else model.num_in_blocks
                    return model.features(xt, t * 999, block)

                xtr, ytr = features(tr, fn, train, e.max_train)
                xte, yte = features(tr, fn, val, e.max_test)
                r = linear_probe(xtr, ytr, xte, yte, epochs=e.probe_epochs, lr=e.probe_lr, batch_size=e.probe_batch,
                                 num_classes=d.num_classes, seed=cfg.seed, device=tr.device)
                res.update({f"probe_t{e.probe_t}_" + k: v for k, v in r.items()})
        try:
            if not e.fid_inception:
                raise FIDUnavailable("FID skipped: no Inception weights given (set eval.fid_inception=/path/to/"
                                     "inception-2015-12-05.pt, the TorchScript FID Inception of StyleGAN2-ADA/EDM)")
            val = eval_loader(tr, "val", 500)
            real = torch.cat([to_uint8(b["image"], mean, std) for b in val.eval_batches(500)])[:e.fid_samples]
            fakes, n = [], 0
            while n < e.fid_samples:
                b = min(500, e.fid_samples - n)
                yb = (torch.arange(b, device=tr.device) % cfg.model.num_classes) if y is not None else None
                with tr.autocast():
                    xs = sampler(model, (b,) + shape[1:], self.sde, steps=e.steps, y=yb, device=tr.device)
                fakes.append(to_uint8(xs, mean, std))
                n += b
            res[f"fid_{e.sampler}{e.steps}"] = fid_fn(e.fid_inception, torch.cat(fakes), real, device=tr.device)
        except FIDUnavailable as err:
            tr.log(f"[dres] {err}")
        return res


TASK = UViTTask()


def main(argv=None):
    from dres.train.cli import main as cli_main

    return cli_main(["uvit"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())

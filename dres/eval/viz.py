"""Image grids (samples, MAE reconstructions) and a t-SNE plot, written as PNG files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dres.optional import import_optional


def to_uint8(x: torch.Tensor, mean=None, std=None) -> torch.Tensor:
    """Undo normalisation (if given) and map [0, 1] floats to uint8 (B, C, H, W)."""
    x = x.detach().float().cpu()
    if mean is not None:
        c = x.shape[1]
        x = x * torch.tensor(std[:c]).view(1, -1, 1, 1) + torch.tensor(mean[:c]).view(1, -1, 1, 1)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


def make_grid(images: torch.Tensor, nrow: int = 8, pad: int = 1, scale: int = 1) -> np.ndarray:
    """uint8 (B, C, H, W) -> (H', W', 3) uint8 mosaic with ``pad`` white pixels between tiles."""
    b, c, h, w = images.shape
    if c == 1:
        images = images.expand(b, 3, h, w)
    ncol = min(nrow, b)
    nr = (b + ncol - 1) // ncol
    out = np.full((nr * (h + pad) + pad, ncol * (w + pad) + pad, 3), 255, np.uint8)
    for i in range(b):
        r, q = divmod(i, ncol)
        out[pad + r * (h + pad):pad + r * (h + pad) + h, pad + q * (w + pad):pad + q * (w + pad) + w] = \
            images[i, :3].permute(1, 2, 0).numpy()
    if scale > 1:
        out = out.repeat(scale, 0).repeat(scale, 1)
    return out


def save_png(array: np.ndarray, path) -> str:
    from PIL import Image

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return str(path)


def label_columns(grid: np.ndarray, labels: list[str], ncol: int) -> np.ndarray:
    """``grid`` (H, W, 3) with a white strip above it naming each of its ``ncol`` columns."""
    from PIL import Image, ImageDraw, ImageFont

    width = grid.shape[1] // ncol
    size = max(9, min(14, width // 7))
    try:
        font = ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one fixed-size bitmap font
        font = ImageFont.load_default()
    lines = [_fit(label, font, width - 4) for label in labels]
    height = max(len(ls) for ls in lines) * (size + 2) + 4
    strip = Image.new("RGB", (grid.shape[1], height), "white")
    draw = ImageDraw.Draw(strip)
    for i, ls in enumerate(lines):
        for j, text in enumerate(ls):
            w = draw.textlength(text, font=font)
            draw.text((i * width + (width - w) / 2, 2 + j * (size + 2)), text, fill="black", font=font)
    return np.concatenate([np.asarray(strip), grid])


def _fit(label: str, font, width: int) -> list[str]:
    """``label`` broken into lines of at most ``width`` pixels at word boundaries."""
    lines = []
    for word in label.split():
        if lines and font.getlength(lines[-1] + " " + word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def save_grid(images_uint8: torch.Tensor, path, nrow=8, scale=None, column_labels=None) -> str:
    """``images_uint8`` as a mosaic of ``nrow`` columns, titled by ``column_labels`` when given."""
    h = images_uint8.shape[-1]
    scale = scale or max(1, 64 // h)  # small images (8..32 px) are enlarged to be legible
    grid = make_grid(images_uint8, nrow=nrow, scale=scale)
    if column_labels:
        grid = label_columns(grid, column_labels, min(nrow, len(images_uint8)))
    return save_png(grid, path)


@torch.no_grad()
def mae_reconstruction_grid(model, imgs: torch.Tensor, path, mean=None, std=None, mask_ratio=None, n=8) -> str:
    """Rows of (original, masked input, reconstruction, reconstruction with visible patches pasted)
    for ``n`` images, as in the MAE paper's figures. The prediction is un-normalised with each
    patch's own mean/var when the model was trained with norm-pix loss."""
    imgs = imgs[:n]
    loss, pred, mask = model(imgs, mask_ratio=mask_ratio) if mask_ratio is not None else model(imgs)
    target = model.patchify(imgs)
    if getattr(model, "norm_pix_loss", False):
        mu, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        pred = pred * (var + 1e-6) ** 0.5 + mu
    m = mask.unsqueeze(-1).to(pred.dtype)
    masked = model.unpatchify(target * (1 - m))
    recon = model.unpatchify(pred.to(target.dtype))
    paste = model.unpatchify(target * (1 - m) + pred.to(target.dtype) * m)
    rows = []
    for t in (imgs, masked, recon, paste):
        rows.append(to_uint8(t, mean, std))
    hidden = model.unpatchify(m.expand_as(target).float()).cpu() > 0.5  # masked patches shown grey
    rows[1] = torch.where(hidden, torch.full_like(rows[1], 128), rows[1])
    grid = torch.cat([torch.stack([r[i] for r in rows]) for i in range(len(imgs))])
    hidden_pct = round(100 * float(mask[0].float().mean()))
    labels = ["original", f"masked ({hidden_pct}% hidden)", "reconstruction", "reconstruction + visible"]
    return save_grid(grid, path, nrow=4, column_labels=labels)


def pyplot():
    """matplotlib.pyplot drawing to files (Agg); an optional dependency, the ``[plots]`` extra."""
    matplotlib = import_optional("matplotlib", "plots", "drawing plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tsne_plot(features: torch.Tensor, labels: torch.Tensor, path, max_points=2000, seed=0, title="") -> str:
    """A 2-D t-SNE of (the first ``max_points``) ``features`` coloured by label, under ``title`` (what
    model, step and scores it shows) and a line counting the points."""
    from sklearn.manifold import TSNE

    plt = pyplot()

    f, y = features[:max_points].float().numpy(), labels[:max_points].numpy()
    emb = TSNE(n_components=2, init="pca", random_state=seed, perplexity=min(30, max(5, len(f) // 4))).fit_transform(f)
    fig, ax = plt.subplots(figsize=(6, 6))
    sc = ax.scatter(emb[:, 0], emb[:, 1], c=y, cmap="tab10", s=4)
    ax.legend(*sc.legend_elements(), loc="best", fontsize=6, markerscale=0.7)
    ax.set_title((f"{title}\n" if title else "") + f"t-SNE of {len(f)} points", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def probe_grid_plot(rows: list[dict], path, title: str = "") -> str:
    """A heat map of ``linear_probe_acc`` over (noise level ``t``, ``block``) from ``rows`` of a probe grid,
    each cell labelled with its accuracy, under ``title``."""
    plt = pyplot()

    blocks = sorted({r["block"] for r in rows})
    ts = sorted({r["t"] for r in rows})
    acc = np.full((len(ts), len(blocks)), np.nan)
    for r in rows:
        acc[ts.index(r["t"]), blocks.index(r["block"])] = r["linear_probe_acc"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(blocks), 1.2 + 0.6 * len(ts)))
    im = ax.imshow(acc, cmap="viridis", aspect="auto")
    for i in range(len(ts)):
        for j in range(len(blocks)):
            ax.text(j, i, f"{acc[i, j]:.3f}", ha="center", va="center", fontsize=7,
                    color="white" if acc[i, j] < np.nanmean(acc) else "black")
    ax.set_xticks(range(len(blocks)), [str(b) for b in blocks])
    ax.set_yticks(range(len(ts)), [f"{t:g}" for t in ts])
    ax.set_xlabel("block")
    ax.set_ylabel("noise level t")
    fig.colorbar(im, ax=ax, label="linear-probe accuracy")
    ax.set_title(title, fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(path)

"""Plain PyTorch baselines of the architectures dres accelerates, written the way their authors'
code is, so end-to-end speed-ups are measured against what users would otherwise run:

* :class:`TimmMAE`: facebookresearch/mae ``models_mae.MaskedAutoencoderViT``: timm ``PatchEmbed`` and
  ``Block`` (pre-LN, qkv bias, GELU MLP ratio 4, LayerNorm eps 1e-6, SDPA attention through timm's
  fused path), fixed 2-D sin-cos position embeddings, random masking by argsort of noise, an 8-block
  512-wide decoder, norm-pix loss on masked patches. ``forward(imgs) -> (loss, pred, mask)``.
* :class:`PlainUViT`: baofff/U-ViT ``libs/uvit.py``: ``[time, patches]`` tokens with a learned
  position embedding, ``depth//2`` in-blocks, a mid block, ``depth//2`` out-blocks that start with
  ``Linear(2D -> D)(cat(x, skip))``, final LayerNorm, ``Linear(D -> p*p*C)``, unpatchify, 3x3 conv.
  Attention through ``F.scaled_dot_product_attention``. ``forward(x, timesteps) -> prediction``.

Neither imports dres: they are the independent reference point.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


def sincos_2d(embed_dim: int, grid_size: int, cls_token: bool = False) -> torch.Tensor:
    """MAE's ``get_2d_sincos_pos_embed``: half the channels encode the row, half the column;
    (grid_size**2 [+1], embed_dim) float32, the class-token row zero."""
    if embed_dim % 4:
        raise ValueError("embed_dim must be divisible by 4 for 2-D sin-cos embeddings")
    coords = torch.arange(grid_size, dtype=torch.float64)
    grid_w, grid_h = torch.meshgrid(coords, coords, indexing="xy")  # MAE: np.meshgrid(grid_w, grid_h)

    def one_d(dim: int, pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
        out = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    # MAE uses grid[0] (w) for the first half of the channels and grid[1] (h) for the second
    emb = torch.cat([one_d(embed_dim // 2, grid_w), one_d(embed_dim // 2, grid_h)], dim=1)
    if cls_token:
        emb = torch.cat([torch.zeros(1, embed_dim, dtype=torch.float64), emb], dim=0)
    return emb.float()


class TimmMAE(nn.Module):
    """MAE with timm blocks (official structure); defaults are ViT-B/16 with the 512x8 decoder."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, decoder_embed_dim: int = 512, decoder_depth: int = 8,
                 decoder_num_heads: int = 16, mlp_ratio: float = 4.0, norm_pix_loss: bool = True,
                 mask_ratio: float = 0.75):
        super().__init__()
        from timm.layers import PatchEmbed
        from timm.models.vision_transformer import Block

        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.patch_size, self.in_chans = patch_size, in_chans
        self.norm_pix_loss, self.mask_ratio = norm_pix_loss, mask_ratio
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        grid = int(math.isqrt(num_patches))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # fixed sin-cos embedding, a frozen Parameter as in the MAE code
        self.pos_embed = nn.Parameter(sincos_2d(embed_dim, grid, cls_token=True)[None], requires_grad=False)
        self.blocks = nn.ModuleList(Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=True,
                                          norm_layer=norm_layer) for _ in range(depth))
        self.norm = norm_layer(embed_dim)

        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(sincos_2d(decoder_embed_dim, grid, cls_token=True)[None],
                                              requires_grad=False)
        self.decoder_blocks = nn.ModuleList(Block(dim=decoder_embed_dim, num_heads=decoder_num_heads,
                                                  mlp_ratio=mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                                            for _ in range(decoder_depth))
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans, bias=True)
        self._init_weights()

    def _init_weights(self) -> None:
        w = self.patch_embed.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        p, c = self.patch_size, self.in_chans
        B, _, H, W = imgs.shape
        h, w = H // p, W // p
        x = imgs.reshape(B, c, h, p, w, p)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(B, h * w, p * p * c)

    @staticmethod
    def random_masking(x: torch.Tensor, mask_ratio: float):
        N, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, 1, ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones(N, L, device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return x_masked, mask, ids_restore

    def parallel_units(self) -> list[nn.Module]:
        """Encoder then decoder blocks: the FSDP2 units / compile regions of the trainer's layout."""
        return list(self.blocks) + list(self.decoder_blocks)

    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float):
        x = self.patch_embed(imgs)
        x = x + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls = self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat((cls.expand(x.shape[0], -1, -1), x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, x: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens.to(x.dtype)], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1)
        x = x + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_norm(x)
        return self.decoder_pred(x)[:, 1:, :]

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)
        return (loss * mask).sum() / mask.sum()

    def forward(self, imgs: torch.Tensor, mask_ratio: float | None = None):
        latent, mask, ids_restore = self.forward_encoder(imgs, self.mask_ratio if mask_ratio is None else mask_ratio)
        pred = self.forward_decoder(latent, ids_restore)
        return self.forward_loss(imgs, pred, mask), pred, mask


def timm_mae_vit_base_patch16(**kw) -> TimmMAE:
    return TimmMAE(**{**dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                             decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16), **kw})


# ---------------------------------------------------------------------------------------------
# U-ViT


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class UViTAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        qkv = self.qkv(x).reshape(B, L, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(x.transpose(1, 2).reshape(B, L, C))


class UViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False, skip: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = UViTAttention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if self.skip_linear is not None:
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PlainUViT(nn.Module):
    """U-ViT; defaults are U-ViT-S/2 for 32x32 images (512 wide, 6 + mid + 6 blocks, 8 heads)."""

    def __init__(self, img_size: int = 32, patch_size: int = 2, in_chans: int = 3, embed_dim: int = 512,
                 depth: int = 12, num_heads: int = 8, mlp_ratio: float = 4.0, qkv_bias: bool = False):
        super().__init__()
        self.in_chans, self.embed_dim, self.patch_size = in_chans, embed_dim, patch_size
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.extras = 1  # the time token (unconditional)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, embed_dim))
        self.in_blocks = nn.ModuleList(UViTBlock(embed_dim, num_heads, mlp_ratio, qkv_bias) for _ in range(depth // 2))
        self.mid_block = UViTBlock(embed_dim, num_heads, mlp_ratio, qkv_bias)
        self.out_blocks = nn.ModuleList(UViTBlock(embed_dim, num_heads, mlp_ratio, qkv_bias, skip=True)
                                        for _ in range(depth // 2))
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_pred = nn.Linear(embed_dim, patch_size ** 2 * in_chans)
        self.final_layer = nn.Conv2d(in_chans, in_chans, 3, padding=1)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def parallel_units(self) -> list[nn.Module]:
        return list(self.in_blocks) + [self.mid_block] + list(self.out_blocks)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        time_token = timestep_embedding(timesteps, self.embed_dim).unsqueeze(1)
        x = torch.cat((time_token.to(x.dtype), x), dim=1) + self.pos_embed
        skips = []
        for blk in self.in_blocks:
            x = blk(x)
            skips.append(x)
        x = self.mid_block(x)
        for blk in self.out_blocks:
            x = blk(x, skips.pop())
        x = self.decoder_pred(self.norm(x))[:, self.extras:, :]
        B, N, P = x.shape
        h, p, c = int(math.isqrt(N)), self.patch_size, self.in_chans
        x = x.reshape(B, h, h, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(B, c, h * p, h * p)
        return self.final_layer(x)


def plain_uvit_small_2(**kw) -> PlainUViT:
    return PlainUViT(**{**dict(img_size=32, patch_size=2, embed_dim=512, depth=12, num_heads=8), **kw})

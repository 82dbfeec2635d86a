"""Training FLOPs of the models the trainers build, counted from their shapes.

The convention is :class:`torch.utils.flop_counter.FlopCounterMode`'s: matmuls, convolutions and
attention count 2 FLOPs a multiply-add; norms, activations, pooling and the optimizer count nothing.
A training step is the forward plus the backward, which computes a weight gradient and an input
gradient per matmul, each as costly as the forward: 3x the forward, except where the input needs no
gradient (the patch embedding and a ResNet's first convolution read the images: 2x). Attention is
``4 T^2 D`` a sample forward (``Q K^T`` and ``P V``), twice that backward. Activation checkpointing's
recomputed forward is not counted: these are model FLOPs, not hardware FLOPs.

``training_flops(model, batch, img_size)`` is exact for one micro-batch of ``batch`` images (a few
terms of the MAE decoder act on parameters once per batch, not per image); divide by ``batch`` for
the FLOPs per image.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import nn

from dres.models.resnet import ResNetClassifier
from dres.models.classifier import ViTClassifier
from dres.models.mae import MAE, SkipLayer
from dres.models.uvit import UViT


def matmul_flops(rows: int, in_features: int, out_features: int, input_grad: bool = True) -> int:
    """Forward + backward FLOPs of ``rows`` tokens through an ``in -> out`` matmul."""
    return (3 if input_grad else 2) * 2 * rows * in_features * out_features


def attention_flops(batch: int, tokens: int, dim: int) -> int:
    """Forward + backward FLOPs of softmax attention over ``tokens`` of width ``dim`` (all heads)."""
    return 3 * 4 * batch * tokens * tokens * dim


def stack_flops(stack: nn.Module, batch: int, tokens: int, dim: int) -> int:
    """A transformer stack (``stream_blocks()``) on ``tokens`` tokens of width ``dim``: every Linear of
    a block acts once on every token, plus one attention."""
    total = 0
    for blk in stack.stream_blocks():
        total += sum(matmul_flops(batch * tokens, m.in_features, m.out_features)
                     for m in blk.modules() if isinstance(m, nn.Linear))
        total += attention_flops(batch, tokens, dim)
    return total


def patch_embed_flops(patch_embed: nn.Module, batch: int, patches: int) -> int:
    """The patch projection (a matmul over the flattened patches) of ``patches`` patches per image;
    images need no gradient."""
    proj = patch_embed.proj
    return matmul_flops(batch * patches, proj.in_channels * math.prod(proj.kernel_size), proj.out_channels,
                        input_grad=False)


def mae_flops(model: nn.Module, batch: int) -> int:
    """:class:`~dres.models.MAE`: the encoder on the visible patches and the class token, the decoder on
    every patch and the class token; the official / paper skips project the visible tokens and the mask
    token with the skip's columns of their first Linear, the stream with the rest."""
    enc, dec_dim = model.encoder, model.decoder_pred.in_features
    patches = enc.patch_embed.num_patches
    visible = int(patches * (1 - model.mask_ratio))  # MAE.random_masking's len_keep
    enc_tokens, dec_tokens = 1 + visible, 1 + patches
    total = patch_embed_flops(enc.patch_embed, batch, visible)
    total += stack_flops(enc.transformer, batch, enc_tokens, enc.embed_dim)
    if model.variant == "official":  # decoder_embed of the class token (a parameter) and of the fixed position table
        total += matmul_flops(1, dec_dim, dec_dim) + matmul_flops(patches, dec_dim, dec_dim, input_grad=False)
    else:
        total += matmul_flops(batch * enc_tokens, enc.embed_dim, dec_dim)
    for skip in model.skips:
        joint = skip.fc[0] if isinstance(skip, SkipLayer) else skip.linear
        total += (matmul_flops(batch * enc_tokens, enc.embed_dim, dec_dim) + matmul_flops(1, enc.embed_dim, dec_dim)
                  + matmul_flops(batch * dec_tokens, joint.in_features - enc.embed_dim, dec_dim))
        if isinstance(skip, SkipLayer):
            total += matmul_flops(batch * dec_tokens, skip.fc[2].in_features, skip.fc[2].out_features)
    total += stack_flops(model.decoder, batch, dec_tokens, dec_dim)
    return total + matmul_flops(batch * dec_tokens, dec_dim, model.decoder_pred.out_features)


def uvit_flops(model: nn.Module, batch: int) -> int:
    """:class:`~dres.models.UViT`: ``[label?, time, patches]`` through the blocks and the long-skip
    Linears, the patch prediction on every token, the final 3x3 convolution on the image."""
    pe, dim = model.patch_embed, model.embed_dim
    tokens = model.extras + pe.num_patches
    total = patch_embed_flops(pe, batch, pe.num_patches)
    time_linears = [m for m in model.time_embed.modules() if isinstance(m, nn.Linear)]
    # the sinusoidal time embedding needs no gradient
    total += sum(matmul_flops(batch, m.in_features, m.out_features, input_grad=i > 0) for i, m in enumerate(time_linears))
    total += stack_flops(model.transformer, batch, tokens, dim)
    total += sum(matmul_flops(batch * tokens, m.in_features, m.out_features) for m in model.skip_linears)
    total += matmul_flops(batch * tokens, dim, model.decoder_pred.out_features)
    if isinstance(model.final_layer, nn.Conv2d):
        total += walk_flops([model.final_layer], batch, (pe.img_size, pe.img_size), input_grad=True)[0]
    return total


def vit_classifier_flops(model: nn.Module, batch: int) -> int:
    """:class:`~dres.models.ViTClassifier`: the encoder on every patch and the class token, the head on
    one (pooled) token."""
    enc = model.encoder
    patches = enc.patch_embed.num_patches
    total = patch_embed_flops(enc.patch_embed, batch, patches)
    total += stack_flops(enc.transformer, batch, 1 + patches, enc.embed_dim)
    return total + matmul_flops(batch, model.head.in_features, model.head.out_features)


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1, ceil_mode: bool = False) -> int:
    """Output side of a convolution or pooling window (PyTorch's formula, ``ceil_mode`` included)."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:  # the last window may not start in the padding
        out -= 1
    return out


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def walk_flops(modules, batch: int, size: tuple[int, int], input_grad: bool) -> tuple[int, tuple[int, int], bool]:
    """Convolutions of ``modules`` run in order on a ``size`` (H, W) map: ``(flops, size after, input_grad
    after)``. Pools change the size; a residual block (a ``downsample`` attribute) runs its branch and its
    shortcut from the same input; a Linear acts once per sample (after the global pool); other layers
    (norms, activations) count nothing. Only the first layer on the images has no input gradient."""
    total = 0
    for m in modules:
        if isinstance(m, nn.Conv2d):
            k, s, p, d = (_pair(getattr(m, a)) for a in ("kernel_size", "stride", "padding", "dilation"))
            size = tuple(conv_out_size(size[i], k[i], s[i], p[i], d[i]) for i in range(2))
            per_pixel = m.out_channels * (m.in_channels // m.groups) * k[0] * k[1]
            total += matmul_flops(batch * size[0] * size[1], per_pixel, 1, input_grad)
            input_grad = True
        elif isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
            k, s, p = (_pair(getattr(m, a)) for a in ("kernel_size", "stride", "padding"))
            d = _pair(getattr(m, "dilation", 1))
            size = tuple(conv_out_size(size[i], k[i], s[i] if s[i] else k[i], p[i], d[i], m.ceil_mode)
                         for i in range(2))
        elif isinstance(m, nn.Linear):
            total += matmul_flops(batch, m.in_features, m.out_features, input_grad)
            input_grad = True
        elif hasattr(m, "downsample"):
            branch = [c for name, c in m.named_children() if name != "downsample"]
            shortcut, _, _ = walk_flops([m.downsample] if m.downsample is not None else [], batch, size, input_grad)
            flops, size, input_grad = walk_flops(branch, batch, size, input_grad)
            total += flops + shortcut
        elif isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
            size = _pair(m.output_size)
        else:  # a container (a stage, timm's head pool) or a layer without FLOPs
            flops, size, input_grad = walk_flops(list(m.children()), batch, size, input_grad)
            total += flops
    return total, size, input_grad


def resnet_flops(model: nn.Module, batch: int, img_size: int) -> int:
    """:class:`~dres.models.ResNetClassifier`: timm's ResNet walked in module order (stem, max pool,
    stages, global pool, head) on ``img_size`` square images."""
    return walk_flops(list(model.net.children()), batch, (img_size, img_size), input_grad=False)[0]


def training_flops(model: nn.Module, batch: int, img_size: Optional[int] = None) -> Optional[int]:
    """Forward + backward FLOPs of one step on ``batch`` images as the trainers run ``model``, or None for
    a model this module does not know. ``img_size``: the images' side, needed by the ResNets (the ViT
    models carry theirs)."""
    if isinstance(model, MAE):
        return mae_flops(model, batch)
    if isinstance(model, UViT):
        return uvit_flops(model, batch)
    if isinstance(model, ViTClassifier):
        return vit_classifier_flops(model, batch)
    if isinstance(model, ResNetClassifier):
        if img_size is None:
            raise ValueError("img_size is needed for the FLOPs of a ResNet")
        return resnet_flops(model, batch, img_size)
    return None

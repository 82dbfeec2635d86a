"""Triton kernel for the random-resized crop of a batch of decoded images of different sizes.

Every image of the batch lies somewhere in one flat uint8 buffer with its own height, width and
strides (HWC as nvImageCodec writes it, CHW as torchvision's decoder does). Output pixel (oy, ox)
of image b is the average of a ``gh x gw`` grid of bilinear samples over its bin of the crop box,
exactly ``torchvision.ops.roi_align(..., aligned=True, sampling_ratio=-1)``: the grid is
``ceil(crop / size)`` samples a side, so a downscale averages every source pixel it covers
(antialiasing) and an upscale is plain bilinear. Then the horizontal flip and
``(v / 255 - mean) / std`` as ``v * scale + shift``, written as float32 (B, C, size, size).

One launch for the whole batch instead of a crop, a resize and a normalisation per image: the
batch's decoded pixels are read once and the output written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import CachedLaunch

@triton.jit
def _crop_resize_kernel(SRC, META, BOX, SCALE, SHIFT, OUT, size,
                        C: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)  # META's row b: offset in SRC, height, width, row / column / channel strides, flip
    pix = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pix < size * size
    oy = (pix // size).to(tl.float32)
    ox = pix % size
    meta = META + b * 7
    offset = tl.load(meta)
    height = tl.load(meta + 1).to(tl.int32)
    width = tl.load(meta + 2).to(tl.int32)
    stride_h = tl.load(meta + 3)
    stride_w = tl.load(meta + 4)
    stride_c = tl.load(meta + 5)
    flip = tl.load(meta + 6)
    ox = tl.where(flip != 0, size - 1 - ox, ox).to(tl.float32)
    # aligned roi_align: pixel centres sit at integer coordinates
    x0 = tl.load(BOX + b * 4) - 0.5
    y0 = tl.load(BOX + b * 4 + 1) - 0.5
    bin_w = tl.load(BOX + b * 4 + 2) / size
    bin_h = tl.load(BOX + b * 4 + 3) / size
    grid_w = tl.maximum(tl.ceil(bin_w), 1.0).to(tl.int32)
    grid_h = tl.maximum(tl.ceil(bin_h), 1.0).to(tl.int32)
    chan = tl.arange(0, CB)
    chan_ok = chan < C
    chan_off = chan.to(tl.int64) * stride_c
    hf = height.to(tl.float32)
    wf = width.to(tl.float32)
    acc = tl.zeros([BLOCK, CB], dtype=tl.float32)
    for iy in range(0, grid_h):
        y = y0 + oy * bin_h + (iy + 0.5) * bin_h / grid_h
        y_in = (y >= -1.0) & (y <= hf)
        y = tl.maximum(y, 0.0)
        y_low = tl.minimum(y.to(tl.int32), height - 1)
        y_top = y_low >= height - 1
        y_high = tl.where(y_top, y_low, y_low + 1)
        ly = tl.where(y_top, 0.0, y - y_low.to(tl.float32))
        for ix in range(0, grid_w):
            x = x0 + ox * bin_w + (ix + 0.5) * bin_w / grid_w
            ok = y_in & (x >= -1.0) & (x <= wf) & inside
            x = tl.maximum(x, 0.0)
            x_low = tl.minimum(x.to(tl.int32), width - 1)
            x_right = x_low >= width - 1
            x_high = tl.where(x_right, x_low, x_low + 1)
            lx = tl.where(x_right, 0.0, x - x_low.to(tl.float32))
            row_lo = offset + y_low.to(tl.int64) * stride_h
            row_hi = offset + y_high.to(tl.int64) * stride_h
            col_lo = x_low.to(tl.int64) * stride_w
            col_hi = x_high.to(tl.int64) * stride_w
            mask = ok[:, None] & chan_ok[None, :]
            v11 = tl.load(SRC + (row_lo + col_lo)[:, None] + chan_off[None, :], mask=mask, other=0).to(tl.float32)
            v12 = tl.load(SRC + (row_lo + col_hi)[:, None] + chan_off[None, :], mask=mask, other=0).to(tl.float32)
            v21 = tl.load(SRC + (row_hi + col_lo)[:, None] + chan_off[None, :], mask=mask, other=0).to(tl.float32)
            v22 = tl.load(SRC + (row_hi + col_hi)[:, None] + chan_off[None, :], mask=mask, other=0).to(tl.float32)
            wx = lx[:, None]
            wy = ly[:, None]
            acc += (1.0 - wy) * ((1.0 - wx) * v11 + wx * v12) + wy * ((1.0 - wx) * v21 + wx * v22)
    count = (grid_h * grid_w).to(tl.float32)
    scale = tl.load(SCALE + chan, mask=chan_ok, other=0.0)
    shift = tl.load(SHIFT + chan, mask=chan_ok, other=0.0)
    out = acc / count * scale[None, :] + shift[None, :]
    plane = size * size
    dst = OUT + b.to(tl.int64) * C * plane + chan[None, :].to(tl.int64) * plane + pix[:, None]
    tl.store(dst, out, mask=inside[:, None] & chan_ok[None, :])


_launch = CachedLaunch(_crop_resize_kernel)


def crop_resize_forward(src: torch.Tensor, meta: torch.Tensor, boxes: torch.Tensor, scale: torch.Tensor,
                        shift: torch.Tensor, size: int, channels: int = 3) -> torch.Tensor:
    """``src`` a flat uint8 buffer; ``meta`` (B, 7) int64 (offset, height, width, row, column and channel
    strides in elements, flip); ``boxes`` (B, 4) float32 crop boxes (left, top, width, height) in pixels;
    ``scale``/``shift`` (channels,) float32 -> float32 (B, channels, size, size)."""
    n = meta.shape[0]
    out = torch.empty((n, channels, size, size), dtype=torch.float32, device=src.device)
    if n == 0:
        return out
    block = 256
    grid = (n, triton.cdiv(size * size, block))
    _launch(grid, (src, meta, boxes, scale, shift, out, size, channels, triton.next_power_of_2(channels), block),
            num_warps=4)
    return out

"""MAE's reconstruction loss (facebookresearch/mae ``forward_loss``) as one fused op.

    loss = mae_loss(pred, imgs, mask, patch_size, norm_pix=True)

    target    = patchify(imgs)                                      (B, L, p*p*C), MAE's (p, q, c) order
    target    = (target - mean) / sqrt(var + eps)   if norm_pix     (per patch, var unbiased)
    per_patch = mean over the patch of (pred - target)^2
    loss      = sum(per_patch * mask) / sum(mask)                   (mask: 1 = masked, counted)

The Triton kernel reads the target straight from ``imgs`` (any strides, no patchify copy) and, in
the same pass, writes the gradient of the loss w.r.t. ``pred``; the autograd saves only that
gradient and its backward is ``dpred * grad_output``. ``imgs`` and ``mask`` are data: they get no
gradient, and passing one that requires grad is an error rather than a silently missing gradient.

Eager calls run :class:`MAELossFn`; under ``torch.compile(fullgraph=True)`` (and for ``opcheck``)
the custom op ``dres::mae_loss``, built from the same launch and formulas (custom-op dispatch
costs tens of microseconds per call, so eager calls skip it). ``backend="torch"`` (the default
on CPU) runs :func:`dres.ops.reference.mae_loss`, which is ``forward_loss`` written out (float64-capable).
A mask with no counted patch (all zero) gives loss 0 and a zero gradient on every backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dres.ops import reference
from dres.ops.checks import REFERENCE_DTYPES, check_eps, check_tensor, resolve_backend_without_csrc, supported_dtypes
from dres.ops.registration import define_op

# mask is any float tensor of weights (normally 0/1) or a bool tensor; it is only read
MASK_DTYPES = REFERENCE_DTYPES + (torch.bool,)


# ---------------------------------------------------------------------------------------------
# Checks: messages name the argument, before any kernel sees it


def check_mae_loss_inputs(backend: str, pred: Tensor, imgs: Tensor, mask: Tensor, patch_size: int,
                          norm_pix: bool, eps: float) -> None:
    """Validate mae_loss's arguments; errors name the argument."""
    dtypes = supported_dtypes(backend)
    check_tensor("pred", pred, dtypes)
    check_tensor("imgs", imgs, dtypes)
    check_tensor("mask", mask, MASK_DTYPES)
    if not isinstance(patch_size, int) or isinstance(patch_size, bool):
        raise TypeError(f"patch_size must be an int, got {type(patch_size).__name__}")
    if patch_size < 1:
        raise ValueError(f"patch_size must be positive, got {patch_size}")
    if imgs.dim() != 4:
        raise ValueError(f"imgs must have shape (B, C, H, W), got {tuple(imgs.shape)}")
    B, C, H, W = imgs.shape
    if H % patch_size or W % patch_size:
        raise ValueError(f"imgs has H x W = {H} x {W}, not divisible by patch_size = {patch_size}")
    num_patches, patch_dim = (H // patch_size) * (W // patch_size), patch_size * patch_size * C
    if tuple(pred.shape) != (B, num_patches, patch_dim):
        raise ValueError(f"pred has shape {tuple(pred.shape)}; expected (B, L, p*p*C) = {(B, num_patches, patch_dim)} "
                         f"for imgs of shape {tuple(imgs.shape)} and patch_size {patch_size}")
    if tuple(mask.shape) != (B, num_patches):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected (B, L) = {(B, num_patches)}")
    for name, t in (("imgs", imgs), ("mask", mask)):
        if t.device != pred.device:
            raise ValueError(f"{name} is on {t.device} but pred is on {pred.device}; all tensors must share one device")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad, but mae_loss treats it as data and gives it no gradient; "
                             f"pass {name}.detach()")
    if norm_pix and patch_dim == 1:
        raise ValueError("norm_pix needs more than one value per patch "
                         "(the unbiased variance of one value is undefined)")
    check_eps(eps)
    if backend != "torch":
        from dres.kernels.mae_loss import MAX_PATCH_DIM

        if patch_dim > MAX_PATCH_DIM:
            raise ValueError(f"pred has p*p*C = {patch_dim} values per patch, above the kernel's maximum of "
                             f"{MAX_PATCH_DIM} (use backend='torch')")


# ---------------------------------------------------------------------------------------------
# Reference: dres.ops.reference.mae_loss (backend="torch" runs it; the tests compare the kernel
# against it)


# ---------------------------------------------------------------------------------------------
# Triton launch: (loss, dpred), dpred the gradient of loss w.r.t. pred (empty when not needed). Also
# the body of the dres::mae_loss custom op.


def mae_loss_triton(pred: Tensor, imgs: Tensor, mask: Tensor, patch_size: int, norm_pix: bool, eps: float,
                    need_dpred: bool) -> tuple[Tensor, Tensor]:
    from dres.kernels.mae_loss import mae_loss_forward

    if pred.stride(-1) != 1:
        pred = pred.contiguous()
    # A device scalar the kernel reads: no host synchronisation anywhere.
    mask_sum = mask.sum(dtype=torch.float32)
    row_terms = torch.empty((pred.shape[0] * pred.shape[1],), dtype=torch.float32, device=pred.device)
    dpred = torch.empty(pred.shape, dtype=pred.dtype, device=pred.device) if need_dpred else None
    mae_loss_forward(pred, imgs, mask, mask_sum, patch_size, norm_pix, eps, row_terms, dpred)
    # mask[r] * loss_r / mask_sum per row; torch's sum over a fixed shape adds in a fixed order: deterministic.
    loss = row_terms.sum()
    return loss, dpred if dpred is not None else pred.new_empty((0,))


# ---------------------------------------------------------------------------------------------
# The autograd Function


class MAELossFn(torch.autograd.Function):
    """loss = sum_r mask[r] * mean_P (pred[r] - t_r)^2 / sum(mask), t = patchify(imgs) (norm-pix);
    the forward writes dloss/dpred in the same pass, so the backward is dpred * grad_loss."""

    @staticmethod
    def forward(ctx, pred, imgs, mask, patch_size, norm_pix, eps, need_dpred, backend):
        inputs = (pred, imgs, mask, patch_size, norm_pix, eps, need_dpred)
        output = mae_loss_triton(*inputs)  # eager calls run Triton: the csrc extension has no such kernel
        MAELossFn.save(ctx, backend, inputs, output)
        return output[0]

    @staticmethod
    def save(ctx, backend, inputs, output):
        _, dpred = output
        ctx.mark_non_differentiable(dpred)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(dpred)

    @staticmethod
    def backward(ctx, grad_loss, *_dpred_grad):
        if grad_loss is None:
            return (None,) * 8
        (dpred,) = ctx.saved_tensors
        # dpred is the gradient for grad_loss = 1; a 0-dim multiply keeps pred's dtype and never syncs.
        return dpred * grad_loss, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# The custom op (what torch.compile, opcheck and the dispatcher see)


def _mae_loss_fake(pred, imgs, mask, patch_size, norm_pix, eps, need_dpred):
    dpred = pred.new_empty(pred.shape if need_dpred else (0,))  # contiguous, like the real one
    return pred.new_empty((), dtype=torch.float32), dpred


mae_loss_op = define_op("dres::mae_loss", mae_loss_triton, _mae_loss_fake, ["dres::mae_loss"], autograd=MAELossFn)


# ---------------------------------------------------------------------------------------------
# Public function


def mae_loss(pred: Tensor, imgs: Tensor, mask: Tensor, patch_size: int, norm_pix: bool = True, eps: float = 1e-6,
             backend: str | None = None) -> Tensor:
    """MAE's (norm-pix) MSE on the masked patches, as a 0-dim fp32 tensor; gradient into ``pred`` only.

    pred: (B, L, p*p*C) (bf16 under autocast, or fp32/fp16), unit stride along the last dim or it is
    copied; imgs: (B, C, H, W), any strides; mask: (B, L), 1 = masked (counted); an all-zero mask
    gives loss 0 with a zero gradient. eps: a positive float. ``backend``: None
    picks Triton for CUDA tensors and :func:`dres.ops.reference.mae_loss` otherwise; "triton" or "torch" force one
    ("cuda", the csrc extension's name, has no kernel for this op and runs Triton).
    """
    backend = resolve_backend_without_csrc(backend, pred, "pred")
    check_mae_loss_inputs(backend, pred, imgs, mask, patch_size, norm_pix, eps)
    if backend == "torch":
        return reference.mae_loss(pred, imgs, mask, patch_size, norm_pix, eps)
    # In evaluation the kernel skips writing the gradient.
    args = (pred, imgs, mask, patch_size, bool(norm_pix), float(eps), pred.requires_grad and torch.is_grad_enabled())
    if torch.compiler.is_compiling():
        loss, _ = mae_loss_op(*args)
        return loss
    return MAELossFn.apply(*args, "triton")

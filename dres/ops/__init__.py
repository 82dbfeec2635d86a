"""dres.ops: the fused operations (the contract: docs/design.md, "The ops").

    out, y = residual_layer_norm(x, h, weight, bias, alpha, eps, row_scale, grad_scale, dropout_p=0.0)
        out = alpha * x + row_scale[b] * dropout(h) (the new residual stream; the mask drawn in the kernel)
        y   = LayerNorm(out) * weight + bias        (normalising the stored, rounded out)
        backward: g = g_out + LN_bwd(g_y); dx = alpha * g; dh = grad_scale[b] * dropout'(g)
    out = residual_add(x, h, alpha, row_scale, grad_scale)
    y   = layer_norm(x, weight, bias, eps)
    act = fused_bias_gelu(pre, bias);  out = fused_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    out = residual_act(x, h, alpha, row_scale, grad_scale, act="relu")
    loss = mae_loss(pred, imgs, mask, patch_size, norm_pix)
    out = short_attention(qkv, num_heads)

One module per op family, five in all: ``residual_norm`` (the three above), ``bias_gelu``
(``fused_bias_gelu``, ``fused_mlp``), ``residual_act``, ``mae_loss``, ``short_attention``. Each reads
the same way top to bottom: checks, a pointer to its reference, the Triton launches, one explicit
``autograd.Function``, the custom ops (``define_op(..., autograd=<the Function>)``; ``residual_act`` has
none: under torch.compile it is its reference formula, for Inductor to fuse), the public function. Shared pieces: every float64-capable reference in :mod:`dres.ops.reference`, helpers in
:mod:`dres.ops.utils`, the backend choice and shared argument checks in :mod:`dres.ops.checks`, the
custom-op wiring in :mod:`dres.ops.registration`, the csrc extension in :mod:`dres.ops.csrc_backend`.
``backend``: None picks Triton for CUDA tensors (the csrc kernels for small eager residual-norm and MLP
calls when built; under torch.compile, and in eager mode without the csrc extension, outside a captured step, the
PyTorch formula of a launch-bound residual norm, :func:`dres.ops.checks.resolve_backend_by_work`, and of a
launch-bound MLP the plain model's, :func:`dres.ops.bias_gelu.plain_mlp`) and the
PyTorch reference otherwise (CPU, float64); "triton" forces the kernels (on CPU only under
``TRITON_INTERPRET=1``); "torch" the reference; "cuda" the csrc extension when built (the ops it has no kernel
for run Triton).
"""

from __future__ import annotations

from dres.ops import reference
from dres.ops.bias_gelu import fused_bias_gelu, fused_mlp
from dres.ops.mae_loss import mae_loss
from dres.ops.residual_act import residual_act
from dres.ops.residual_norm import layer_norm, residual_add, residual_layer_norm
from dres.ops.short_attention import short_attention

__all__ = ["fused_bias_gelu", "fused_mlp", "residual_layer_norm", "residual_add", "layer_norm", "mae_loss",
           "reference", "residual_act", "short_attention"]

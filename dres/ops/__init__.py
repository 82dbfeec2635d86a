"""dres.ops: the fused residual operations (the contract: docs/design.md, "The ops").

    out, y = residual_layer_norm(x, h, weight, bias, alpha, eps, row_scale, grad_scale)
        out = alpha * x + row_scale[b] * h          (the new residual stream)
        y   = LayerNorm(out) * weight + bias        (normalising the stored, rounded out)
        backward: g = g_out + LN_bwd(g_y); dx = alpha * g; dh = grad_scale[b] * g
    out = residual_add(x, h, alpha, row_scale, grad_scale)
    y   = layer_norm(x, weight, bias, eps)

One module per op family (``residual_norm``, ``bias_gelu``, ``mae_loss``, ``residual_act``), each in
the same order: checks, reference, launch, explicit ``autograd.Function``, custom op, public
function. Shared pieces: helpers in :mod:`dres.ops.utils`, the backend choice and argument checks in
:mod:`dres.ops.checks`, the custom-op wiring in :mod:`dres.ops.registration`, the csrc extension in
:mod:`dres.ops.csrc_backend`. ``backend``: None picks Triton for CUDA tensors and the PyTorch
reference otherwise (CPU, float64); "triton" forces the kernels (on CPU only under ``TRITON_INTERPRET=1``);
"torch" the reference (:mod:`dres.ops.reference`, float64-capable); "cuda" the csrc extension when built.
"""

from __future__ import annotations

from dres.ops import reference
from dres.ops.bias_gelu import fused_bias_gelu, fused_mlp
from dres.ops.mae_loss import mae_loss, mae_loss_reference
from dres.ops.residual_act import residual_act
from dres.ops.residual_norm import layer_norm, residual_add, residual_layer_norm
from dres.ops.short_attention import short_attention

__all__ = ["fused_bias_gelu", "fused_mlp", "residual_layer_norm", "residual_add", "layer_norm", "mae_loss",
           "mae_loss_reference", "reference", "residual_act", "short_attention"]

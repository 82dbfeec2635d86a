"""Triton kernels of dres and their launchers: this folder installs as ``dres.kernels`` (setup.py's
``package_dir``), so code imports it as ``from dres.kernels import ...``.

No autograd and no modules here: ``dres.ops`` wraps these launchers as torch custom ops.
"""

from .bias_gelu import bias_gelu_backward, bias_gelu_forward
from .mae_loss import MAX_PATCH_DIM, mae_loss_forward
from .residual_act import residual_act_backward, residual_act_forward
from .residual_norm import MAX_DIM, residual_norm_backward, residual_norm_forward

__all__ = ["bias_gelu_backward", "bias_gelu_forward", "MAX_PATCH_DIM", "mae_loss_forward", "MAX_DIM",
           "residual_norm_backward", "residual_norm_forward", "residual_act_backward", "residual_act_forward"]

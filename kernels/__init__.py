"""Triton kernels of dres and their launchers (installed as ``dres.kernels``).

No autograd and no modules here: ``dres.ops`` wraps these launchers as torch custom ops.
"""

from .residual_norm import MAX_DIM, launch_config, residual_norm_backward, residual_norm_forward

__all__ = ["MAX_DIM", "launch_config", "residual_norm_backward", "residual_norm_forward"]

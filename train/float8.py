"""Float8 matmuls in the transformer blocks (``fp8=true``): torchao's ``Float8Linear`` with dynamic
tensorwise scaling (inputs and weights e4m3, output gradients e5m2), as torchtitan converts its models.

Only the Linear layers inside :class:`~dres.nn.Block` s whose both sizes are multiples of 16 (what the
float8 matmul takes) are converted; the patch embedding, the heads, the decoder's prediction and the skip
projections stay as they are. The converted layers keep ``weight`` and ``bias``, so checkpoints and
exports are those of the unconverted model. The blocks' MLPs take their plain path: the fused MLP kernel
reads ``fc1.weight`` itself and would bypass the conversion. Float8 matmuls need a GPU of compute capability
8.9 or higher (Ada, Hopper); on the CPU torch emulates them (for tests, not for speed).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from dres.nn import Block, set_fused_mlp
from dres.train.config import ConfigError

FLOAT8_MIN_CAPABILITY = (8, 9)


class Float8Unavailable(ConfigError):
    """``fp8=true`` cannot run here: torchao missing, a GPU without float8 matmuls, or nothing to convert."""


def block_linears(model: nn.Module) -> set[str]:
    """The qualified names of the Linear layers inside the model's blocks that a float8 matmul can take."""
    names = set()
    for block_name, block in model.named_modules():
        if isinstance(block, Block):
            for name, m in block.named_modules():
                if isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0:
                    names.add(f"{block_name}.{name}" if block_name else name)
    return names


def apply_float8(model: nn.Module, device: torch.device, names: set[str] | None = None) -> int:
    """Convert the Linear layers ``names`` of ``model`` (default: :func:`block_linears`) in place, before
    compiling and wrapping, to float8 training; the number converted."""
    if importlib.util.find_spec("torchao") is None:
        raise Float8Unavailable("fp8=true needs torchao: pip install 'dres[fp8]' (or torchao)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FLOAT8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise Float8Unavailable(f"fp8=true needs a GPU of compute capability >= 8.9 (Ada, Hopper); "
                                f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
    names = block_linears(model) if names is None else names
    if not names:
        raise Float8Unavailable(f"fp8=true: {type(model).__name__} has no transformer-block Linear layers to convert")
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in names)
    set_fused_mlp(model, False)
    return len(names)

"""dres.nn: decay schedules, the ResidualDroppath controller and transformer stacks on the fused ops."""

from dres.nn.droppath import ResidualDroppath, build_droppath, depth_linear_rates, droppath_scales
from dres.nn.embed import PatchEmbed, sincos_2d
from dres.nn.modules import FusedLayerNorm, FusedMLP, ResidualAct, ResidualAdd, ResidualLayerNorm
from dres.nn.schedule import decay_schedule, describe_schedule
from dres.nn.transformer import (Attention, Block, Mlp, TransformerStack, init_vit_weights, set_backend,
                                 set_fused_mlp)

__all__ = [
    "decay_schedule", "describe_schedule", "ResidualDroppath", "build_droppath", "depth_linear_rates", "droppath_scales",
    "PatchEmbed", "sincos_2d", "Attention", "Block", "Mlp", "TransformerStack", "init_vit_weights", "set_backend",
    "set_fused_mlp", "FusedLayerNorm", "ResidualLayerNorm", "ResidualAdd", "ResidualAct", "FusedMLP",
]

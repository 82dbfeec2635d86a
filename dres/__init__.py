"""dres: fused residual kernels and trainers for decayed identity shortcuts and ResidualDroppath."""

__version__ = "0.1.0"

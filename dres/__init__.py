"""dres: fused residual kernels and trainers for decayed identity shortcuts and ResidualDroppath.

The checkout's top-level ``kernels/`` and ``train/`` folders install as ``dres.kernels`` and
``dres.train`` (``package_dir`` in setup.py; wheels and editable installs both map them).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy, so that `import dres` stays light (convert pulls in dres.ops and torch)
    if name == "convert_timm_vit":
        from dres.convert import convert_timm_vit

        return convert_timm_vit
    if name == "convert_timm_resnet":
        from dres.convert_resnet import convert_timm_resnet

        return convert_timm_resnet
    if name in ("convert_hf_vit", "convert_hf_bert"):
        from dres import convert_hf

        return getattr(convert_hf, name)
    raise AttributeError(f"module 'dres' has no attribute {name!r}")

"""dres: fused residual kernels and trainers for decayed identity shortcuts and ResidualDroppath.

The checkout's top-level ``kernels/`` and ``train/`` folders install as ``dres.kernels`` and
``dres.train`` (``package_dir`` in setup.py; wheels and editable installs both map them).

The public names below are imported on first use, so that ``import dres`` stays light and importing a
converter imports torch and dres' ops, not torch.compile's machinery nor Triton.
"""

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "convert_timm_vit": "dres.convert",
    "convert_timm_resnet": "dres.convert_resnet",
    "convert_hf_vit": "dres.convert_hf",
    "convert_hf_bert": "dres.convert_hf",
    "convert_hf_gpt2": "dres.convert_hf",
    "compile_step": "dres.captured_step",
    "export_model": "dres.export",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dres' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))

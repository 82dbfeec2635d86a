"""dres: fused residual kernels and trainers for decayed identity shortcuts and ResidualDroppath."""

import importlib.util as _importlib_util
import os as _os

__version__ = "0.1.0"


def _map_checkout_packages() -> None:
    """``kernels/`` and ``train/`` live beside ``dres/`` in a checkout and install as ``dres.kernels``
    and ``dres.train``. A wheel or a modern editable install maps them itself; an editable install
    through an older setuptools only puts the checkout on sys.path, so point the package's search
    path at the checkout as well (only when the mapping is missing and the folders are there)."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    for name in ("kernels", "train"):
        if _importlib_util.find_spec(f"{__name__}.{name}") is None and _os.path.isfile(
            _os.path.join(root, name, "__init__.py")
        ):
            __path__.append(root)  # noqa: F821 - the package's own search path
            return


_map_checkout_packages()


def __getattr__(name):
    # lazy, so that `import dres` stays light (convert pulls in dres.ops and torch)
    if name == "convert_timm_vit":
        from dres.convert import convert_timm_vit

        return convert_timm_vit
    if name == "convert_timm_resnet":
        from dres.convert_resnet import convert_timm_resnet

        return convert_timm_resnet
    raise AttributeError(f"module 'dres' has no attribute {name!r}")

"""The trainers: this folder installs as ``dres.train`` (setup.py's ``package_dir``), so code imports
it as ``from dres.train import ...`` and runs it as ``dres-train`` or ``python -m dres.train.<task>``.
Their packages are the ``[train]`` extra: without one, importing ``dres.train`` names it."""

from dres.optional import require_extra

# the import names of the [train] extra's packages (pyyaml, tqdm, pillow, scikit-learn, numpy)
require_extra(("yaml", "tqdm", "PIL", "sklearn", "numpy"), "train", "the trainers (dres.train)")

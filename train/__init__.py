"""The trainers: this folder installs as ``dres.train`` (setup.py's ``package_dir``), so code imports
it as ``from dres.train import ...`` and runs it as ``dres-train`` or ``python -m dres.train.<task>``."""

"""Builds and installs package ``dres``; the top-level ``kernels/`` installs as ``dres.kernels``
and ``train/`` as ``dres.train`` (the layout the project's owner asked for)."""

from setuptools import find_packages, setup

packages = ["dres"] + [f"dres.{p}" for p in find_packages("dres")]
packages += ["dres.kernels"] + [f"dres.kernels.{p}" for p in find_packages("kernels")]
packages += ["dres.train"] + [f"dres.train.{p}" for p in find_packages("train")]

setup(
    name="dres",
    version="0.1.0",
    description="Fused residual kernels and trainers for decayed identity shortcuts and ResidualDroppath",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"dres": "dres", "dres.kernels": "kernels", "dres.train": "train"},
    package_data={"dres.train": ["presets/*.yaml"]},
    install_requires=["torch>=2.6", "triton>=3.2; platform_system=='Linux'", "numpy"],
    extras_require={
        "dev": ["pytest>=7", "pytest-benchmark>=4", "hypothesis>=6", "timm>=1.0", "pyyaml",
                "webdataset>=0.2", "scikit-learn>=1.3", "matplotlib>=3.7", "pillow", "tqdm",
                "tensorboard"],
    },
    entry_points={"console_scripts": ["dres-train=dres.train.cli:main", "dres-eval=dres.train.cli:eval_main"]},
)

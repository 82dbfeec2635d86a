"""Optional dependencies (pyproject's extras) missing at run time: each place that imports one says,
in one line, which ``pip install 'dres[...]'`` adds it; the command line prints that line and exits 2."""

import sys

import pytest
import torch

from dres.optional import MissingExtra, import_optional


class NotInstalled:
    """A meta path finder that finds ``package`` nowhere, as the import system does a package not installed."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.package or fullname.startswith(self.package + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def uninstall(monkeypatch, package: str) -> None:
    """Make ``import package`` (and its submodules) fail as if it were not installed."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled(package)] + sys.meta_path)


def test_import_optional_names_the_extra(monkeypatch):
    uninstall(monkeypatch, "timm")
    with pytest.raises(MissingExtra, match=r"^the thing needs timm, which is not installed: pip install 'dres\[timm\]'$"):
        import_optional("timm.models.resnet", "timm", "the thing")
    assert issubclass(MissingExtra, ModuleNotFoundError)


def test_an_installed_package_that_fails_to_import_keeps_its_error(monkeypatch):
    import types

    uninstall(monkeypatch, "timm")
    monkeypatch.setitem(sys.modules, "timm", types.ModuleType("timm"))  # found, but a module, not a package
    with pytest.raises(ModuleNotFoundError) as caught:
        import_optional("timm.models.resnet", "timm", "the thing")
    assert not isinstance(caught.value, MissingExtra) and caught.value.name == "timm.models"


def test_timm_models_and_converters_without_timm(monkeypatch):
    import dres
    from dres.models import ResNetClassifier

    uninstall(monkeypatch, "timm")
    with pytest.raises(MissingExtra, match=r"^the resnet50d classifier \(a timm ResNet\) needs timm, which is not "
                                           r"installed: pip install 'dres\[timm\]'$"):
        ResNetClassifier("resnet50d")
    with pytest.raises(MissingExtra, match=r"^convert_timm_resnet needs timm.*dres\[timm\]"):
        dres.convert_timm_resnet(torch.nn.Linear(2, 2))
    vit_like = torch.nn.Module()
    vit_like.blocks = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(MissingExtra, match=r"^convert_timm_vit needs timm.*dres\[timm\]"):
        dres.convert_timm_vit(vit_like)


def test_plots_without_matplotlib(monkeypatch):
    from dres.eval.viz import pyplot

    uninstall(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtra, match=r"^drawing plots needs matplotlib.*pip install 'dres\[plots\]'$"):
        pyplot()


def test_a_resnet_preset_without_timm_is_one_line(monkeypatch, tmp_path, capsys):
    from dres.train import cli

    uninstall(monkeypatch, "timm")
    out = tmp_path / "run"
    code = cli.main(["classify", "--preset", "classify_resnet50d_cifar10", "--out", str(out),
                     "--set", "data.name=synthetic", "--set", "steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["dres-train: error: the resnet50d classifier (a timm ResNet) needs timm, which is not installed: "
                   "pip install 'dres[timm]'"]
    assert not out.exists()  # a start refused before training leaves nothing behind


def test_the_trainers_without_the_train_extra_name_it(monkeypatch):
    import importlib

    import dres.train

    uninstall(monkeypatch, "sklearn")
    with pytest.raises(MissingExtra, match=r"^the trainers \(dres.train\) needs sklearn, which is not installed: "
                                           r"pip install 'dres\[train\]'$"):
        importlib.reload(dres.train)

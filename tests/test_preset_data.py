"""Presets that read data the user brings: without it, one line saying how to make it (dres-prep) and which keys
read it, the same from an installed wheel (whose default shared folder does not exist) as from a checkout."""

import pytest

import dres.data.factory
from dres.data import DataError, load_arrays
from dres.train.config import build_config, list_presets


def _without_shared_shards(monkeypatch, tmp_path):
    # an installed wheel: the default beside the package is a folder that does not exist
    monkeypatch.setattr(dres.data.factory, "default_cifar10_dir", lambda: tmp_path / "site-packages" / "shared" / "cifar10")


@pytest.mark.parametrize("task, preset", [("mae", "mae_cifar10"), ("uvit", "uvit_cifar10"),
                                          ("classify", "classify_cifar10")])
def test_a_cifar_preset_without_shards_says_how_to_make_them(monkeypatch, tmp_path, task, preset):
    _without_shared_shards(monkeypatch, tmp_path)
    with pytest.raises(DataError) as caught:
        load_arrays(build_config(task, preset, []).data, "train")
    message = str(caught.value)
    assert "\n" not in message and "site-packages" not in message
    assert message.startswith("this preset reads CIFAR-10 that you bring")
    assert "`dres-prep <train folder of class folders> <out>/train`" in message
    assert "--set data.name=wds --set data.path=<out>/train --set data.val_path=<out>/val" in message


def test_an_imagefolder_preset_without_a_path_names_the_key_and_dres_prep():
    with pytest.raises(DataError, match=r"^no training data path: set data.path=<folder of class folders> "
                                        r"\(data.name=imagefolder\), or make shards with `dres-prep "):
        load_arrays(build_config("mae", "mae_vit_b16_in1k", []).data, "train")


def test_a_path_given_that_is_missing_is_named(monkeypatch, tmp_path):
    _without_shared_shards(monkeypatch, tmp_path)
    cfg = build_config("mae", "mae_cifar10", [f"data.path={tmp_path / 'nope'}"])
    with pytest.raises(DataError, match=f"^data path not found: {tmp_path / 'nope'}$"):
        load_arrays(cfg.data, "train")


def test_every_preset_of_data_to_bring_says_so_in_its_summary():
    from dres.train.config import preset_summaries

    summaries = preset_summaries()
    for name in list_presets():
        data = build_config(None, name, []).data
        if data.name in ("cifar10_wds", "imagefolder"):
            assert "Data you bring:" in summaries[name] and "dres-prep" in summaries[name], name

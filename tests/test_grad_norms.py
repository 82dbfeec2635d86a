"""experiments.grad_norms: per-block gradient norms of the trainer's own steps, by ResidualDroppath parity."""

import json

import pytest

from experiments import grad_norms

TINY = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.aug=none", "model.img_size=8",
        "model.in_chans=1", "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.patch_size=4",
        "log.progress=false", "log.tensorboard=false", "batch_size=32", "data.mean=[0.3]", "data.std=[0.4]",
        "model.drop_path=0.5"]


def test_groups_are_blocks_else_modules():
    assert grad_norms.group_of("net.layer2.3.conv1.weight") == "net.layer2.3"
    assert grad_norms.group_of("net.layer2.0.downsample.1.weight") == "net.layer2.0.downsample"
    assert grad_norms.group_of("net.layer2.0.conv1.weight") == "net.layer2.0"
    assert grad_norms.group_of("encoder.transformer.blocks.4.attn.qkv.bias") == "encoder.transformer.blocks.4"
    assert grad_norms.group_of("net.fc.weight") == "net.fc" and grad_norms.group_of("cls_token") == "cls_token"


@pytest.mark.parametrize("mode,block0_odd_zero", [("residual_droppath", False), ("residual_droppath_literal", True)])
def test_odd_iterations_of_the_literal_mode_leave_block_zero_without_gradient(mode, block0_odd_zero, tmp_path):
    """Block 0 has rate 0 (linear in depth): residual_droppath trains it on odd iterations too, the literal
    Algorithm 1 detaches it there."""
    res = grad_norms.measure("classify_cifar10", 4, TINY + [f"model.droppath_mode={mode}"], tmp_path / "run",
                             log=lambda msg: None)
    assert (res["even_steps"], res["odd_steps"]) == (2, 2) and res["rates"][:2] == [0.0, 0.0]
    rows = {r["group"]: r for r in res["groups"]}
    block0 = rows["encoder.transformer.blocks.0"]
    assert block0["even_mean"] > 0 and (block0["odd_mean"] == 0) == block0_odd_zero
    assert rows["head"]["odd_mean"] > 0  # the head is trained on every iteration


def test_cli_writes_the_json_and_refuses_an_existing_file(tmp_path, capsys):
    out = tmp_path / "norms.json"
    args = ["--preset", "classify_cifar10", "--steps", "2", "--out", str(out)] + sum(
        [["--set", s] for s in TINY + ["model.droppath_mode=residual_droppath"]], [])
    assert grad_norms.main(args) == 0
    assert json.loads(out.read_text())["odd_steps"] == 1
    assert grad_norms.main(args) == 2 and "exists" in capsys.readouterr().err
    assert grad_norms.main(args[:3] + ["1", "--out", str(tmp_path / "x.json")]) == 2

"""FSDP2 on two CPU processes (gloo, explicit CPU device mesh) against one process at the same
global batch, and a DCP save/load round trip.

Tolerance: the two runs compute the same global batch in different reduction orders (two local
means averaged by the gradient reduce-scatter instead of one mean), so losses agree to float32
rounding, amplified a little by Adam over the steps: we require |diff| <= 1e-5 relative per step.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from helpers import process_group
from tiny_models import tiny_classifier, tiny_mae, tiny_uvit

OVR = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.mean=[0.3]", "data.std=[0.4]",
       "model.img_size=8", "model.patch_size=4", "model.in_chans=1", "model.embed_dim=32", "model.depth=2",
       "model.num_heads=2", "model.num_classes=10", "batch_size=32", "steps=4", "optim.lr=1e-3",
       "optim.warmup_steps=1", "log.every=1", "log.progress=false", "log.tensorboard=false", "ckpt.every=0",
       "fsdp_param_dtype=fp32", "eval.probe=false", "device=cpu"]


def _worker(rank, group, out, mode, tag, extra):
    os.environ.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from dres.train import distributed
    from dres.train.classify import TASK
    from dres.train.config import build_config
    from dres.train.loop import Trainer

    cfg = build_config("classify", None, OVR + extra + [f"dist={mode}", f"out={out}/{tag}"])
    trainer = Trainer(cfg, TASK, log=lambda m: None).setup()
    trainer.fit()
    res = {"losses": [h["loss"] for h in trainer.history]}
    if mode == "fsdp":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # a group of modules shares one FSDP state (one all-gather, one set of hooks)
        res["fsdp_units"] = len({id(fully_shard.state(m)) for m in trainer.raw_model.modules() if isinstance(m, FSDPModule)})
        trainer.save()  # DCP directory (ckpt.format auto under FSDP)
        full = {k: v.full_tensor() for k, v in trainer.raw_model.state_dict().items() if hasattr(v, "full_tensor")}
        cfg2 = build_config("classify", None, OVR + extra + [f"dist={mode}", f"out={out}/{tag}"])
        tr2 = Trainer(cfg2, TASK, log=lambda m: None).setup()
        with torch.no_grad():  # other weights than the checkpoint's (a resume keeps the seed)
            for p in tr2.raw_model.parameters():
                p.add_(1.0)
        before = max((tr2.raw_model.state_dict()[k].full_tensor() - v).abs().max().item() for k, v in full.items())
        tr2.resume("auto")
        after = max((tr2.raw_model.state_dict()[k].full_tensor() - v).abs().max().item() for k, v in full.items())
        res.update(before=before, after=after, step=tr2.step, is_dir=os.path.isdir(tr2.last_good),
                   optim_state=len(tr2.optimizer.state))
    if rank == 0:
        with open(f"{out}/{tag}.json", "w") as f:
            json.dump(res, f)
    distributed.cleanup()
    # Leave without running C++ static destructors: about one run in a few on the 2-core CI machine,
    # gloo's threads were still joinable when the interpreter tore down and the process aborted
    # ("terminate called without an active exception") after all the work above had succeeded.
    os._exit(0)


def _launch(world, tmp_path, mode, tag=None, extra=()):
    tag = tag or mode
    with process_group(world) as group:
        mp.spawn(_worker, args=(group, str(tmp_path), mode, tag, list(extra)), nprocs=world, join=True)
    with open(tmp_path / f"{tag}.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_fsdp2_two_cpu_processes_match_one_process_and_dcp_round_trip(tmp_path):
    one = _launch(1, tmp_path, "none")
    two = _launch(2, tmp_path, "fsdp")
    # fsdp_prefetch: units stay gathered to the backward and prefetch the next; the same math
    prefetched = _launch(2, tmp_path, "fsdp", "fsdp_prefetch", ["fsdp_prefetch=true", "fsdp_blocks_per_unit=1"])
    assert len(one["losses"]) == len(two["losses"]) == len(prefetched["losses"]) == 4
    for a, b, c in zip(one["losses"], two["losses"], prefetched["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (one["losses"], two["losses"])
        assert abs(a - c) <= 1e-5 * abs(a), (one["losses"], prefetched["losses"])
    # fsdp_blocks_per_unit: the 2 blocks in one unit by default (4 a unit), one each at 1; plus the root
    assert two["fsdp_units"] == 2 and prefetched["fsdp_units"] == 3
    # the losses move (training happened), so the match is not vacuous
    assert one["losses"][0] != one["losses"][-1]
    # DCP round trip: a differently seeded model differs before loading and is identical after
    assert two["is_dir"] and two["step"] == 4
    assert two["before"] > 1e-3 and two["after"] == 0.0
    assert two["optim_state"] > 0
    assert prefetched["step"] == 4 and prefetched["after"] == 0.0


def _droppath_worker(rank, group, out):
    os.environ.update(group, RANK=str(rank))
    import torch.distributed as dist


    dist.init_process_group("gloo")
    model = tiny_classifier(drop_path=0.5, droppath_mode="residual_droppath", droppath_seed=3)
    model.train()(torch.randn(64, 3, 8, 8))
    torch.save({"masks": model.droppath.masks, "rank": model.droppath.stream_rank}, f"{out}/masks{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # as _worker: skip gloo's static destructors


def test_droppath_masks_differ_per_rank_under_torch_distributed(tmp_path):
    """A model built the trainer's way (one seed for all ranks) draws other masks on
    every rank, each the masks of an explicitly ranked controller of the same seed."""
    from dres.nn import ResidualDroppath

    with process_group(2) as group:
        mp.spawn(_droppath_worker, args=(group, str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"masks{r}.pt") for r in range(2)]
    assert [g["rank"] for g in got] == [0, 1]
    assert not torch.equal(got[0]["masks"], got[1]["masks"])
    for r in range(2):
        want = ResidualDroppath(0.5, 4, mode="residual_droppath", seed=3, rank=r)
        want.scales(64, "cpu")
        assert torch.equal(got[r]["masks"], want.masks)


def test_units_are_whole_dres_blocks():
    """A dres Block's forward touches only its own parameters, so each block is one FSDP2 unit (and
    one torch.compile region): MAE tiny = encoder + decoder blocks, no attention/MLP sub-units."""
    from dres.nn import Block
    from dres.train.distributed import parallel_units

    model = tiny_mae(variant="official", alpha_min=0.6)
    units = parallel_units(model)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert units == blocks and len(units) == len(model.encoder.transformer.blocks) + len(model.decoder.blocks)
    classifier, uvit = tiny_classifier(), tiny_uvit()
    assert parallel_units(classifier) == list(classifier.encoder.transformer.blocks)
    assert parallel_units(uvit) == list(uvit.transformer.blocks)  # in-, mid and out-blocks; skip Linears in the root
    with pytest.raises(TypeError, match="Linear does not list its blocks"):
        parallel_units(torch.nn.Linear(2, 2))


def test_per_block_compile_matches_eager():
    """The trainer's compile=true compiles each unit (each dres Block, called as (hidden_states,
    residual, scales, entering_alpha) with a hook's alpha as a float or None, and the official MAE's
    skip layers): loss and gradients match eager."""
    import copy

    from dres.train.distributed import apply_compile

    torch.manual_seed(0)
    model = tiny_mae(variant="official", alpha_min=0.6)
    with torch.no_grad():  # move every zero-initialised branch end off zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    compiled = copy.deepcopy(model)
    n_units = len(model.encoder.transformer.blocks) + len(model.decoder.blocks) + len(model.skips)
    assert len(model.skips) > 0 and apply_compile(compiled) == n_units
    imgs, noise = torch.randn(4, 3, 8, 8), torch.rand(4, 4)
    losses = []
    for m in (model, compiled):
        loss, _, _ = m(imgs, noise=noise)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


# FSDP2 wrappings of apply_fsdp/apply_ddp, each against the unwrapped model on the whole batch
WRAPPINGS = {
    "fsdp_auto": dict(kind="fsdp"),
    "fsdp_always": dict(kind="fsdp", reshard="always"),
    "fsdp_never": dict(kind="fsdp", reshard="never"),
    "fsdp_except_last_2_blocks": dict(kind="fsdp", reshard="except_last", blocks_per_unit=2),
    "fsdp_prefetch_2_blocks": dict(kind="fsdp", prefetch=True, blocks_per_unit=2),
    "ddp_bucket_view": dict(kind="ddp", bucket_view=True),
}


def _mae(variant="official"):

    torch.manual_seed(0)
    model = tiny_mae(variant=variant, alpha_min=0.6)
    with torch.no_grad():  # move every zero-initialised branch end off zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _wrap(model, info, kind, bucket_view=False, **fsdp):
    from dres.train import distributed

    if kind == "ddp":
        return distributed.apply_ddp(model, info, bucket_view=bucket_view)
    return distributed.apply_fsdp(model, info, "fp32", **fsdp)


def _train(model, imgs, noise, steps=3):
    """Losses (mean over the ranks) of ``steps`` SGD steps on ``imgs`` (SGD: the parameters then
    differ by the gradients' rounding, which Adam's normalisation would blow up where gradients
    are tiny; the trainer's FSDP2 test covers AdamW on DTensors)."""
    from dres.train.distributed import all_mean

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss, _, _ = model(imgs, noise=noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(all_mean(loss.detach()).item())
    return losses


def _wrappings_worker(rank, group, out):
    os.environ.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from dres.train import distributed

    info = distributed.init("cpu", "fsdp")
    g = torch.Generator().manual_seed(1)
    imgs, noise = torch.randn(8, 3, 8, 8, generator=g), torch.rand(8, 4, generator=g)
    reference = _mae()
    res = {"reference": _train(reference, imgs, noise),
           "reference_params": {n: p.tolist() for n, p in reference.named_parameters()}}
    world = info.world
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)  # this rank's share of the batch
    for tag, spec in WRAPPINGS.items():
        model = _mae()
        kept = []
        # the root's forward hook runs after every unit's post-forward: the units that keep their
        # gathered parameters hold plain tensors then, the resharded ones DTensors
        def record_kept(*_, model=model, kept=kept):
            if not kept:
                kept.extend(not hasattr(next(u.parameters()), "full_tensor") for u in distributed.parallel_units(model))

        model.register_forward_hook(record_kept)
        wrapped = _wrap(model, info, **spec)
        res[tag] = {"losses": _train(wrapped, imgs[mine], noise[mine]), "kept": kept,
                    "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).tolist()
                               for n, p in model.named_parameters()}}
        distributed.barrier()
    if rank == 0:
        with open(f"{out}/wrappings{world}.json", "w") as f:
            json.dump(res, f)
    distributed.cleanup()
    os._exit(0)  # as _worker: skip gloo's static destructors


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_reshard_policies_unit_groups_and_ddp_bucket_view_match_one_process(tmp_path, world):
    """Every candidate wrapping trains like the unwrapped model on the whole batch (fp32: losses,
    averaged over the ranks, at each step and the final parameters). Which units keep their
    gathered parameters after the forward follows the reshard policy: auto keeps all on one rank
    and all but the last elsewhere; a group of 2 blocks reshards as a whole."""
    with process_group(world) as group:
        mp.spawn(_wrappings_worker, args=(group, str(tmp_path)), nprocs=world, join=True)
    with open(tmp_path / f"wrappings{world}.json") as f:
        res = json.load(f)
    ref = res["reference_params"]
    assert res["reference"][0] != res["reference"][-1]  # it trained
    for tag in WRAPPINGS:
        got = res[tag]
        assert got["losses"] == pytest.approx(res["reference"], rel=1e-5), tag
        for name, want in ref.items():
            torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(want), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, t=tag: f"{t} {n}: {m}")
    n = len(res["fsdp_auto"]["kept"])
    assert n == 4 and res["ddp_bucket_view"]["kept"] == [True] * n
    assert res["fsdp_auto"]["kept"] == ([True] * n if world == 1 else [False] * (n - 1) + [True])
    assert res["fsdp_always"]["kept"] == [False] * n
    assert res["fsdp_never"]["kept"] == [True] * n
    assert res["fsdp_except_last_2_blocks"]["kept"] == [False] * (n - 2) + [True] * 2
    assert res["fsdp_prefetch_2_blocks"]["kept"] == [True] * n


def _input_dtypes_worker(rank, group, out):
    os.environ.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from dres.train import distributed

    info = distributed.init("cpu", "fsdp")
    seen = {}

    def record(name, block=False):
        def hook(module, args, kwargs):
            if block:  # the stream: `residual`, or `hidden_states` where it is None (the first block, a replaced stream)
                residual = args[1] if len(args) > 1 else kwargs.get("residual")
                floats = [args[0] if residual is None else residual]
            else:
                floats = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()]
            seen.setdefault(name, set()).update(str(a.dtype) for a in floats)
        return hook

    mae, uvit = _mae(), tiny_uvit()
    for tag, model in (("mae", mae), ("uvit", uvit)):
        distributed.apply_fsdp(model, info, "bf16")
        # registered after fully_shard: runs after FSDP2's own pre-forward hook, on what the module gets
        model.register_forward_pre_hook(record(f"{tag} root"), with_kwargs=True)
        for i, u in enumerate(distributed.parallel_units(model)):
            u.register_forward_pre_hook(record(f"{tag} unit {i}", block=True), with_kwargs=True)
    g = torch.Generator().manual_seed(2)
    imgs = torch.randn(4, 3, 8, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = mae(imgs, noise=torch.rand(4, 4, generator=g))
        eps = uvit(imgs, torch.tensor([1.0, 517.0, 998.0, 999.0]))
    (loss + eps.float().square().mean()).backward()
    if rank == 0:
        with open(f"{out}/dtypes.json", "w") as f:
            json.dump({k: sorted(v) for k, v in seen.items()}, f)
    distributed.cleanup()
    os._exit(0)  # as _worker: skip gloo's static destructors


def test_fsdp_bf16_parameters_leave_inputs_in_fp32(tmp_path):
    """With bf16 parameters, FSDP2 casts no forward input: MAE's image (and so its norm-pix target)
    and U-ViT's noisy image and diffusion time (517 is not a bf16 number) reach the model in fp32,
    and every block receives the residual stream in the model's own dtype: fp32, but for U-ViT's out-block,
    whose stream is its skip Linear's output, bf16 under autocast; autocast does the casting at the matmuls."""
    with process_group(1) as group:
        mp.spawn(_input_dtypes_worker, args=(group, str(tmp_path)), nprocs=1, join=True)
    with open(tmp_path / "dtypes.json") as f:
        seen = json.load(f)
    assert {"mae root", "uvit root", "mae unit 3", "uvit unit 2"} <= set(seen)
    want = {name: ["torch.float32"] for name in seen}
    want["uvit unit 2"] = ["torch.bfloat16"]  # the tiny U-ViT: in-block, mid block, out-block
    assert seen == want

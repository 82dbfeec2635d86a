"""Park's Algorithm 1 read literally (``residual_droppath_literal``): an odd iteration detaches every kept
branch, the never-dropped ones of rate 0 (block 0 under the linear-in-depth rule) included, where
``residual_droppath`` leaves rate-0 residuals unscaled (full gradient on odd iterations)."""

import torch

from dres.nn import ResidualDroppath


def test_literal_mode_detaches_rate_zero_residuals_on_odd_iterations_only():
    literal, usual = ResidualDroppath(0.1, 6, mode="residual_droppath_literal"), ResidualDroppath(0.1, 6)
    assert literal.rates[:2] == [0.0, 0.0] and usual.rates == literal.rates  # block 0: rate 0
    even = literal.scales(8, "cpu")
    for row, grad in even[:2]:  # never dropped: the value and the gradient of a plain residual
        assert torch.equal(row, torch.ones(8)) and torch.equal(grad, torch.ones(8))
    assert usual.scales(8, "cpu")[:2] == [(None, None), (None, None)]
    literal.next_iteration()
    usual.next_iteration()
    odd = literal.scales(8, "cpu")
    for row, grad in odd[:2]:  # kept, so detached: the plain value, no gradient into the branch
        assert torch.equal(row, torch.ones(8)) and torch.equal(grad, torch.zeros(8))
    assert usual.scales(8, "cpu")[:2] == [(None, None), (None, None)]
    # the dropped residuals' scales are the same in both readings
    for (row_l, grad_l), (row_u, grad_u) in zip(odd[2:], usual.scales(8, "cpu")[2:]):
        assert torch.equal(row_l, row_u) and torch.equal(grad_l, grad_u)


def test_literal_mode_stops_block_zeros_branch_gradient_on_odd_iterations():
    """A tiny ViT classifier: block 0's branch weights get no gradient on an odd iteration of the literal mode,
    and some under residual_droppath."""
    from dres.models import ViTClassifier

    grads = {}
    for mode in ("residual_droppath", "residual_droppath_literal"):
        torch.manual_seed(0)
        model = ViTClassifier(img_size=8, patch_size=4, in_chans=3, num_classes=3, embed_dim=16, depth=2, num_heads=2,
                              drop_path=0.5, droppath_mode=mode, backend="torch").train()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
        for _ in range(2):  # the even iteration, then the odd one
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        fc2 = model.encoder.transformer.blocks[0].mlp.fc2.weight.grad
        grads[mode] = fc2.abs().sum().item()
    assert grads["residual_droppath_literal"] == 0.0 < grads["residual_droppath"]

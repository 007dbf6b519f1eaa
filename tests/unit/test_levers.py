"""The training levers beside the recipe (drafter/levers.py): D-PACE position weights, loss and gradient, against a
direct float64 computation; Muon + AdamW as one optimizer that a checkpoint saves and a resume continues exactly."""

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from dflash_pipeline.drafter.batching import block_loss
from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.head_loss import head_loss
from dflash_pipeline.drafter.levers import OptimizerPair, build_optimizer, dpace_weights, lr_schedule


def direct_dpace(ce: list[float], supervised: list[bool], alpha: float) -> list[float]:
    """D-PACE's weight of each position of one block, written out as its definition: the sum over later supervised
    positions m of the product of smoothed confidences up to m."""
    s = [(1 - alpha) * math.exp(-c) + alpha if m else 1.0 for c, m in zip(ce, supervised, strict=True)]
    out = []
    for k in range(len(ce)):
        if not supervised[k]:
            out.append(0.0)
            continue
        out.append(sum(math.prod(s[: m + 1]) for m in range(k, len(ce)) if supervised[m]))
    return out


def test_dpace_weights_are_their_definition():
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(5, 7, generator=g, dtype=torch.float64) * 4
    sup = torch.rand(5, 7, generator=g) > 0.3
    sup[:, 0] = False  # the anchor
    w = dpace_weights(ce, sup, 0.5)
    for row in range(5):
        want = direct_dpace(ce[row].tolist(), sup[row].tolist(), 0.5)
        assert w[row].tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert (w[~sup] == 0).all()
    # a certain draft (CE 0) weighs every supervised position by how many supervised positions follow it
    ones = dpace_weights(torch.zeros(1, 4, dtype=torch.float64), torch.tensor([[False, True, True, True]]), 0.5)
    assert ones.tolist() == [[0.0, 3.0, 2.0, 1.0]]


def test_dpace_weights_carry_no_gradient():
    ce = torch.rand(2, 4, dtype=torch.float64, requires_grad=True)
    assert not dpace_weights(ce, torch.ones(2, 4, dtype=torch.bool), 0.3).requires_grad


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_block_loss_with_dpace_equals_direct_float64(rows, monkeypatch):
    """block_loss(dpace_alpha) over a [B, N, bs] batch, its chunks of `rows`: loss and gradient equal to plain
    autograd over all logits with the weights computed from the definition (detached)."""
    import dflash_pipeline.drafter.batching as batching

    monkeypatch.setattr(batching, "head_loss", lambda *a, **k: head_loss(*a, **k, rows=rows))
    g = torch.Generator().manual_seed(rows)
    b, n, bs, hid, vocab = 2, 3, 4, 8, 29
    out = torch.randn(b, n * bs, hid, generator=g, dtype=torch.float64)
    lm = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (b, n, bs), generator=g)
    weights = torch.rand(b, n, bs, generator=g, dtype=torch.float64) + 0.1
    weights[..., 0] = 0.0  # the anchor
    weights[1, 2, 2:] = 0.0  # a block past its sample's end
    blk = {"weights": weights, "labels": labels}
    head = type("Head", (), {"lm_head": torch.nn.Linear(hid, vocab, bias=False, dtype=torch.float64)})()
    head.lm_head.weight.data.copy_(lm)

    o1 = out.clone().requires_grad_(True)
    loss1, stats = block_loss(o1, head, blk, None, dpace_alpha=0.5)
    (loss1 * 0.37).backward()

    o2 = out.clone().requires_grad_(True)
    ce = -F.log_softmax(o2.reshape(b, n, bs, hid) @ lm.t(), dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    sup = weights > 0
    w = torch.tensor(
        [direct_dpace(c, m, 0.5) for c, m in zip(ce.detach().reshape(-1, bs).tolist(), sup.reshape(-1, bs).tolist())],
        dtype=torch.float64,
    ).reshape(b, n, bs)
    loss2 = (ce * w).sum() / w.sum()
    (loss2 * 0.37).backward()

    torch.testing.assert_close(loss1, loss2, rtol=1e-12, atol=0)
    torch.testing.assert_close(o1.grad, o2.grad, rtol=1e-10, atol=1e-13)
    assert int(stats["tokens"]) == int(sup.sum())


def test_dpace_is_refused_with_distillation():
    with pytest.raises(ValidationError, match="position_weight=dpace.*distill"):
        TrainConfig(position_weight="dpace", distill=True)
    with pytest.raises(ValueError, match="not distillation"):
        head_loss(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), torch.ones(2),
                  lambda s: torch.zeros(2, 5), reweight=lambda ce: ce)  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def _steps(model, opt, sched, xs):
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def test_muon_takes_the_matrices_and_adamw_the_rest():
    model = _model()
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02), fused=False)
    assert isinstance(opt, OptimizerPair)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert len([p for g in adamw.param_groups for p in g["params"]]) == 4  # two biases, the norm's weight and bias
    assert [g["lr"] for g in opt.param_groups] == [0.02, 1e-3]


def test_muon_pair_resumes_exactly_from_its_state_dict():
    """Five steps in one go equal three steps, a save of the optimizer and schedule, and two more after loading them
    into fresh objects: what a checkpoint and a resume do (drafter/checkpoint.py saves opt.state_dict())."""
    cfg = TrainConfig(optimizer="muon", lr=1e-3)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 6, generator=g) for _ in range(5)]

    def fresh():
        model = _model()
        opt = build_optimizer(model, cfg, fused=False)
        sched = lr_schedule(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched

    m1, o1, s1 = fresh()
    _steps(m1, o1, s1, xs)

    m2, o2, s2 = fresh()
    _steps(m2, o2, s2, xs[:3])
    saved = ({k: v.clone() for k, v in m2.state_dict().items()}, o2.state_dict(), s2.state_dict())
    m3, o3, s3 = fresh()
    m3.load_state_dict(saved[0])
    o3.load_state_dict(saved[1])
    s3.load_state_dict(saved[2])
    _steps(m3, o3, s3, xs[3:])
    for a, b in zip(m1.parameters(), m3.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [g["lr"] for g in o3.param_groups] == [g["lr"] for g in o1.param_groups]


def test_an_adamw_checkpoint_is_not_loaded_into_muon():
    model = _model()
    adamw_state = build_optimizer(model, TrainConfig(), fused=False).state_dict()
    with pytest.raises(ValueError, match="not Muon \\+ AdamW"):
        build_optimizer(model, TrainConfig(optimizer="muon"), fused=False).load_state_dict(adamw_state)

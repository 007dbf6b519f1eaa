"""Training levers beside the DFlash recipe's defaults: D-PACE position weights and Muon for the 2-D weights.

D-PACE (the per-position weight `speculators` trains DFlash with by default since Aug 2026): a block's drafted
token k is only accepted if tokens 1..k-1 were, so the weight of position k follows the draft's own confidence
in the positions before it. With q_j = exp(-CE_j) the detached probability of the right token at position j and
s_j = (1 - alpha) q_j + alpha (smoothed; 1 where j is not supervised), the weight of position k is
sum_{m >= k} mask_m prod_{j <= m} s_j: the expected number of accepted tokens that position k takes part in. It
replaces the fixed exp(-(k-1)/gamma) decay and carries no gradient of its own (the confidences are detached).

Muon orthogonalizes the update of 2-D weight matrices (Newton-Schulz); everything else (norm weights, biases)
stays with AdamW. The drafter's embedding and lm_head are the target's, frozen, so every trained matrix is Muon's.
"""

from __future__ import annotations

import torch


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """[..., block_size] D-PACE weights from per-position cross-entropy `ce` and the `supervised` mask (bool) of the
    same shape; 0 where not supervised. Computed without gradient."""
    with torch.no_grad():
        mask = supervised.to(torch.float64 if ce.dtype == torch.float64 else torch.float32)
        q = torch.exp(-ce.to(mask.dtype))
        smooth = torch.where(supervised, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(smooth, dim=-1)
        return (prefix * mask).flip(-1).cumsum(-1).flip(-1) * mask


class OptimizerPair:
    """Muon over the 2-D weights and AdamW over the rest, stepped together, with one state dict (a checkpoint
    holds both) and one list of param groups (the learning-rate schedule scales each group's own lr)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer | None):
        self.parts = [muon] + ([adamw] if adamw is not None else [])

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self):
        return {k: v for part in self.parts for k, v in part.state.items()}

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get("optimizers")
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            raise ValueError(
                "the checkpoint's optimizer state is not Muon + AdamW (it was saved with train.optimizer=adamw): "
                "resume with the optimizer it was trained with, or start a new training in another output_dir"
            )
        for part, s in zip(self.parts, parts, strict=True):
            part.load_state_dict(s)


class SchedulePair:
    """One learning-rate schedule per optimizer of an OptimizerPair (torch's schedulers take one optimizer each),
    stepped together and saved as one state dict."""

    def __init__(self, pair: OptimizerPair, lr_lambda):
        self.parts = [torch.optim.lr_scheduler.LambdaLR(part, lr_lambda) for part in pair.parts]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def get_last_lr(self) -> list[float]:
        return [lr for part in self.parts for lr in part.get_last_lr()]

    def state_dict(self) -> dict:
        return {"schedules": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        for part, s in zip(self.parts, state["schedules"], strict=True):
            part.load_state_dict(s)


def lr_schedule(opt, lr_lambda):
    """The learning-rate schedule `lr_lambda` (a factor of each group's lr by step) over `opt`."""
    if isinstance(opt, OptimizerPair):
        return SchedulePair(opt, lr_lambda)
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def build_optimizer(model: torch.nn.Module, cfg, fused: bool):
    """The optimizer `train.optimizer` names over the model's trainable parameters."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in params], lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    matrices = [p for _, p in params if p.ndim == 2 and min(p.shape) > 1]
    rest = [p for _, p in params if not (p.ndim == 2 and min(p.shape) > 1)]
    muon = torch.optim.Muon(
        matrices,
        lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
        momentum=0.95,
        weight_decay=cfg.muon_weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused) if rest else None
    return OptimizerPair(muon, adamw)

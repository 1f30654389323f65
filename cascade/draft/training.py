"""Distillation loop: KL to the target's top-k distribution plus cross-entropy on the text.

Deterministic for a seed (the batch order is a function of seed and step), resumable (a checkpoint
with model, optimizer, schedule and step is written whole every ``checkpoint_every`` steps), and
device-agnostic (bf16 autocast on CPU and CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cascade import atomic


@dataclass(frozen=True)
class TrainPlan:
    steps: int = 1200
    batch: int = 16
    """Windows per step."""
    lr: float = 2e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    ce_weight: float = 0.2
    """Weight of cross-entropy on the text next to the KL to the target."""
    checkpoint_every: int = 100
    seed: int = 0


@dataclass
class StepMetrics:
    loss: float
    kl: float
    agreement: float
    """Fraction of positions where the draft's argmax is the target's."""


def distillation_loss(
    logits: torch.Tensor, tokens: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, ce_weight: float
) -> tuple[torch.Tensor, StepMetrics]:
    """logits [B, W, V]; tokens [B, W]; top_ids / top_logprobs [B, W, K] (the target's, sorted)."""
    draft_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, W, V]
    target_probs = torch.softmax(top_logprobs.float(), dim=-1)  # [B, W, K], renormalised over the top k
    kl = -(target_probs * draft_logprobs.gather(-1, top_ids.long())).sum(-1).mean()
    kl = kl + (target_probs * target_probs.clamp_min(1e-12).log()).sum(-1).mean()
    ce = F.nll_loss(draft_logprobs[:, :-1].flatten(0, 1), tokens[:, 1:].flatten().long())
    loss = kl + ce_weight * ce
    agreement = (draft_logprobs.argmax(-1) == top_ids[..., 0]).float().mean()
    return loss, StepMetrics(loss.item(), kl.item(), agreement.item())


def batch_indices(step: int, batch: int, count: int, seed: int) -> torch.Tensor:
    """Windows of ``step``: consecutive slices of a per-epoch permutation seeded by (seed, epoch)."""
    start = step * batch
    picked = []
    while len(picked) < batch:
        epoch, offset = divmod(start + len(picked), count)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        picked += order[offset : offset + batch - len(picked)].tolist()
    return torch.tensor(picked)


def lr_factor(plan: TrainPlan) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < plan.warmup:
            return (step + 1) / plan.warmup
        progress = (step - plan.warmup) / max(1, plan.steps - plan.warmup)
        return plan.min_lr_ratio + (1 - plan.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class Trainer:
    """Owns the draft, its optimizer and schedule, and the checkpoint file that resumes them."""

    def __init__(
        self,
        draft: torch.nn.Module,
        data: dict[str, torch.Tensor],
        plan: TrainPlan,
        checkpoint: Path,
        device: torch.device,
    ) -> None:
        self.draft, self.data, self.plan = draft.to(device), data, plan
        self.checkpoint, self.device = checkpoint, device
        decay = [p for n, p in draft.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in draft.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": plan.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=plan.lr,
            betas=(0.9, 0.95),
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(plan))
        self.step = 0
        if checkpoint.exists():
            self.resume()

    def resume(self) -> None:
        state = torch.load(self.checkpoint, map_location=self.device)
        if state["plan"] != asdict(self.plan):
            raise ValueError(
                f"{self.checkpoint} was written with a different plan {state['plan']}; "
                f"pass the same settings or start in a new work directory"
            )
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.step = state["step"]

    def save(self) -> None:
        state = {
            "draft": self.draft.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "step": self.step,
            "plan": asdict(self.plan),
        }
        with atomic.replacing(self.checkpoint) as partial:
            torch.save(state, partial)

    def train_step(self) -> StepMetrics:
        rows = batch_indices(self.step, self.plan.batch, len(self.data["tokens"]), self.plan.seed)
        tokens, top_ids, top_logprobs = (
            self.data[key][rows].to(self.device) for key in ("tokens", "top_ids", "top_logprobs")
        )
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.draft(input_ids=tokens.long()).logits  # [B, W, V]
        loss, metrics = distillation_loss(logits, tokens, top_ids, top_logprobs, self.plan.ce_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.step += 1
        return metrics

    def run(self, on_step: Callable[[int, StepMetrics], None]) -> None:
        torch.manual_seed(self.plan.seed + self.step)
        self.draft.train()
        while self.step < self.plan.steps:
            metrics = self.train_step()
            on_step(self.step, metrics)
            if self.step % self.plan.checkpoint_every == 0 or self.step == self.plan.steps:
                self.save()

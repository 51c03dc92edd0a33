"""The optimizer and learning-rate schedule of training: AdamW, linear warmup, cosine decay."""

from __future__ import annotations

import math

import torch

from kda_cp.train.config import OptimConfig

__all__ = ["lr_lambda", "build_optimizer", "build_scheduler", "sync_lr"]


def lr_lambda(cfg: OptimConfig, max_steps: int):
    """Multiplier of the peak lr at a step: linear warmup, then cosine down to min_lr_ratio."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices only (not on embeddings, norms, biases, gate scales)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    """The LambdaLR of :func:`lr_lambda` over ``max_steps`` steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, max_steps))


def sync_lr(optimizer, scheduler) -> None:
    """After loading a checkpoint: set every group's lr from this run's schedule at the loaded step.

    The optimizer's state restores the lr it last used, from the checkpoint's schedule; a resume
    that changed trainer.max_steps has a different cosine, which must apply from the resumed step
    on (LambdaLR's own state keeps the step count and base lrs, not the lambdas)."""
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs

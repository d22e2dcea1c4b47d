"""AdamW with decoupled weight decay on matrices only; its step (clip, then the update unless
the step is non-finite: optimizer_step); and warmup + cosine learning rate (and what becomes of
it when a resumed run is given another length: extend_schedule); and the batch schedule beside it
(global_batch_at: train.batch_ramp, and the points batch_ramp = "auto" decided; batch_lr_scale:
what a larger batch does to the rate)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ndtrain.compat.torch import skips_on_device, step_unless
from ndtrain.parallel.grad_norm import clip_scale, scale_grads


def build_optimizer(model_parts: list[nn.Module], cfg) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in (p for part in model_parts for p in part.parameters()):
        if p.requires_grad:
            # Norm gains (1-D) are not decayed: shrinking them only fights the normalisation.
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[cfg.implementation]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)


def optimizer_step(optimizer: torch.optim.Optimizer, params, grad_clip: float, grad_norm: torch.Tensor,
                   applied: torch.Tensor, skipped: Callable[[], bool], host_decides: bool = False) -> None:
    """Clips the gradients to `grad_clip` (0: no clipping) and applies the update unless the step
    is non-finite. `grad_norm` and `applied` (1.0 when loss and norm are finite, else 0.0) are
    device scalars; clipping scales by a factor computed on the device (like torch's
    clip_grad_norm_), so it reads nothing. The skip: fused AdamW takes torch's GradScaler door
    (`found_inf`, a device flag: its kernel leaves weights, moments and step counts alone), so
    the decision never reaches the host; foreach and for-loop AdamW have no such door, and with
    `host_decides` (DiLoCo agrees on the host) the host decides too, asking `skipped()` (a read of
    the step's values: a sync on a GPU)."""
    on_host = host_decides or not skips_on_device(optimizer)
    if on_host and skipped():
        return
    if grad_clip > 0:
        scale_grads(params, clip_scale(grad_norm, grad_clip))
    if on_host:
        optimizer.step()
        return
    step_unless(optimizer, (1.0 - applied).to(torch.float32))


def lr_at(step: int, cfg, total_steps: int, segment: list | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup, then cosine (or constant) down
    to lr * min_lr_ratio at `total_steps`. `segment` [start, end, peak, warmup]: the curve a run
    extended on resume follows instead (extend_schedule), from step `start`."""
    start, end, peak, warmup = segment if segment is not None else (0, total_steps, cfg.lr, cfg.warmup_steps)
    k = step - start
    if warmup and k < warmup:
        return peak * (k + 1) / warmup
    if cfg.schedule == "constant":
        return peak
    progress = min(1.0, (k - warmup) / max(1, end - start - warmup))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# What optimizer.extend does to the schedule where a resume finds train.steps changed.
EXTEND = {
    "stretch": "recomputes the schedule over the new length, as a fresh run of {now} steps would have it",
    "keep": "keeps the checkpoint's schedule: the steps past {before} run at its final rate",
    "decay": "decays from the checkpoint's rate at step {step} to the floor at step {now}",
    "restart": "warms up again from step {step} and decays to the floor at step {now}",
}


def extend_schedule(cfg, progress) -> str | None:
    """The schedule this run's steps follow, in `progress.lr_schedule` ({"steps": the train.steps
    it was made for, "segment": lr_at's segment or None for the config's own}); where a resume
    finds train.steps changed, optimizer.extend decides the new one, and the line saying so is
    returned (else None). Idempotent: a run resumed again (or rolled back) with the same
    train.steps keeps the schedule its checkpoint recorded."""
    opt, now, step = cfg.optimizer, cfg.train.steps, progress.step
    saved = progress.lr_schedule
    if saved is None or saved["steps"] == now:
        progress.lr_schedule = saved or {"steps": now, "segment": None}
        return None
    before, segment = saved["steps"], saved["segment"]
    old = segment if segment is not None else [0, before, opt.lr, opt.warmup_steps]
    mode = opt.extend
    if mode == "stretch":  # the config's own schedule (None), or an earlier segment's end moved
        new = None if segment is None else [old[0], now, old[2], old[3]]
    elif mode == "keep":
        new = old
    elif mode == "decay" and step >= old[0] + old[3]:
        new = [step, now, lr_at(step, opt, before, old), 0]
    elif mode == "decay":  # still warming up: finish the warmup, then decay to the new end
        new = [old[0], now, old[2], old[3]]
    else:  # restart
        new = [step, now, opt.lr, opt.warmup_steps]
    progress.lr_schedule = {"steps": now, "segment": new}
    what = EXTEND[mode].format(before=before, now=now, step=step)
    return (f"train.steps {before} -> {now} on resume at step {step}: optimizer.extend = \"{mode}\" {what}; "
            f"step {step + 1} learns at {lr_at(step, opt, now, new):.2e}, where the checkpoint's schedule gave "
            f"{lr_at(step, opt, before, old):.2e} (other choices: {', '.join(m for m in EXTEND if m != mode)}; "
            f"docs/checkpoints.md)")


def global_batch_at(cfg, tokens_seen: int, decided: list | None = None) -> int:
    """The global batch (sequences) for the next step; `batch_ramp` raises it by tokens seen
    (with "auto", by the points `decided` at checkpoint boundaries, which the checkpoint keeps)."""
    gb = cfg.train.global_batch
    ramp = (decided or []) if cfg.train.batch_ramp == "auto" else cfg.train.batch_ramp
    for threshold, batch in sorted(ramp):
        if tokens_seen >= threshold:
            gb = batch
    return gb


# The exponent of (batch / train.global_batch) that scales the learning rate (optimizer.batch_lr_rule):
# sqrt keeps the update's noise (Adam-style optimizers; OLMo-core's choice), linear keeps the step per
# sample (SGD's rule), none leaves the schedule alone.
BATCH_LR_EXPONENT = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def batch_lr_scale(rule: str, batch: int, base: int) -> float:
    """The factor on the schedule's rate for a step of `batch` sequences, the rate being tuned at
    `base` (train.global_batch). A function of the batch alone, so a resume needs no state for it."""
    return (batch / base) ** BATCH_LR_EXPONENT[rule]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

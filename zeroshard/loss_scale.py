"""Loss scaling for fp16 training: DeepSpeed's static and dynamic loss scalers.

They serve the DeepSpeed-style engine (``engine``, ``zeroshard.initialize``),
which scales the loss and skips overflowing steps over DDP, ZeRO-1 or FSDP;
FullyShardedDataParallel itself, like torch FSDP1, does no loss scaling.

fp16 has 5 exponent bits: gradients smaller than about 6e-8 flush to zero.
Multiplying the loss by S before ``backward`` multiplies every gradient by S
(the chain rule is linear), lifting small gradients into fp16's range; the
optimizer must see ``grad / S``, so gradients are unscaled before clipping
(the clip threshold is in true units) and before the step.

Too large an S overflows instead. DeepSpeed's ``DynamicLossScaler``
(``deepspeed/runtime/fp16/loss_scaler.py``, after Megatron-LM) rides that edge:

* start at ``2**initial_scale_power``;
* a step whose gradients hold an inf or nan on *any* rank is skipped on
  *every* rank (the overflow flag is all-reduced with MAX: one rank stepping
  while another skips would desynchronize the replicas), leaving parameters,
  optimizer state and the LR scheduler untouched;
* hysteresis: the first ``hysteresis - 1`` overflows only use up tolerance;
  the overflow after that halves S, never below ``min_loss_scale``; one more
  at ``min_loss_scale`` raises (DeepSpeed's ``raise_error_at_min_scale``: the
  run has diverged, and skipping every step would only hide it);
* S doubles (and, unless ``consecutive_hysteresis``, the tolerance refills)
  when the clean steps since the last overflow (or the start), not counting
  the first, reach a multiple of ``loss_scale_window``: after window + 1 clean
  steps, then every window; with ``consecutive_hysteresis`` every clean step
  refills the tolerance. (DeepSpeed's older rule doubled after window steps;
  zeroshard followed it until a side-by-side run with DeepSpeed 0.19.8.)

A static scale (``loss_scale > 0``) never changes, but a step with inf/nan
gradients is still skipped, as DeepSpeed's ZeRO optimizers do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm


class StaticLossScaler:
    """A fixed loss scale (``"fp16": {"loss_scale": S}`` with S > 0)."""

    dynamic = False

    def __init__(self, scale: float):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = sd["cur_scale"]


class DynamicLossScaler(StaticLossScaler):
    """DeepSpeed's dynamic loss scaler (``"fp16": {"loss_scale": 0, ...}``).

    ``hysteresis`` is DeepSpeed's ``delayed_shift``: how many overflows it
    takes (counting the one that acts) before the scale is halved.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000, min_scale: float = 1.0,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, scale_factor: float = 2.0,
                 raise_error_at_min_scale: bool = True):
        super().__init__(init_scale)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = scale_factor
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update_scale(self, overflow: bool) -> None:
        """Call once per optimizer step (taken or skipped) with that step's overflow flag."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(
                        f"zeroshard fp16 loss scaling: the gradients overflowed (inf/nan) again at the minimum loss "
                        f"scale {self.min_scale:g} (fp16.min_loss_scale): the scale cannot go lower, so the run has "
                        "diverged or that floor is too high. Fix: lower fp16.min_loss_scale or the learning rate, or "
                        "train in bf16 (DeepSpeed stops here too).")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1  # clean steps since, less the first
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    # The settings, then where the scaler is (what a resumed run takes from a checkpoint).
    SETTINGS = {"scale_window": "loss_scale_window", "min_scale": "min_loss_scale", "delayed_shift": "hysteresis",
                "consecutive_hysteresis": "consecutive_hysteresis", "scale_factor": None}
    _STATE = (*SETTINGS, "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def resume(self, saved: dict) -> list[str]:
        """Take a saved scaler's position (scale, step count, last overflow, hysteresis left) and keep
        this one's settings, so that a config changed for the resumed run (a lower ``min_loss_scale``
        after the floor was hit) applies; the position is clamped to them. Returns the
        ``fp16.*`` config keys whose saved values differ."""
        changed = [f"fp16.{key or name}" for name, key in self.SETTINGS.items() if saved[name] != getattr(self, name)]
        self.cur_scale = max(float(saved["cur_scale"]), self.min_scale)
        self.cur_iter, self.last_overflow_iter = saved["cur_iter"], saved["last_overflow_iter"]
        self.cur_hysteresis = min(saved["cur_hysteresis"], self.delayed_shift)
        return changed

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, sd: dict) -> None:
        for k in self._STATE:
            setattr(self, k, sd[k])


@torch.no_grad()
def has_overflow(grads, device: torch.device, group=None) -> bool:
    """True on every rank if any rank's ``grads`` hold an inf or nan.

    Each rank only sees its own gradients (its shard under ZeRO, its
    unreduced micro-batch sums before a reduction), so the local flag is
    all-reduced with MAX: one collective of one element per step.
    """
    grads = [g for g in grads if g is not None and g.numel() > 0]
    local = torch.stack([torch.isfinite(g).all() for g in grads]).all().logical_not() if grads else torch.tensor(False)
    flag = local.to(device=device, dtype=torch.float32).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        comm.all_reduce(flag, group, op=dist.ReduceOp.MAX, what="the fp16 overflow flag (loss scaling)")
    return bool(flag.item())


@torch.no_grad()
def unscale_(grads, scale: float) -> None:
    """Divide gradients by the loss scale in place (as a multiply by 1/scale, like DeepSpeed)."""
    if scale == 1.0:
        return
    inv = 1.0 / scale
    for g in grads:
        if g is not None:
            g.mul_(inv)

"""DeepSpeed's LR schedules (``deepspeed/runtime/lr_schedules.py``) with its
formulas and step counting, for configs run through ``zeroshard.initialize``:
the DeepSpeed-style engine (``engine``) builds one from its config's
``scheduler`` section and steps it; FullyShardedDataParallel never uses them.

All three count ``last_batch_iteration`` i from -1: construction sets the LR of
i = -1, and each ``step()`` (once per optimizer step, at accumulation
boundaries) advances i by one and sets the LR of the new i. So after k steps
the LR is that of i = k - 1. The warmup fraction g(i) for n warmup steps
(n is at least 2) is ``ln(i + 1) / ln(n)`` ("log") or ``i / n`` ("linear").

* WarmupLR: min_lr + (max_lr - min_lr) * g(i) for i < n, then max_lr.
  ``warmup_max_lr`` defaults to the optimizer's lr.
* WarmupDecayLR: the same warmup, then a linear decay reaching 0 at
  ``total_num_steps``. ``warmup_max_lr`` defaults to 0.001.
* WarmupCosineLR: a ratio of each group's lr at construction. During warmup it
  is min_ratio + (1 - min_ratio) * g(i); afterwards, with progress
  p = min(1, (i - n + 1) / max(1, total - n)), it is
  cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2. The LR is 0 before
  the first step.

Where DeepSpeed's formulas break, these hold (deliberate differences):
WarmupCosineLR stays at cos_min_ratio after ``total_num_steps`` (DeepSpeed's
cosine goes on and the LR climbs back up), runs ``total_num_steps ==
warmup_num_steps`` (a ZeroDivisionError in DeepSpeed) and sets every param
group's LR to 0 before the first step (DeepSpeed only group 0's); WarmupLR's
``warmup_max_lr`` defaults to each group's own lr (DeepSpeed: group 0's).
"""
from __future__ import annotations

import math


def _per_group(value, optimizer, name: str) -> list:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"zeroshard LR schedule: {name} has {len(value)} values for {n} param groups. "
                             "Fix: give one value, or one per param group.")
        return list(value)
    return [value] * n


def _warmup_fraction(i: int, n: int, kind: str) -> float:
    # (log: DeepSpeed multiplies by a stored 1 / ln(n) rather than dividing; so does this, for the same rounding)
    return (1.0 / math.log(n)) * math.log(i + 1) if kind == "log" else i / n


class _Schedule:
    """Step counting and state shared by the three schedules (``lrs()`` differs)."""

    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int):
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
            raise ValueError(f"zeroshard LR schedule: warmup_num_steps = {warmup_num_steps!r}: expected an integer >= 0 "
                             "(0 and 1 warm up over 2 steps, as in DeepSpeed). Fix: give the number of optimizer steps "
                             "to warm up over.")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"zeroshard LR schedule: warmup_type = {warmup_type!r}: expected 'log' or 'linear'. "
                             'Fix: write "log" or "linear".')
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration

    def _start(self):
        if self.last_batch_iteration == -1:
            self._set(self.get_lr())

    def _set(self, lrs):
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._set(self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict):
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._last_lr = self.get_lr()


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps, then flat."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log",
                 last_batch_iteration=-1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        # Each group warms up to its own lr. DeepSpeed's WarmupLR takes group 0's lr for every
        # group, so a second group at 10x would train at group 0's rate (a deliberate difference).
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def _gamma(self) -> float:
        i = self.last_batch_iteration
        return _warmup_fraction(i, self.warmup_num_steps, self.warmup_type) if i < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``. Unlike WarmupLR's,
    its ``warmup_max_lr`` defaults to 0.001 (not the optimizer's lr), as in DeepSpeed."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """A warmup of the lr ratio from warmup_min_ratio to 1, then a cosine decay to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log", last_batch_iteration=-1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        self._start()

    def ratio(self) -> float:
        i, n = self.last_batch_iteration, self.warmup_num_steps
        if i < 0:
            return 0.0
        if i < n:
            return self.warmup_min_ratio + _warmup_fraction(i, n, self.warmup_type) * (1.0 - self.warmup_min_ratio)
        # pi * step / steps, in DeepSpeed's order (pi * (step / steps) rounds differently)
        steps = max(1, self.total_num_steps - n)
        half_cosine = (1 + math.cos(math.pi * min(i - n + 1, steps) / steps)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self) -> list[float]:
        r = self.ratio()
        return [lr * r for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(spec: dict, optimizer):
    """The schedule a parsed ``scheduler`` config section describes, over ``optimizer``."""
    return SCHEDULES[spec["type"]](optimizer, **spec["params"])

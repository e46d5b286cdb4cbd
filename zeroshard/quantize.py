"""Quantized weight all-gather: ZeRO++'s qwZ (Wang et al., 2023, section 3.1).

ZeRO-3 all-gathers every unit's parameters twice per step (forward and
backward) in the compute dtype. qwZ sends them as int8 instead, quantized per
block of ``block_size`` consecutive elements with one scale each (symmetric,
absmax: ``scale = max|x| / 127``, ``q = round(x / scale)``): about 1 byte per
element plus ``scale bytes / block_size``, ≈ 0.25× of fp32 for blocks of 256
with fp32 scales. Each rank quantizes its own shard, the int8 blocks and their
scales travel in one all-gather (the scales' bytes appended to the int8
payload), and every rank dequantizes the same bytes into the compute dtype,
so all ranks compute with identical (slightly perturbed) weights.

Only the all-gathered copy is quantized: the fp32 master shard the optimizer
steps is untouched, gradients are reduce-scattered unquantized (in
``reduce_dtype``, as without qwZ), and ``summon_full_params`` / state dicts
gather exactly. The gradient is the one of the dequantized weights (a
straight-through estimate for the master).

Use: ``FullyShardedDataParallel(model, quantized_all_gather=Int8BlockQuant(block_size=256))``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm


@dataclass(frozen=True)
class Int8BlockQuant:
    """Blockwise symmetric int8 quantization of the all-gathered parameters.

    ``scale_dtype``: torch.float32 (exact scales) or torch.float16 (half the
    scale bytes; a scale's rounding then becomes part of the quantization,
    and blocks with max|x| above 127 · 65504 ≈ 8.3e6 saturate there).
    The error per element is at most scale / 2, plus fp32 rounding of
    ``x / scale`` and ``q · scale`` (at most scale · 2⁻¹⁶ more).
    """

    block_size: int = 256
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"zeroshard: Int8BlockQuant(block_size={self.block_size!r}) must be a positive int "
                             "(elements per scale). Fix: pass e.g. block_size=256.")
        if self.scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"zeroshard: Int8BlockQuant scale_dtype must be float32 or float16, not {self.scale_dtype}.")

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def payload_bytes(self, numel: int) -> int:
        """Bytes one rank sends for a shard of ``numel`` elements."""
        return self.blocks(numel) * (self.block_size + self.scale_dtype.itemsize)

    def quantize(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` as one int8 payload: the quantized blocks, then the scales' bytes."""
        nb, b = self.blocks(shard.numel()), self.block_size
        x = shard.new_zeros(nb * b, dtype=torch.float32)
        x[: shard.numel()].copy_(shard.detach())
        x = x.view(nb, b)
        # The scale is rounded to its stored dtype first, so quantizing and
        # dequantizing use the very same number; rounded up (to the next fp16
        # above) so that no |x| / scale exceeds 127 and the error stays ≤ scale / 2.
        exact = x.abs().amax(dim=1) / 127
        if self.scale_dtype == torch.float16:  # beyond fp16's range the scale saturates (|x| > 127 * 65504 clip)
            exact = exact.clamp(max=torch.finfo(torch.float16).max)
        scale = exact.to(self.scale_dtype)
        if self.scale_dtype == torch.float16:
            low = scale.float() < exact  # positive halves: +1 on the bits is the next one up
            scale = torch.where(low, (scale.view(torch.int16) + 1).view(torch.float16), scale)
        s = scale.float()
        # Divided, not multiplied by 1/s: 1/s overflows for tiny scales (absmax below ~4e-37), and one
        # rounding instead of two keeps the error within scale / 2 up to fp32 rounding.
        q = torch.round(x / torch.where(s > 0, s, torch.ones_like(s))[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(-1), scale.view(torch.int8)])

    def dequantize(self, payload: torch.Tensor, numel: int, out: torch.Tensor):
        """Write the ``numel`` values one rank's ``payload`` encodes into ``out``."""
        nb, b = self.blocks(numel), self.block_size
        q = payload[: nb * b].view(nb, b)
        # A copy: the scales' bytes need not sit at an offset aligned for their dtype.
        scale = payload[nb * b :].clone().view(self.scale_dtype).float()
        out.copy_((q.float() * scale[:, None]).view(-1)[:numel])


class QuantizedGather:
    """An all-gather in flight whose ``wait()`` also dequantizes into the full buffer."""

    def __init__(self, quant: Int8BlockQuant, full: torch.Tensor, shard: torch.Tensor, group, what: str, padding=()):
        self.quant, self.full, self.numel = quant, full, shard.numel()
        if padding:  # ranges holding no parameter: quantized as zeros (use_orig_params' alignment
            shard = shard.clone()  # gaps hold torch's marker 42, which would set their blocks' scales)
            for start, end in padding:
                shard[start:end] = 0
        payload = quant.quantize(shard)
        self.world = group.size()
        self.gathered = payload.new_empty(self.world * payload.numel())
        self.work = comm.all_gather(self.gathered, payload, group, what=what + " (int8 blocks)")

    def wait(self):
        self.work.wait()
        rows = self.gathered.view(self.world, -1)
        for r in range(self.world):  # rank r's shard is the r-th chunk of the full buffer
            self.quant.dequantize(rows[r], self.numel, self.full[r * self.numel : (r + 1) * self.numel])
        self.gathered = None

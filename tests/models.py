"""Small models the tests shard: odd sizes so every layout needs padding."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Residual MLP block."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.l1 = nn.Linear(d, hidden)
        self.l2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class MLP(nn.Module):
    def __init__(self, d_in: int = 5, d: int = 7, hidden: int = 13, n_blocks: int = 3, d_out: int = 3):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))  # a buffer for buffer_dtype
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n_blocks))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x) * self.scale

    def reset_parameters(self):  # its own state only (the buffer): meta-device init calls it
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel()))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer; the head is tied to the token embedding."""

    def __init__(self, vocab: int = 37, d: int = 24, heads: int = 4, layers: int = 3, ctx: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class BNBlock(nn.Module):
    """Linear -> BatchNorm -> ReLU, residual: the BatchNorm is what mixed
    precision leaves in fp32 (MixedPrecision._module_classes_to_ignore)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.relu(self.norm(self.lin(x)))


class BNMLP(nn.Module):
    def __init__(self, d_in: int = 5, d: int = 11, n_blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(BNBlock(d) for _ in range(n_blocks))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def build(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "gpt": TinyGPT, "lora": LoRAMLP, "bn": BNMLP}[name](**kwargs)


def batch(name: str, rank: int, step: int, d_in: int = 5):
    """Inputs differ per rank (data parallel) and per step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "gpt":
        return torch.randint(0, 37, (2, 16), generator=g)
    if name == "lora":
        return torch.randn(4, 5, generator=g)
    return torch.randn(4, d_in, generator=g)


class ParamBag(nn.Module):
    """Parameters of arbitrary shapes in a small module tree (for layout tests)."""

    def __init__(self, shapes, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        half = len(shapes) // 2
        for i, s in enumerate(shapes[:half]):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(s, generator=g)))
        self.child = nn.Module()
        for i, s in enumerate(shapes[half:]):
            self.child.register_parameter(f"q{i}", nn.Parameter(torch.randn(s, generator=g)))


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update (LoRA)."""

    def __init__(self, d: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class LoRAMLP(nn.Module):
    def __init__(self, d_in: int = 5, d: int = 9, n_blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(LoRALinear(d) for _ in range(n_blocks))
        self.out = nn.Linear(d, 3)
        self.out.weight = nn.Parameter(self.out.weight.detach().clone(), requires_grad=False)  # frozen head weight

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)

"""Hypothesis strategies for property-testing sharding engines (ZeRO / FSDP).

Bugs in a sharding engine hide along a few axes: parameter sizes that do or
do not divide the world size (padding, empty shards), how the model is cut
into units (the wrap policy), the number of ranks, the ZeRO stage
(SHARD_GRAD_OP = ZeRO-2, FULL_SHARD = ZeRO-3, NO_SHARD = plain data
parallelism), ``use_orig_params`` (16-byte alignment padding) and the
prefetch order. These strategies draw points on those axes; with
:func:`zeroshard.testing.assert_parity` they state the property "for every
such configuration the engine equals torch FSDP1, bit for bit"::

    from hypothesis import given
    from zeroshard.testing import RankPool, assert_parity, strategies as zst

    def check(rank, world_size, mlp, kw):
        return str(assert_parity(mlp.factory(), **kw))

    @given(mlp=zst.mlp_configs(), kw=zst.fsdp_configs())
    def test_parity(mlp, kw):
        pool.run(check, mlp, kw)              # pool = RankPool(2), made once

A ``ParityError`` on the ranks is raised by ``pool.run`` as itself, so
hypothesis shrinks it to the smallest configuration; a hung example raises
``TimeoutError`` and the pool starts fresh ranks for the next one.

Everything drawn is picklable (it crosses to the ranks): models are built by
module-level classes from frozen dataclasses. Needs ``hypothesis``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from hypothesis import strategies as st

__all__ = ["Layer", "MLP", "MLPConfig", "mlp_configs", "world_sizes", "sharding_strategies", "backward_prefetches",
           "wrap_policies", "mixed_precisions", "fsdp_configs", "param_shapes"]


class Layer(nn.Module):
    """One hidden layer: the natural FSDP unit of an MLP (``ModuleWrapPolicy({Layer})``)."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class MLP(nn.Module):
    """``widths`` hidden layers then a linear head, with a buffer (for buffer_dtype)."""

    def __init__(self, config: "MLPConfig"):
        super().__init__()
        dims = (config.d_in, *config.widths)
        self.layers = nn.ModuleList(Layer(a, b, config.bias) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], config.d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, config.d_out))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * self.scale


@dataclass(frozen=True)
class MLPConfig:
    d_in: int
    widths: tuple[int, ...]
    d_out: int
    bias: bool = True

    def build(self) -> MLP:
        return MLP(self)

    def factory(self):
        """A picklable zero-argument factory (what assert_parity takes)."""
        return functools.partial(MLP, self)

    @property
    def numel(self) -> int:
        dims = (self.d_in, *self.widths)
        n = sum(a * b + (b if self.bias else 0) for a, b in zip(dims, dims[1:]))
        return n + dims[-1] * self.d_out + self.d_out


def mlp_configs(max_layers: int = 4, max_width: int = 19, max_in: int = 9, max_out: int = 5) -> st.SearchStrategy[MLPConfig]:
    """Random MLP shapes. Small odd sizes on purpose: most flat buffers then need
    padding, and on larger world sizes some ranks hold no element of a parameter."""
    return st.builds(
        MLPConfig,
        d_in=st.integers(1, max_in),
        widths=st.lists(st.integers(1, max_width), min_size=1, max_size=max_layers).map(tuple),
        d_out=st.integers(1, max_out),
        bias=st.booleans(),
    )


def world_sizes(min_value: int = 1, max_value: int = 4) -> st.SearchStrategy[int]:
    """Numbers of ranks (1 makes torch and zeroshard both switch to NO_SHARD)."""
    return st.integers(min_value, max_value)


def sharding_strategies(no_shard: bool = True) -> st.SearchStrategy[str]:
    """ZeRO-3, ZeRO-2 and (optionally) plain data parallelism, by name."""
    names = ["FULL_SHARD", "SHARD_GRAD_OP"] + (["NO_SHARD"] if no_shard else [])
    return st.sampled_from(names)


def backward_prefetches() -> st.SearchStrategy[str | None]:
    return st.sampled_from([None, "BACKWARD_PRE", "BACKWARD_POST"])


def wrap_policies(unit_classes=(Layer,), max_min_num_params: int = 400) -> st.SearchStrategy:
    """Ways to cut a model into units, as assert_parity's ``auto_wrap_policy``
    specs: none (one unit), every instance of ``unit_classes`` (module and
    transformer policies), or size-based with a random threshold."""
    classes = frozenset(unit_classes)
    return st.one_of(
        st.just(None),
        st.just(classes),
        st.just(("transformer", classes)),
        st.integers(1, max_min_num_params),
    )


def mixed_precisions() -> st.SearchStrategy[dict | None]:
    """None, or low-precision parameters / reductions / buffers (bf16 or fp16)."""
    low = st.sampled_from(["bfloat16", "float16"])
    return st.one_of(
        st.none(),
        st.builds(lambda p, r, b: {"param_dtype": p, "reduce_dtype": r, "buffer_dtype": b},
                  low, st.one_of(st.none(), st.just("float32"), low), st.one_of(st.none(), low)),
    )


def fsdp_configs(unit_classes=(Layer,), mixed_precision: bool = False, no_shard: bool = True) -> st.SearchStrategy[dict]:
    """Keyword arguments for :func:`zeroshard.testing.assert_parity` (the engine configuration)."""
    return st.fixed_dictionaries({
        "sharding_strategy": sharding_strategies(no_shard),
        "auto_wrap_policy": wrap_policies(unit_classes),
        "use_orig_params": st.booleans(),
        "backward_prefetch": backward_prefetches(),
        "forward_prefetch": st.booleans(),
        "limit_all_gathers": st.booleans(),
        "mixed_precision": mixed_precisions() if mixed_precision else st.none(),
    })


def param_shapes(max_params: int = 6, max_dim: int = 9, max_ndim: int = 3) -> st.SearchStrategy[list[tuple[int, ...]]]:
    """Lists of parameter shapes, for flat-buffer layout tests (flatten, shard, unflatten)."""
    shape = st.lists(st.integers(1, max_dim), min_size=1, max_size=max_ndim).map(tuple)
    return st.lists(shape, min_size=1, max_size=max_params)

"""Faults fail fast and name themselves: a dead peer, ranks wrapping different
models. Each scenario runs in its own short-lived processes (a fault leaves a
process group unusable), under a deadline."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn as nn

import zeroshard as zs
from models import MLP, Block, batch
from zeroshard.testing import spawn


def _killed_peer(rank, world_size):
    model = zs.FSDP(MLP(n_blocks=3), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    if rank == 1:  # dies in the middle of the second block's forward
        model.blocks[1].module.register_forward_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    model(batch("mlp", rank, 0)).sum().backward()


def test_dead_peer_raises_named_collective_error():
    with pytest.raises(RuntimeError) as info:
        spawn(_killed_peer, 2, timeout=120, pg_timeout=20)
    msg = str(info.value)
    assert "rank 1 exited" in msg or "exited with code" in msg
    # The survivor's error names itself, the collective, the lifecycle step and the unit.
    assert "zeroshard: rank 0:" in msg and "CollectiveError" in msg, msg
    assert "unshard" in msg or "post-backward" in msg, msg
    assert "blocks." in msg, msg


class Other(nn.Module):
    def __init__(self, wide):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 6 if wide else 5)


def _different_models(rank, world_size):
    zs.FSDP(Other(wide=rank == 1))


def test_different_models_detected_at_construction():
    with pytest.raises(RuntimeError) as info:
        spawn(_different_models, 2, timeout=120, pg_timeout=20)
    msg = str(info.value)
    assert "different layout on different ranks" in msg and "b.weight" in msg and "Fix" in msg, msg


def _different_memory_formats(rank, world_size):
    model = Other(wide=False)
    if rank == 1:  # e.g. .to(memory_format=...) run on some ranks only: flattened in another element order
        model.b.weight.data = model.b.weight.data.t().contiguous().t()
    zs.FSDP(model)


def test_different_parameter_memory_layouts_detected_at_construction():
    with pytest.raises(RuntimeError) as info:
        spawn(_different_memory_formats, 2, timeout=120, pg_timeout=20)
    msg = str(info.value)
    assert "different layout on different ranks" in msg and "'b.weight', (5, 4), None" in msg and "(1, 5)" in msg, msg


def _different_settings(rank, world_size, which):
    kwargs = {"mp": dict(mixed_precision=zs.MixedPrecision(param_dtype=(torch.bfloat16, torch.float16)[rank])),
              "reduce": dict(mixed_precision=zs.MixedPrecision(reduce_dtype=(torch.bfloat16, torch.float16)[rank])),
              "strategy": dict(sharding_strategy=(zs.ShardingStrategy.FULL_SHARD, zs.ShardingStrategy.NO_SHARD)[rank]),
              "orig": dict(use_orig_params=rank == 1), "frozen": dict(use_orig_params=True),
              "prefetch": dict(backward_prefetch=(zs.BackwardPrefetch.BACKWARD_PRE, None)[rank]),
              "bucket": dict(bucket_cap_mb=(25, None)[rank]),
              "quant": dict(quantized_all_gather=(zs.Int8BlockQuant(), None)[rank])}.get(which)
    if which == "nested":  # each rank ignores another block: units pair up by construction order, relative names equal
        model = MLP(n_blocks=3)
        zs.FSDP(model, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), ignored_modules=[model.blocks[rank]])
        return
    model = Other(wide=False)
    if which == "frozen" and rank == 1:  # frozen on one rank only: its collectives would mismatch in backward
        model.b.requires_grad_(False)
    zs.FSDP(model, **kwargs)


@pytest.mark.parametrize("which,name", [("mp", "param_dtype"), ("reduce", "reduce_dtype"),
                                        ("strategy", "sharding_strategy"), ("orig", "use_orig_params"),
                                        ("frozen", "frozen_parameters"), ("prefetch", "backward_prefetch"),
                                        ("bucket", "bucket_cap_mb"), ("quant", "quantized_all_gather"),
                                        ("nested", "nested_units")])
def test_ranks_disagreeing_on_fsdp_arguments_detected_at_construction(which, name):
    """Without the check, different mixed precision per rank trains on to wrong
    (non-finite) values silently, and the other differences time out or abort."""
    with pytest.raises(RuntimeError) as info:
        spawn(_different_settings, 2, which, timeout=120, pg_timeout=20)
    msg = str(info.value)
    assert "different layout on different ranks" in msg and f"{name}=" in msg and "Fix" in msg, msg


def _hybrid_different_model(rank, world_size):
    try:
        zs.FSDP(Other(wide=rank == 3), sharding_strategy=zs.ShardingStrategy.HYBRID_SHARD, fsdp_group_size=2)
    except ValueError as e:
        return str(e)
    return None


def test_different_models_under_hybrid_sharding_detected_on_every_rank():
    """Shards {0,1} {2,3}, replicas {0,2} {1,3}; rank 3 wraps another model. Only
    its shard group compared layouts: ranks 0 and 1 wrapped without error and
    trained on until a collective timed out, and the error on rank 3 named
    rank 1 (its index in the shard group). Now every rank raises, naming rank 3."""
    msgs = spawn(_hybrid_different_model, 4, timeout=120, pg_timeout=20)
    assert all(m and "different layout on different ranks" in m and "rank 3 has ('b.weight', (6, 4)" in m
               for m in msgs), msgs


def _two_process_groups(rank, world_size, port):
    """Train, destroy the default process group, init a new one (a sweep, a notebook), train again."""
    from datetime import timedelta

    import torch.distributed as dist

    kinds = (dict(sharding_strategy=zs.ShardingStrategy.HYBRID_SHARD, fsdp_group_size=1), dict(hpz_group_size=2))
    calls = []
    for round_ in range(2):
        if round_:
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=30))
        for kw in kinds:
            torch.manual_seed(0)
            m = zs.FSDP(MLP(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), **kw)
            with zs.comm_stats() as stats:
                m(batch("mlp", rank, 0)).sum().backward()
            calls.append(sum(stats.calls.values()))
    return calls[:2] == calls[2:]


def test_groups_are_rebuilt_under_a_new_default_process_group():
    """fsdp_group_size / hpz_group_size groups were cached for the process's
    life: after destroy_process_group() and a new init, wrapping failed ('not
    initialized in the world group map'), and hpZ gathered over a group of the
    destroyed one (comm_stats raised KeyError on it)."""
    from zeroshard.testing.ranks import free_port

    assert spawn(_two_process_groups, 2, free_port(), timeout=120, pg_timeout=30) == [True, True]


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        # One shape for all three and no backward prefetch: every collective pairs up whatever unit each
        # rank is at (else the prefetches' all-gathers mismatch or differ in number: gloo aborts or times out).
        self.body, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, branch=None):
        h = torch.tanh(self.body(x))
        if branch is not None:  # one head, chosen per rank
            return (self.a if branch == 0 else self.b)(h)
        return self.a(h), self.b(h)


def _ranks_disagree(rank, world_size, case, detail):
    """Heads of one shape: their collectives pair up whatever unit each rank runs."""
    old = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if detail else "OFF"
    try:
        torch.manual_seed(0)
        model = zs.FSDP(_TwoHeads(), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({nn.Linear}), backward_prefetch=None)
        x = torch.randn(2, 4)
        try:
            if case == "branch":  # rank 0 runs head a, rank 1 head b
                model(x, branch=rank).sum().backward()
            elif case == "loss":  # both heads run; the loss uses a on rank 0, b on rank 1
                model(x)[rank].sum().backward()
            else:  # the same on every rank
                model(x)[0].sum().backward()
        except RuntimeError as e:
            return str(e)
        return None
    finally:
        if old is None:
            del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old


@pytest.mark.parametrize("case,said", [("branch", "rank 0 ran forward through units ['body', 'a'], rank 1 "
                                                  "ran forward through units ['body', 'b']"),
                                       ("loss", "rank 0 reduced the gradients of units"), ("same", None)])
def test_detail_debug_names_ranks_that_ran_or_reduced_different_units(ranks, case, said):
    """Silent in both engines by default: wrong gradients. torch FSDP1 checks its forward
    order under TORCH_DISTRIBUTED_DEBUG=DETAIL; zeroshard checks both after each backward."""
    for msg in ranks.run(2, _ranks_disagree, case, True):
        assert (msg is None) if said is None else (said in msg and "Fix" in msg), msg
    assert ranks.run(2, _ranks_disagree, case, False) == [None, None]  # off by default: no collective added

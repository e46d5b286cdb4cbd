"""zeroshard.compat.hfai: hfai's constructor and checkpoint habits on 4 ranks
with fsdp_group_size=2 (shard in pairs, replicate across them)."""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import torch

import zeroshard as zs
from models import MLP, batch, build
from zeroshard.compat import hfai


def _policy():
    return functools.partial(hfai.size_based_auto_wrap_policy, min_num_params=150)


def _train(model, rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        model(batch("mlp", rank, step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _hfai_vs_full_shard(rank, world_size):
    base = build("mlp")
    ours = hfai.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=_policy(), fsdp_group_size=2)
    ref = zs.FSDP(copy.deepcopy(base), auto_wrap_policy=_policy())
    units = zs.FSDP.fsdp_modules(ours)
    held = sum(p.numel() for p in ours.parameters())
    assert held == sum(-(-u._handle.layout.numel // 2) for u in units)  # half of each unit, rounded up
    for m in (ours, ref):
        _train(m, rank)
    with ours.summon_full_params():
        full = ours.state_dict()  # no collective: only rank 0 might call it
    ref_full = ref.state_dict()
    assert list(full) == list(ref_full)
    for k in full:
        # Gradients are summed in another order ((r0+r1)+(r2+r3) vs a 4-way
        # reduce-scatter), so fp32 results differ in the last bits only.
        torch.testing.assert_close(full[k], ref_full[k], rtol=1e-5, atol=1e-6, msg=k)
    plain = copy.deepcopy(base)
    plain.load_state_dict(full, strict=True)
    x = batch("mlp", rank, 50)
    assert torch.equal(plain(x), ours(x))
    return True


def test_training_matches_full_shard_and_holds_half(ranks):
    assert all(ranks.run(4, _hfai_vs_full_shard))


def _checkpoint_paths(rank, world_size, path):
    model = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy(), fsdp_group_size=2)
    _train(model, rank)
    with model.summon_full_params():
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(path, "full.pt"))
    torch.distributed.barrier()
    torch.save(model.state_dict(), os.path.join(path, f"model{rank}.pt"))
    x = batch("mlp", rank, 77)
    want = model(x)
    full_fresh = hfai.FullyShardedDataParallel(build("mlp", seed=5), auto_wrap_policy=_policy(), fsdp_group_size=2)
    with full_fresh.summon_full_params():
        full_fresh.load_state_dict(torch.load(os.path.join(path, "full.pt")))
    local_fresh = hfai.FullyShardedDataParallel(build("mlp", seed=6), auto_wrap_policy=_policy(), fsdp_group_size=2)
    local_fresh.load_state_dict(torch.load(os.path.join(path, f"model{rank}.pt")))
    return torch.equal(want, full_fresh(x)) and torch.equal(want, local_fresh(x))


def _local_at_other_group_size(rank, world_size, path):
    model = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy(), fsdp_group_size=4)
    try:
        model.load_state_dict(torch.load(os.path.join(path, f"model{rank}.pt")))
    except ValueError as e:
        return str(e)
    return None


def test_full_and_local_checkpoints(ranks, tmp_path):
    assert all(ranks.run(4, _checkpoint_paths, str(tmp_path)))
    for msg in ranks.run(4, _local_at_other_group_size, str(tmp_path)):
        assert msg and "shard group size 2" in msg and "shard group size 4" in msg and "Fix" in msg


def _zero2_vs_zero3(rank, world_size):
    base = build("mlp")
    counts, states = [], []
    for reshard in (True, False):
        model = hfai.FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=_policy(), fsdp_group_size=2,
                                              reshard_after_forward=reshard)
        with zs.comm_stats() as stats:
            _train(model, rank, steps=1)
        counts.append(stats.calls["all_gather"])
        with model.summon_full_params():
            states.append(model.state_dict())
    units = len(zs.FSDP.fsdp_modules(model))
    same = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    return counts, units, same


def test_reshard_after_forward_false_gathers_once(ranks):
    (counts, units, same), *_ = ranks.run(4, _zero2_vs_zero3)
    assert same
    assert counts == [2 * units - 1, units]  # ZeRO-3: twice per unit (root once); ZeRO-2: once


def _bad_group_size(rank, world_size):
    try:
        hfai.FullyShardedDataParallel(MLP(), fsdp_group_size=3)
    except ValueError as e:
        return str(e)
    return None


def test_group_size_must_divide_world(ranks):
    for msg in ranks.run(4, _bad_group_size):
        assert msg and "fsdp_group_size=3" in msg and "world size 4" in msg


def test_example_runs(tmp_path):
    """--out may name a folder that does not exist yet (it was 'Parent directory ... does not exist')."""
    ckpt = tmp_path / "new" / "ckpt"
    out = subprocess.run([sys.executable, "-m", "zeroshard.examples.hfai_style", "--world-size", "4", "--steps", "4",
                          "--out", str(ckpt)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (ckpt / "full.pt").is_file() and (ckpt / "model3.pt").is_file()
    assert "full checkpoint reloads in a plain model: True" in out.stdout
    assert "local shards restore a fresh model: True" in out.stdout


def _full_checkpoint_misuse(rank, world_size):
    model = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy())
    errors = []
    with model.summon_full_params(recurse=False):  # nested units stay sharded: no plain-key checkpoint to give
        for call in (model.state_dict, lambda: model.load_state_dict({})):
            try:
                call()
            except ValueError as e:
                errors.append(str(e))
    with model.summon_full_params():
        full = model.state_dict()
    try:
        model.load_state_dict(full)  # outside the block: this rank's shards are expected
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_full_checkpoint_misuse_is_refused(ranks):
    for errors in ranks.run(2, _full_checkpoint_misuse):
        assert len(errors) == 3
        assert "state_dict() inside summon_full_params(recurse=False)" in errors[0] and "Fix" in errors[0]
        assert "load_state_dict() inside summon_full_params(recurse=False)" in errors[1]
        assert "got a full checkpoint" in errors[2] and "inside `with model.summon_full_params()" in errors[2]


def _nested_unit_in_summon(rank, world_size):
    torch.manual_seed(0)
    m = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy())
    m(batch("mlp", rank, 0)).sum().backward()
    inner = next(u for u in m.modules() if isinstance(u, zs.FullyShardedDataParallel) and u is not m)
    with m.summon_full_params():
        full = m.state_dict()
        own = inner.state_dict()  # a block's own dict: its full parameters under its plain keys
    for k, v in own.items():
        assert any(torch.equal(v, w) for name, w in full.items() if name.endswith(k)), k
    return sorted(own)


def test_a_nested_unit_state_dict_inside_summon_is_the_plain_blocks(ranks):
    """Inside hfai's summon_full_params state_dict() is the plain model's, for a nested
    block too; the refusal of LOCAL dicts inside torch-style summon_full_params
    (4b3afac) raised here."""
    for keys in ranks.run(2, _nested_unit_in_summon):
        assert keys and not any("flat_param" in k for k in keys), keys


def _load_misuse(rank, world_size, path):
    model = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy(), fsdp_group_size=2)
    _train(model, rank)
    with model.summon_full_params():
        full = model.state_dict()
    local = model.state_dict()
    torch.save(local, os.path.join(path, f"model{rank}.pt"))
    torch.distributed.barrier()
    fresh = hfai.FullyShardedDataParallel(build("mlp", seed=5), auto_wrap_policy=_policy(), fsdp_group_size=2)
    errors = {}
    try:  # hfai saves on rank 0 only; a load on rank 0 only left the replicas of different models
        with fresh.summon_full_params():
            if rank == 0:
                fresh.load_state_dict(full)
    except RuntimeError as e:
        errors["rank 0 only"] = str(e)
    for name, call in (("writeback=False", lambda: fresh.summon_full_params(writeback=False)),
                       ("local inside", fresh.summon_full_params)):
        try:
            with call():
                fresh.load_state_dict(full if name == "writeback=False" else local)
        except ValueError as e:
            errors[name] = str(e)
    for name, other in (("neighbour's file", rank ^ 1), ("replica's file", (rank + 2) % 4)):
        try:  # the neighbour holds the other half of the group's shards, the replica the same ones
            fresh.load_state_dict(torch.load(os.path.join(path, f"model{other}.pt")))
        except ValueError as e:
            errors[name] = str(e)
    try:
        hfai.FullyShardedDataParallel(build("mlp"), fsdp_group_size=True)
    except ValueError as e:
        errors["fsdp_group_size=True"] = str(e)
    x = batch("mlp", rank, 7)
    return errors, torch.equal(model(x), fresh(x))  # the replica's file restored this rank's own shards


def test_hfai_load_misuse_is_refused(ranks, tmp_path):
    """All of these were accepted silently: a full load inside summon_full_params on rank 0 only
    (the ranks then held parts of different models), a load inside summon_full_params(writeback=False)
    (dropped), another rank's local shard file (a wrong model), fsdp_group_size=True (no sharding)."""
    for rank, (errors, restored) in enumerate(ranks.run(4, _load_misuse, str(tmp_path))):
        assert sorted(errors) == ["fsdp_group_size=True", "local inside", "neighbour's file", "rank 0 only",
                                  "writeback=False"], errors
        assert "(loaded on [0], raised on [], not called on [1, 2, 3])" in errors["rank 0 only"], errors
        assert "writeback=False" in errors["writeback=False"] and "got a local checkpoint" in errors["local inside"]
        assert f"shards of rank {(rank ^ 1) % 2} of its shard group, this is rank {rank % 2}" in errors["neighbour's file"]
        assert "fsdp_group_size=True must be an int" in errors["fsdp_group_size=True"] and restored


def _summon_on_part_of_the_job(rank, world_size):
    """Leaving the block asks only this model's ranks whether they loaded: two models on ranks
    {0, 1} and {2, 3}, only the first opening the block (the question went to all 4 ranks: a
    CollectiveError). A rank whose block raised (a failed load) still answers: the others
    waited for it until the timeout, and are told that a load ran on that rank only."""
    import time

    group = [torch.distributed.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    model = hfai.FullyShardedDataParallel(build("mlp"), process_group=group, auto_wrap_policy=_policy())
    if rank < 2:
        with model.summon_full_params():
            model.state_dict()
    torch.distributed.barrier()
    start, raised = time.monotonic(), ""
    try:
        with model.summon_full_params():
            if rank == 1:
                model.load_state_dict({"nope": torch.zeros(1)})  # raises on rank 1 only
    except RuntimeError as e:
        raised = str(e)
    return raised, time.monotonic() - start


def test_the_load_check_asks_this_models_ranks_and_waits_for_a_raising_one(ranks):
    (r0, t0), (r1, t1), (r2, t2), (r3, t3) = ranks.run(4, _summon_on_part_of_the_job)
    assert "(loaded on [], raised on [1], not called on [0])" in r0 and '"nope"' in r1 and r2 == r3 == "", (r0, r1, r2)
    assert max(t0, t1, t2, t3) < 20


def _load_fails_on_one_rank(rank, world_size):
    """Every rank loads; rank 1's dict has a wrong shape. The others were not told (each had
    called load), and the replicas then differed."""
    model = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy(), fsdp_group_size=2)
    with model.summon_full_params():
        full = model.state_dict()
    if rank == 1:
        full = {**full, "out.weight": torch.zeros(1)}
    try:
        with model.summon_full_params():
            model.load_state_dict(full)
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_load_that_fails_on_one_rank_is_an_error_on_every_rank(ranks):
    errors = ranks.run(4, _load_fails_on_one_rank)
    assert "size mismatch for _fsdp_wrapped_module.out.weight" in errors[1], errors[1]
    for r in (0, 2, 3):
        assert "(loaded on [0, 2, 3], raised on [1], not called on [])" in errors[r], errors[r]


def _raises_before_a_collective_in_the_block(rank, world_size):
    import time

    model = hfai.FullyShardedDataParallel(build("mlp"), auto_wrap_policy=_policy())
    start = time.monotonic()
    try:
        with model.summon_full_params():
            box = [model.state_dict()] if rank == 0 else [None]
            if rank == 1:
                raise FileNotFoundError("rank 1's own problem")  # before the broadcast rank 0 is in
            torch.distributed.broadcast_object_list(box, src=0)
    except BaseException as e:  # noqa: BLE001
        return type(e).__name__, time.monotonic() - start
    return None, time.monotonic() - start


def test_a_rank_raising_before_any_load_keeps_its_own_error():
    """Its answer to the load check met rank 0's broadcast: both waited out the timeout, and rank
    1's own error became the CollectiveError's context. A rank that called no load now raises at once."""
    from zeroshard.testing import spawn

    (_, _), (kind, seconds) = spawn(_raises_before_a_collective_in_the_block, 2, timeout=120, pg_timeout=15)
    assert kind == "FileNotFoundError" and seconds < 10, (kind, seconds)

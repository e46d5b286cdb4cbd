"""Faults during training end in a named error instead of a hang, and a
checkpoint save killed at any moment loses nothing.

Each training scenario runs in fresh processes (``spawn``; a fault leaves a
process group unusable) with a short process-group timeout and an overall
deadline. The errors these tests pin are listed, verbatim, in the README's
reliability section.
"""
from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import torch

import zeroshard as zs
from models import MLP, Block, batch
from zeroshard import checkpoint
from zeroshard.comm import CollectiveError
from zeroshard.testing import spawn

PG_TIMEOUT = 5.0  # seconds; a peer that neither answers nor dies is detected after this
SPAWN_TIMEOUT = 90.0


def _model():
    torch.manual_seed(0)
    return zs.FSDP(MLP(n_blocks=3), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))


def _step(model, opt, rank, step):
    model(batch("mlp", rank, step)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _timed(fn, flag_path=None):
    """Run ``fn``; a CollectiveError gets a note saying how long it took to
    surface, and ``flag_path`` is created so a lingering peer can exit."""
    start = time.monotonic()
    try:
        return fn()
    except CollectiveError as e:
        e.add_note(f"[surfaced after {time.monotonic() - start:.2f}s]")
        raise
    finally:
        if flag_path is not None:
            open(flag_path, "w").close()


def _linger(flag_path, limit=60.0):
    """Stay alive (in no collective) until the peer has failed: a rank stuck
    elsewhere, e.g. in data loading or an error handler."""
    deadline = time.monotonic() + limit
    while not os.path.exists(flag_path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _surfaced_after(msg: str) -> float:
    found = re.findall(r"\[surfaced after ([0-9.]+)s\]", msg)
    assert found, msg
    return float(found[0])


def _assert_named_collective_error(msg: str, rank: int, collective: str):
    """The survivor's error names itself, the collective, the lifecycle step and the unit."""
    assert "zeroshard.comm.CollectiveError" in msg, msg
    assert f"zeroshard: rank {rank}: {collective} for " in msg, msg
    assert re.search(r"unit '(<root>|blocks\.\d) \((MLP|Block)\)'", msg), msg
    assert "different number of forward/backward calls" in msg, msg  # the hint covers this fault


# ------------------------------------------- 3. uneven forward/backward counts
def _extra_step(rank, world_size, flag_path, linger):
    """Rank 0 runs one more training step than rank 1 (a classic FSDP hang:
    e.g. an uneven last batch). Rank 1 then exits, or lingers."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        _step(model, opt, rank, step)
    if rank == 0:
        _timed(lambda: _step(model, opt, rank, 3), flag_path)
    elif linger:
        _linger(flag_path)
    return "finished"


def test_extra_step_on_one_rank_raises_named_error_when_peer_exits(tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(_extra_step, 2, str(tmp_path / "flag"), False, timeout=SPAWN_TIMEOUT, pg_timeout=20)
    msg = str(info.value)
    # Rank 1 finished its (shorter) loop and exited; rank 0's first all-gather
    # of the extra step then fails at once, naming the root unit.
    assert "--- rank 1 ---" not in msg, msg
    _assert_named_collective_error(msg, 0, "all_gather")
    assert "unshard (forward/backward) of unit '<root> (MLP)'" in msg, msg
    assert "Connection closed by peer" in msg, msg
    assert _surfaced_after(msg) < 20  # well within the process group's timeout
    assert time.monotonic() - start < SPAWN_TIMEOUT


def test_extra_step_on_one_rank_times_out_when_peer_lingers(tmp_path):
    with pytest.raises(RuntimeError) as info:
        spawn(_extra_step, 2, str(tmp_path / "flag"), True, timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    msg = str(info.value)
    # Rank 1 stays alive but never joins: rank 0 hangs only until the
    # process group's timeout, then names the all-gather it waited on.
    assert "--- rank 1 ---" not in msg, msg
    _assert_named_collective_error(msg, 0, "all_gather")
    assert "timed out (the process group's timeout)" in msg, msg
    assert PG_TIMEOUT - 0.5 < _surfaced_after(msg) < PG_TIMEOUT + 5, msg


def _hybrid_extra_step(rank, world_size, flag_path):
    """As _extra_step, where the step's last collective runs on zeroshard's own
    replica group (fsdp_group_size=1: every rank its own shard group)."""
    torch.manual_seed(0)
    model = zs.FSDP(MLP(n_blocks=3), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                    sharding_strategy=zs.ShardingStrategy.HYBRID_SHARD, fsdp_group_size=1)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(2):
        _step(model, opt, rank, step)
    if rank == 0:
        _timed(lambda: _step(model, opt, rank, 2), flag_path)
    else:
        _linger(flag_path)
    return "finished"


def test_zeroshards_own_groups_time_out_with_the_process_groups_timeout(tmp_path):
    """Groups made for fsdp_group_size / hpz_group_size waited torch's 30-minute
    new_group default, not the timeout init_process_group was given."""
    with pytest.raises(RuntimeError) as info:
        spawn(_hybrid_extra_step, 2, str(tmp_path / "flag"), timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    msg = str(info.value)
    assert "zeroshard: rank 0: all_reduce for replica all-reduce of unit" in msg, msg
    assert "timed out (the process group's timeout)" in msg, msg
    assert _surfaced_after(msg) < PG_TIMEOUT + 5, msg


def _group_size_differs(rank, world_size, name):
    kw = {name: (2, 1)[rank]}
    if name == "fsdp_group_size":
        kw["sharding_strategy"] = zs.ShardingStrategy.HYBRID_SHARD
    try:
        zs.FSDP(MLP(n_blocks=2), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", ["fsdp_group_size", "hpz_group_size"])
def test_a_group_size_that_differs_across_ranks_is_refused(name):
    """Ranks making different groups waited in new_group's rendezvous (30 minutes)."""
    for msg in spawn(_group_size_differs, 2, name, timeout=SPAWN_TIMEOUT, pg_timeout=20):
        assert msg.startswith(f"zeroshard: {name} differs across ranks: rank 0 has 2, rank 1 has 1. Fix: pass the same value "
                              "on every rank."), msg


def _extra_no_grad_forward(rank, world_size):
    """Rank 0 runs an extra evaluation forward (no_grad) between two steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        if rank == 0 and step == 1:
            with torch.no_grad():
                model(batch("mlp", rank, 50))
        _step(model, opt, rank, step)
    return "finished"


def test_extra_no_grad_forward_on_one_rank_fails_fast():
    """The collectives then line up with the peer's *next* ones (all-gathers
    of other units, of other sizes). gloo detects the size mismatch and
    aborts the receiving process (std::terminate on gloo::EnforceNotMet,
    'Received data size doesn't match expected size'), which zeroshard cannot
    catch; the other rank reports a named CollectiveError. No hang, no
    silently wrong parameters."""
    with pytest.raises(RuntimeError) as info:
        spawn(_extra_no_grad_forward, 2, timeout=SPAWN_TIMEOUT, pg_timeout=20)
    msg = str(info.value)
    assert "exited with code -6 without a report" in msg, msg  # SIGABRT from gloo
    assert "zeroshard.comm.CollectiveError: zeroshard: rank " in msg, msg
    assert re.search(r"unit '(<root>|blocks\.\d) \((MLP|Block)\)'", msg), msg


# ------------------------------------------- 4. an exception inside backward
class InjectedFault(RuntimeError):
    pass


def _arm_fault(unit, stage, once=False):
    """Raise from inside ``unit`` (blocks.1): when its forward starts, or in backward when the
    gradient reaches it (``stage``: "forward" or "backward")."""
    armed = [True]

    def hook(module, inputs_or_grads):
        if armed[0]:
            armed[0] = not once
            raise InjectedFault(f"injected fault in the {stage} of blocks.1")

    m = unit.module
    (m.register_forward_pre_hook if stage == "forward" else m.register_full_backward_pre_hook)(hook)


def _raise_in_backward(rank, world_size, flag_path, linger):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt, rank, 0)
    if rank == 1:
        _arm_fault(model.blocks[1], "backward")
        try:
            _step(model, opt, rank, 1)
        except InjectedFault:
            if not linger:
                raise
            _linger(flag_path)  # caught, e.g. by an error handler that reports before exiting
            return "caught"
    else:
        _timed(lambda: _step(model, opt, rank, 1), flag_path)
    return "finished"


def test_exception_in_backward_on_one_rank_fails_the_other(tmp_path):
    with pytest.raises(RuntimeError) as info:
        spawn(_raise_in_backward, 2, str(tmp_path / "flag"), False, timeout=SPAWN_TIMEOUT, pg_timeout=20)
    msg = str(info.value)
    assert "InjectedFault: injected fault in the backward of blocks.1" in msg, msg  # rank 1's own cause
    rank0 = msg.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]
    # Rank 0 was waiting for the reduce-scatter of the unit whose backward rank 1 never finished.
    _assert_named_collective_error(rank0, 0, "reduce_scatter")
    assert "post-backward gradient of unit 'blocks.1 (Block)'" in rank0, rank0
    assert _surfaced_after(rank0) < 20, rank0


def test_exception_in_backward_with_lingering_rank_times_out_the_other(tmp_path):
    with pytest.raises(RuntimeError) as info:
        spawn(_raise_in_backward, 2, str(tmp_path / "flag"), True, timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    msg = str(info.value)
    assert "--- rank 1 ---" not in msg, msg
    _assert_named_collective_error(msg, 0, "reduce_scatter")
    assert "post-backward gradient of unit 'blocks.1 (Block)' timed out (the process group's timeout)" in msg, msg
    assert PG_TIMEOUT - 0.5 < _surfaced_after(msg) < PG_TIMEOUT + 5, msg


def _train_on_after_caught_backward_fault(rank, world_size):
    """Both ranks hit the same exception in the same backward (like an OOM on
    one too-long batch), catch it, skip the batch and train on: the result is
    bit-identical to a run that never saw that batch (the partial gradients of
    the interrupted backward are discarded, not added to the next step's)."""
    model, clean = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_clean = torch.optim.AdamW(clean.parameters(), lr=1e-2)
    _step(model, opt, rank, 0)
    _step(clean, opt_clean, rank, 0)
    _arm_fault(model.blocks[1], "backward", once=True)
    try:
        _step(model, opt, rank, 1)
    except InjectedFault:
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="after a backward that raised and was caught, run the next forward first"):
            model.state_dict()  # refused (as by torch FSDP1) until the next forward puts the units back
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2, 5):
        _step(model, opt, rank, step)
        _step(clean, opt_clean, rank, step)
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    same = [torch.equal(a, b) for a, b in zip(model.parameters(), clean.parameters())]
    return all(moved) and all(same)


def test_training_resumes_after_an_exception_caught_in_backward():
    assert all(spawn(_train_on_after_caught_backward_fault, 2, timeout=SPAWN_TIMEOUT, pg_timeout=20))


def _accumulate_across_caught_fault(rank, world_size, strategy, use_orig_params, sync, zero_grad=False, hook=False):
    """Micro-batch 1 completes, micro-batch 2's backward raises half-way (after
    blocks.2 reduced, before blocks.0), micro-batch 3 completes, all without
    zero_grad. Every unit then holds micro-batch 3's gradient alone, as a
    fresh model's backward of it gives (before, the units that reduced during
    the failure had lost micro-batch 1, or under NO_SHARD kept micro-batch 2's
    part, and the rest kept micro-batch 1). With ``zero_grad`` (the warning's fix) called
    after the failure: NO_SHARD's first forward after it raised AttributeError (the
    interrupted all-reduce's result was copied into a .grad set to None)."""
    import warnings
    import contextlib

    def build():
        torch.manual_seed(0)
        m = zs.FSDP(MLP(n_blocks=3), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}),
                    sharding_strategy=zs.ShardingStrategy[strategy], use_orig_params=use_orig_params)
        if hook:  # a communication hook's reductions are finished (and dropped) by the recovery too
            m.register_comm_hook(zs.comm_hooks.DefaultState(m.process_group), zs.comm_hooks.allreduce_hook)
        return m

    model, clean = build(), build()
    ctx = contextlib.nullcontext if sync else model.no_sync
    with ctx():
        model(batch("mlp", rank, 1)).pow(2).mean().backward()
    _arm_fault(model.blocks[1], "backward", once=True)
    try:
        with ctx():
            model(batch("mlp", rank, 2)).pow(2).mean().backward()
    except InjectedFault:
        if zero_grad:
            model.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(batch("mlp", rank, 3)).pow(2).mean().backward()
    clean(batch("mlp", rank, 3)).pow(2).mean().backward()
    said = any("also those accumulated before it" in str(w.message) for w in caught)
    grads = [(p.grad is None) == (q.grad is None) if p.grad is None or q.grad is None else torch.equal(p.grad, q.grad)
             for p, q in zip(model.parameters(), clean.parameters())]
    return said, grads, sum(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("strategy, use_orig_params, sync, zero_grad, hook", [
    ("FULL_SHARD", False, True, False, False), ("FULL_SHARD", True, True, False, False),
    ("NO_SHARD", False, True, False, False), ("SHARD_GRAD_OP", True, True, False, False),
    ("FULL_SHARD", True, False, False, False), ("NO_SHARD", False, True, True, False), ("NO_SHARD", False, True, True, True)])
def test_a_caught_backward_fault_drops_every_units_gradients_alike(strategy, use_orig_params, sync, zero_grad, hook):
    for said, grads, with_grad in spawn(_accumulate_across_caught_fault, 2, strategy, use_orig_params, sync, zero_grad,
                                        hook, timeout=SPAWN_TIMEOUT, pg_timeout=20):
        assert said
        assert with_grad > 0 and all(grads), grads


# ------------------------------------------- 4a. an exception inside forward
def _train_on_after_caught_forward_fault(rank, world_size):
    """Micro-batch 1 completes its backward; micro-batch 2 raises inside the
    forward of blocks.1 (a bad batch), is caught and skipped; the optimizer
    steps and training goes on. The result is bit-identical to a run that never
    saw micro-batch 2. Before, the root and blocks.1 stayed gathered past the
    step: the next forward computed with the old parameters (use_orig_params),
    or the step itself failed on a full-size FlatParameter (torch FSDP1 does both)."""
    out = {}
    # "blocks only": a root holding no parameters of its own (its post-forward still marks the forward)
    S = zs.ShardingStrategy
    cases = [(kind, dict(sharding_strategy=strategy, use_orig_params=orig)) for kind in ("mlp", "blocks only")
             for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP) for orig in (False, True)]
    cases += [("mlp", kw) for kw in (dict(forward_prefetch=True), dict(sharding_strategy=S.NO_SHARD),
                                     dict(mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16)),
                                     dict(cpu_offload=zs.CPUOffload(offload_params=True)))]
    for kind, kw in cases:
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            net = MLP(n_blocks=3) if kind == "mlp" else torch.nn.Sequential(*(Block(5, 13) for _ in range(3)))
            m = zs.FSDP(net, auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), **kw)
            assert (m._handle is None) == (kind != "mlp")
            runs.append((m, torch.optim.AdamW(m.parameters(), lr=1e-2)))
        (model, opt), (clean, opt_clean) = runs
        for m, _ in runs:
            m(batch("mlp", rank, 0)).pow(2).mean().backward()
        _arm_fault(model.blocks[1] if kind == "mlp" else model.module[1], "forward", once=True)
        with pytest.raises(InjectedFault):
            model(batch("mlp", rank, 1))
        for m, o in runs:
            o.step()
            o.zero_grad()
        for step in range(2, 4):
            _step(model, opt, rank, step)
            _step(clean, opt_clean, rank, step)
        out[f"{kind} {kw}"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), clean.parameters()))
    return out


def test_training_resumes_after_an_exception_caught_in_forward():
    for result in spawn(_train_on_after_caught_forward_fault, 2, timeout=SPAWN_TIMEOUT, pg_timeout=20):
        assert all(result.values()), result


def _forward_fault_on_one_rank(rank, world_size, flag_path):
    model = _model()
    if rank == 1:  # raises in blocks.1's forward, catches it and lingers: it never gathers blocks.2
        _arm_fault(model.blocks[1], "forward")
        with pytest.raises(InjectedFault):
            model(batch("mlp", rank, 0))
        _linger(flag_path)
        return []
    try:
        _timed(lambda: model(batch("mlp", rank, 0)), flag_path)
    except CollectiveError as e:
        chain = []
        while e is not None:
            chain.append(type(e).__name__)
            e = e.__context__
        return chain
    return ["no error"]


def test_a_collective_failing_inside_forward_is_raised_once(tmp_path):
    """Rank 0's all-gather of blocks.2 times out: the forward's unwinding ends its units without
    waiting on that failed all-gather again (it used to raise the same CollectiveError a second
    time, from inside the first's handling)."""
    chain, _ = spawn(_forward_fault_on_one_rank, 2, str(tmp_path / "flag"), timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    assert chain == ["CollectiveError", "RuntimeError"], chain


def _forward_after_a_failed_gather(rank, world_size, flag_path):
    torch.manual_seed(0)
    model = zs.FSDP(torch.nn.Linear(8, 8))
    x = torch.ones(2, 8)
    model(x).sum().backward()
    if rank == 1:  # never joins the next all-gather
        _linger(flag_path)
        return []
    seen = []
    for _ in range(2):  # the second forward, after the failure was caught, must not use the unfilled buffer
        try:
            with torch.no_grad():
                model(x)
            seen.append("returned")
        except CollectiveError:
            seen.append("CollectiveError")
        open(flag_path, "w").close()
    return seen


def test_a_forward_after_a_caught_all_gather_failure_raises_again(tmp_path):
    """The failed all-gather stays pending, so the next forward raises again. Cleared on failure
    (tried once), it let that forward compute on the never-filled gathered buffer, silently."""
    seen, _ = spawn(_forward_after_a_failed_gather, 2, str(tmp_path / "flag"), timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    assert seen == ["CollectiveError", "CollectiveError"], seen


# ------------------------------------------- 4b. a collective call on one rank only
def _state_call_on_rank0_only(rank, world_size, flag_path, call):
    """Rank 0 alone makes a collective state-dict or checkpoint call (the
    classic ``if rank == 0: save(...)``); rank 1 lingers elsewhere."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt, rank, 0)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}  # on every rank, as it should be
    if rank != 0:
        _linger(flag_path)
        return "lingered"
    if call == "optim_state_dict":
        _timed(lambda: zs.FSDP.optim_state_dict(model, opt), flag_path)
    elif call == "local_state_dict":
        with zs.FSDP.state_dict_type(model, zs.StateDictType.LOCAL_STATE_DICT):
            _timed(model.state_dict, flag_path)
    else:
        _timed(lambda: checkpoint.save_sharded(state, os.path.join(os.path.dirname(flag_path), "ckpt")), flag_path)
    return "finished"


@pytest.mark.parametrize("call, waited_on", [
    ("optim_state_dict", "all_gather_object for optim_state_dict (unit '<root> (MLP)': which ranks hold optimizer state)"),
    ("save_sharded", "all_gather_object for save_sharded (comparing the paths)"),
    # torch's ShardedTensor exchange, named too (gloo's bare error named neither rank nor call)
    ("local_state_dict", "all_gather_object for LOCAL state_dict (unit '<root> (MLP)': ShardedTensor metadata)"),
])
def test_state_call_on_one_rank_only_times_out_naming_the_call(tmp_path, call, waited_on):
    with pytest.raises(RuntimeError) as info:
        spawn(_state_call_on_rank0_only, 2, str(tmp_path / "flag"), call, timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    msg = str(info.value)
    assert "--- rank 1 ---" not in msg, msg
    assert f"zeroshard.comm.CollectiveError: zeroshard: rank 0: {waited_on} timed out" in msg, msg
    assert "did not make this call" in msg, msg  # the hint covers this fault
    assert PG_TIMEOUT - 0.5 < _surfaced_after(msg) < PG_TIMEOUT + 5, msg


def _rank1_dies_inside_dcp_load(rank, world_size, folder):
    import torch.distributed.checkpoint as dcp

    model = _model()
    with zs.FSDP.state_dict_type(model, zs.StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
    checkpoint.save_sharded(state, folder)
    if rank == 1:
        dcp.load = lambda *args, **kwargs: os._exit(0)  # gone between the checks and DCP's own collectives
    checkpoint.load_sharded(state, folder)


def test_a_rank_lost_inside_dcp_is_named():
    """DCP's own gather_object failed with gloo's bare 'Connection reset by peer': no rank, no call."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder, pytest.raises(RuntimeError) as info:
        spawn(_rank1_dies_inside_dcp_load, 2, os.path.join(folder, "ck"), timeout=SPAWN_TIMEOUT, pg_timeout=20)
    msg = str(info.value)
    assert "CollectiveError: zeroshard: rank 0: torch.distributed.checkpoint.load for load_sharded(" in msg, msg


def _sync_module_states_on_rank0_only(rank, world_size):
    torch.manual_seed(0)
    try:
        zs.FSDP(MLP(n_blocks=2), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}), sync_module_states=rank == 0)
    except CollectiveError as e:
        return str(e)
    return None


def test_ranks_in_different_exchanges_say_so():
    """Rank 0's sync_module_states comparison paired with rank 1's layout comparison: each read the
    other's data and reported a dtype difference in identical models."""
    for rank, msg in enumerate(spawn(_sync_module_states_on_rank0_only, 2, timeout=SPAWN_TIMEOUT, pg_timeout=20)):
        mine, theirs = ("sync_module_states", "construction") if rank == 0 else ("construction", "sync_module_states")
        assert msg and "the ranks are in different exchanges" in msg, msg
        assert msg.index(mine) < msg.index(f"rank {1 - rank} in '{theirs}"), msg


def _lazy_init_on_rank0_only(rank, world_size):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    if rank == 0:
        zs.FSDP.fsdp_modules(model, root_only=True)  # a local query: the units get their '<path> (Class)' names here
    zs.FSDP.optim_state_dict(model, opt)
    return True


def test_an_exchange_named_after_a_unit_renamed_on_one_rank_is_not_refused():
    assert all(spawn(_lazy_init_on_rank0_only, 2, timeout=SPAWN_TIMEOUT, pg_timeout=20))


# ------------------------------------------- 5. SIGKILL during checkpoint.save
_NUMEL = 1_000_000  # x 5 tensors x 4 bytes = 20 MB per checkpoint


def _version(v: int) -> dict:
    """Checkpoint number ``v``: every tensor's content is derived from ``v``, so a
    file mixing two versions (or a torn one) cannot pass for either."""
    state = {"version": torch.tensor(v)}
    for k in range(5):
        state[f"t{k}"] = torch.full((_NUMEL,), v + k / 8)
    return state


def _is_version(state: dict, v: int) -> bool:
    expected = _version(v)
    return list(state) == list(expected) and all(torch.equal(state[k], expected[k]) for k in expected)


def _save_in_child(state: dict, path) -> tuple[int, int]:
    """Fork a child that saves ``state`` to ``path`` once. Returns (pid, fd
    of a pipe on which the child writes b"r" just before and b"d" just after
    the save). Forked, not exec'd: a fresh interpreter would spend seconds
    importing torch per round."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.write(w, b"r")
            checkpoint.save(state, path)
            os.write(w, b"d")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"r"
    return pid, r


def test_checkpoint_save_killed_at_random_moments_loses_nothing(tmp_path):
    """(tests/test_checkpoint.py has a 6-round version with an exec'd writer
    script saving in a loop; it has no helper functions to share.) Here: 20
    rounds, one save of version v+1 over version v per round, SIGKILL at a
    random moment spread over the save's duration."""
    path = tmp_path / "ckpt.pt"
    checkpoint.save(_version(0), path)
    t = time.perf_counter()
    checkpoint.save(_version(0), path)  # calibrate: how long one save takes here
    save_s = time.perf_counter() - t
    rng = random.Random(1234)
    current, outcomes = 0, {"old": 0, "new": 0, "torn_tmp": 0}
    for _ in range(20):
        new = current + 1
        state = _version(new)
        pid, pipe = _save_in_child(state, path)
        time.sleep(rng.uniform(0, 1.5 * save_s))  # before, inside (write, fsync, rename) or after the save
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        completed = os.read(pipe, 1) == b"d"
        os.close(pipe)
        temporaries = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert len(temporaries) <= 1, temporaries  # each save clears the stale one a killed save left
        outcomes["torn_tmp"] += bool(temporaries)
        loaded = checkpoint.load(path)  # never a torn file
        if _is_version(loaded, new):
            current = new
            outcomes["new"] += 1
        else:
            assert not completed, "a save that returned was lost"
            assert _is_version(loaded, current), f"neither version {current} nor {new}: {int(loaded['version'])}"
            outcomes["old"] += 1
    # The kills landed on both sides of the rename and really inside writes.
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1 and outcomes["torn_tmp"] >= 1, outcomes
    checkpoint.save(_version(current), path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # stale temporaries cleaned up

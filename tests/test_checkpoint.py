"""Checkpoints: optimizer state dicts equal to torch FSDP1's and loadable by
either engine, resuming bit-exactly, also rank 0 only; SHARDED state dicts
through torch.distributed.checkpoint with resharding across world sizes; the
consolidation CLI (model and optimizer); atomic saves that survive SIGKILL;
prefixed and misshapen FULL state dicts. (Sharded optimizer state and hybrid
sharding: test_sharded_checkpoint.py; atomic DCP directories: test_dcp_atomic.py.)"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.fsdp as tfsdp

import zeroshard as zs
from models import build
from parity import assert_same_value as _assert_same_value
from parity import train_step as _step
from parity import trained_with_adamw as _trained_pair
from parity import wrapped_with_adamw as _engines
from zeroshard import checkpoint, optim_load, optim_state
from zeroshard import FullOptimStateDictConfig


def _torch_osd(model, opt):
    # offload_to_cpu=False: with torch's default (True) on CPU, FSDP1's
    # use_orig_params=True gather returns views of one buffer reused for every
    # state name, so exp_avg comes back equal to exp_avg_sq (see the report).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tfsdp.FullyShardedDataParallel.state_dict_type(
                model, tfsdp.StateDictType.FULL_STATE_DICT, tfsdp.FullStateDictConfig(),
                tfsdp.FullOptimStateDictConfig(offload_to_cpu=False)):
            return tfsdp.FullyShardedDataParallel.optim_state_dict(model, opt)


def _torch_to_load(model, opt, osd):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tfsdp.FullyShardedDataParallel.optim_state_dict_to_load(model, opt, osd)


def _assert_osd_equal(ref, ours, key_order=True):
    """Equal values; with ``key_order`` also each parameter's state keys in the same order."""
    assert list(ref["state"]) == list(ours["state"]), (list(ref["state"]), list(ours["state"]))
    for fqn, st in ref["state"].items():
        same = list(st) == list(ours["state"][fqn]) if key_order else set(st) == set(ours["state"][fqn])
        assert same, (fqn, list(st), list(ours["state"][fqn]))
        for k, v in st.items():
            _assert_same_value(v, ours["state"][fqn][k], f"{fqn}.{k}")
    assert ref["param_groups"] == ours["param_groups"]


def _assert_local_equal(a, b):
    """Two optimizers' own state dicts (per-rank shards) are equal."""
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"]) or set(a["state"]) == set(b["state"]), (list(a["state"]), list(b["state"]))
    for k in a["state"]:
        assert set(a["state"][k]) == set(b["state"][k]), k
        for name, v in a["state"][k].items():
            _assert_same_value(v, b["state"][k][name], f"{k}.{name}")


# ------------------------------------------------------------- optim state dicts
def _osd_parity(rank, world_size, model_name, use_orig_params, strategy, ignored=()):
    (ref, ours), (opt_ref, opt_ours) = _trained_pair(rank, model_name, use_orig_params, strategy, ignored=ignored)
    for (n, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        assert torch.equal(a, b), n  # trained bit-identically: the states must be equal too
    osd_ref = _torch_osd(ref, opt_ref)
    with zs.FSDP.state_dict_type(ours, zs.StateDictType.FULL_STATE_DICT, zs.FullStateDictConfig(),
                                 tfsdp.FullOptimStateDictConfig(offload_to_cpu=False)):
        osd_ours = zs.FSDP.optim_state_dict(ours, opt_ours)
    _assert_osd_equal(osd_ref, osd_ours)
    # Back to this rank's shards: both engines give what each optimizer holds.
    local = opt_ours.state_dict()
    _assert_local_equal(local, optim_load.optim_state_dict_to_load(ours, opt_ours, osd_ours))
    _assert_local_equal(_torch_to_load(ref, opt_ref, osd_ref), optim_load.optim_state_dict_to_load(ours, opt_ours, osd_ref))
    return len(osd_ours["state"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_optim_state_dict_matches_torch(ranks, world_size, use_orig_params, model_name):
    counts = ranks.run(world_size, _osd_parity, model_name, use_orig_params, "FULL_SHARD")
    assert counts[0] == (16 if model_name == "mlp" else 40)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_optim_state_dict_matches_torch_no_shard(ranks, use_orig_params):
    ranks.run(2, _osd_parity, "mlp", use_orig_params, "NO_SHARD")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_optim_state_dict_with_ignored_parameters_matches_torch(ranks, use_orig_params):
    """A parameter no unit manages: its state is the optimizer's own, copied in its key order (step first)."""
    ranks.run(2, _osd_parity, "mlp", use_orig_params, "FULL_SHARD", ("inp.weight", "out.bias"))


def _resume(rank, world_size, model_name, use_orig_params, load_orig_params):
    (model,), (opt,) = _engines(model_name, use_orig_params, engines=("zeroshard",))
    for step in range(3):
        _step(model, opt, model_name, rank, step)
    sd, osd = model.state_dict(), zs.FSDP.optim_state_dict(model, opt)
    for step in range(3, 6):
        _step(model, opt, model_name, rank, step)
    expected = model.state_dict()
    # A fresh model (other initial weights, no optimizer state), possibly in the other layout.
    (fresh,), (fresh_opt,) = _engines(model_name, load_orig_params, engines=("zeroshard",), seed=1)
    fresh.load_state_dict(sd)
    zs.FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd, load_directly=True)
    for step in range(3, 6):
        _step(fresh, fresh_opt, model_name, rank, step)
    got = fresh.state_dict()
    assert list(expected) == list(got)
    for k in expected:
        assert torch.equal(expected[k], got[k]), k
    return True


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("use_orig_params,load_orig_params", [(False, False), (True, True), (False, True), (True, False)])
def test_resume_from_full_model_and_optim_state_is_bit_exact(ranks, world_size, use_orig_params, load_orig_params):
    ranks.run(world_size, _resume, "gpt", use_orig_params, load_orig_params)


def _state_dict_between_steps(rank, world_size, use_orig_params):
    """Saving between steps leaves training unchanged (after zero_grad the flat
    gradient must not come back as the original parameters' grads)."""
    (a, b), (opt_a, opt_b) = _engines("gpt", use_orig_params, engines=("zeroshard", "zeroshard"))
    for step in range(3):
        for m, o in ((a, opt_a), (b, opt_b)):
            _step(m, o, "gpt", rank, step)
        a.state_dict()
        zs.FSDP.optim_state_dict(a, opt_a)
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_saving_between_steps_does_not_change_training(ranks, use_orig_params):
    assert all(ranks.run(2, _state_dict_between_steps, use_orig_params))


def _adagrad_steps(rank, world_size):
    """Adagrad makes its state at construction, also for a parameter this rank
    holds no element of (use_orig_params): that state's ``step`` stays 0. The
    saved ``step`` is the one of the ranks that hold the parameter, as torch's;
    with lr_decay a wrong one changes training after a reload."""
    (ref, ours), _ = _engines("mlp", True)
    make = lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.5)  # noqa: E731
    opt_ref, opt_ours = make(ref), make(ours)
    assert any(p.numel() == 0 for p in ours.parameters())  # the case above exists on some rank
    for step in range(2):
        for m, o in ((ref, opt_ref), (ours, opt_ours)):
            _step(m, o, "mlp", rank, step)
    osd = optim_state.optim_state_dict(ours, opt_ours)
    _assert_osd_equal(_torch_osd(ref, opt_ref), osd, key_order=False)
    (again,), _ = _engines("mlp", True, engines=("zeroshard",))
    opt_again = make(again)
    again.load_state_dict(ours.state_dict())
    opt_again.load_state_dict(optim_load.optim_state_dict_to_load(again, opt_again, osd))
    for step in range(2, 4):
        for m, o in ((ours, opt_ours), (again, opt_again)):
            _step(m, o, "mlp", rank, step)
    return all(torch.equal(a, b) for a, b in zip(ours.parameters(), again.parameters()))


def test_adagrad_step_comes_from_the_ranks_holding_the_parameter(ranks):
    assert all(ranks.run(2, _adagrad_steps))


def _cross_engine(rank, world_size, model_name, src_orig, dst_orig):
    """zeroshard's full optim state dict loads into torch FSDP1 and back."""
    (ref, ours), (opt_ref, opt_ours) = _trained_pair(rank, model_name, src_orig)
    osd_ours, osd_ref = optim_state.optim_state_dict(ours, opt_ours), _torch_osd(ref, opt_ref)
    sd = ours.state_dict()
    # Fresh models of both engines in the destination layout; each loads the
    # *other* engine's checkpoint, then all four train on identically.
    (ref2, ours2), (opt_ref2, opt_ours2) = _engines(model_name, dst_orig, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref2.load_state_dict(sd)
    ours2.load_state_dict(sd)
    opt_ref2.load_state_dict(_torch_to_load(ref2, opt_ref2, osd_ours))
    opt_ours2.load_state_dict(optim_load.optim_state_dict_to_load(ours2, opt_ours2, osd_ref))
    if src_orig == dst_orig:
        _assert_local_equal(opt_ref.state_dict(), opt_ref2.state_dict())
        _assert_local_equal(opt_ours.state_dict(), opt_ours2.state_dict())
    for step in range(3, 5):
        for m, o in ((ref, opt_ref), (ours, opt_ours), (ref2, opt_ref2), (ours2, opt_ours2)):
            _step(m, o, model_name, rank, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        finals = [m.state_dict() for m in (ref, ours, ref2, ours2)]
    for k in finals[0]:
        assert all(torch.equal(finals[0][k], f[k]) for f in finals[1:]), k
    return True


@pytest.mark.parametrize("src_orig,dst_orig", [(False, False), (True, True), (True, False)])
def test_optim_state_dict_crosses_engines(ranks, src_orig, dst_orig):
    ranks.run(2, _cross_engine, "mlp", src_orig, dst_orig)


def _rank0_only(rank, world_size, use_orig_params):
    """FullOptimStateDictConfig(rank0_only=True): the full dict on rank 0
    only, {} elsewhere, as torch; loading reads rank 0's dict only."""
    (ref, ours), (opt_ref, opt_ours) = _trained_pair(rank, "mlp", use_orig_params)
    TFSDP, FULL = tfsdp.FullyShardedDataParallel, tfsdp.StateDictType.FULL_STATE_DICT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TFSDP.state_dict_type(ref, FULL, tfsdp.FullStateDictConfig(), tfsdp.FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=False)):
            osd_t = TFSDP.optim_state_dict(ref, opt_ref)
            with zs.FSDP.state_dict_type(ours, zs.StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
                osd_z = zs.FSDP.optim_state_dict(ours, opt_ours)
                # Each engine's rank-0 dict loads into both (other ranks pass the {} they got).
                for osd in (osd_t, osd_z):
                    _assert_local_equal(opt_ours.state_dict(), zs.FSDP.optim_state_dict_to_load(ours, opt_ours, osd))
                    _assert_local_equal(opt_ref.state_dict(), TFSDP.optim_state_dict_to_load(ref, opt_ref, osd))
        # torch's full_optim_state_dict always offloads: wrong on CPU with use_orig_params=True (see _torch_osd)
        legacy_t = TFSDP.full_optim_state_dict(ref, opt_ref) if not use_orig_params else None
    legacy_z = zs.FSDP.full_optim_state_dict(ours, opt_ours)  # rank0_only=True by default, as in torch
    everywhere = zs.FSDP.full_optim_state_dict(ours, opt_ours, rank0_only=False)
    full_t = _torch_osd(ref, opt_ref)
    if rank != 0:
        assert osd_t == {} and osd_z == {} and legacy_z == {} and legacy_t in (None, {})
        _assert_osd_equal(full_t, everywhere)
        return True
    for osd in (osd_t, osd_z, legacy_z, everywhere, legacy_t):
        if osd is not None:
            _assert_osd_equal(full_t, osd)
    return True


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_rank0_only_optim_state_dict_matches_torch(ranks, use_orig_params):
    assert all(ranks.run(3, _rank0_only, use_orig_params))


# ------------------------------------------------- SHARDED_STATE_DICT with DCP
def _zs_model(model_name, use_orig_params, seed=0):
    (model,), (opt,) = _engines(model_name, use_orig_params, engines=("zeroshard",), seed=seed)
    return model, opt


def _sharded_save(rank, world_size, path, model_name, use_orig_params, engine="zeroshard"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    (model,), (opt,) = _engines(model_name, use_orig_params, engines=(engine,))
    for step in range(2):
        _step(model, opt, model_name, rank, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = model.state_dict()
    lib = zs if engine == "zeroshard" else tfsdp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
            sd = model.state_dict()
            if engine == "zeroshard":
                assert list(sd) == list(full)
                for k, v in sd.items():
                    if not isinstance(v, DTensor):  # buffers stay plain
                        assert torch.equal(v, full[k]) and k == "scale", k
                        continue
                    rows = -(-full[k].shape[0] // world_size)
                    assert v.shape == full[k].shape and torch.equal(v.to_local(), full[k][rank * rows : (rank + 1) * rows]), k
            dcp.save(sd, checkpoint_id=path)
    return full if rank == 0 else None


def _sharded_load(rank, world_size, path, model_name, use_orig_params):
    import torch.distributed.checkpoint as dcp

    model, _ = _zs_model(model_name, use_orig_params, seed=1)  # other initial weights
    with zs.FSDP.state_dict_type(model, zs.StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
    return model.state_dict()


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 3), (3, 1), (4, 2)])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_state_dict_reshards_through_dcp(ranks, tmp_path, save_world, load_world, use_orig_params):
    model_name = "gpt" if save_world != 4 else "mlp"
    saved = ranks.run(save_world, _sharded_save, str(tmp_path), model_name, use_orig_params)[0]
    for got in ranks.run(load_world, _sharded_load, str(tmp_path), model_name, not use_orig_params if load_world == 3 else use_orig_params):
        assert list(got) == list(saved)
        for k in saved:
            assert torch.equal(saved[k], got[k]), k


def test_torch_fsdp_sharded_checkpoint_loads_into_zeroshard(ranks, tmp_path):
    saved = ranks.run(2, _sharded_save, str(tmp_path), "gpt", False, "torch")[0]
    for got in ranks.run(3, _sharded_load, str(tmp_path), "gpt", True):
        assert list(got) == list(saved)
        for k in saved:
            assert torch.equal(saved[k], got[k]), k


# ------------------------------------------------------------- consolidation
def test_consolidate_cli_gives_a_plain_state_dict(ranks, tmp_path):
    import subprocess
    import sys

    ckpt, out = tmp_path / "ckpt", tmp_path / "full.pt"
    saved = ranks.run(3, _sharded_save, str(ckpt), "gpt", True)[0]
    proc = subprocess.run([sys.executable, "-m", "zeroshard.consolidate", str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    full = torch.load(out, weights_only=True)
    assert list(full) == list(saved)  # the plain model's keys, in its order
    plain = build("gpt", seed=1)
    plain.load_state_dict(full, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), k
    bad = subprocess.run([sys.executable, "-m", "zeroshard.consolidate", str(tmp_path), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not a torch.distributed.checkpoint directory" in bad.stderr


def _save_model_and_optim(rank, world_size, path):
    (model,), (opt,) = _engines("gpt", True, engines=("zeroshard",))
    for step in range(2):
        _step(model, opt, "gpt", rank, step)
    full = zs.FSDP.optim_state_dict(model, opt)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.SHARDED_STATE_DICT):
        checkpoint.save_sharded({"model": model.state_dict(), "optim": zs.FSDP.optim_state_dict(model, opt)}, path)
    return full if rank == 0 else None


def test_consolidate_gives_the_full_optimizer_state_dict(ranks, tmp_path):
    from zeroshard.consolidate import consolidate

    ckpt = str(tmp_path / "ckpt")
    full = ranks.run(3, _save_model_and_optim, ckpt)[0]
    got = consolidate(ckpt, str(tmp_path / "optim.pt"), key="optim")
    assert set(got["state"]) == set(full["state"])
    _assert_osd_equal(full, {**got, "state": {k: got["state"][k] for k in full["state"]}}, key_order=False)
    reloaded = torch.load(tmp_path / "optim.pt", weights_only=False)
    assert all(torch.equal(reloaded["state"][k]["exp_avg"], full["state"][k]["exp_avg"]) for k in full["state"])


# ------------------------------------------------------------- atomic saves
_WRITER = """
import sys, torch
from zeroshard import checkpoint
base = int(sys.argv[2])
print("ready", flush=True)
for i in range(10_000):  # save until killed
    v = base + i
    checkpoint.save({"version": torch.tensor(v), "w": torch.full((2_000_000,), float(v))}, sys.argv[1])
"""


def test_atomic_save_survives_sigkill(tmp_path):
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from zeroshard import checkpoint

    path = tmp_path / "ckpt.pt"
    checkpoint.save({"version": torch.tensor(0), "w": torch.zeros(2_000_000)}, path)
    rng, last, torn = random.Random(0), 0, 0
    for round_ in range(1, 31):  # at least 6 kills, and on until one lands inside a save (a loaded box can miss 6 times)
        if round_ > 6 and torn:
            break
        base = 1000 * round_
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(base)], stdout=subprocess.PIPE,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.02, 0.4))  # lands anywhere in a save (each takes tens of ms)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        torn += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # killed inside a save
        state = checkpoint.load(path)  # never a torn file
        v = int(state["version"])
        assert v == last or base <= v < base + 10_000, (v, last, base)
        assert torch.equal(state["w"], torch.full((2_000_000,), float(v)))
        last = v
    assert torn >= 1  # some kill really landed mid-write
    checkpoint.save({"version": torch.tensor(99)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # stale temporaries cleaned up
    assert int(checkpoint.load(path)["version"]) == 99


def test_load_of_an_empty_or_truncated_file_names_it(tmp_path):
    from zeroshard import checkpoint

    path = tmp_path / "ckpt.pt"
    checkpoint.save({"w": torch.randn(1000, 100)}, path)
    os.truncate(path, os.path.getsize(path) // 2)  # e.g. an interrupted copy
    with pytest.raises(RuntimeError, match=rf"checkpoint.load: '{path}' \(\d+ bytes\) is truncated or damaged \(BadZipFile: "):
        checkpoint.load(path)  # found by the CRC check's zip reader
    with pytest.raises(RuntimeError, match=rf"checkpoint.load: '{path}' \(\d+ bytes\) is empty or truncated \(RuntimeError: "):
        checkpoint.load(path, verify=False)  # found by torch.load
    open(path, "wb").close()
    with pytest.raises(RuntimeError, match=rf"checkpoint.load: '{path}' \(0 bytes\) is empty or truncated \(EOFError"):
        checkpoint.load(path)


def test_load_of_a_file_cut_anywhere_or_with_changed_bytes_names_it(tmp_path):
    """Cut at 40 points, torch.load raised a bare 'OSError: [Errno 22] Invalid argument' at 19
    of them; with 64 bytes zeroed, it loaded wrong values silently at 49 of 50 offsets (it
    checks no CRC). load checks every entry's CRC-32 first, unless verify=False; it still reads
    every file torch.load reads."""
    from zeroshard import checkpoint

    path = tmp_path / "ckpt.pt"
    state = {f"l{i}": torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    checkpoint.save(state, path)
    blob = path.read_bytes()
    for k in range(1, 40):
        path.write_bytes(blob[: len(blob) * k // 40])
        for verify in (True, False):
            with pytest.raises(RuntimeError, match=rf"checkpoint.load: '{path}' \(\d+ bytes\) is (empty or )?truncated"):
                checkpoint.load(path, verify=verify)
    data = blob.index(state["l2"].numpy().tobytes()[:64])  # inside a tensor's bytes
    path.write_bytes(blob[:data] + bytes(64) + blob[data + 64 :])
    with pytest.raises(RuntimeError, match=r"is damaged: its entry '.*/data/\d+' fails its CRC-32 check"):
        checkpoint.load(path)
    loaded = checkpoint.load(path, verify=False)  # what torch.load gives
    assert not torch.equal(loaded["l2"], state["l2"]) and torch.equal(loaded["l1"], state["l1"])
    path.write_bytes(blob)
    assert all(torch.equal(v, state[k]) for k, v in checkpoint.load(path).items())
    # What torch.load reads, load reads: a save told not to compute CRCs (all 0), and a legacy
    # (non-zip) file whose tensor bytes hold a zip end record (zipfile.is_zipfile says yes)
    torch.serialization.set_crc32_options(False)
    try:
        checkpoint.save(state, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert all(torch.equal(v, state[k]) for k, v in checkpoint.load(path).items())
    eocd = torch.tensor(list(b"PK\x05\x06" + bytes(18)), dtype=torch.uint8)
    torch.save({"w": eocd}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(checkpoint.load(path)["w"], eocd)


def test_save_into_a_missing_directory_names_the_path(tmp_path):
    """torch.save says 'Parent directory ... does not exist'; the atomic save named its
    temporary file in a FileNotFoundError instead."""
    from zeroshard import checkpoint

    path = tmp_path / "missing" / "ckpt.pt"
    with pytest.raises(RuntimeError, match=rf"cannot save '{path}': its parent directory '{path.parent}' does not exist"):
        checkpoint.save({"w": torch.zeros(2)}, path)
    assert not path.parent.exists()


_BUSY_WRITER = """
import sys, torch
from zeroshard import checkpoint
print("ready", flush=True)
while True:  # a writer that is almost always inside a save
    checkpoint.save({"w": torch.zeros(2_000_000)}, sys.argv[1])
"""


def test_save_leaves_a_concurrent_writers_temporary_alone(tmp_path):
    """Two processes saving to one path (e.g. every rank saving a rank0_only
    state dict): a save's cleanup of killed saves' temporaries must not delete
    a live writer's, which would make that save fail after writing everything."""
    import os
    import subprocess
    import sys
    import time

    from zeroshard import checkpoint

    path = tmp_path / "ckpt.pt"
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_WRITER, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline, seen_live = time.monotonic() + 3.0, 0
        while time.monotonic() < deadline and proc.poll() is None:
            seen_live += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # the writer is mid-save
            checkpoint.save({"small": torch.ones(3)}, path)
            time.sleep(0.01)
        assert seen_live >= 10, seen_live  # this process's saves really ran beside the writer's
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]  # the writer never failed
    finally:
        proc.kill()
        proc.wait()


def _every_rank_saves_rank0_only(rank, world_size, path):
    from zeroshard import checkpoint

    model, opt = _zs_model("mlp", False)
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT, zs.FullStateDictConfig(rank0_only=True),
                                 FullOptimStateDictConfig(rank0_only=True)):
        state = {"model": model.state_dict(), "optim": zs.FSDP.optim_state_dict(model, opt), "step": 3}
    try:
        checkpoint.save(state, path)
        outcome = "saved"
    except ValueError as e:
        outcome = str(e)
    torch.distributed.barrier()
    # Not refused: an empty optimizer state (no step yet) saved to this rank's own file.
    checkpoint.save(torch.optim.SGD(model.parameters()).state_dict(), f"{path}.{rank}")
    return outcome, sorted(checkpoint.load(path)["model"])


def test_saving_a_rank0_only_state_dict_on_every_rank_is_refused_off_rank0(ranks, tmp_path):
    """Rank 1's dict is empty; saved to rank 0's path it could replace rank 0's checkpoint."""
    path = str(tmp_path / "full.pt")
    (out0, keys0), (out1, keys1) = ranks.run(2, _every_rank_saves_rank0_only, path)
    assert out0 == "saved"
    assert out1.startswith("zeroshard: checkpoint.save: rank 1 is saving the empty state a rank0_only state dict gives"), out1
    assert "Fix: save on rank 0 only" in out1, out1
    assert keys0 == keys1 and len(keys0) > 0 and "blocks.0.l1.weight" in keys0, keys0


def _torch_configs_rank0_only(rank, world_size):
    model, opt = _zs_model("mlp", False)
    with zs.FSDP.state_dict_type(model, tfsdp.StateDictType.FULL_STATE_DICT,
                                 tfsdp.FullStateDictConfig(rank0_only=True, offload_to_cpu=True),
                                 tfsdp.FullOptimStateDictConfig(rank0_only=True)):
        return sorted(model.state_dict()), sorted(zs.FSDP.optim_state_dict(model, opt))


def test_torch_config_classes_set_rank0_only(ranks):
    """torch's own FullStateDictConfig(rank0_only=True) counts as zeroshard's:
    rank 1 gets {} from state_dict() (it got the whole model before)."""
    (model0, optim0), (model1, optim1) = ranks.run(2, _torch_configs_rank0_only)
    assert "blocks.0.l1.weight" in model0 and optim0 == ["param_groups", "state"], (model0, optim0)
    assert model1 == [] and optim1 == [], (model1, optim1)


# ------------------------------------------------- prefixed / misshapen FULL
def _prefixed_and_misshapen(rank, world_size):
    model, _ = _zs_model("mlp", False)
    sd = model.state_dict()
    msgs = []
    for prefix in ("module.", "_fsdp_wrapped_module."):
        fresh, _ = _zs_model("mlp", False, seed=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh.load_state_dict({prefix + k: v for k, v in sd.items()})
        msgs += [str(w.message) for w in caught if "stripped" in str(w.message)]
        got = fresh.state_dict()
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    bad = dict(sd)
    bad["blocks.1.l1.weight"] = torch.zeros(3, 3)
    try:
        model.load_state_dict(bad)
    except RuntimeError as e:  # torch raises RuntimeError for a size mismatch too
        msgs.append(str(e))
    return msgs


def test_full_load_strips_prefixes_with_a_warning_and_names_bad_shapes(ranks):
    for msgs in ranks.run(2, _prefixed_and_misshapen):
        assert len(msgs) == 3, msgs
        assert "'module.'" in msgs[0] and "17 key(s)" in msgs[0] and "'module.scale'" in msgs[0]
        assert "'_fsdp_wrapped_module.scale'" in msgs[1]
        assert "'blocks.1.l1.weight'" in msgs[2] and "(3, 3)" in msgs[2] and "(13, 7)" in msgs[2]


def _bad_on_one_rank(rank, world_size):
    """Only rank 1's dict is misshapen: every rank raises and none loads (rank 0
    loading alone left the shards a mix of old and new values)."""
    model, _ = _zs_model("mlp", False)
    before = model.state_dict()
    new = {k: v + 1 for k, v in before.items()}
    if rank == 1:
        new["blocks.1.l1.weight"] = torch.zeros(3, 3)
    try:
        model.load_state_dict(new)
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = None
    after = model.state_dict()
    return msg, all(torch.equal(after[k], before[k]) for k in before)


def test_full_load_bad_on_one_rank_loads_nowhere(ranks):
    (msg0, same0), (msg1, same1) = ranks.run(2, _bad_on_one_rank)
    assert same0 and same1
    assert msg0 is not None and "rank 1 cannot load" in msg0 and "'blocks.1.l1.weight'" in msg0, msg0
    assert msg1 is not None and "(3, 3)" in msg1, msg1


def test_save_removes_only_its_own_dead_temporaries(tmp_path):
    """A save's cleanup matches its own names only: a save_sharded temporary
    directory '.model.dcp.<hex>.tmp' made save('model') raise IsADirectoryError,
    and a user's '.model.notes.tmp' was deleted. A dead writer's is removed."""
    import subprocess
    import sys

    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / ".model.dcp.0123456789ab.tmp").mkdir()
    (tmp_path / ".model.notes.tmp").write_text("mine")
    stale = tmp_path / f".model.{socket.gethostname()}.{dead_pid}.0123456789ab.tmp"
    stale.write_bytes(b"half a checkpoint")
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "model")
    assert torch.equal(checkpoint.load(tmp_path / "model")["w"], torch.ones(2))
    assert (tmp_path / ".model.dcp.0123456789ab.tmp").is_dir()
    assert (tmp_path / ".model.notes.tmp").read_text() == "mine"
    assert not stale.exists()


def test_consolidate_cli_errors_are_one_line_and_checked_first(tmp_path, capsys):
    """Bad paths: one line naming the path and the fix, exit status 1, no
    traceback; the output path is checked before the checkpoint is read (an
    output under a file gave torch's 'Parent directory ... does not exist')."""
    from zeroshard import consolidate

    ckpt = str(tmp_path / "ckpt")
    checkpoint.save_sharded({"model": {"w": torch.ones(3)}, "optim": {"state": {"w": {"exp_avg": torch.ones(3)}}}}, ckpt)
    (tmp_path / "afile").write_text("")
    cases = {"not a checkpoint": ([str(tmp_path), str(tmp_path / "o.pt")], "not a torch.distributed.checkpoint directory"),
             "under a file": ([ckpt, str(tmp_path / "afile" / "o.pt")], "which is not a directory"),
             "a directory": ([ckpt, str(tmp_path)], "is a directory"),
             "no such key": ([ckpt, str(tmp_path / "o.pt"), "--key", "nope"], "has no top-level 'nope'")}
    # Damaged after its save: DCP's CheckpointException (a BaseException) came out as a traceback.
    import shutil
    for name, damage in (("garbled metadata", lambda d: (d / ".metadata").write_text("garbage")),
                         ("a data file gone", lambda d: [f.unlink() for f in d.glob("*.distcp")])):
        broken = tmp_path / name.replace(" ", "_")
        shutil.copytree(ckpt, broken)
        damage(broken)
        cases[name] = ([str(broken), str(tmp_path / "o.pt")], "is missing, truncated or corrupt")
    for name, (argv, said) in cases.items():
        with pytest.raises(SystemExit) as info:
            consolidate.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 1 and said in err and "Fix" in err and err.count("\n") == 1, (name, err)
    assert consolidate.main([ckpt, str(tmp_path / "new" / "o.pt")]) == 0  # a missing parent is made
    assert "wrote" in capsys.readouterr().err
    assert consolidate.main([ckpt, str(tmp_path / "optim.pt"), "--key", "optim"]) == 0
    assert "1 entries, 3 elements" in capsys.readouterr().err  # the states two levels down are counted


def test_consolidate_cli_points_at_key_for_a_checkpoint_of_several_state_dicts(ranks, tmp_path):
    """A {"model", "optim"} checkpoint consolidated without --key is written whole, two nested
    dicts, not the plain state_dict the README promises: the tool says so and names --key."""
    import subprocess
    import sys

    ckpt = str(tmp_path / "ckpt")
    ranks.run(2, _save_model_and_optim, ckpt)
    proc = subprocess.run([sys.executable, "-m", "zeroshard.consolidate", ckpt, str(tmp_path / "all.pt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--key model writes that one alone" in proc.stderr, proc.stderr


def _rows_to_one_file(rank, world_size, tmp, kind):
    """A SHARDED (DTensor rows) or LOCAL (ShardedTensor flat shards) state dict saved by every rank
    with checkpoint.save to one path: each rename replaced the others' file, and the checkpoint kept
    one rank's rows; at equal row counts its reload was silently wrong. Refused on every rank before
    anything is written: SHARDED always (its checkpoint is save_sharded's directory), LOCAL where
    ranks share a path (a path per rank saves and reloads exactly, as torch FSDP1 saves LOCAL)."""
    model = zs.FSDP(build("mlp", seed=1))
    sdt = getattr(zs.StateDictType, kind)
    with zs.FSDP.state_dict_type(model, sdt):
        state = model.state_dict()
        one = os.path.join(tmp, f"{kind}.pt")
        said = "would keep one rank's rows" if kind == "SHARDED_STATE_DICT" else "save to the same file"
        with pytest.raises(ValueError, match=f"{said}.* Fix: zeroshard.checkpoint.save_sharded"):
            checkpoint.save({"model": state}, one)
        assert not os.path.exists(one)
        if kind == "SHARDED_STATE_DICT":  # refused on the ranks calling: rank 0 alone too, no collective to wait in
            if rank == 0:
                with pytest.raises(ValueError, match="would keep one rank's rows"):
                    checkpoint.save({"model": state}, one)
            return True
        mine = os.path.join(tmp, f"{kind}.{rank}.pt")
        checkpoint.save({"model": state}, mine)
        fresh = zs.FSDP(build("mlp", seed=2))
    with zs.FSDP.state_dict_type(fresh, sdt):
        fresh.load_state_dict(checkpoint.load(mine, weights_only=False)["model"])
    with zs.FSDP.state_dict_type(model, zs.StateDictType.FULL_STATE_DICT):
        want = model.state_dict()
    with zs.FSDP.state_dict_type(fresh, zs.StateDictType.FULL_STATE_DICT):
        got = fresh.state_dict()
    return all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
def test_a_sharded_state_dict_saved_by_every_rank_to_one_file_is_refused(ranks, tmp_path, kind):
    assert all(ranks.run(2, _rows_to_one_file, str(tmp_path), kind))

"""Atomic sharded (DCP) checkpoint directories: ranks SIGKILLed at random
moments of save_sharded leave the previous or the new complete checkpoint,
never a mix; load_sharded names the first key / shape / dtype / world-size
problem on every rank; save_sharded refuses per-rank plain tensors (DCP would
keep one rank's) and directories that are not checkpoints."""
from __future__ import annotations

import os
import random
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not in every forked rank

import zeroshard as zs
from models import Block, build
from zeroshard import checkpoint
from zeroshard.testing import free_port

ROWS, COLS, TENSORS = 750, 1000, 3  # 3 MB per tensor and rank: 18 MB per checkpoint on 2 ranks


def _version_state(v: int, rank: int) -> dict:
    """Checkpoint number ``v``: every value derives from ``v``, so a directory
    mixing two versions (or missing a rank's file) cannot pass for either.
    Each rank saves its own keys (no DTensors: their first use costs a second
    per fresh process, and this test is about the directory, not the format)."""
    return {"model": {f"r{rank}.t{k}": torch.full((ROWS, COLS), v + k / 8) for k in range(TENSORS)}, "step": torch.tensor(v)}


def _read_version(path) -> int:
    """Load the checkpoint in this process (no process group) and check it is one complete version."""
    state = {"model": {f"r{r}.t{k}": torch.zeros(ROWS, COLS) for r in range(2) for k in range(TENSORS)}, "step": torch.tensor(0)}
    checkpoint.load_sharded(state, path)
    v = int(state["step"])
    for key, t in state["model"].items():
        assert torch.equal(t, torch.full((ROWS, COLS), v + int(key[-1]) / 8)), f"{key} is not version {v}"
    return v


def _rank_saving_forever(rank: int, port: int, path: str, base: int, exchange: bool, pipe: int) -> None:
    """A forked rank: saves versions base, base+1, ... until killed; writes
    b"r" when its process group is up and b"s" after each save returned."""
    import torch.distributed as dist

    code = 1
    try:
        torch.set_num_threads(1)  # forked from pytest: stay out of the parent's OpenMP pool
        checkpoint._USE_EXCHANGE = exchange
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=10))
        os.write(pipe, b"r")
        for v in range(base, base + 10_000):
            checkpoint.save_sharded(_version_state(v, rank), path)
            os.write(pipe, b"s")
    except BaseException:  # noqa: BLE001 - the peer was killed: expected
        pass
    finally:
        os._exit(code)


def _fork_rank(rank, port, path, base, exchange):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns into pytest
        os.close(r)
        _rank_saving_forever(rank, port, path, base, exchange, w)
    os.close(w)
    return pid, r


def _read_all(fd) -> bytes:
    out = b""
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return out


def test_sharded_save_killed_at_random_moments_keeps_a_complete_checkpoint(tmp_path):
    """16 rounds: two forked ranks save versions in a loop; at a random
    moment one rank is SIGKILLed, then the other. The directory must then
    hold one complete version: the last one before the round, or one saved
    in it, and never older than a save rank 0 saw return (rank 0 renames).
    Half the rounds swap with renameat2(RENAME_EXCHANGE), half with the
    two-rename fallback (a kill between the renames is rolled back on load)."""
    path = str(tmp_path / "ckpt")
    rng = random.Random(7)
    last, save_s = None, None
    outcomes = {"old": 0, "new": 0, "interrupted_tmp": 0, "rolled_back": 0}
    for round_ in range(16):
        exchange = round_ % 4 < 2
        base = 1000 * (round_ + 1)
        port = free_port()
        procs = [_fork_rank(r, port, path, base, exchange) for r in range(2)]
        for _, fd in procs:
            assert os.read(fd, 1) == b"r"
        if save_s is None:  # calibrate: how long one (warm) save takes here
            assert os.read(procs[0][1], 1) == b"s"
            t = time.perf_counter()
            assert os.read(procs[0][1], 1) == b"s"
            save_s = time.perf_counter() - t
            delay = 0.0
        else:
            # Half the kills land in a round's first save (the old checkpoint must
            # survive), the others anywhere in the saves that follow.
            delay = rng.uniform(0, save_s if round_ % 2 else 3 * save_s)
        time.sleep(delay)
        victim = rng.randrange(2)
        os.kill(procs[victim][0], signal.SIGKILL)
        time.sleep(rng.uniform(0, 0.05))  # the survivor may get further (e.g. finish a rename) or fail
        os.kill(procs[1 - victim][0], signal.SIGKILL)
        for pid, _ in procs:
            os.waitpid(pid, 0)
        saves_seen = _read_all(procs[0][1]).count(b"s") + 2 * (round_ == 0)
        for _, fd in procs:
            os.close(fd)
        names = sorted(os.listdir(tmp_path))
        outcomes["interrupted_tmp"] += any(n.endswith(".tmp") for n in names)
        if exchange:  # the swap is atomic: the path itself always holds a complete checkpoint
            assert "ckpt" in names and ".ckpt.old" not in names, names
        else:
            outcomes["rolled_back"] += "ckpt" not in names
        assert set(names) <= {"ckpt", ".ckpt.old"} | {n for n in names if n.startswith(".ckpt.") and n.endswith(".tmp")}, names
        if last is None and "ckpt" not in names and ".ckpt.old" not in names:
            assert saves_seen == 0
            continue  # killed before the very first save completed: nothing to check yet
        v = _read_version(path)
        if saves_seen:
            assert base + saves_seen - 1 <= v <= base + saves_seen, (v, base, saves_seen)  # nothing returned was lost
        else:
            assert v == last or v == base, (v, last, base)  # the old one, or the first save of this round
        outcomes["new" if v != last else "old"] += 1
        last = v
    # The kills landed before and after renames, and really inside saves.
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1 and outcomes["interrupted_tmp"] >= 1, outcomes
    # The next save clears what killed saves left behind.
    both_ranks = {"model": {**_version_state(1, 0)["model"], **_version_state(1, 1)["model"]}, "step": torch.tensor(1)}
    checkpoint.save_sharded(both_ranks, path)  # one process now
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert _read_version(path) == 1


def test_fallback_swap_killed_between_renames_is_rolled_back(tmp_path):
    """The state a kill between the two fallback renames leaves (old aside,
    nothing at path) loads as the old checkpoint; after the second rename
    (new at path, old still aside) it loads as the new one."""
    path = str(tmp_path / "ckpt")
    one = {"model": {"w": torch.arange(6.0).view(2, 3)}, "step": torch.tensor(1)}
    checkpoint.save_sharded(one, path)
    os.rename(path, str(tmp_path / ".ckpt.old"))
    got = {"model": {"w": torch.zeros(2, 3)}, "step": torch.tensor(0)}
    checkpoint.load_sharded(got, path)
    assert int(got["step"]) == 1 and torch.equal(got["model"]["w"], one["model"]["w"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    checkpoint.save_sharded(one, str(tmp_path / ".ckpt.old"))  # a stale aside copy next to a newer checkpoint
    checkpoint._USE_EXCHANGE = False
    try:
        checkpoint.save_sharded({"model": {"w": torch.ones(2, 3)}, "step": torch.tensor(2)}, path)
    finally:
        checkpoint._USE_EXCHANGE = True
    checkpoint.load_sharded(got, path)
    assert int(got["step"]) == 2 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_sharded_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a checkpoint directory"):
        checkpoint.save_sharded({"w": torch.ones(2)}, str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_checkpoint_files_follow_the_umask_and_sibling_saves_are_left_alone(tmp_path):
    """checkpoint.save wrote through tempfile.mkstemp, whose mode 0600 the rename gave
    the checkpoint (torch.save's file follows the umask: 0644 under 022); save_sharded's
    cleanup of killed saves' folders ('.ckpt.<hex>.tmp') also matched a live save of
    'ckpt.best' ('.ckpt.best.<hex>.tmp') and deleted it."""
    old = os.umask(0o022)
    try:
        checkpoint.save({"a": torch.ones(2)}, str(tmp_path / "m.pt"))
        torch.save({"a": torch.ones(2)}, str(tmp_path / "t.pt"))
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "m.pt").st_mode & 0o777) == oct(os.stat(tmp_path / "t.pt").st_mode & 0o777) == "0o644"
    busy = tmp_path / ".ckpt.best.0123456789ab.tmp"  # ckpt.best being written right now
    stale = tmp_path / ".ckpt.ba9876543210.tmp"
    busy.mkdir(), stale.mkdir()
    checkpoint.save_sharded({"w": torch.ones(2)}, str(tmp_path / "ckpt"))
    assert busy.is_dir() and not stale.exists()


# ------------------------------------------------------------ load_sharded errors
def _mlp():
    torch.manual_seed(0)
    model = zs.FSDP(build("mlp"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state_of(model, opt):
    from zeroshard import ShardedOptimStateDictConfig

    with zs.FSDP.state_dict_type(model, zs.StateDictType.SHARDED_STATE_DICT, None, ShardedOptimStateDictConfig()):
        return {"model": model.state_dict(), "optim": zs.FSDP.optim_state_dict(model, opt)}


def _local_state(model):
    # Per-rank flat shards as plain tensors (hfai's per-rank files, zeroshard's earlier LOCAL
    # format): LOCAL_STATE_DICT now gives ShardedTensors, which DCP saves like any sharded value.
    return {"model": {"_fsdp_wrapped_module._flat_param": model._handle.local_shard.detach().clone()}}


def _save_for_errors(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    model, opt = _mlp()
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    checkpoint.save_sharded(_state_of(model, opt), path)
    try:
        checkpoint.save_sharded(_local_state(model), path + "_local")
    except ValueError as e:
        refused = str(e), os.path.exists(path + "_local")
    # What plain DCP does with it: keeps one copy of each "_flat_param", silently.
    dcp.save(_local_state(model), checkpoint_id=path + "_raw_local")
    return refused


def _load_with_problems(rank, world_size, path):
    """Each case breaks the state to load into in one way; every rank must
    raise the same message (the first problem found on any rank)."""
    from zeroshard.sharded_state import device_mesh, to_row_shard

    model, opt = _mlp()  # its optimizer has not stepped: no state yet
    mesh = device_mesh(model)
    cases = {
        "fresh optimizer": lambda: _state_of(model, opt),
        "missing key": lambda: {"model": {**_state_of(model, opt)["model"], "blocks.9.l1.weight": torch.zeros(1)}},
        "prefixed": lambda: {"model": {"module." + k: v for k, v in _state_of(model, opt)["model"].items()}},
        "shape": lambda: {"model": {**_state_of(model, opt)["model"], "out.bias": to_row_shard(torch.zeros(4), mesh)}},
        "dtype": lambda: {"model": {**_state_of(model, opt)["model"], "scale": torch.zeros(3, dtype=torch.float64)}},
        # only the last rank's state is wrong here
        "one rank": lambda: {"model": {**_state_of(model, opt)["model"], "scale": torch.zeros(3 + (rank == world_size - 1))}},
        "per-rank shards": lambda: _local_state(model),
    }
    messages = {}
    for name, make in cases.items():
        try:
            checkpoint.load_sharded(make(), path + ("_raw_local" if name == "per-rank shards" else ""))
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_load_sharded_names_the_first_problem_on_every_rank(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    for msg, wrote in ranks.run(2, _save_for_errors, path):
        assert "'model._fsdp_wrapped_module._flat_param' is a plain tensor that differs between ranks" in msg, msg
        assert "Fix:" in msg and not wrote
    per_rank = ranks.run(3, _load_with_problems, path)
    assert all(m == per_rank[0] for m in per_rank)  # the same errors everywhere
    m = per_rank[0]
    assert len(m) == 7, m
    assert "has 'optim.state." in m["fresh optimizer"] and "init_optim_state" in m["fresh optimizer"]
    assert "has no 'model.blocks.9.l1.weight' (saved at world size 2, loading at 3)" in m["missing key"]
    assert "has no 'model.module.scale'" in m["prefixed"] and "it has 'model.scale'" in m["prefixed"]
    assert "'model.out.bias' has shape (3,) in the checkpoint but (4,) here" in m["shape"]
    assert "'model.scale' is torch.float32 in the checkpoint but torch.float64 here" in m["dtype"]
    assert "'model.scale' has shape (3,) in the checkpoint but (4,) here" in m["one rank"]
    assert "_flat_param' has shape" in m["per-rank shards"] and "saved at world size 2, loading at 3" in m["per-rank shards"]
    assert "only loads at the world size it was saved with" in m["per-rank shards"]


def test_load_sharded_of_a_path_without_a_checkpoint(tmp_path):
    os.mkdir(tmp_path / ".ckpt.123.tmp")  # what a save killed before its rename leaves
    with pytest.raises(ValueError, match=r"holds no complete checkpoint \(no .metadata file\); an interrupted save left"):
        checkpoint.load_sharded({"w": torch.zeros(2)}, str(tmp_path / "ckpt"))


def _bn_buffers_differ(rank, world_size, path):
    """Each rank's own batch moves its own BatchNorm statistics (FSDP does not
    synchronize buffers): saved as rank 0's, with a warning, and the caller's
    state dict is left as it was; per-rank optimizer rows are still refused."""
    import warnings

    from models import BNBlock, batch

    def make():
        torch.manual_seed(0)
        model = zs.FSDP(build("bn"), auto_wrap_policy=zs.wrap.ModuleWrapPolicy({BNBlock}))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = make()
    model(batch("bn", rank, 0)).sum().backward()
    opt.step()
    state = _state_of(model, opt)
    key = "blocks.0.norm.running_mean"
    mine = state["model"][key]
    every = [torch.empty_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(every, mine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save_sharded(state, path)
    warned = [str(w.message) for w in caught if "differ between ranks" in str(w.message)]
    untouched = state["model"][key] is mine and torch.equal(mine, every[rank])
    fresh, fresh_opt = make()
    loaded = _state_of(fresh, fresh_opt)["model"]
    checkpoint.load_sharded({"model": loaded}, path)
    try:
        checkpoint.save_sharded({"optim": opt.state_dict()}, path + "_raw_optim")
        refused = None
    except ValueError as e:
        refused = str(e)
    return (not torch.equal(every[0], every[1]), warned, untouched, torch.equal(loaded[key], every[0]), refused)


def test_save_sharded_keeps_rank0s_unsynchronized_buffers_and_refuses_per_rank_rows(ranks, tmp_path):
    for differ, warned, untouched, loaded_rank0s, refused in ranks.run(2, _bn_buffers_differ, str(tmp_path / "ckpt")):
        assert differ  # else this test shows nothing
        assert len(warned) == 1 and "'model.blocks.0.norm.running_mean', ..." in warned[0], warned
        assert "rank 0's values are saved" in warned[0], warned
        assert untouched and loaded_rank0s
        assert refused is not None and "'optim.state.0.exp_avg' is a plain tensor that differs" in refused, refused


def _save_plain(rank, world_size, path):
    model, opt = _mlp()
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    checkpoint.save_sharded(_state_of(model, opt), path)


def _load_damaged(rank, world_size, paths):
    model, opt = _mlp()
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    messages = {}
    for name, path in paths.items():
        try:
            checkpoint.load_sharded(_state_of(model, opt), path)
        except (ValueError, RuntimeError) as e:  # not DCP's CheckpointException, a BaseException
            messages[name] = f"{type(e).__name__}: {e}"
    return messages, all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_load_sharded_of_damaged_files_names_the_checkpoint_on_every_rank(ranks, tmp_path):
    """Files changed after the save completed: every rank raises a RuntimeError
    or ValueError naming the checkpoint (DCP raises a CheckpointException, which
    `except Exception` does not catch, naming neither path nor file for a
    truncated one), and the model is untouched."""
    import shutil

    ranks.run(2, _save_plain, str(tmp_path / "good"))
    paths = {}
    for case in ("truncated data", "missing data", "truncated metadata"):
        path = paths[case] = str(tmp_path / case.replace(" ", "_"))
        shutil.copytree(tmp_path / "good", path)
        data = os.path.join(path, "__1_0.distcp")
        if case == "truncated data":
            os.truncate(data, os.path.getsize(data) // 2)
        elif case == "missing data":
            os.remove(data)
        else:
            os.truncate(os.path.join(path, ".metadata"), 100)
    results = ranks.run(2, _load_damaged, paths)
    assert results[0][0] == results[1][0] and all(untouched for _, untouched in results)
    m = results[0][0]
    assert len(m) == 3, m
    for case in ("truncated data", "missing data"):
        assert m[case].startswith(f"RuntimeError: zeroshard: load_sharded: reading the checkpoint '{paths[case]}' failed (rank "), m[case]
        assert "missing, truncated or corrupt" in m[case] and "Fix: load another checkpoint" in m[case], m[case]
    assert "__1_0.distcp" in m["missing data"], m["missing data"]
    assert m["truncated metadata"].startswith(f"ValueError: zeroshard: load_sharded: the checkpoint's .metadata in '{paths['truncated metadata']}' cannot be read"), m


def test_a_failed_sharded_save_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """A write that fails (a full disk) keeps the previous checkpoint and
    removes the half-written temporary directory; it stayed, filling the disk
    further with every save to a new path (step_1, step_2, ...)."""
    import torch.distributed.checkpoint.filesystem as fs

    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded({"w": torch.ones(4)}, path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full_disk)
    # A RuntimeError naming the path, not DCP's CheckpointException: a BaseException, which a training
    # loop's `except Exception` around the save would let through (and it named neither path nor call).
    with pytest.raises(RuntimeError, match=r"save_sharded: writing the checkpoint '.*ckpt' failed \(rank 0: OSError: "
                       r".*No space left on device\); nothing was replaced"):
        checkpoint.save_sharded({"w": torch.zeros(4)}, path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    state = {"w": torch.empty(4)}
    checkpoint.load_sharded(state, path)
    assert torch.equal(state["w"], torch.ones(4))


def test_load_sharded_hints_init_optim_state_only_for_an_optimizer_without_state(tmp_path):
    """The hint to call init_optim_state fits an optimizer with no state at all,
    not one missing a single parameter's (another model, tied weights)."""
    path = str(tmp_path / "ckpt")
    groups = [{"lr": 0.1}]
    saved = {"optim": {"state": {"a": {"exp_avg": torch.ones(2)}, "b": {"exp_avg": torch.ones(2)}}, "param_groups": groups}}
    checkpoint.save_sharded(saved, path)
    with pytest.raises(ValueError) as partial:
        checkpoint.load_sharded({"optim": {"state": {"a": {"exp_avg": torch.empty(2)}}, "param_groups": groups}}, path)
    assert "has 'optim.state.b.exp_avg'" in str(partial.value) and "init_optim_state" not in str(partial.value)
    with pytest.raises(ValueError) as fresh:
        checkpoint.load_sharded({"optim": {"state": {}, "param_groups": groups}}, path)
    assert "init_optim_state" in str(fresh.value), str(fresh.value)


def _save_to_per_rank_paths(rank, world_size, base):
    state = {"w": torch.distributed.tensor.DTensor.from_local(
        torch.full((2,), float(rank)), torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,)),
        [torch.distributed.tensor.Shard(0)])}
    try:
        checkpoint.save_sharded(state, os.path.join(base, f"step100_rank{rank}"))
    except ValueError as e:
        return str(e), os.listdir(base)
    return None, os.listdir(base)


def test_save_sharded_to_a_different_path_on_each_rank_is_refused(ranks, tmp_path):
    """Rank 1's save returned normally and its shard went into rank 0's directory:
    rank 1's path held nothing."""
    for msg, listed in ranks.run(2, _save_to_per_rank_paths, str(tmp_path)):
        assert msg and "different paths" in msg and "step100_rank0' on rank 0" in msg and "Fix" in msg, msg
        assert listed == [], listed


def _save_during_the_read(monkeypatch, path, saves=1):
    """Make ``saves`` other save_sharded calls to ``path`` land after the reader read .metadata,
    before it opens a data file."""
    from torch.distributed.checkpoint import filesystem

    real, landed = filesystem.FileSystem.create_stream, []

    def create_stream(self, p, mode):
        if mode == "rb" and str(p).endswith(".distcp") and not landed:
            landed.append(True)
            for v in range(2, 2 + saves):
                checkpoint.save_sharded({"model": {"w": torch.full((4, 3), float(v))}, "step": torch.tensor(v)}, path)
        return real(self, p, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    return landed


@pytest.mark.parametrize("saves", [1, 2])
def test_a_save_landing_during_a_read_is_an_error_not_a_mix(tmp_path, monkeypatch, saves):
    """DCP opens the data files by name after reading .metadata: a save_sharded to the same
    path completing meanwhile swapped the directory, and the read went on in the new checkpoint
    under the old one's metadata (on 2 ranks: half the tensors from each, silently). Two saves
    in a row can leave the directory's inode number as it was (ext4 reuses it)."""
    from zeroshard.consolidate import consolidate

    path = str(tmp_path / "ckpt")
    one = {"model": {"w": torch.full((4, 3), 1.0)}, "step": torch.tensor(1)}
    checkpoint.save_sharded(one, path)
    landed = _save_during_the_read(monkeypatch, path, saves)
    with pytest.raises(RuntimeError, match="was replaced by another save while being read.*load again"):
        checkpoint.load_sharded({"model": {"w": torch.zeros(4, 3)}, "step": torch.tensor(0)}, path)
    assert landed
    checkpoint.save_sharded(one, path)
    landed.clear()
    with pytest.raises(RuntimeError, match="was replaced by another save while being read.*run it again"):
        consolidate(path, str(tmp_path / "full.pt"))
    assert landed and sorted(os.listdir(tmp_path)) == ["ckpt"]  # no output, no temporary left


def test_saves_through_symlinks_write_the_target_and_keep_the_link(tmp_path):
    """checkpoint.save replaced a symlink with a regular file, leaving its target (what others
    read) at the old checkpoint; save_sharded refused a link to a checkpoint as 'not a
    checkpoint directory'."""
    real, link = tmp_path / "real.pt", tmp_path / "current.pt"
    checkpoint.save({"step": 1}, str(real))
    os.symlink(real, link)
    checkpoint.save({"step": 2}, str(link))
    assert os.path.islink(link) and torch.load(real)["step"] == 2
    real_dir, link_dir = tmp_path / "ckpt.1", tmp_path / "ckpt"
    checkpoint.save_sharded({"w": torch.ones(2)}, str(real_dir))
    os.symlink(real_dir, link_dir)
    checkpoint.save_sharded({"w": torch.full((2,), 2.0)}, str(link_dir))
    got = {"w": torch.zeros(2)}
    checkpoint.load_sharded(got, str(real_dir))
    assert os.path.islink(link_dir) and torch.equal(got["w"], torch.full((2,), 2.0))


def test_consolidate_reads_a_checkpoint_left_aside_by_a_killed_fallback_swap(tmp_path):
    """Killed between the fallback's two renames, the previous checkpoint sits at .NAME.old
    (through a symlink: next to its target): load_sharded puts it back, consolidate said there
    was no checkpoint."""
    from zeroshard.consolidate import consolidate

    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded({"w": torch.arange(3.0)}, path)
    os.rename(path, str(tmp_path / ".ckpt.old"))
    assert torch.equal(consolidate(path, str(tmp_path / "full.pt"))["w"], torch.arange(3.0))
    os.symlink(path, str(tmp_path / "current"))
    assert torch.equal(consolidate(str(tmp_path / "current"), str(tmp_path / "full.pt"))["w"], torch.arange(3.0))


def test_an_unreadable_sidecar_is_no_false_alarm(tmp_path, monkeypatch):
    """A momentary failure to read the save_id (EMFILE, say) on one side of the comparison fell
    back to None and reported 'replaced by another save' though nothing was; the inode decides then."""
    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded({"w": torch.ones(2)}, path)
    before = checkpoint.identity(path)
    assert before[2] is not None

    def emfile(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(checkpoint, "open", emfile, raising=False)
    assert checkpoint.replaced_while_read(path, before) is None
    assert checkpoint.identity(str(tmp_path / "none")) is None


def _one_rank_cannot_write(rank, world_size, path):
    import torch.distributed.checkpoint.filesystem as fs

    checkpoint.save_sharded({"w": torch.full((4,), float(rank))}, path)
    real = fs._write_item
    if rank == 0:  # the one writing the plain tensor (saved once, as rank 0's)
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")
        fs._write_item = full_disk
    try:
        checkpoint.save_sharded({"w": torch.full((4,), 7.0)}, path)
        said = None
    except RuntimeError as e:
        said = str(e)
    finally:
        fs._write_item = real
    state = {"w": torch.empty(4)}
    checkpoint.load_sharded(state, path)
    return said, state["w"].tolist()


def test_a_sharded_save_failing_on_one_rank_raises_a_runtime_error_on_every_rank(ranks, tmp_path):
    for said, kept in ranks.run(2, _one_rank_cannot_write, str(tmp_path / "ckpt")):
        assert said is not None and "rank 0: OSError" in said and "No space left on device" in said, said
        assert kept == [0.0] * 4  # the previous checkpoint (rank 0's plain tensor)

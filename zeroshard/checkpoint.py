"""Atomic checkpoints: a save that dies midway never destroys the last good one.

This is how FSDP's model and optimizer state dicts reach disk: a FULL one
(or each rank's LOCAL shards) as a single file written by :func:`save`, a
SHARDED one as a DCP directory written by :func:`save_sharded`. The engine's
DeepSpeed-style checkpoints (``ds_checkpoint``) write their files with
:func:`save` too.

Single files. ``torch.save(obj, path)`` truncates ``path`` first and then
writes it, so a process killed mid-write (preemption, OOM killer, SIGKILL)
leaves neither the old nor the new checkpoint. :func:`save` writes a
temporary file in the same directory (same filesystem, so the rename cannot
become a copy), flushes it to disk, and ``os.replace``s it over ``path``:
readers see the old file or the complete new one, never a prefix. A killed
save can leave a stale ``.NAME.HOST.PID.*.tmp`` file next to ``path``; the next
save to ``path`` on that host removes it once that process is gone (never a
live writer's: two ranks saving to one path must not delete each other's).
A ``path`` that is a symlink is written through, as ``torch.save`` does.

Sharded (DCP) directories. ``torch.distributed.checkpoint.save`` writes one
file per rank and then ``.metadata`` into the directory it is given; killed
midway over an existing checkpoint, it leaves a mix of old and new files.
:func:`save_sharded` has every rank write into a temporary sibling directory;
after all ranks finished (a barrier), rank 0 swaps it into place in one step
(Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere two renames, rolled back by
the next save or load if killed between them) and only then deletes the
previous checkpoint (a symlinked ``path``: its target). A read (:func:`load_sharded`,
``consolidate``) that such a swap overtakes raises instead of mixing the two
checkpoints: DCP opens the data files by name after reading ``.metadata``.
:func:`load_sharded` checks the state to load into
against the checkpoint's metadata first, and names the first key, shape,
dtype or world-size problem on every rank instead of failing inside DCP.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import re
import shutil
import socket
import zipfile

import torch
import torch.distributed as dist

from . import comm
from .dcp_checks import SIDECAR, _distributed, _plain_tensors_agreed, _describe_problem
from .state_dict import OffRank0


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


def _writer_tag() -> str:
    """Who writes a temporary file: host and pid, so that another save's
    cleanup can tell a killed writer's leftover from a live writer's file."""
    return f"{socket.gethostname()}.{os.getpid()}."


def _is_stale(tmp_name: str, prefix: str) -> bool:
    """A temporary file is stale when it is one :func:`save` names
    (``.NAME.HOST.PID.<12 hex>.tmp``: not another file that happens to start
    with ``.NAME.``, such as a ``.NAME.dcp.<hex>.tmp`` directory of
    save_sharded's) and its writer on this host is gone. A live writer's
    (another rank, process or thread saving to the same path right now) and
    another host's are left alone: removing them would make that save fail
    after writing everything, leaving whatever this one wrote. (Two
    containers sharing a hostname but not a PID namespace cannot tell each
    other's writers apart: give them distinct hostnames.)"""
    found = re.fullmatch(re.escape(prefix) + r"(.+)\.(\d+)\.[0-9a-f]{12}\.tmp", tmp_name)
    if found is None:
        return False
    host, pid = found.group(1), found.group(2)
    if host != socket.gethostname() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale(directory: str, pattern: str, prefix_of) -> None:
    """Remove the files matching ``pattern`` in ``directory`` that a killed :func:`save` left
    (``prefix_of(name)``: the prefix of the path that save wrote, or None for not one of its)."""
    for stale in glob.glob(os.path.join(glob.escape(directory), pattern)):
        name = os.path.basename(stale)
        prefix = prefix_of(name)
        if prefix is not None and os.path.isfile(stale) and _is_stale(name, prefix):
            try:
                os.remove(stale)
            except FileNotFoundError:
                pass


def _nested(obj, key: str = ""):
    """(key path, value) for ``obj`` and every value inside its dicts, lists and tuples."""
    yield key, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        yield from _nested(v, f"{key}.{k}" if key else str(k))


def _refuse_empty_on_other_ranks(obj, path: str) -> None:
    """FULL state dicts and optimizer state dicts with ``rank0_only=True`` are
    empty on ranks other than 0 (``state_dict.OffRank0``); saved there to rank
    0's path, they would replace its checkpoint (whichever rename lands last)."""
    if any(isinstance(v, OffRank0) for _, v in _nested(obj)):
        rank = dist.get_rank() if _distributed() else 0
        raise ValueError(
            f"zeroshard: checkpoint.save: rank {rank} is saving the empty state a rank0_only state dict gives ranks "
            f"other than 0, to '{path}'. With rank0_only=True (FullStateDictConfig, FullOptimStateDictConfig) only "
            "rank 0 holds the state; saved here to the same path, this empty one could replace rank 0's checkpoint. "
            "Fix: save on rank 0 only (`if dist.get_rank() == 0: checkpoint.save(...)`), or pass rank0_only=False.")


def _holds_rows(value) -> bool:
    """Only this rank's part of a tensor sharded across ranks: a SHARDED state dict's DTensor, a
    LOCAL one's ShardedTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return any(pl.is_shard() and value.device_mesh.size(d) > 1 for d, pl in enumerate(value.placements))
    if type(value).__name__ == "ShardedTensor":
        group = getattr(value, "_process_group", None)
        return group is not None and dist.get_world_size(group) > 1
    return False


def _refuse_one_file_for_all_rows(obj, path: str) -> None:
    """A SHARDED (or LOCAL) state dict holds this rank's rows only; written by every rank to one
    path, each rename replaces the others' file and the checkpoint keeps one rank's rows (a reload
    at equal row counts is silently wrong); written by rank 0 alone, it holds rank 0's rows.
    A SHARDED one (DTensors) is refused outright, on the ranks calling (no collective, so a
    rank-0-only save raises instead of waiting): its file is DCP's directory. A LOCAL one
    (ShardedTensors) is per-rank by design, as torch FSDP1 saves it: the paths are compared over
    its group (collective there), and one path per rank saves."""
    found = next(((k, v) for k, v in _nested(obj) if _holds_rows(v)), None) if _distributed() else None
    if found is None:
        return
    key, value = found
    fix = ("Fix: zeroshard.checkpoint.save_sharded(state, directory) (one checkpoint for all ranks, loadable at any "
           "world size), or a FULL state dict")
    if type(value).__name__ != "ShardedTensor":
        raise ValueError(f"zeroshard: checkpoint.save: '{key}' is a DTensor holding only this rank's rows (a SHARDED "
                         f"state dict): a single file '{path}' would keep one rank's rows. {fix}.")
    group = value._process_group
    paths = comm.gather_objects(path, group, what=f"checkpoint.save (comparing the paths of '{key}', sharded across ranks)")
    ranks = dist.get_process_group_ranks(group)
    shared = sorted({r for r, p in zip(ranks, paths) if paths.count(p) > 1})
    if shared:
        raise ValueError(
            f"zeroshard: checkpoint.save: '{key}' holds only this rank's part of a tensor sharded across ranks {ranks} "
            f"(a LOCAL state dict), and ranks {shared} save to the same file '{path}': each would replace the others' "
            f"file, keeping one rank's part. {fix}, or a path per rank.")


def save(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, atomically (on POSIX filesystems).

    Refused when ``obj`` holds the empty dict a rank0_only state dict is on
    ranks other than 0 (see ``_refuse_empty_on_other_ranks``), and when it
    holds this rank's rows of a SHARDED state dict, or its part of a LOCAL one
    that another rank saves to the same path (collective over that tensor's
    ranks): see ``_refuse_one_file_for_all_rows``.
    """
    path = os.path.realpath(os.fspath(path))
    _refuse_empty_on_other_ranks(obj, path)
    _refuse_one_file_for_all_rows(obj, path)
    write_atomic(path, lambda f: torch.save(obj, f))


def write_atomic(path: str | os.PathLike, write) -> None:
    """``write(f)`` into a binary file that replaces ``path`` only once complete (see the module
    docstring): a temporary file beside it, fsynced, renamed over it."""
    # Through a symlink to the file it names, as torch.save writes (the rename would replace the link)
    path = os.path.realpath(os.fspath(path))
    directory, prefix = os.path.dirname(path), _tmp_prefix(path)
    remove_stale(directory, glob.escape(prefix) + "*.tmp", lambda name: prefix)
    tmp = os.path.join(directory, prefix + _writer_tag() + os.urandom(6).hex() + ".tmp")
    # Not mkstemp, whose mode 0600 the rename would hand to the checkpoint: 0666 less the umask, as torch.save's open().
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileNotFoundError as e:  # as torch.save says it, not about a temporary file's name
        raise RuntimeError(f"zeroshard: cannot save '{path}': its parent directory '{directory}' does not exist. "
                           "Fix: create it first (os.makedirs).") from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)  # persist the rename itself (the directory entry) across a power loss


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, map_location=None, weights_only: bool = True, verify: bool = True):
    """``torch.load`` of a file written by :func:`save` (or by ``torch.save``);
    an empty, truncated or damaged file raises a RuntimeError naming it.

    With ``verify`` (the default), a file in torch.save's zip format has every
    entry's CRC-32 checked first. torch.load checks none, so a file with bytes
    changed after it was written (a disk or a copy) loaded wrong values
    silently. It costs a second read of the file (0.26 s for 512 MB on this
    project's CPU box, where torch.load took 0.3-0.4 s)."""
    path = os.fspath(path)
    if verify:
        _verify(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except (EOFError, RuntimeError, OSError) as e:
        if isinstance(e, RuntimeError) and "zip archive" not in str(e):
            raise  # not the file's integrity (a map_location problem, ...)
        if isinstance(e, OSError) and (e.errno != errno.EINVAL or e.filename is not None):
            raise  # a missing file or a permission: named already. EINVAL: torch's reader ran off a cut file's end
        raise _damaged(path, "is empty or truncated", e) from e


def _verify(path: str) -> None:
    """Each entry's bytes against its CRC-32, for a file in torch.save's zip format (it starts with
    a zip entry, as torch.load tells them apart: not zipfile.is_zipfile, which finds an end record
    that a legacy file's tensor bytes may hold). Entries of CRC 0 are not checked: torch writes
    that when told not to compute them (torch.serialization.set_crc32_options(False))."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return  # the legacy format, or an empty file: torch.load says which
    entry = None
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if entry.CRC == 0:
                    continue
                with archive.open(entry) as data:  # raises BadZipFile at the end if the CRC differs
                    while data.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        if entry is not None and "Bad CRC-32" in str(e):
            raise _damaged(path, f"is damaged: its entry '{entry.filename}' fails its CRC-32 check (the bytes "
                           "changed after they were written: a disk or a copy)", None) from e
        raise _damaged(path, "is truncated or damaged", e) from e


def _damaged(path: str, what: str, cause) -> RuntimeError:
    said = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return RuntimeError(
        f"zeroshard: checkpoint.load: '{path}' ({os.path.getsize(path)} bytes) {what}{said}. checkpoint.save never "
        "leaves a partial file at its path, so this one was written or copied by something else, or changed "
        "afterwards. Fix: load another checkpoint.")


# ------------------------------------------------------- sharded (DCP) directories
_USE_EXCHANGE = True  # tests switch it off to exercise the two-rename fallback


def on_rank0(fn, what: str):
    """Run ``fn`` on rank 0 only; every rank returns its result or raises its
    error (a broadcast, so it is also a barrier: nobody returns before rank 0)."""
    result, error = None, None
    if not _distributed() or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, and told to the other ranks
            error = e
    if _distributed():
        box = [(result, None if error is None else f"{type(error).__name__}: {error}")]
        comm.broadcast_objects(box, 0, what=what)
        result, message = box[0]
        if message is not None and error is None:
            raise RuntimeError(f"zeroshard: {what} failed on rank 0: {message}")
    if error is not None:
        raise error
    return result


def _aside(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")


def is_checkpoint_dir(path: str) -> bool:
    """Only files DCP or save_sharded write: the one kind of directory save_sharded may replace."""
    return os.path.isdir(path) and not os.path.islink(path) and all(
        n in (".metadata", SIDECAR) or n.endswith((".distcp", ".metadata.tmp")) for n in os.listdir(path))


def _recover(path: str) -> None:
    """Finish or undo a swap killed between its two renames (fallback mode only)."""
    aside = _aside(path)
    if os.path.isdir(aside):
        if not os.path.lexists(path):
            os.rename(aside, path)  # killed after moving the old one aside: put it back
        else:
            shutil.rmtree(aside)  # killed after the new one was in place


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directory entries (Linux >= 3.15); False where unsupported."""
    if not _USE_EXCHANGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this filesystem or kernel cannot
        return False
    raise OSError(code, os.strerror(code), f"renameat2({a}, {b}, RENAME_EXCHANGE)")


def _prepare(path: str) -> str:
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _recover(path)
    if os.path.lexists(path) and not is_checkpoint_dir(path):
        raise FileExistsError(f"zeroshard: save_sharded: '{path}' exists and is not a checkpoint directory (it holds "
                              "other files); refusing to replace it. Fix: pass a new path or a previous checkpoint's.")
    own = re.compile(re.escape(f".{name}.") + "[0-9a-f]{12}" + re.escape(".tmp"))  # not '.{name}.best.<hex>.tmp'
    for stale in glob.glob(os.path.join(glob.escape(parent), glob.escape(f".{name}.") + "*.tmp")):
        if own.fullmatch(os.path.basename(stale)):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed save; nobody else writes these names
    tmp = os.path.join(parent, f".{name}.{os.urandom(6).hex()}.tmp")
    os.mkdir(tmp)  # not mkdtemp: its mode 0700 would become the checkpoint's; mkdir follows the umask as dcp.save does
    return tmp


def _commit(tmp: str, path: str, world_size: int) -> None:
    with open(os.path.join(tmp, SIDECAR), "w") as f:
        # save_id: which save this is, for a read to tell it was overtaken (see identity)
        json.dump({"world_size": world_size, "save_id": os.urandom(8).hex()}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)  # DCP fsyncs its files; this persists their names
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # tmp now names the previous checkpoint
    else:
        aside = _aside(path)
        os.rename(path, aside)
        os.rename(tmp, path)
        shutil.rmtree(aside)
    _fsync_dir(os.path.dirname(path))


def save_sharded(state: dict, path: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.save(state, path)``, atomically (collective).

    ``path`` holds the previous complete checkpoint until the new one is
    complete on every rank, then the new one. Plain tensors (not DTensor /
    ShardedTensor) are saved once: per-rank ones are refused, other
    differing ones (unsynchronized buffers) saved as rank 0's, see
    ``_plain_tensors_agreed``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.path.abspath(os.fspath(path))
    differs = comm.first_difference(path, what="save_sharded (comparing the paths)")
    if differs is not None:  # every rank writes into rank 0's directory: another path would hold none of its files
        r, first, theirs = differs
        raise ValueError(f"zeroshard: save_sharded was given different paths: '{first}' on rank 0, '{theirs}' on "
                         f"rank {r}. One checkpoint is one directory, written by every rank. Fix: pass the same path "
                         "on every rank.")
    path = os.path.realpath(path)  # a symlink to a checkpoint: its target is replaced, the link kept
    state = _plain_tensors_agreed(state)
    tmp = on_rank0(lambda: _prepare(path), "save_sharded (preparing the directory)")
    try:
        with comm.named("torch.distributed.checkpoint.save", f"save_sharded('{path}')"):
            dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
        if _distributed():
            # dcp.save already ends with rank 0 writing .metadata after every
            # rank reported its files; the barrier makes "all ranks finished" explicit.
            comm.barrier(what="save_sharded (every rank's files written)")
    except BaseException as e:  # DCP's CheckpointException too: every rank raises it
        if not _distributed() or dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk stays full otherwise, until a save to this path
        if isinstance(e, CheckpointException):  # a BaseException: an `except Exception` around the save would miss it
            raise RuntimeError(
                f"zeroshard: save_sharded: writing the checkpoint '{path}' failed ({_failures(e)}); nothing was "
                "replaced: the previous checkpoint there, if any, is intact. Fix: free space (or fix the permissions) "
                "where that rank writes, and save again.") from e
        raise
    world = dist.get_world_size() if _distributed() else 1
    on_rank0(lambda: _commit(tmp, path, world), "save_sharded (renaming the checkpoint into place)")


def load_sharded(state: dict, path: str | os.PathLike, strict: bool = True) -> None:
    """``torch.distributed.checkpoint.load(state, path)`` (collective), after
    checking ``state`` against the checkpoint: every key must be saved with
    the same global shape and dtype and, with ``strict``, every saved key
    under the top-level entries of ``state`` must be in ``state``. The first
    problem found on any rank is raised on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.path.realpath(os.fspath(path))
    on_rank0(lambda: _recover(path), "load_sharded (recovering an interrupted save)")
    before = identity(path)
    found = comm.first_problem(_describe_problem(state, path, strict), what="load_sharded: checking the checkpoint")
    if found is not None:
        raise ValueError(found[1])
    try:
        with comm.named("torch.distributed.checkpoint.load", f"load_sharded('{path}')"):
            dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    except CheckpointException as e:  # a BaseException: an `except Exception` would let it through
        raise RuntimeError(
            f"zeroshard: load_sharded: reading the checkpoint '{path}' failed ({_failures(e)}). A data file its .metadata "
            "names is missing, truncated or corrupt: the directory changed after its save completed (save_sharded "
            "only swaps in complete checkpoints). The state dict passed in may be partly overwritten; the model and "
            "optimizer are not (their state dicts hold copies). Fix: load another checkpoint.") from e
    swapped = comm.first_problem(replaced_while_read(path, before), what="load_sharded: checking the directory")
    if swapped is not None:
        raise RuntimeError(f"zeroshard: load_sharded (rank {swapped[0]}): {swapped[1]} The state dict passed in "
                           "holds a mix of the two. Fix: load again (after that save).")


def _failures(e) -> str:
    """What each rank's failure in a DCP CheckpointException was, in one line."""
    return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items()))


def identity(path: str):
    """Which checkpoint the name ``path`` points at now: a save_sharded swapping in a new one
    changes it. The save's random id (the directory's inode alone repeats: two saves later,
    ext4 hands the first one's number back), else for a directory DCP wrote itself the inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        with open(os.path.join(path, SIDECAR)) as f:
            save_id = json.load(f).get("save_id")
    except (OSError, ValueError, AttributeError):  # none (DCP's own directory), damaged or unreadable now
        save_id = None
    return st.st_dev, st.st_ino, save_id


def replaced_while_read(path: str, before) -> str | None:
    """Why a read of the DCP directory ``path`` that started at ``identity`` ``before`` cannot be
    trusted, or None. DCP opens the data files by name, one after another; a save to the same
    path that completes meanwhile swaps the directory, and the rest would be read from the new
    checkpoint under the old one's metadata."""
    now = identity(path)
    if before is not None and now is not None and None in (before[2], now[2]):
        now, before = now[:2], before[:2]  # a save_id unknown on one side: the inode alone
    if now != before:
        return (f"'{path}' was replaced by another save while being read (the read began in the "
                "previous checkpoint and went on in the new one).")
    return None

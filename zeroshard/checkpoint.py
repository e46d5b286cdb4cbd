"""Atomic checkpoint files: a save that dies midway never destroys the last good one.

``torch.save(obj, path)`` truncates ``path`` first and then writes it, so a
process killed mid-write (preemption, OOM killer, SIGKILL) leaves neither the
old nor the new checkpoint. :func:`save` writes a temporary file in the same
directory (same filesystem, so the rename cannot become a copy), flushes it
to disk, and ``os.replace``s it over ``path``: readers see the old file or the
complete new one, never a prefix. A killed save can leave a stale
``.NAME.*.tmp`` file next to ``path``; the next save to ``path`` removes it.
"""
from __future__ import annotations

import glob
import os
import tempfile

import torch


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


def save(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, atomically (on POSIX filesystems)."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    for stale in glob.glob(os.path.join(glob.escape(directory), glob.escape(_tmp_prefix(path)) + "*.tmp")):
        try:  # left by a killed save; nobody else writes these names
            os.remove(stale)
        except FileNotFoundError:
            pass
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_tmp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # Persist the rename itself (the directory entry) across a power loss.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: str | os.PathLike, map_location=None, weights_only: bool = True):
    """``torch.load`` of a file written by :func:`save` (or by ``torch.save``)."""
    return torch.load(os.fspath(path), map_location=map_location, weights_only=weights_only)

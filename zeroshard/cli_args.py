"""argparse types shared by zeroshard's command-line tools (``python -m zeroshard demo``,
``zeroshard.simulate``, ``zeroshard.estimate``, ``python -m zeroshard.testing parity``
and the examples): a count below 1 or a size that is not a number is a usage error
(argparse exits 2 naming the flag), never a run that does nothing or a crash after it."""
from __future__ import annotations

import argparse
import atexit
import math
import os


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a world size, a group, a count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a parameter count)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return value


MAX_PARAMS = 1e18  # far above any model; keeps 16 bytes a parameter, and the times derived, finite


def parameter_count(text: str) -> float:
    """argparse type: a parameter count Ψ, a number > 0 and at most 1e18 (beyond it the byte
    counts overflow to inf)."""
    value = positive_float(text)
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"{value:g} parameters is beyond any model (at most {MAX_PARAMS:g})")
    return value


def check_output_path(parser: argparse.ArgumentParser, option: str, path: str | None, is_dir: bool = False) -> None:
    """Before any training: ``path`` (a file, or with ``is_dir`` a folder) can be written, else a
    usage error naming ``option`` (it used to fail only once training was done). Missing folders on
    the way are created here (a file's save would not create them), and removed at exit if the
    run wrote nothing into them."""
    if path is None:
        return
    path = os.path.abspath(path)
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
        parser.error(f"{option} {path}: {'not a directory' if is_dir else 'is a directory'}")
    parent = path if is_dir else os.path.dirname(path)
    while not os.path.exists(parent):
        if os.path.islink(parent):  # a link to nothing: makedirs would fail, a save write somewhere else
            parser.error(f"{option} {path}: {parent} is a broken symbolic link (to {os.readlink(parent)}); "
                         "remove it or pass another path")
        parent = os.path.dirname(parent)
    if not is_dir and os.path.islink(path) and not os.path.exists(path):
        parser.error(f"{option} {path}: a broken symbolic link (to {os.readlink(path)}); remove it or pass another path")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        parser.error(f"{option} {path}: {parent} is not a writable directory")
    target = path if is_dir else os.path.dirname(path)
    os.makedirs(target, exist_ok=True)
    created = []  # innermost first: the folders made here, removed at exit if a failed run left them empty
    while target != parent:
        created.append(target)
        target = os.path.dirname(target)
    atexit.register(_remove_if_empty, created)


def _remove_if_empty(folders: list[str]) -> None:
    for folder in folders:
        try:
            os.rmdir(folder)  # only an empty one: a run that wrote its output keeps it
        except OSError:
            return


def check_count(where: str, name: str, value, low: int = 1) -> None:
    """The Python API's check of an integer count (a world size, a group, tokens): ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {name} must be an integer >= {low}, got {value!r}")


def check_fraction(where: str, name: str, value, low_open: bool) -> None:
    """A number in [0, 1] ((0, 1] with ``low_open``): ValueError naming it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (0 < value if low_open else 0 <= value) and value <= 1):
        raise ValueError(f"{where}: {name} must be in {'(0' if low_open else '[0'}, 1], got {value!r}")


def check_choice(where: str, name: str, value, choices) -> None:
    """One of ``choices``: ValueError naming them."""
    if value not in choices:
        raise ValueError(f"{where}: {name} must be one of {', '.join(map(str, choices))}; got {value!r}")

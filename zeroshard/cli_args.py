"""argparse types shared by zeroshard's command-line tools (``python -m zeroshard demo``,
``zeroshard.simulate``, ``zeroshard.estimate``, ``python -m zeroshard.testing parity``
and the examples): a count below 1 or a size that is not a number is a usage error
(argparse exits 2 naming the flag), never a run that does nothing or a crash after it."""
from __future__ import annotations

import argparse
import math


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

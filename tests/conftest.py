"""Shared fixtures: long-lived gloo rank pools (one per world size) and the
hypothesis profile (few examples: each one runs on several processes)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

sys.path.insert(0, os.path.dirname(__file__))

from zeroshard.testing import RankPool  # noqa: E402

settings.register_profile(
    "zeroshard",
    max_examples=int(os.environ.get("ZEROSHARD_HYPOTHESIS_EXAMPLES", "8")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
    # Each example runs on several processes; shrinking a failure could take
    # minutes, so report the first failing example as generated.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile("zeroshard")


class Ranks:
    """``ranks.run(world_size, fn, *args)``: run fn on a pool of that many gloo ranks."""

    def __init__(self):
        self.pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 180.0):
        pool = self.pools.get(world_size)
        if pool is None or pool.broken:
            pool = self.pools[world_size] = RankPool(world_size)
        return pool.run(fn, *args, timeout=timeout)

    def close(self):
        for pool in self.pools.values():
            if not pool.broken:
                pool.close()


@pytest.fixture(scope="session")
def ranks():
    r = Ranks()
    yield r
    r.close()


@pytest.fixture
def four_threads():
    """Four intra-op threads even on a 2-core box: the C++ extension's parallel
    passes (checks of long tensor lists, copies) then cut their work four ways."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)

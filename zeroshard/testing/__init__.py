"""zeroshard.testing: tools to test a sharding engine (ZeRO / FSDP) on CPU ranks.

* ``ranks``      spawn / RankPool / free_port: run a function on N gloo ranks,
                 every call under a deadline (a hung collective fails, not blocks)
* ``parity``     assert_parity: your model under zeroshard vs torch FSDP1, bit for
                 bit (outputs, gradient shards, parameter shards, state dict)
* ``strategies`` hypothesis strategies: random MLPs, world sizes, wrap policies,
                 FSDP configurations (imported on first use; needs hypothesis)
* ``cli``        ``python -m zeroshard.testing parity module:factory [...]``: the same
                 check from the shell, on spawned ranks, with a printed report

zeroshard's own test suite, demo, examples and benchmarks use the same tools.
"""
from .parity import ParityError, ParityReport, assert_parity
from .ranks import RankPool, free_port, spawn

__all__ = ["spawn", "RankPool", "free_port", "assert_parity", "ParityError", "ParityReport", "strategies"]


def __getattr__(name):
    if name == "strategies":  # lazily: hypothesis is a test dependency, not a runtime one
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

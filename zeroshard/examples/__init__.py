"""Runnable examples: ``python -m zeroshard.examples.<name> --help``.

* ``mnist_digits``    torch's FSDP MNIST tutorial on scikit-learn's 8x8 digits
* ``ddp_template``    torch's DDP tutorial template: DDP, NO_SHARD and FULL_SHARD side by side
                      (spawned, or under torchrun)
* ``transformer``     transformer auto-wrap, backward prefetch, bf16 mixed precision, and a
                      SHARDED_STATE_DICT checkpoint (torch.distributed.checkpoint) that resumes bit for bit
* ``hybrid_torchrun`` HYBRID_SHARD over two torchrun "nodes" on one machine
* ``hfai_style``      a script written for hfai's FSDP, only the import changed

Each has a small size (``--small``) that CI runs (tests/test_examples.py).
"""


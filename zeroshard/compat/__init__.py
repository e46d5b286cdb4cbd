"""Drop-in front ends for scripts written against other FSDP APIs.

Each maps another API onto FullyShardedDataParallel, zeroshard's ZeRO-3 / FSDP
module, and implements no sharding of its own: ``hfai`` gives
hfai.distributed.fsdp's constructor, its ``summon_full_params`` method and its
per-rank shard checkpoints.
"""

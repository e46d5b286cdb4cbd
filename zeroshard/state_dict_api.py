"""The state-dict half of FullyShardedDataParallel's public API: torch FSDP1's methods.

Saving and loading model and optimizer state, ``summon_full_params``, and the
``state_dict_type`` settings, each a thin call into the module that does the
work: ``state_dict`` (FULL and SHARDED), ``local_state`` (LOCAL), ``summon``,
``state_dict_settings``, ``optim_state`` / ``optim_load`` (optimizer state),
``optim_legacy`` (torch's older optimizer-state API) and ``parent_load`` (a
plain parent module's ``load_state_dict``). A mixin of
:class:`~zeroshard.fully_sharded.FullyShardedDataParallel`.
"""
from __future__ import annotations

import torch.nn as nn

from . import local_state, optim_legacy, optim_load, optim_state, parent_load
from . import state_dict as sd
from . import state_dict_settings as sd_settings
from .options import StateDictType


class StateDictMethods:
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if sd.passthrough_active():  # inside a state-dict walk (see state_dict.walk_unit)
            return sd.walk_unit(self, destination, lambda d: nn.Module.state_dict(
                self, *args, destination=d, prefix=prefix, keep_vars=keep_vars))
        self._lazy_init()
        sd_settings.state_dict_settings(self, strict=False)  # raises where units disagree (a type set on one unit)
        local = self._state_dict_type == StateDictType.LOCAL_STATE_DICT
        out = (local_state if local else sd).save(self, prefix=prefix, keep_vars=keep_vars)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("zeroshard: load_state_dict(assign=True) would replace the sharded parameters. Fix: use assign=False.")
        self._lazy_init()
        sd_settings.state_dict_settings(self, strict=False)
        with parent_load.own_load():
            return (local_state if self._state_dict_type == StateDictType.LOCAL_STATE_DICT else sd).load(self, state_dict, strict)

    _fqn_modifiers = sd.refuse_dcp_state_dict_helpers  # what torch's DCP state_dict helpers call

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if parent_load.own_load_active():  # a unit's own load walks the tree as nn.Module does
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)
        parent_load.load_from_parent(self, state_dict, prefix, local_metadata)  # a plain parent's load_state_dict

    @staticmethod
    def summon_full_params(module, recurse=True, writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False):
        """Context manager: the full parameters, under their original names, inside the block."""
        return sd.summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    @staticmethod
    def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        """Context manager selecting FULL / LOCAL / SHARDED state dicts for every unit in ``module``.

        The state dict type also picks the optimizer state dict's form (FULL or
        SHARDED, as in torch); ``optim_state_dict_config`` adds options
        (``FullOptimStateDictConfig(rank0_only=True)``), see ``optim_state``."""
        return sd_settings.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        """torch FSDP1's optimizer state dict, FQN keys (collective): full tensors
        (on rank 0 only with rank0_only), or DTensor rows under SHARDED_STATE_DICT."""
        return optim_state.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None):
        """An optimizer state dict (full, rank 0's with rank0_only, or sharded rows) cut to this
        rank's shards, for ``optim.load_state_dict`` (or loaded directly with ``load_directly=True``)."""
        out = optim_load.optim_state_dict_to_load(model, optim, optim_state_dict, group, named=is_named_optimizer)
        if load_directly:
            optim.load_state_dict(out)
        return out

    @staticmethod
    def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
        """torch's older API: the FULL optimizer state dict, on rank 0 only by default (others get {})."""
        optim_legacy.check_optim_input(model, optim_input, optim)
        return optim_state.full_optim_state_dict(model, optim, rank0_only, group)

    @staticmethod
    def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        """Set the state dict type of every unit in ``module``; returns the previous ``StateDictSettings``."""
        previous = sd_settings.state_dict_settings(module, strict=False)
        sd_settings.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
        return previous

    @staticmethod
    def get_state_dict_type(module):
        """The ``StateDictSettings`` (type, config, optimizer config) the units of
        ``module`` share; None when it holds no unit (as torch FSDP1 returns)."""
        return sd_settings.state_dict_settings(module)

    # torch's older optimizer-state API (see optim_legacy)
    sharded_optim_state_dict = staticmethod(optim_legacy.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_legacy.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_legacy.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_legacy.flatten_sharded_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_legacy.rekey_optim_state_dict)

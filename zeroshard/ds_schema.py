"""What DeepSpeed 0.19.8 accepts in the config sections it validates, for ``ds_config``.

DeepSpeed checks ``zero_optimization`` (with its offload sections), ``fp16`` and
``bf16`` with pydantic models that forbid unknown keys, and ``optimizer.params`` /
``scheduler.params`` through its FusedAdam's and schedulers' signatures. A key
outside these tables is a typo that DeepSpeed refuses, and so does zeroshard; a
key inside them that zeroshard does not act on is ignored with a warning.
"""
from __future__ import annotations

# zero_optimization's fields (DeepSpeedZeroConfig, names and aliases).
DS_ZERO_KEYS = {
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm", "contiguous_gradients",
    "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint", "enable_sanity_checks",
    "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "leaf_module", "legacy_stage1",
    "load_from_fp32_weights", "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance",
    "memory_efficient_linear", "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer",
    "offload_param", "overlap_comm", "override_module_apply", "param_persistence_threshold", "parameter_alignment",
    "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage", "stage3_allgather_sequential",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
    "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights", "mics_shard_size",
    "mics_hierarchical_params_gather", "zeropp_loco_param"}
# DeepSpeed's offload sections (DeepSpeedZeroOffloadParamConfig / ...OptimizerConfig); zeroshard reads device
# (and accepts pin_memory), the rest tune NVMe or partial offload.
DS_OFFLOAD_KEYS = {"offload_param": {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"},
                   "offload_optimizer": {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                         "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"}}
# Older names DeepSpeed still reads as the newer keys (its deprecated fields, and a field's name beside its alias).
DS_RENAMED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
              "param_persistence_threshold": "stage3_param_persistence_threshold"}
DS_FP16_EXTRA = {"fp16_master_weights_and_grads"}  # beside the fp16 keys zeroshard reads (ds_config.FP16_KEYS)
DS_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                "bf16_optimizer_states"}
DS_OPTIMIZER_EXTRA = {"adam": {"bias_correction", "set_grad_none", "decoupled_weight_decay"}, "sgd": set()}
DS_SCHEDULER_EXTRA = {"last_batch_iteration"}

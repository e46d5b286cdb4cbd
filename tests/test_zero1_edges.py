"""ZeRO-1 (zeroshard/zero1.py, stage 1 of zeroshard.initialize) against stage 0,
whose optimizer steps the model's own parameters after the all-reduce, on 2
gloo ranks: the cases a review found silently wrong or refused unclearly.

* ranks listing a param group in other orders (a set's order differs between
  processes) wrote each other's chunks into the wrong parameters: refused;
* ranks holding other models trained on (same numel) or aborted: refused, as DDP;
* ``optimizer.step()`` on the returned optimizer stepped nothing: refused;
* in-place edits between steps (pruning, clamping) were overwritten by the
  master at the next step: taken into the master, only the changed elements;
* Adagrad (state built in ``__init__``) was refused as "already stepped";
  Adafactor silently lost its factoring: refused;
* sparse gradients, ``zero_grad(set_to_none=False)``, a group of two dtypes.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from zeroshard import zero1, zero1_state
from zeroshard.engine import initialize


def _model(seed=0, sparse=False):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 6, sparse=sparse), nn.Flatten(), nn.Linear(18, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank, step):
    return torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(100 * rank + step))


def _engine(stage, opt_fn=None, model=None, bf16=False):
    model = model if model is not None else _model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    opt_fn = opt_fn or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, _ = initialize(model=model, optimizer=opt_fn, config=cfg)
    return engine, opt


def _train(rank, stage, steps=3, edit=None, **kw):
    engine, _ = _engine(stage, **kw)
    for step in range(steps):
        engine.backward(engine(_batch(rank, step)).float().pow(2).mean())
        engine.step()
        if edit is not None:
            with torch.no_grad():
                edit(engine.module)
    return [p.detach().clone() for p in engine.module.parameters()]


def _same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _message(fn, *args):
    try:
        fn(*args)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------- ranks must agree
def _groups_in_rank_order(rank, world_size):
    def opt_fn(params):
        params = list(params)
        return torch.optim.AdamW(params if rank == 0 else params[::-1], lr=1e-2)

    return _message(_engine, 1, opt_fn)


def _other_models(rank, world_size, how):
    model = _model()
    if rank == 1 and how == "shapes":
        model[6].weight = nn.Parameter(torch.zeros(4, 4))  # the numel of (2, 8)
    elif rank == 1:
        model.add_module("extra", nn.Linear(2, 2))
    return [_message(_engine, stage, None, model) for stage in (0, 1)]


def test_ranks_listing_a_group_in_other_orders_are_refused(ranks):
    for msg in ranks.run(2, _groups_in_rank_order):
        assert msg and msg.startswith("ValueError") and "param group 0" in msg and "same order" in msg, msg
        assert "0.weight" in msg, msg  # names from the model


@pytest.mark.parametrize("how", ["shapes", "extra"])
def test_ranks_with_other_models_are_refused_at_stages_0_and_1(ranks, how):
    for msgs in ranks.run(2, _other_models, how):
        for msg in msgs:
            assert msg and msg.startswith("ValueError") and "differs across ranks" in msg, msg


# ------------------------------------------------ the returned optimizer
def _direct_step(rank, world_size, stage, bf16):
    engine, opt = _engine(stage, bf16=bf16)
    engine.backward(engine(_batch(rank, 0)).float().pow(2).mean())
    msg = _message(opt.step)
    direct = zero1.ZeroOneOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    for p in direct.model_params():
        p.grad = torch.ones_like(p)
    return msg, _message(direct.step)


@pytest.mark.parametrize("stage,bf16", [(1, False), (0, True)])
def test_stepping_the_returned_optimizer_alone_is_refused(ranks, stage, bf16):
    for msg, direct in ranks.run(2, _direct_step, stage, bf16):
        assert msg and msg.startswith("RuntimeError") and "engine.step()" in msg, msg
        assert direct and "reduce_gradients() first" in direct, direct


# ---------------------------------------------- in-place edits persist
def _prune(module):
    module[2].weight[0].zero_()
    module[4].weight.clamp_(-0.2, 0.2)


def _touch(module):
    for p in module.parameters():
        p.copy_(p.clone())  # a version bump, no value changed


def _edits(rank, world_size):
    return (_same(_train(rank, 1, edit=_prune), _train(rank, 0, edit=_prune)),
            _same(_train(rank, 1, edit=_touch, bf16=True), _train(rank, 1, bf16=True)),
            _same(_train(rank, 1, edit=_prune, bf16=True), _train(rank, 1, bf16=True)))


def test_edits_between_steps_reach_the_master(ranks):
    """fp32: ZeRO-1 with pruning/clamping after every step equals stage 0 (which steps
    the parameters themselves) bit for bit; bf16: a write of unchanged values leaves
    the fp32 master bits alone, and a real edit does change the training."""
    for as_stage0, untouched, changed in ranks.run(2, _edits):
        assert as_stage0 and untouched and not changed


def _edit_then_checkpoint(rank, world_size, folder, stage, bf16):
    engines = [_engine(stage, bf16=bf16)[0] for _ in range(2)]
    first = engines[0]
    for step in range(2):
        first.backward(first(_batch(rank, step)).float().pow(2).mean())
        first.step()
    with torch.no_grad():
        _prune(first.module)
    first.save_checkpoint(folder, tag=f"s{stage}{bf16}")
    engines[1].load_checkpoint(folder, tag=f"s{stage}{bf16}")
    for e in engines:
        e.backward(e(_batch(rank, 5)).float().pow(2).mean())
        e.step()
    return _same(*([p.detach() for p in e.module.parameters()] for e in engines))


@pytest.mark.parametrize("stage,bf16", [(1, False), (1, True), (0, True)])
def test_an_edit_survives_a_checkpoint_before_the_next_step(ranks, tmp_path, stage, bf16):
    """The saved master takes the edits too: a load wrote the master from before them
    over the saved (edited) model (found by review)."""
    assert all(ranks.run(2, _edit_then_checkpoint, str(tmp_path), stage, bf16))


# ------------------------------------------------------------ optimizers
def _adagrad(rank, world_size):
    opt_fn = lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1)  # noqa: E731
    adafactor = _message(_engine, 1, lambda ps: torch.optim.Adafactor(ps, lr=0.01))
    return _same(_train(rank, 1, opt_fn=opt_fn), _train(rank, 0, opt_fn=opt_fn)), adafactor


def test_adagrad_trains_and_adafactor_is_refused(ranks):
    for same, adafactor in ranks.run(2, _adagrad):
        assert same
        assert adafactor and adafactor.startswith("ValueError") and "Adafactor" in adafactor, adafactor


# ----------------------------------------------------------------- edges
def _edges(rank, world_size):
    sparse = _same(_train(rank, 1, model=_model(sparse=True)), _train(rank, 0, model=_model(sparse=True)))
    engine, opt = _engine(1)
    engine.backward(engine(_batch(rank, 0)).pow(2).mean())
    engine.zero1.zero_grad(set_to_none=False)
    zeroed = all(p.grad is not None and not p.grad.any() for p in engine.module.parameters())
    mixed = nn.Linear(2, 2)
    mixed.bias = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    return sparse, zeroed, _message(zero1.ZeroOneOptimizer, torch.optim.SGD(mixed.parameters(), lr=0.1))


def test_sparse_grads_zero_grad_in_place_and_mixed_dtypes(ranks):
    for sparse, zeroed, mixed in ranks.run(2, _edges):
        assert sparse and zeroed
        assert mixed and "mixes dtypes" in mixed and "torch.float64" in mixed, mixed


# ------------------------------------------- found by the session-26 review
def _float64_model_in_bf16(rank, world_size):
    engine, _ = _engine(1, model=_model().double(), bf16=True)
    return next(engine.module.parameters()).dtype, engine.zero1.parts[0].master.dtype


def test_a_float64_model_trained_in_bf16_gets_an_fp32_master(ranks):
    """The master was built before the model's cast to bf16, from its float64 parameters."""
    assert ranks.run(2, _float64_model_in_bf16) == [(torch.bfloat16, torch.float32)] * 2


def _wide_dtypes(rank, world_size):
    """float64 trains as stage 0 (which steps the float64 parameters themselves); complex keeps its imaginary part."""
    as_stage0 = _same(_train(rank, 1, model=_model().double()), _train(rank, 0, model=_model().double()))
    torch.manual_seed(0)
    c = nn.Parameter(torch.randn(6, dtype=torch.complex64))
    ref = nn.Parameter(c.detach().clone())
    z = zero1.ZeroOneOptimizer(torch.optim.SGD([c], lr=0.1))
    opt = torch.optim.SGD([ref], lr=0.1)
    for p in (c, ref):
        (p * (rank + 1)).abs().pow(2).sum().backward()
    ref.grad.div_(world_size)
    torch.distributed.all_reduce(ref.grad)
    z.reduce_gradients()
    z.step()
    opt.step()
    return as_stage0, z.parts[0].master.dtype, bool(c.imag.any()), torch.equal(c, ref)


def test_float64_and_complex_groups_keep_their_dtype(ranks):
    """The fp32 master rounded float64 parameters every step and dropped complex ones' imaginary parts."""
    for as_stage0, dtype, imag, same in ranks.run(2, _wide_dtypes):
        assert as_stage0 and dtype == torch.complex64 and imag and same


def _returned_optimizer(rank, world_size, stage, bf16):
    engine, opt = _engine(stage, bf16=bf16)
    engine.backward(engine(_batch(rank, 0)).float().pow(2).mean())
    opt.zero_grad()  # throw the batch away
    cleared = all(p.grad is None for p in engine.module.parameters())
    engine.backward(engine(_batch(rank, 1)).float().pow(2).mean())
    engine.step()
    mine = opt.state_dict()
    other = [None] * world_size
    torch.distributed.all_gather_object(other, mine)
    refused = _message(opt.load_state_dict, other[1 - rank])
    untagged = _message(opt.load_state_dict, {k: v for k, v in mine.items() if k != zero1_state._RANK_KEY})
    opt.load_state_dict(mine)  # its own loads
    rank0s = [mine]
    torch.distributed.broadcast_object_list(rank0s, src=0)
    everywhere = _message(opt.load_state_dict, rank0s[0])  # the DDP habit: rank 0's file on every rank
    return cleared, refused, untagged, everywhere


@pytest.mark.parametrize("stage,bf16", [(1, False), (0, True)])
def test_the_returned_optimizers_zero_grad_and_state_dict(ranks, stage, bf16):
    """Its zero_grad() cleared only the masters (the discarded batch was trained on); its
    state_dict() is one rank's chunks, and another rank's loaded silently."""
    for cleared, refused, untagged, everywhere in ranks.run(2, _returned_optimizer, stage, bf16):
        assert cleared
        if stage == 1:  # stage 0's single partition is the same on every rank
            # the first rank's problem, on every rank
            assert refused and "on rank 0 of 2 the state dict holds rank 1 of 2's chunks" in refused, refused
            assert "engine.save_checkpoint" in refused, refused
            # refused on rank 0 too, which holds its own: it used to train on alone into the next collective
            assert everywhere and "on rank 1 of 2 the state dict holds rank 0 of 2's chunks" in everywhere, everywhere
        else:
            assert refused is None and everywhere is None, (refused, everywhere)
        assert untagged and "no ZeRO-1 rank tag" in untagged, untagged


def _two_reduces(rank, world_size):
    lin = nn.Linear(3, 3)
    z = zero1.ZeroOneOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    for scale in (1.0, 2.0):
        for q in z.model_params():
            q.grad = torch.full_like(q, scale)
        z.reduce_gradients()
    part = z.parts[0]
    real = part.layout.shard_end - part.layout.shard_start  # the rest is padding, reduced as zeros
    summed = bool((part.master.grad[:real] == 3.0).all())
    z.step()  # no zero_grad: the next backward's gradients, then a step without reducing them
    for q in z.model_params():
        q.grad = torch.ones_like(q)
    stale = _message(z.step)
    z.reduce_gradients()
    z.zero_grad()  # the reduced batch thrown away: the next one needs its own reduce
    for q in z.model_params():
        q.grad = torch.ones_like(q)
    return summed, stale, _message(z.step)


def test_two_reduces_add_up_and_a_step_without_reduce_is_refused(ranks):
    """A second reduce_gradients() replaced the first; a step() without one, after a step
    that was not followed by zero_grad, stepped the old master gradients again."""
    for summed, stale, after_zero_grad in ranks.run(2, _two_reduces):
        assert summed
        for msg in (stale, after_zero_grad):
            assert msg and "reduce_gradients() first" in msg, msg


def _thread_counts_differ(rank, world_size):
    torch.set_num_threads(1 if rank == 0 else 2)
    torch.manual_seed(0)
    big = nn.Linear(2000, 2000)  # a float64 sum of its values depends on the thread count
    return _message(zero1.ZeroOneOptimizer, torch.optim.SGD(big.parameters(), lr=0.1))


def test_the_value_check_holds_whatever_the_thread_count(ranks):
    """The first checksum was a float64 sum: ranks with other thread counts summed the same
    weights to other last bits and were refused as holding different parameters."""
    assert ranks.run(2, _thread_counts_differ) == [None, None]


def _swapped_same_shapes(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    norm = list(model[1].parameters())
    norm = norm if rank == 0 else norm[::-1]  # e.g. from a set
    nameless = _message(zero1.ZeroOneOptimizer, torch.optim.SGD([{"params": list(model[0].parameters())},
                                                                 {"params": norm}], lr=0.1))
    z = zero1.ZeroOneOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), model=model)
    model.extra = nn.Linear(3, 3)  # registered after construction: named now
    extra = list(model.extra.parameters())
    later = _message(z.optimizer.add_param_group, {"params": extra if rank == 0 else extra[::-1]})
    return nameless, later


def test_same_shape_parameters_swapped_between_ranks_are_refused(ranks):
    """Without names (model=None) only shapes were compared: a LayerNorm's weight and bias
    swapped on one rank passed; a group added later was compared by shape even with model=."""
    for nameless, later in ranks.run(2, _swapped_same_shapes):
        assert nameless and "param group 1 lists different parameters" in nameless and "other values" in nameless, nameless
        assert later and "param group 1" in later and "extra.weight" in later, later


def _unfrozen_and_added(rank, world_size):
    lin = nn.Linear(3, 3)
    lin.bias.requires_grad_(False)
    z = zero1.ZeroOneOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    lin.bias.requires_grad_(True)
    z.optimizer.add_param_group({"params": [lin.bias]})  # the fix the warning names
    lin(torch.ones(2, 3)).sum().backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        z.reduce_gradients()
    before = lin.bias.detach().clone()
    z.step()
    return [str(w.message) for w in seen], not torch.equal(before, lin.bias)


def test_a_parameter_unfrozen_and_added_is_not_warned_about(ranks):
    for warned, trained in ranks.run(2, _unfrozen_and_added):
        assert not warned and trained, warned


def _stage0_step_after_no_sync(rank, world_size):
    engine, _ = _engine(0)
    with engine.no_sync():
        engine.backward(engine(_batch(rank, 0)).pow(2).mean())
    return _message(engine.step)


def test_stage0_step_after_only_a_no_sync_backward_is_refused(ranks):
    """Its gradients were never all-reduced: each rank stepped its own and the replicas diverged."""
    for msg in ranks.run(2, _stage0_step_after_no_sync):
        assert msg and msg.startswith("RuntimeError") and "inside no_sync()" in msg, msg


def _one_tensor_group(rank, world_size):
    model = _model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    groups = [{"params": model[0].weight, "lr": 0.1}, {"params": [p for p in model.parameters() if p is not model[0].weight]}]
    engine, *_ = initialize(model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), model_parameters=groups,
                            config=cfg)
    return [len(g["params"]) for g in engine.optimizer.param_groups]


def test_a_param_group_of_one_tensor_is_accepted(ranks):
    """torch.optim takes {"params": tensor}; initialize iterated the tensor's rows and refused them."""
    for sizes in ranks.run(2, _one_tensor_group):
        assert sizes == [1, 1], sizes


def test_initialize_takes_deepspeeds_arguments_in_its_order():
    """deepspeed.initialize's positional order (0.19): distributed_port was missing, so the 7th
    positional argument landed in mpu; mesh_param raised TypeError."""
    import inspect

    deepspeed_order = ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                       "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                       "config_params"]
    params = inspect.signature(initialize).parameters
    assert list(params)[: len(deepspeed_order)] == deepspeed_order
    assert params["distributed_port"].default == 29500
    assert params["fsdp_kwargs"].kind is inspect.Parameter.KEYWORD_ONLY
    msg = _message(initialize, None, nn.Linear(2, 2), None, None, None, None, 29500, None, None, None, {}, object())
    assert msg and "mesh_param" in msg, msg

"""The distributed optimizer (megamoe.training.distributed_optimizer, ZeRO-1 / ZeRO-2) against its oracle, the
plain optimizer.

The in-process cases; those that spawn ranks or run scripts end to end are in
tests/multirank/test_distributed_optimizer.py."""

import math

import pytest
import torch
from torch import nn

from megamoe.training.distributed_optimizer import DistributedOptimizer
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.distributed_optimizer import (MICRO_BATCH, REL_TOL, _close, _single_process_trainer, build_model,
                                                 global_batch, train)

pytestmark = pytest.mark.usefixtures("one_thread")
FP16_REL_TOL = torch.finfo(torch.float16).eps   # 2^-10: fp16 autocast steps after the first update


# ---- in-process checks -----------------------------------------------------------------------------------
def test_bf16_parameters_keep_fp32_master_weights():
    """Updates far below bf16's resolution at 1.0 (2^-8 relative) accumulate in the fp32 master; the bf16
    parameter is the rounded master. Reference: torch's AdamW on an fp32 copy, with the same gradients."""
    from parallel_state import ParallelState

    class One(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 8, dtype=dtype))

    model, reference, bf16_alone = One(torch.bfloat16), One(torch.float32), One(torch.bfloat16)
    opt = DistributedOptimizer(model, ParallelState.single_process(), lr=1e-3, shard=False)
    ref = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    alone = torch.optim.AdamW(bf16_alone.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(10):
        grad = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).abs() + 0.5
        model.w.grad, reference.w.grad, bf16_alone.w.grad = grad.bfloat16(), grad.bfloat16().float(), grad.bfloat16()
        opt.reduce_gradients()
        opt.step()
        ref.step()
        alone.step()
        opt.zero_grad()
    master = opt.state[model.w]["master"]
    assert master.dtype == torch.float32 and master.shape == (1, 32)
    assert torch.equal(master.view(4, 8), reference.w.detach()), "the master is the fp32 AdamW result"
    assert torch.equal(model.w.detach(), reference.w.detach().bfloat16()), "the parameter is the rounded master"
    assert (reference.w < 0.995).all() and (model.w < 1).all(), "ten steps of ~1e-3 move the weights"
    assert torch.equal(bf16_alone.w.detach(), torch.ones(4, 8, dtype=torch.bfloat16)), \
        "bf16 parameters alone lose every such update (what the master is for)"


class Linear(nn.Module):
    """A bias-free bf16 linear layer whose per-micro-batch gradient is ``c_k^T x_k`` (scaled by ``scale_k``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 4 * 8).view(4, 8).bfloat16())
        self.b = nn.Parameter(torch.linspace(0, 1, 4).bfloat16())

    def loss(self, k: int) -> torch.Tensor:
        """Micro-batch k's loss: k = 0 has gradients ~1, the others the same ~1e-3 ones (below half of bf16's
        spacing at 1, 2^-8: each is rounded away on its own, while their sum is not small)."""
        g = torch.Generator().manual_seed(min(k, 1))
        x, c = torch.randn(2, 8, generator=g).bfloat16(), torch.randn(2, 4, generator=g)
        scale = 1.0 if k == 0 else 1e-3
        return ((x @ self.w.t() + self.b).float() * c * scale).sum()


MICRO_BATCHES = 8


def _hand_accumulated(model: Linear) -> tuple[dict, dict, dict]:
    """The oracle, per parameter name: each micro-batch's bf16 gradient by autograd on its own, summed in fp32
    (in micro-batch order); the same gradients summed in bf16 (what autograd's own accumulation gives); the
    large micro-batch's gradient alone."""
    fp32, bf16 = {}, {}
    for k in range(MICRO_BATCHES):
        grads = torch.autograd.grad(model.loss(k), list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads):
            assert g.dtype == torch.bfloat16
            fp32[name] = fp32.get(name, torch.zeros(g.shape)) + g.float()
            bf16[name] = g if name not in bf16 else bf16[name] + g
        if k == 0:
            first = {name: g.float() for (name, _), g in zip(model.named_parameters(), grads)}
    return fp32, bf16, first


@pytest.mark.parametrize("shard", [False, True])
def test_bf16_gradients_accumulate_in_fp32_over_micro_batches(shard):
    """One large micro-batch gradient and seven ~1e-3 ones: the accumulated gradient (``p.main_grad``, the
    reduced shard and what the step uses) is exactly the fp32 sum of the bf16 per-micro-batch gradients,
    while bf16 accumulation drops the small ones; ``p.grad`` is freed after every micro-batch. The step is
    torch's fp32 AdamW on the fp32 master with that gradient, the parameter its rounding."""
    from parallel_state import ParallelState
    from megamoe.gradients import main_grad
    model = Linear()
    want, lossy, large = _hand_accumulated(Linear())
    opt = DistributedOptimizer(model, ParallelState.single_process(), lr=1e-2, weight_decay=0.1, shard=shard)
    reference = {name: p.detach().float().clone().requires_grad_() for name, p in model.named_parameters()}
    ref = torch.optim.AdamW([{"params": [reference["w"]], "weight_decay": 0.1},
                             {"params": [reference["b"]], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95),
                            fused=True)
    for step in range(2):
        opt.zero_grad()
        for k in range(MICRO_BATCHES):
            model.loss(k).backward()
            assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in model.parameters()), \
                "each micro-batch's bf16 gradient goes into the fp32 main_grad at once"
        if step == 0:
            for name, p in model.named_parameters():
                assert torch.equal(main_grad(p), want[name]), name
                assert not torch.equal(lossy[name].float(), want[name]), f"{name}: bf16 would lose nothing"
                # bf16 accumulation keeps little of the small micro-batches' contribution; fp32 keeps it all.
                small, kept = want[name] - large[name], lossy[name].float() - large[name]
                assert (kept - small).abs().sum() > 0.5 * small.abs().sum(), (name, kept, small)
        opt.reduce_gradients()
        for name, grad in opt.named_gradient_shards():
            assert torch.equal(grad.view(want[name].shape), main_grad(dict(model.named_parameters())[name])), name
        opt.step()
        for name, q in reference.items():
            q.grad = {n: main_grad(p) for n, p in model.named_parameters()}[name].clone()
        ref.step()
        for name, p in model.named_parameters():
            master = opt.state[p]["master"].view(p.shape)
            assert torch.equal(master, reference[name].detach()), f"step {step}: {name}'s master is fp32 AdamW's"
            assert torch.equal(p.detach(), master.bfloat16()), f"step {step}: {name} is the rounded master"
    opt.zero_grad()
    assert all(getattr(p, "main_grad", None) is None and p.grad is None for p in model.parameters())


def test_bf16_trainer_step_reduces_the_fp32_sum_of_the_micro_batch_gradients():
    """The Trainer on a bf16 model (unsharded distributed optimizer, no clipping): the gradient its step uses is
    the fp32 sum of each micro-batch's bf16 gradient of ``(loss + aux) / num_micro_batches``, computed by hand
    with autograd on an identical model, bit for bit; autograd's bf16 accumulation of them differs."""
    from parallel_state import ParallelState
    from megamoe.precision import upcast
    state = ParallelState.single_process()
    trainer = Trainer(build_model(state, dtype=torch.bfloat16), state, TrainConfig(lr=1e-2, grad_clip=0.0))
    reference = build_model(state, dtype=torch.bfloat16)
    batches = [(mb[:, :-1], mb[:, 1:]) for mb in global_batch().split(MICRO_BATCH)]
    params = list(reference.parameters())
    fp32 = [torch.zeros(p.shape) for p in params]
    bf16 = [None] * len(params)
    for inputs, labels in batches:
        out, aux = reference(inputs, labels=labels)
        grads = torch.autograd.grad([upcast(out) / len(batches), aux / len(batches)], params, allow_unused=True)
        for i, g in enumerate(grads):
            g = torch.zeros_like(params[i]) if g is None else g
            fp32[i] += g.float()
            bf16[i] = g if bf16[i] is None else bf16[i] + g
    trainer.train_step(batches)
    names = [name for name, _ in reference.named_parameters()]
    shards = dict(trainer.optimizer.named_gradient_shards())
    assert len(shards) == len(names) > 4
    for name, want, lossy in zip(names, fp32, bf16):
        assert torch.equal(shards[name].view(want.shape), want), name
    assert sum(not torch.equal(lossy.float(), want) for lossy, want in zip(bf16, fp32)) > len(names) // 2, \
        "bf16 accumulation of the same gradients rounds most parameters' sums differently"


def test_bf16_trainer_builds_unsharded_masters_and_its_checkpoint_holds_the_master(tmp_path):
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    trainer = _single_process_trainer()
    assert not isinstance(trainer.optimizer, DistributedOptimizer), "fp32 parameters: the plain optimizer"
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    bf16 = Trainer(build_model(state, dtype=torch.bfloat16), state, TrainConfig(lr=1e-2))
    assert isinstance(bf16.optimizer, DistributedOptimizer) and not bf16.optimizer.shard
    losses = [loss for loss, _ in train(bf16, 2)]
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0]
    save_training_checkpoint(tmp_path / "ckpt", bf16, sampler_state=None, world_group=None)
    # A plain fp32 run resuming loads the fp32 master as its weights (not the rounded bf16 copy).
    load_training_checkpoint(tmp_path / "ckpt", trainer, world_group=None)
    # (the routers' gates are held in fp32 in a bf16 model: the parameter is its own master)
    masters = {id(p): bf16.optimizer.state[p].get("master", p.detach()) for p in bf16.model.parameters()}
    for (name, p), q in zip(trainer.model.named_parameters(), bf16.model.parameters()):
        assert torch.equal(p.detach().reshape(-1), masters[id(q)].reshape(-1)), name
    # ... and a bf16 run resuming takes its master from them.
    again = Trainer(build_model(state, dtype=torch.bfloat16), state, TrainConfig(lr=1e-2))
    load_training_checkpoint(tmp_path / "ckpt", again, world_group=None)
    for p, q in zip(again.model.parameters(), bf16.model.parameters()):
        assert torch.equal(again.optimizer.state[p].get("master", p.detach()), masters[id(q)])
        assert torch.equal(p, q)


def test_fp16_loss_scaling_and_skipped_steps_match_the_plain_optimizer():
    """fp16 with a loss scale that first overflows: the skipped steps (found non-finite from the shards) leave
    everything unchanged, then the unscaled, clipped steps train as the plain optimizer's (ZeRO-2)."""
    from megamoe.training.loss_scaling import LossScaleConfig
    curves = []
    for kwargs in ({}, dict(distributed_optimizer=True, zero_stage=2)):
        trainer = _single_process_trainer(autocast="fp16", loss_scale=LossScaleConfig(initial_scale=2.0 ** 21),
                                          **kwargs)
        curve = []
        for _ in range(8):
            m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in global_batch().split(MICRO_BATCH)])
            curve.append((m.skipped, m.loss_scale, m.loss, m.grad_norm if not m.skipped else 0.0))
            if m.skipped and not curve[:-1]:
                assert not trainer.optimizer.state, "a skipped first step creates no optimizer state"
        curves.append(curve)
    plain, sharded = curves
    assert plain[0][0] and not plain[-1][0], f"the test needs skipped steps, then finite ones: {plain}"
    first_real = next(i for i, row in enumerate(plain) if not row[0])
    for step, (got, want) in enumerate(zip(sharded, plain)):
        # Skips and loss scales are exact. Up to the first real step both runs hold the same parameters, so the
        # fp16 forward is the same and only the fp32 sum of squares differs (REL_TOL). After it the sharded and
        # plain updates round differently in fp32; fed back through fp16 matmuls, that difference is amplified
        # by the fp16 kernel the CPU picks (AMX / AVX512-FP16 kernels accumulate differently from AVX2 ones),
        # so the bound is fp16's own precision. A wrong unscale or a dropped shard is off by far more.
        rel = REL_TOL if step <= first_real else FP16_REL_TOL
        assert got[:2] == want[:2] and _close(got[2:], want[2:], rel), (step, got, want)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="TrainConfig.zero_stage must be 1 or 2"):
        TrainConfig(distributed_optimizer=True, zero_stage=3)
    with pytest.raises(ValueError, match="TrainConfig.zero_stage=2 needs distributed_optimizer=True"):
        TrainConfig(zero_stage=2)
    with pytest.raises(ValueError, match="TrainConfig.distributed_optimizer must be a bool"):
        TrainConfig(distributed_optimizer=1)
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = build_model(state)
    with pytest.raises(ValueError, match=r"Trainer\(optimizer=...\) with TrainConfig.distributed_optimizer=True"):
        Trainer(model, state, TrainConfig(distributed_optimizer=True), optimizer=torch.optim.SGD(model.parameters()))
    with pytest.raises(ValueError, match="bucket_numel must be an int >= 1"):
        DistributedOptimizer(model, state, bucket_numel=0)
    from megamoe.training.trainer import build_optimizer
    with pytest.raises(ValueError, match="torch.bfloat16 need fp32 master weights"):
        build_optimizer(build_model(state, dtype=torch.bfloat16), TrainConfig())


def test_pretrain_script_flags_reach_the_train_config_and_bad_combinations_are_refused(demo, tmp_path, capsys):
    """The flags -> TrainConfig and the model dtype (a whole run of the script costs ~15 s: the flags' wiring
    into main is two keyword arguments); the refused combination: one error line, no work done."""
    from megamoe.cli.launch import run_script
    from megamoe.training.optim_arguments import param_dtype, train_config_kwargs
    args = demo.build_parser().parse_args(["--distributed-optimizer", "--zero-stage", "2", "--param-dtype", "bf16"])
    config = TrainConfig(**train_config_kwargs(args, train_steps=2))
    assert config.distributed_optimizer and config.zero_stage == 2 and param_dtype(args) == torch.bfloat16
    plain = TrainConfig(**train_config_kwargs(demo.build_parser().parse_args([]), train_steps=2))
    assert not plain.distributed_optimizer and plain.zero_stage == 1
    assert param_dtype(demo.build_parser().parse_args([])) == torch.float32
    code = run_script(demo.main, ["--work-dir", str(tmp_path / "w"), "--zero-stage", "2"], prog=demo.PROG)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("pretrain_moe.py: error: ") and \
        "--zero-stage 2 needs --distributed-optimizer" in err[0], err
    assert not (tmp_path / "w").exists(), "the error must come before any work"


def test_owned_rows_cover_this_ranks_columns_of_any_dim0_slice():
    """ShardEntry.owned_rows (what a rank reads of a checkpoint's state): the dim-0 range of a view (the
    whole parameter, a slab, a TP-like column slice, a stacked slot) holding every element of this rank's
    columns, checked against every element's flat position, at group sizes 1 to 5."""
    from megamoe.training.optimizer_shards import ShardEntry
    param = nn.Parameter(torch.zeros(3, 6, 5))                 # 3 slot rows of 30 (a stacked expert parameter)
    base = torch.zeros(param.shape)
    position = torch.arange(param.numel()).view(param.shape)
    shrunk = 0
    for size in range(1, 6):
        cols = math.ceil(30 / size)
        for rank in range(size):
            entry = ShardEntry(param, 3, 30, cols, rank, True)
            for index in (slice(None), (1,), (2, slice(2, 5)), (0, slice(None), slice(1, 4)), (1, slice(1, 6), 2)):
                view = base[index]
                flat = position[index] % 30
                mine = ((flat >= rank * cols) & (flat < rank * cols + entry.valid)).reshape(view.shape[0], -1)
                rows = mine.any(dim=1).nonzero().flatten().tolist()
                got = entry.owned_rows(view, base)
                if not rows:
                    assert got is None or entry.valid == 0, (size, rank, index, got)
                    continue
                assert got is not None and got[0] <= rows[0] and got[1] >= rows[-1] + 1, (size, rank, index, got)
                shrunk += got[1] - got[0] < view.shape[0]
    assert shrunk > 20, "the ranges must leave rows out, else nothing is saved"


def _state_bytes_of_largest(optimizer) -> tuple[int, int]:
    """(fp32 bytes of the largest bucket, gathered over its group; fp32 bytes of the largest parameter)."""
    bucket = max(4 * b.shard_numel * b.group.size for b in optimizer._buckets)
    return bucket, max(4 * p.numel() for p in optimizer._entries)


def test_zero_checkpoint_save_and_load_stage_bucket_by_bucket_through_host_memory(tmp_path):
    """Saving and loading a bf16 run's ZeRO checkpoint hold about one bucket of fp32 state on the device, not
    the full state (12 bytes per parameter: the master and the two moments), and the round trip is bit-exact.
    Device bytes: DeviceMemory, every storage the ops touch less the host staging buffers (on a CPU run host
    and device are the same memory); the parameters and the optimizer's own shards are the baseline."""
    from parallel_state import ParallelState
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    from megamoe.training.memory_measure import DeviceMemory
    state = ParallelState.single_process()

    def bf16_trainer():
        # small buckets (a few parameters each), so that one bucket is a small part of the state
        return Trainer(build_model(state, dtype=torch.bfloat16), state, TrainConfig(lr=1e-2, grad_bucket_mb=0.02))

    trainer = bf16_trainer()
    train(trainer, 2)
    optimizer = trainer.optimizer
    assert isinstance(optimizer, DistributedOptimizer) and optimizer.num_buckets >= 6, optimizer.num_buckets
    numel = sum(p.numel() for p in trainer.model.parameters())
    full_state = 12 * numel
    bucket_bytes, param_bytes = _state_bytes_of_largest(optimizer)
    assert bucket_bytes < full_state / 4, (bucket_bytes, full_state)

    def device_peak(run, trainer) -> int:
        with DeviceMemory("cpu") as live:
            live.track(list(trainer.model.parameters()), list(trainer.model.buffers()),
                       [list(s.values()) for s in trainer.optimizer.state.values()])
            baseline = live.current_bytes
            run()
        return live.peak_bytes - baseline

    saved = device_peak(lambda: save_training_checkpoint(tmp_path / "ckpt", trainer, sampler_state=None,
                                                         world_group=None), trainer)
    resumed = bf16_trainer()
    resumed.optimizer.materialize_state()          # the shards a load fills: this rank's state, not a transient
    loaded = device_peak(lambda: load_training_checkpoint(tmp_path / "ckpt", resumed, world_group=None), resumed)
    # One bucket's gathered state for one key, and one parameter in transit (a read piece, a reordering).
    bound = bucket_bytes + 2 * param_bytes
    for what, peak in (("save", saved), ("load", loaded)):
        assert 0 < peak <= bound < full_state / 2, (what, peak, bound, full_state)

    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
        want, got = optimizer.state[p], resumed.optimizer.state[q]
        master = {"master"} if p.dtype != torch.float32 else set()      # the fp32 router gates are their own
        assert want.keys() == got.keys() == {"exp_avg", "exp_avg_sq", "step"} | master, name
        assert all(torch.equal(want[k], got[k]) for k in want), name

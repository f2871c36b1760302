"""Device-cleanliness harness: whole training steps and a generation with every parameter and input on the
``meta`` device, over torch's fake process group, so that a tensor the library creates on the CPU raises.

Each case plays the ranks of a layout one after another in this process: ``dist.init_process_group`` with
torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg.FakeStore``), registered for the
``cpu`` and ``meta`` devices, makes every collective a no-op that still checks its tensors' devices and
leaves receive buffers as the library allocated them (so their shapes must be right on their own).

A stray CPU tensor is caught twice over: meta kernels refuse to combine a CPU and a meta tensor, and
:class:`_StrayCpuTensors` (a dispatch mode) also refuses the mixes meta kernels let through (a 0-dim CPU
tensor is a "scalar" to them) and any collective on a CPU tensor. Explicit copies (``.to(device)``,
``copy_``) are allowed: they are deliberate transfers, e.g. the placement tables copied once per device.

Values do not exist on meta: the library's host reads go through :mod:`megamoe.host_values`, whose
documented meta assumptions keep the shapes consistent (every token sent to every EP rank, every pair
dispatched, no padding, token 0 sampled), with torch's own
``meta_nonzero_assume_all_nonzero`` so that ``nonzero`` agrees; the step's metrics read as NaN.

torch has no autocast on meta either: the cases under autocast run :class:`_MetaAutocast`, which casts the
GEMMs' inputs as CUDA autocast does, so that the dtypes meeting in a stage and between stages are a GPU's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from megamoe import comms
from megamoe.gradients import main_grad
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.sampling import SamplingConfig
from megamoe.models import GPTMoEModel
from megamoe.moe.placement.expert_migration import migrate_layer
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer.recompute import RECOMPUTE_MODULES, RecomputeConfig
from tests.helpers.p2p_recording import fake_rank
from tests.helpers.tiny_model import E, MICRO_BATCH, S, V, tiny_config

WORLD_SIZE = 4
_EXPLICIT_COPIES = {"aten::_to_copy", "aten::copy_"}


_POINT_TO_POINT = {"c10d::send", "c10d::recv_"}


class _StrayCpuTensors(TorchDispatchMode):
    """Raise on an op that mixes CPU and meta tensors (other than an explicit copy) or on a collective
    given a CPU tensor: where the library created a tensor without the model's device. ``p2p_dtypes``:
    the dtypes of the tensors point-to-point sends and receives were given (pipeline activations and
    gradients, and their receive buffers)."""

    def __init__(self):
        super().__init__()
        self.p2p_dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        name = func._schema.name
        if "cpu" in devices and (("meta" in devices and name not in _EXPLICIT_COPIES) or func.namespace == "c10d"):
            raise AssertionError(f"{name} got a CPU tensor in a meta run: a tensor created without device=")
        if name in _POINT_TO_POINT:
            self.p2p_dtypes.update(t.dtype for t in tensors)
        return func(*args, **kwargs)


class _MetaAutocast(TorchFunctionMode):
    """``torch.autocast`` on the meta device, which torch has none for; :meth:`install` patches it in. Inside an
    enabled meta region the GEMM-family functions of autocast's lower-precision list get their floating inputs
    (fp64 aside) cast to the region's dtype, as CUDA autocast does; ``out=`` calls stay as they are (autocast
    has no ``mm.out``: the experts' per-slot GEMMs on fp32 rows). Autocast's fp32 list is not emulated: it
    widens intermediate results only. So the dtypes that meet at a stage's residual sums, its output and
    the pipeline's messages are those of a CUDA step. ``casts`` counts the calls cast (a run that cast
    nothing proved nothing)."""

    _LOWER_PRECISION = {F.linear, F.scaled_dot_product_attention, torch.mm, torch.bmm, torch.matmul, torch.addmm,
                        torch.baddbmm, torch.einsum, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.matmul}

    def __init__(self):
        super().__init__()
        self.regions: list[torch.dtype | None] = []     # the open meta regions, innermost last; None: disabled
        self.casts = 0

    @classmethod
    def install(cls, monkeypatch) -> _MetaAutocast:
        emulation, real_autocast, real_available = cls(), torch.autocast, torch.amp.is_autocast_available

        def autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
            if device_type != "meta":
                return real_autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            return _MetaAutocastRegion(emulation, dtype if enabled else None)

        monkeypatch.setattr(torch, "autocast", autocast)
        # The router opens a disabled region where autocast exists, to keep its GEMM in fp32.
        monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device: device == "meta" or real_available(device))
        # The experts ask whether autocast is on and in which dtype, to cast their rows once (issue 29 row 9).
        real_enabled, real_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: (
            bool(emulation.regions and emulation.regions[-1] is not None) if device == ("meta",)
            else real_enabled(*device)))
        monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: (
            (emulation.regions[-1] if emulation.regions and emulation.regions[-1] is not None else torch.bfloat16)
            if device == "meta" else real_dtype(device)))
        return emulation

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.regions[-1] if self.regions else None
        if dtype is not None and func in self._LOWER_PRECISION and "out" not in kwargs:
            self.casts += 1
            args, kwargs = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                                    and t.dtype != torch.float64 else t, (args, kwargs))
        return func(*args, **kwargs)


class _MetaAutocastRegion:
    """One ``torch.autocast("meta", ...)`` context (reusable, like torch's)."""

    def __init__(self, emulation: _MetaAutocast, dtype: torch.dtype | None):
        self.emulation, self.dtype = emulation, dtype

    def __enter__(self):
        self.emulation.regions.append(self.dtype)

    def __exit__(self, *exc):
        self.emulation.regions.pop()


def _fake_rank(rank: int, **layout):
    """This process as ``rank`` of a fake world of WORLD_SIZE ranks, with ``layout``'s groups."""
    return fake_rank(rank, WORLD_SIZE, **layout)


@contextlib.contextmanager
def _meta_run(stray: _StrayCpuTensors | None = None):
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True), stray or _StrayCpuTensors(), \
            comms.comm_counter() as counter:
        yield counter


# (dispatcher, layout, expert slots, parameter dtype): bf16 takes the experts' torch._grouped_mm path, fp32
# their per-slot GEMMs (no autocast here: the dtypes are the parameters'); 6 slots for 4
# experts replicate two of them (the replica gradient sum and its share of the gradient norm).
LAYOUTS = {
    "alltoall-pp2-ep2-bf16": ("alltoall", dict(pp=2, ep=2), None, torch.bfloat16),
    "allgather-tp2-ep2-pp2-fp32": ("allgather", dict(tp=2, ep=2, etp=1, pp=2), None, torch.float32),
    "alltoall-ep2-dp2-replicas-fp32": ("alltoall", dict(ep=2), 6, torch.float32),
}


def _accumulated_gradients(model) -> list:
    """Every trainable parameter's accumulated gradient, on meta: fp32 parameters' ``p.grad``; bf16 ones'
    fp32 ``p.main_grad`` (the distributed optimizer's accumulation, ``p.grad`` freed by its hook)."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            assert p.grad is None, "a bf16 parameter kept its bf16 p.grad past the accumulation hook"
            assert p.main_grad is not None and p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
    grads = [main_grad(p) for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.is_meta for g in grads), "a parameter got no meta gradient"
    return grads


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_step_on_meta_creates_every_tensor_on_the_model_device(name):
    dispatcher, layout, num_slots, dtype = LAYOUTS[name]
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, **layout) as state:
            model = GPTMoEModel(tiny_config(dispatcher, num_slots), state, device="meta", dtype=dtype)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]
            with _meta_run() as counter:
                metrics = trainer.train_step(micro_batches)
            _accumulated_gradients(model)
            assert math.isnan(metrics.loss) and math.isnan(metrics.grad_norm), "meta metrics are not measured"
            kinds = counter.kinds()
            # The EP exchange really ran (not skipped), and so did the pipeline's point-to-point traffic.
            assert kinds.get("all_to_all" if dispatcher == "alltoall" else "all_reduce", 0) > 0, kinds
            if state.pp.size > 1:
                assert kinds.get("send", 0) > 0 and kinds.get("recv", 0) > 0, kinds


def test_recomputed_training_step_on_meta_creates_every_tensor_on_the_model_device():
    """Activation recomputation (megamoe.transformer.recompute): the checkpointed regions, their RNG
    stash and their recomputation in backward stay on the model's device (pp 2, ep 2, bf16). Ranks 0 and
    2 (both stages) recompute full layers, ranks 1 and 3 every selective module."""
    modes = {0: RecomputeConfig("full"), 1: RecomputeConfig("selective", RECOMPUTE_MODULES)}
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, pp=2, ep=2) as state:
            config = dataclasses.replace(tiny_config("alltoall"), recompute=modes[rank % 2])
            model = GPTMoEModel(config, state, device="meta", dtype=torch.bfloat16)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run() as counter:
                trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
            _accumulated_gradients(model)
            assert counter.kinds().get("all_to_all", 0) > 0


def test_expert_migration_on_meta_creates_every_tensor_on_the_model_device():
    """After a meta training step (AdamW state on meta), migrate every MoE layer: weights, moments and the
    byte exchange stay on the model's device."""
    for rank in (0, 1):                                          # the two EP ranks (2 and 3 repeat them)
        with _fake_rank(rank, ep=2) as state:
            model = GPTMoEModel(tiny_config("alltoall", 6), state, device="meta")
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run():
                trainer.train_step([(batch[:, :-1], batch[:, 1:])])
            new = ExpertPlacement([3, 1, 0, 2, 2, 1], E, 2)      # both ranks receive an expert
            with _meta_run() as counter:
                for layer in model.moe_layers().values():
                    migrate_layer(layer, new, trainer.optimizer)
            assert counter.kinds() == {"expert_slot_exchange": len(model.moe_layers())}
            assert all(layer.placement == new for layer in model.moe_layers().values())
            moments = [v for s in trainer.optimizer.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.dim()]                # (AdamW keeps its `step` on CPU)
            assert moments and all(t.is_meta for t in [*model.parameters(), *moments])


# The distributed optimizer (ZeRO-1 / ZeRO-2): reduce-scatter into shards, the step and the all-gather, then
# a migration moving the slots' shard rows. (zero_stage, layout, parameter dtype): bf16 keeps fp32 masters and
# accumulates its gradients in fp32. The state bytes measured after the step are the estimate's, exactly.
DISTRIBUTED = {"zero1-pp2-ep2-bf16": (1, dict(pp=2, ep=2), torch.bfloat16),
               "zero2-pp2-ep2-bf16": (2, dict(pp=2, ep=2), torch.bfloat16),
               "zero2-ep2-dp4-replicas-fp32": (2, dict(ep=2), torch.float32)}


def _zero_checkpoint_device_peaks(optimizer, rank: int) -> None:
    """The optimizer's side of a ZeRO checkpoint on meta (:meth:`logical_state` to save, then every bucket of
    :meth:`logical_state_buckets` taken back by :meth:`load_logical_state`): one all-gather per bucket and
    state key; this rank keeps the buckets it writes (bucket i: rank i % N of its group), in host buffers; the
    device peak over the optimizer's own state stays within one gathered bucket (and its shard, and one
    parameter in transit), far below the full fp32 state (12 bytes per parameter with masters, 8 without)."""
    from megamoe.training.memory_measure import DeviceMemory
    buckets = optimizer._buckets
    def keys(param) -> int:         # its fp32 state tensors, not the step (no master: the fp32 router gates)
        return len(optimizer.state[param]) - 1
    full_state = sum((4 * keys(p)) * p.numel() for p in optimizer._entries)
    bucket_bytes = max(4 * b.shard_numel * (b.group.size + 1) for b in buckets)      # gathered + its shard
    bound = bucket_bytes + 2 * max(4 * p.numel() for p in optimizer._entries)
    assert bound < full_state / 2, (bound, full_state)
    peaks = []
    for stage in ("save", "load"):
        with _meta_run() as counter, DeviceMemory("meta") as live:
            live.track([p for p in optimizer._entries], [list(s.values()) for s in optimizer.state.values()])
            baseline = live.current_bytes
            if stage == "save":
                logical = optimizer.logical_state()
            else:
                for part in optimizer.logical_state_buckets():
                    assert part.state and all(v.is_meta for s in part.state.values() for v in s.values() if v.dim())
                    optimizer.load_logical_state(part)
        peaks.append(live.peak_bytes - baseline)
        gathers = sum(keys(b.entries[0].param) for b in buckets if b.group.size > 1)   # (none for a group of one)
        assert counter.calls("all_gather") == (gathers if stage == "save" else 0), stage
    written = {e.param for i, b in enumerate(buckets) if i % b.group.size == b.group.rank for e in b.entries}
    assert set(logical.state) == written and set(logical.masters) <= written, f"rank {rank}"
    assert all(p.dtype == torch.float32 for p in written - set(logical.masters)), "masters of non-fp32 parameters"
    # (loading copies the host buffers into the shards in place: on meta, nothing new on the device at all)
    assert 0 < peaks[0] <= bound and 0 <= peaks[1] <= bound, (rank, peaks, bound, full_state)


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_optimizer_step_on_meta_creates_every_tensor_on_the_model_device(name):
    from megamoe.training.memory_estimate import estimate_memory
    from megamoe.training.memory_measure import measure_state_bytes
    zero_stage, layout, dtype = DISTRIBUTED[name]
    pp, ep = layout.get("pp", 1), layout.get("ep", 1)
    estimate = estimate_memory(tiny_config("alltoall", 6), pp=pp, ep=ep, dp=WORLD_SIZE // pp, micro_batch=MICRO_BATCH,
                               seq_len=S, param_dtype=dtype, distributed_optimizer=True, zero_stage=zero_stage)
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, **layout) as state:
            model = GPTMoEModel(tiny_config("alltoall", 6), state, device="meta", dtype=dtype)
            # small buckets (a few parameters each): a ZeRO checkpoint's device peak is one bucket's state
            trainer = Trainer(model, state, TrainConfig(lr=1e-2, distributed_optimizer=True, zero_stage=zero_stage,
                                                        grad_bucket_mb=0.05),
                              world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run() as counter:
                trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
            kinds = counter.kinds()
            assert kinds.get("reduce_scatter", 0) > 0 and kinds.get("all_gather", 0) > 0, kinds
            shards = trainer.optimizer.gradient_shards()
            state_tensors = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
            assert shards and state_tensors and all(t.is_meta for t in [*shards, *state_tensors])
            # ZeRO-2 frees the full gradients (bf16: the fp32 accumulation buffers) after the reduce-scatter.
            assert all((main_grad(p) is None) == (zero_stage == 2) for p in model.parameters()), "ZeRO-2 frees them"
            if zero_stage == 1:
                _accumulated_gradients(model)
            measured, stage = measure_state_bytes(model, trainer.optimizer), estimate.stages[state.pp.rank]
            assert (measured.param_bytes, measured.grad_bytes, measured.optimizer_bytes) == (
                stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes), f"rank {rank}"
            _zero_checkpoint_device_peaks(trainer.optimizer, rank)
            moved = ExpertPlacement([3, 1, 0, 2, 2, 1], E, 2)
            with _meta_run() as counter:
                for layer in model.moe_layers().values():
                    migrate_layer(layer, moved, trainer.optimizer)
            assert counter.kinds() == {"expert_slot_exchange": len(model.moe_layers())}


def test_generation_on_meta_creates_every_tensor_on_the_model_device():
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, pp=2, ep=2) as state:
            model = GPTMoEModel(tiny_config("alltoall"), state, device="meta")
            config = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=1.0, top_k=8, seed=0))
            with _meta_run():
                out = generate(model, state, [[1, 2, 3], [4, 5, 6]], config)
            assert out.token_ids == [[0, 0, 0], [0, 0, 0]] and out.decode_steps == 2, out


def test_padded_vocabulary_on_meta_creates_every_tensor_on_the_model_device():
    """A vocabulary TP does not divide (67 under tp 2, padded to 72 by make_vocab_size_divisible_by 4; tied
    embeddings across pp 2): the padded embedding / output layer, the masking of the padding logits in the
    loss and the stripping of them in generation stay on the model's device, and the parameters are the
    estimate's, which counts the padding rows. TP rank 1 of both stages (the ranks holding padding)."""
    from megamoe.training.memory_estimate import estimate_memory
    config = dataclasses.replace(tiny_config("allgather"), vocab_size=67, tie_word_embeddings=True,
                                 make_vocab_size_divisible_by=4)
    estimate = estimate_memory(config, tp=2, pp=2, dp=1, micro_batch=MICRO_BATCH, seq_len=S)
    for rank in (1, 3):
        with _fake_rank(rank, tp=2, pp=2) as state:
            assert state.tp.rank == 1
            model = GPTMoEModel(config, state, device="meta")
            assert model.embed_tokens.weight.shape == (36, config.hidden_size)
            assert sum(p.numel() * 4 for p in model.parameters()) == estimate.stages[state.pp.rank].param_bytes
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run():
                trainer.train_step([(batch[:, :-1], batch[:, 1:])])
            _accumulated_gradients(model)
            with _meta_run():
                out = generate(model, state, [[1, 2, 3]], GenerationConfig(max_new_tokens=2))
            assert out.token_ids == [[0, 0]], out


def test_glm_and_minimax_paths_on_meta_create_every_tensor_on_the_model_device():
    """The paths glm4_moe / minimax_m2 add: partial rotary (4 of 8 head dims), q/k norms across heads on
    one KV head replicated over TP 2, sigmoid routing with groups and scaling; a training step and a
    generation (tp 2, ep 2)."""
    base = tiny_config("allgather")
    attention = dataclasses.replace(base.attention, num_key_value_heads=1, rope=dataclasses.replace(
        base.attention.rope, dim=4), qk_norm="full_width")
    router = dataclasses.replace(base.moe.router, score_func="sigmoid", n_group=2, topk_group=1,
                                 group_score="top2_sum", routed_scaling_factor=2.5)
    config = dataclasses.replace(base, attention=attention, moe=dataclasses.replace(base.moe, router=router))
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, tp=2, ep=2, etp=1) as state:
            model = GPTMoEModel(config, state, device="meta")
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run():
                metrics = trainer.train_step([(batch[:, :-1], batch[:, 1:])])
                out = generate(model, state, [[1, 2, 3]], GenerationConfig(max_new_tokens=2))
            _accumulated_gradients(model)
            assert math.isnan(metrics.loss) and out.token_ids == [[0, 0]], out


def test_per_token_loss_step_on_meta_creates_every_tensor_on_the_model_device():
    """TrainConfig.per_token_loss (chat SFT): the labelled-token counts, their all-reduce over DP (dp 2 here)
    and the micro-batch weights stay on the model's device (ranks 0 and 3: both pipeline stages)."""
    for rank in (0, WORLD_SIZE - 1):
        with _fake_rank(rank, ep=2, pp=2) as state:
            model = GPTMoEModel(tiny_config("alltoall", num_layers=2), state, device="meta")
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]
            calls = []
            for per_token_loss in (True, False) if rank == 0 else (True,):
                trainer = Trainer(model, state, TrainConfig(lr=1e-2, per_token_loss=per_token_loss),
                                  world_group=dist.group.WORLD)
                with _meta_run() as counter:
                    trainer.train_step(micro_batches)
                _accumulated_gradients(model)
                calls.append(counter.calls("all_reduce", state.dp.group))
            if len(calls) == 2:         # the one extra collective: the count's all-reduce over the DP group
                assert calls[0] == calls[1] + 1


def test_train_step_moves_host_micro_batches_to_the_model_device():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = GPTMoEModel(tiny_config("alltoall", num_layers=2), state, device="meta")
    trainer = Trainer(model, state, TrainConfig(lr=1e-2))
    batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64)           # as a data loader returns it
    with _meta_run():
        trainer.train_step([(batch[:, :-1], batch[:, 1:])])
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters() if p.requires_grad)


def _held_out_data(tmp_path, flag: str):
    """The eval dataset of the script's ``--eval-fraction`` (held out of the training token file) or
    ``--eval-data`` (a token file of its own): tiny documents of ids < V."""
    from megamoe.data.training_data import build_train_eval_data
    from tests.helpers.blending import _documents_file
    train = _documents_file(tmp_path / "train.bin", [[d % (V - 1) + 1] * 5 for d in range(24)])
    if flag == "--eval-fraction":
        return build_train_eval_data([train], seq_len=S, vocab_size=V, eval_fraction=0.25).eval
    held_out = _documents_file(tmp_path / "eval.bin", [[d + 1] * 5 for d in range(8)])
    return build_train_eval_data([train], seq_len=S, vocab_size=V, eval_paths=[held_out]).eval


def _script_eval_micro_batches(held_out, state) -> list:
    """This DP rank's eval micro-batches as examples/pretrain_moe.py hands them to evaluate_loss: on the host."""
    from megamoe.data.eval_split import eval_batches
    steps = eval_batches(held_out, global_batch_size=2 * MICRO_BATCH * state.dp.size, micro_batch_size=MICRO_BATCH,
                         dp_rank=state.dp.rank, dp_size=state.dp.size)
    micro_batches = [mb for step in steps for mb in step]
    assert micro_batches and all(t.device.type == "cpu" for mb in micro_batches for t in mb)
    return micro_batches


@pytest.mark.parametrize("flag", ["--eval-fraction", "--eval-data"])
def test_evaluation_moves_host_micro_batches_to_the_model_device(flag, tmp_path):
    """evaluate_loss moves the script's eval micro-batches (host tensors read from the held-out data) to the
    model's device, as the Trainer moves its training micro-batches."""
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = GPTMoEModel(tiny_config("alltoall", num_layers=2), state, device="meta")
    micro_batches = _script_eval_micro_batches(_held_out_data(tmp_path, flag), state)
    with _meta_run():
        assert math.isnan(evaluate_loss(model, state, micro_batches)), "meta losses are not measured"


# pp 2 under autocast: fp32 parameters under bf16 autocast (the CUDA default) with 1F1B and with the interleaved
# schedule, and bf16 parameters under bf16 autocast. (layout, virtual pipeline stages, parameter dtype, autocast)
AUTOCAST_PIPELINES = {
    "pp2-ep2-fp32-bf16-autocast": (dict(pp=2, ep=2), 1, torch.float32, "bf16"),
    "v2-pp2-ep2-fp32-bf16-autocast": (dict(pp=2, ep=2), 2, torch.float32, "bf16"),
    "pp2-bf16-bf16-autocast": (dict(pp=2), 1, torch.bfloat16, "bf16"),
}


@pytest.mark.parametrize("name", list(AUTOCAST_PIPELINES))
def test_pipeline_under_autocast_on_meta_exchanges_the_parameter_dtype(name, monkeypatch, tmp_path):
    """A training step and an evaluation (the script's --eval-fraction micro-batches, from the host) of pp 2
    under autocast (:class:`_MetaAutocast`): the stages exchange activations and gradients in the parameters'
    dtype (megamoe.pipeline.stage_dtype), on the model's device. One rank of each stage."""
    layout, virtual_stages, dtype, autocast = AUTOCAST_PIPELINES[name]
    emulation = _MetaAutocast.install(monkeypatch)
    held_out = _held_out_data(tmp_path, "--eval-fraction")
    for rank in (0, WORLD_SIZE - 1):
        with _fake_rank(rank, **layout) as state:
            model = GPTMoEModel(tiny_config("alltoall"), state, device="meta", dtype=dtype,
                                virtual_pipeline_stages=virtual_stages)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2, autocast=autocast), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64)      # on the host, as a data loader's
            stray = _StrayCpuTensors()
            with emulation, _meta_run(stray) as counter:
                trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
                evaluate_loss(model, state, _script_eval_micro_batches(held_out, state), world_group=dist.group.WORLD,
                              autocast_dtype=trainer.autocast_dtype)
            assert emulation.casts > 0, "no GEMM ran under the emulated autocast"
            kinds = counter.kinds()
            assert kinds.get("send", 0) > 0 and kinds.get("recv", 0) > 0, kinds
            assert stray.p2p_dtypes == {dtype}, f"rank {rank}: the pipeline exchanged {stray.p2p_dtypes}"


def test_expert_rebalancing_round_on_meta_creates_every_tensor_on_the_model_device():
    """TrainConfig.eplb: the step records its loads into the window and the round reduces them and checks the
    placements over the world, all on the model's device (a meta run reads no load: nothing moves)."""
    from megamoe.moe.placement.eplb import EPLBConfig
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, pp=2, ep=2) as state:
            model = GPTMoEModel(tiny_config("alltoall", 6), state, device="meta")
            trainer = Trainer(model, state, TrainConfig(lr=1e-2, eplb=EPLBConfig(window=2, interval=1)),
                              world_group=dist.group.WORLD)
            batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run():
                report = trainer.train_step([(batch[:, :-1], batch[:, 1:])]).eplb
            assert trainer.rebalancer.window.buffer.is_meta and report is not None and report.moved_slots == 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_measurement_on_meta_matches_the_estimated_state(name):
    """measure_train_step on meta (its dispatch mode and saved-tensor hooks create no tensor; storages
    have sizes there): a dry run measures the state of a layout exactly as the estimate computes it."""
    from megamoe.training.memory_estimate import estimate_memory
    from megamoe.training.memory_measure import measure_train_step
    dispatcher, layout, num_slots, dtype = LAYOUTS[name]
    config = tiny_config(dispatcher, num_slots)
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    estimate = estimate_memory(config, tp=tp, pp=pp, ep=ep, etp=layout.get("etp"), dp=WORLD_SIZE // (tp * pp),
                               micro_batch=MICRO_BATCH, seq_len=S, param_dtype=dtype)
    for rank in (0, WORLD_SIZE - 1):                   # a first and a last pipeline stage
        with _fake_rank(rank, **layout) as state:
            model = GPTMoEModel(config, state, device="meta", dtype=dtype)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run():
                trainer.train_step([(batch[:, :-1], batch[:, 1:])])
                memory, _ = measure_train_step(trainer, [(batch[:, :-1], batch[:, 1:])])
            stage = estimate.stages[state.pp.rank]
            measured = memory.state
            assert (measured.param_bytes, measured.grad_bytes, measured.optimizer_bytes) == (
                stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes), f"rank {rank}"
            assert 0 < memory.saved_activation_bytes < memory.peak_live_bytes


# Sequence parallelism under tp 2 (with pp 2: the stages send [B, S / tp, H]): both dispatchers on sharded tokens.
# MoE parallel folding without it (all-to-all, etp 1 < tp 2: each TP rank dispatches its share). Context
# parallelism (megamoe.transformer.context_parallel): the chunk indices, the slicing of ids, labels and positions
# and the K / V all-gather stay on the model's device; with pp 2 the stages send [B, S / cp, H], and with
# sequence parallelism [B, S / (cp tp), H]. (dispatcher, layout, sequence parallel)
SP_LAYOUTS = {
    "sp-allgather-tp2-ep2-pp2": ("allgather", dict(tp=2, ep=2, etp=1, pp=2), True),
    "sp-alltoall-tp2-etp2-pp2": ("alltoall", dict(tp=2, etp=2, pp=2), True),
    "fold-alltoall-tp2-etp1-ep4": ("alltoall", dict(tp=2, ep=4, etp=1), False),
    "cp2-pp2-ep2-alltoall": ("alltoall", dict(cp=2, pp=2, ep=2), False),
    "cp2-tp2-sp-ep2-allgather": ("allgather", dict(cp=2, tp=2, ep=2, etp=1), True),
}


@pytest.mark.parametrize("name", list(SP_LAYOUTS))
def test_sequence_and_context_parallel_training_step_on_meta_creates_every_tensor_on_the_model_device(name):
    dispatcher, layout, sp = SP_LAYOUTS[name]
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, **layout) as state:
            config = dataclasses.replace(tiny_config(dispatcher), sequence_parallel=sp)
            model = GPTMoEModel(config, state, device="meta")
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run() as counter:
                trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
            assert all(p.grad is not None and p.grad.is_meta for p in model.parameters() if p.requires_grad)
            tp, cp = state.tp.group, state.cp.group
            if state.tp.size > 1:
                assert counter.calls("reduce_scatter", tp) > 0 or not sp, counter.kinds()
                assert counter.calls("all_gather", tp) > 0, counter.kinds()   # SP blocks, or the folded MoE exit
            if state.cp.size > 1:       # the K / V all-gather over CP and its backward reduce-scatter ran
                assert counter.calls("all_gather", cp) > 0, counter.kinds()
                assert counter.calls("reduce_scatter", cp) > 0, counter.kinds()


# (pp 2, V 2) under the interleaved schedule: with EP 2, with ZeRO-2 on top, and with sequence parallelism at
# TP 2 plus full recomputation.
INTERLEAVED = {
    "v2-alltoall-pp2-ep2-bf16": (dict(pp=2, ep=2), {}, {}),
    "v2-zero2-pp2-ep2-bf16": (dict(pp=2, ep=2), {}, dict(distributed_optimizer=True, zero_stage=2)),
    "v2-sp-recompute-tp2-etp2-pp2-bf16": (dict(tp=2, etp=2, pp=2),
                                          dict(sequence_parallel=True, recompute=RecomputeConfig("full")), {}),
}


@pytest.mark.parametrize("name", list(INTERLEAVED))
def test_interleaved_pipeline_training_step_on_meta_creates_every_tensor_on_the_model_device(name):
    """The interleaved schedule (V = 2 model chunks per rank): its tagged asynchronous sends, receive
    buffers and per-chunk steps stay on the model's device; an evaluation pass (padded to pp micro-batches)
    too."""
    layout, model_fields, train_fields = INTERLEAVED[name]
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, **layout) as state:
            config = dataclasses.replace(tiny_config("alltoall"), **model_fields)
            model = GPTMoEModel(config, state, device="meta", dtype=torch.bfloat16, virtual_pipeline_stages=2)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2, **train_fields), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]
            with _meta_run() as counter:
                trainer.train_step(micro_batches)
                evaluate_loss(model, state, micro_batches[:1], world_group=dist.group.WORLD)
            if not train_fields.get("zero_stage") == 2:      # ZeRO-2 frees the full gradients
                _accumulated_gradients(model)
            kinds = counter.kinds()
            assert kinds.get("send", 0) > 0 and kinds.get("recv", 0) > 0, kinds


# Communication overlap (megamoe.training.grad_buckets, megamoe.comms.async_collectives): gradient buckets
# launched asynchronously from backward hooks (plain all-reduce, and the distributed optimizer's
# reduce-scatter), the dispatch and combine all-to-alls in flight during the shared experts. (layout,
# distributed optimizer, zero stage, parameter dtype, recompute); small buckets so that several launch from
# hooks; full recomputation re-runs the overlapped MoE forward inside the backward.
OVERLAP = {"plain-pp2-ep2-recompute-bf16": (dict(pp=2, ep=2), False, 1, torch.bfloat16, RecomputeConfig("full")),
           "zero2-tp2-sp-pp2-fp32": (dict(tp=2, pp=2), True, 2, torch.float32, None)}


@pytest.mark.parametrize("name", list(OVERLAP))
def test_overlapped_training_step_on_meta_creates_every_tensor_on_the_model_device(name):
    layout, distributed, zero_stage, dtype, recompute = OVERLAP[name]
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, **layout) as state:
            config = tiny_config("alltoall")
            config = dataclasses.replace(config, sequence_parallel=state.tp.size > 1,
                                         moe=dataclasses.replace(config.moe, shared_expert_overlap=True))
            if recompute is not None:
                config = dataclasses.replace(config, recompute=recompute)
            model = GPTMoEModel(config, state, device="meta", dtype=dtype)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2, distributed_optimizer=distributed,
                                                        zero_stage=zero_stage, overlap_grad_reduce=True,
                                                        grad_bucket_mb=0.004), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run() as counter, comms.comm_timeline() as timeline:
                trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
            kinds = counter.kinds()
            reduction = "reduce_scatter" if distributed else "all_reduce"
            assert timeline.select(reduction, "issue", "grad_bucket"), "no gradient bucket was launched"
            assert len(timeline.select(reduction, "wait", "grad_bucket")) == len(
                timeline.select(reduction, "issue", "grad_bucket")), "every launched bucket is waited for"
            if state.ep.size > 1:
                assert timeline.select("all_to_all", "issue", "moe_dispatch"), kinds
            if zero_stage == 1:
                _accumulated_gradients(model)
            else:
                assert trainer.optimizer.gradient_shards() and all(main_grad(p) is None for p in model.parameters())


def test_blocking_step_on_meta_records_its_waits_on_the_timeline():
    """Without overlap the blocking MoE all-to-alls and the pipeline's point-to-point waits record their
    blocked time (what benchmarks/scaling.py compares the overlapped step against), on the model's device."""
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, pp=2, ep=2) as state:
            model = GPTMoEModel(tiny_config("alltoall"), state, device="meta", dtype=torch.float32)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run(), comms.comm_timeline() as timeline:
                trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)])
            for tag in ("moe_dispatch", "moe_combine", "pipeline"):
                waits = [e for e in timeline.events if e.tag == tag and e.phase == "wait"]
                assert waits and len(waits) == len(timeline.select(phase="wait_start", tag=tag)), (rank, tag)
            _accumulated_gradients(model)


def test_kept_block_fp8_generation_on_meta_creates_every_tensor_on_the_model_device():
    """Kept block-FP8 weights (e4m3 + block scales): dense linears dequantized per call, routed experts on the
    emulated block recipe, with replica slots and TP-sharded blocks."""
    from megamoe.moe.experts.fp8 import FP8Config
    from megamoe.quantization.block_fp8 import BlockFP8Config

    base = tiny_config("allgather", 2 * E)
    config = dataclasses.replace(base, weight_quantization=BlockFP8Config(block_size=(8, 8)),
                                 moe=dataclasses.replace(base.moe, expert_fp8=FP8Config(recipe="block"),
                                                         expert_backend="fp8_emulated"))
    for rank in (0, 1):           # one TP group, both EP ranks (ranks 2 and 3 are their data-parallel twins)
        with _fake_rank(rank, tp=2, ep=2) as state:
            model = GPTMoEModel(config, state, device="meta")
            assert model.layers["1"].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
            with _meta_run():
                out = generate(model, state, [[1, 2, 3], [4, 5, 6]], GenerationConfig(max_new_tokens=2))
            assert out.token_ids == [[0, 0], [0, 0]], out


def test_mtp_training_step_on_meta_creates_every_tensor_on_the_model_device():
    """DeepSeek-V3's MTP layers (megamoe.models.mtp, a MoE one here) on the last of two pipeline stages, which
    embeds the ids the Trainer passes it; every parameter, the last stage's embedding copy included, gets a
    gradient."""
    config = tiny_config("alltoall", None)
    config = dataclasses.replace(config, mtp_num_layers=1, moe_layer_ids=(*config.moe_layer_ids, config.num_layers))
    for rank in range(WORLD_SIZE):
        with _fake_rank(rank, pp=2, ep=2) as state:
            model = GPTMoEModel(config, state, device="meta")
            assert bool(model.mtp_layer_ids) == state.is_last_pp_stage
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(2 * MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]
            with _meta_run():
                trainer.train_step(micro_batches)


def _gpt_oss_like(config):
    """tiny_config with gpt-oss's parts: attention sinks and biases, sliding and full layers, a biased
    router, biased experts with the clamped SwiGLU."""
    attention = dataclasses.replace(config.attention, sinks=True, qkv_bias=True, o_proj_bias=True, sliding_window=3)
    moe = dataclasses.replace(config.moe, router=dataclasses.replace(config.moe.router, bias=True),
                              activation="swiglu_clamped", expert_bias=True, swiglu_limit=1.0)
    return dataclasses.replace(config, attention=attention, moe=moe, sliding_window_layer_ids=(0, 2))


def test_gpt_oss_parts_on_meta_create_every_tensor_on_the_model_device():
    """A bf16 training step (tp2 etp2 ep2: sinks sharded with the heads, the down bias added by ETP rank 0
    only: ranks 0 and 1 are the two roles). Decoding runs the same sink code (causal_attention) as this
    step's forward."""
    from megamoe.training.memory_estimate import estimate_memory
    config = _gpt_oss_like(tiny_config("alltoall"))
    estimate = estimate_memory(config, tp=2, pp=1, ep=2, etp=2, dp=2, micro_batch=MICRO_BATCH, seq_len=S,
                               param_dtype=torch.bfloat16)
    for rank in (0, 1):
        with _fake_rank(rank, tp=2, ep=2, etp=2) as state:
            model = GPTMoEModel(config, state, device="meta", dtype=torch.bfloat16)
            # The memory estimate counts the sinks, the router bias and the expert biases.
            assert sum(p.numel() * p.element_size() for p in model.parameters()) == estimate.stages[0].param_bytes
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            batch = torch.zeros(MICRO_BATCH, S + 1, dtype=torch.int64, device="meta")
            with _meta_run():
                trainer.train_step([(batch[:, :-1], batch[:, 1:])])
            _accumulated_gradients(model)

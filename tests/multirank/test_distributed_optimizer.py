"""The distributed optimizer (megamoe.training.distributed_optimizer, ZeRO-1 / ZeRO-2) against its oracle, the
plain optimizer: the same loss curve and gradient norm (clipped steps included) under every layout of the
table below, expert rebalancing included; the optimizer state per rank at most 1/N of the plain one's (+1%);
a reduce-scatter plus an all-gather where the plain path had an all-reduce, moving the same bytes; replica
slots kept identical; odd sizes padded; checkpoints that resume across optimizers and DP sizes (through
``reshard`` too); bf16 parameters with fp32 master weights; the config errors. One 4-rank spawn for all the
multi-rank checks."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megamoe import comms
from megamoe.moe.placement.eplb import EPLBConfig
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.distributed_optimizer import DistributedOptimizer
from megamoe.training.trainer import Trainer
from tests.helpers.distributed_optimizer import (CLIP, REL_TOL, SAVE_AT, STEPS, _close, _single_process_trainer,
                                                 build_model, train, train_config)

pytestmark = pytest.mark.usefixtures("one_thread")
NORM_REL_TOL = 1e-6     # the first step's gradient norm: same parameters, sharded vs plain sum of squares
WORLD = 4


def state_bytes(trainer: Trainer) -> dict[str, int]:
    """This rank's per-element optimizer state (moments, masters) in bytes, dense and expert parameters
    apart. (0-dim ``step`` scalars, one per parameter in either optimizer, are left out: not per element.)"""
    out = {"dense": 0, "expert": 0}
    for param, s in trainer.optimizer.state.items():
        kind = "expert" if getattr(param, "expert_parallel", False) else "dense"
        out[kind] += sum(t.nbytes for t in s.values() if t.dim() > 0)
    return out


def replicas_identical(model, optimizer) -> bool:
    """Every slot of one expert (on this rank) holds identical weights, optimizer state rows and reduced
    gradient rows."""
    shards = {id(e.param): e for e in optimizer._entries.values()}
    for layer in model.moe_layers().values():
        by_expert: dict[int, list[int]] = {}
        for local, slot in enumerate(layer.local_slots):
            by_expert.setdefault(int(layer.placement.slot_to_expert[slot]), []).append(local)
        for slots in (s for s in by_expert.values() if len(s) > 1):
            for param in layer.experts.parameters():
                entry = shards[id(param)]
                grad = entry.shard_of(optimizer._buckets[entry.bucket].grad_shard)
                rows = [param.detach(), grad] + [t for t in optimizer.state[param].values() if t.dim() > 0]
                if any(not torch.equal(t[slots[0]], t[i]) for t in rows for i in slots[1:]):
                    return False
    return True


def traffic(counter, groups) -> dict:
    """Bytes per (kind, group ranks) for the all-reduces, reduce-scatters and all-gathers over ``groups``."""
    return {(kind, ranks): counter.bytes(kind, ranks) for kind in ("all_reduce", "reduce_scatter", "all_gather")
            for ranks in groups}


# The layouts on 4 ranks (extend the table: a row per layout). Oracle: the plain optimizer's single-process
# curve (the loss curve does not depend on the layout, the number of expert slots or rebalancing: see
# tests/multirank/test_training.py and test_eplb.py). zero: the ZeRO stage the row trains with; eplb: rebalance
# every 3 steps; traffic: also run the plain optimizer for TRAFFIC_STEPS steps and compare the counted bytes;
# save: save the run at SAVE_AT (the checkpoint checks resume from it).
def layout(name, tp=1, pp=1, ep=1, slots=None, zero=1, eplb=False, dispatcher="alltoall", traffic=False,
           save=False, sp=False):
    return dict(name=name, tp=tp, pp=pp, ep=ep, slots=slots, zero=zero, eplb=eplb, dispatcher=dispatcher,
                traffic=traffic, save=save, sp=sp)


LAYOUTS = [
    layout("dp4", traffic=True),
    layout("ep2-dp2", ep=2, traffic=True, save=True),
    layout("tp2-ep2", tp=2, ep=2, dispatcher="allgather", zero=2),     # EP 2 inside TP 2: expert-DP 2
    layout("tp2-sp-ep2", tp=2, ep=2, dispatcher="allgather", sp=True),  # sequence parallel: tagged grads over TP
    layout("pp2-dp2-ep2", pp=2, ep=2),
    layout("ep2-dp4-replicated-slots-eplb", ep=2, slots=6, zero=2, eplb=True),
]
TRAFFIC_STEPS = 2


class OddSizes(nn.Module):
    """Dense parameters whose sizes are not multiples of the group size (4): padded shards."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.linspace(-1, 1, 7))
        self.b = nn.Parameter(torch.linspace(0, 2, 15).view(3, 5))
        self.c = nn.Parameter(torch.linspace(1, -1, 18).view(2, 9))


def _odd_sizes_check(rank, state):
    """DistributedOptimizer over DP 4 on padded sizes, one bucket per parameter, vs torch's AdamW on the mean
    gradient (every rank draws every rank's gradients)."""
    model, reference = OddSizes(), OddSizes()
    opt = DistributedOptimizer(model, state, lr=0.05, weight_decay=0.1, bucket_numel=20)
    ref = torch.optim.AdamW([{"params": [reference.b, reference.c], "weight_decay": 0.1},
                             {"params": [reference.a], "weight_decay": 0.0}], lr=0.05, betas=(0.9, 0.95))
    with comms.comm_counter() as counter:
        for step in range(3):
            grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + 10 * r + i))
                      for i, p in enumerate(model.parameters())] for r in range(WORLD)]
            for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters())):
                p.grad = grads[state.dp_cp.rank][i].clone()
                q.grad = torch.stack([g[i] for g in grads]).mean(0)
            opt.reduce_gradients()
            opt.step()
            ref.step()
            opt.zero_grad()
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    shapes = {name: tuple(opt.state[p]["exp_avg"].shape) for name, p in model.named_parameters()}
    return {"err": err, "shapes": shapes, "buckets": len(opt._buckets),
            "rs_calls": counter.calls("reduce_scatter"), "ag_calls": counter.calls("all_gather")}


def _bf16_accumulation_check(state):
    """bf16 parameters over DP 4 with padded shards (each rank's fp32 ``p.main_grad`` copied into the
    reduce-scatter buffer), three micro-batches of autograd per rank, one large and two ~1e-3: this rank's
    ``main_grad`` is exactly the fp32 sum of its own bf16 micro-batch gradients (ZeRO-1 keeps it), and its
    reduced shard is the mean over ranks of those sums (every rank computes every rank's by hand)."""
    from megamoe.gradients import main_grad
    model = OddSizes().bfloat16()
    opt = DistributedOptimizer(model, state, bucket_numel=20)

    def loss(module, r, k):
        g = torch.Generator().manual_seed(10 * r + k)
        return sum(((p * p).float() * torch.randn(p.shape, generator=g) * (1.0 if k == 0 else 1e-3)).sum()
                   for p in module.parameters())

    sums = []
    for r in range(WORLD):
        reference = OddSizes().bfloat16()
        total = [torch.zeros(p.shape) for p in reference.parameters()]
        for k in range(3):
            for t, g in zip(total, torch.autograd.grad(loss(reference, r, k), list(reference.parameters()))):
                t += g.float()
        sums.append(total)
    for k in range(3):
        loss(model, state.dp_cp.rank, k).backward()
    local_exact = all(p.grad is None and torch.equal(main_grad(p), want)
                      for p, want in zip(model.parameters(), sums[state.dp_cp.rank]))
    opt.reduce_gradients()
    err = 0.0
    for i, p in enumerate(model.parameters()):
        e = opt._entries[p]
        mean = torch.stack([total[i] for total in sums]).mean(0)
        got = e.shard_of(opt._buckets[e.bucket].grad_shard)[:, :e.valid]
        err = max(err, ((got - e.owned(mean)).abs() / (mean.abs().max() + 1e-30)).max().item())
    return {"local_exact": local_exact, "err": err}


def _worker(rank, world_size, layouts, plain_checkpoint, dist_checkpoint, bf16_checkpoint):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    results = []
    for row in layouts:
        state = initialize_model_parallel(tp=row["tp"], pp=row["pp"], ep=row["ep"])
        groups = {state.dp_cp.ranks, state.edp.ranks}
        eplb = EPLBConfig(window=3, interval=3) if row["eplb"] else None

        def trainer_for(**kwargs):
            return Trainer(build_model(state, row["slots"], dispatcher=row["dispatcher"], sequence_parallel=row["sp"]), state,
                           train_config(eplb=eplb, **kwargs),
                           world_group=dist.group.WORLD)

        runs = {"sizes": {"dp_cp": state.dp_cp.size, "edp": state.edp.size,
                          "groups": [state.dp_cp.ranks, state.edp.ranks]}}
        # The plain optimizer's per-element state: Adam's two fp32 moments shaped like every local parameter.
        runs["plain_bytes"] = {"dense": 0, "expert": 0}
        for param in build_model(state, row["slots"], dispatcher=row["dispatcher"], sequence_parallel=row["sp"]).parameters():
            runs["plain_bytes"]["expert" if getattr(param, "expert_parallel", False) else "dense"] += 8 * param.numel()
        if row["traffic"]:
            with comms.comm_counter() as counter:
                train(trainer_for(), TRAFFIC_STEPS)
            runs["plain_traffic"] = traffic(counter, groups)
        for name in (f"zero{row['zero']}",):
            trainer = trainer_for(distributed_optimizer=True, zero_stage=row["zero"])
            with comms.comm_counter() as counter:
                curve = train(trainer, TRAFFIC_STEPS)
            if row["save"]:
                curve += train(trainer, SAVE_AT - TRAFFIC_STEPS)
                save_training_checkpoint(dist_checkpoint, trainer, sampler_state=None, world_group=dist.group.WORLD)
            with comms.comm_counter() as rebalancing:
                curve += train(trainer, STEPS - len(curve))
            opt = trainer.optimizer
            runs[name] = {
                "curve": curve, "bytes": state_bytes(trainer), "traffic": traffic(counter, groups),
                "moved": rebalancing.bytes("expert_slot_exchange"),
                "replicas_identical": replicas_identical(trainer.model, opt),
                "grads_kept": all(p.grad is not None for p in trainer.model.parameters()),
                "shards": len(opt.gradient_shards()),
                "padding": sum((e.cols * (state.edp.size if e.expert else state.dp_cp.size) - e.row_numel) * e.rows
                               for e in opt._entries.values())}
        results.append(runs)
        destroy_model_parallel()

    # Padded shards and several buckets (DP 4, no MoE).
    state = initialize_model_parallel()
    odd = _odd_sizes_check(rank, state)
    odd["bf16"] = _bf16_accumulation_check(state)
    # The plain DP 1 checkpoint (saved by the parent) resumes under the distributed optimizer at DP 4.
    trainer = Trainer(build_model(state), state, train_config(distributed_optimizer=True, zero_stage=2),
                      world_group=dist.group.WORLD)
    load_training_checkpoint(plain_checkpoint, trainer, world_group=dist.group.WORLD)
    from_plain = train(trainer, STEPS - SAVE_AT)
    # bf16 parameters at DP 4: fp32 masters saved as the weights, with small buckets so that every rank writes
    # some (bucket i: rank i % 4); a DP 4 resume is bit-exact, and this rank's master columns go back to the
    # parent, which resumes at DP 1.
    def bf16_trainer():
        return Trainer(build_model(state, dtype=torch.bfloat16), state,
                       train_config(distributed_optimizer=True, grad_bucket_mb=0.02), world_group=dist.group.WORLD)
    bf16, again = bf16_trainer(), bf16_trainer()
    train(bf16, 2)
    save_training_checkpoint(bf16_checkpoint, bf16, sampler_state=None, world_group=dist.group.WORLD)
    load_training_checkpoint(bf16_checkpoint, again, world_group=dist.group.WORLD)
    names = dict(bf16.model.named_parameters())
    # What a load reads of the state: the slices holding this rank's columns, against the whole tensors.
    from megamoe.checkpoint_state import chunks_by_parameter, sharded_state_dict
    from megamoe.training.checkpoint import _logical_chunks
    by_param = chunks_by_parameter(again.model.parameters(), sharded_state_dict(again.model))
    read = whole = 0
    for part in again.optimizer.logical_state_buckets():
        chunks = _logical_chunks(part, by_param)
        whole += sum(c.numel for c in chunks if c.tensor.dim())
        read += sum(c.numel for c in again.optimizer.owned_chunks(chunks, part) if c.tensor.dim())
    bf16_run = {"writers": sorted({i % 4 for i in range(bf16.optimizer.num_buckets)}), "read_fraction": read / whole,
                "exact": all(torch.equal(p, q) and bf16.optimizer.state[p].keys() == again.optimizer.state[q].keys()
                             and all(torch.equal(v, again.optimizer.state[q][k])
                                     for k, v in bf16.optimizer.state[p].items())
                             for p, q in zip(bf16.model.parameters(), again.model.parameters())),
                # (as lists: tensors returned by a rank exiting would share memory it takes with it)
                # (the fp32 router gates are their own masters: their owned columns)
                "masters": {name: (bf16.optimizer.state[p]["master"][:, :bf16.optimizer._entries[p].valid]
                                   if "master" in bf16.optimizer.state[p]
                                   else bf16.optimizer._entries[p].owned(p.detach())).tolist()
                            for name, p in names.items()}}
    destroy_model_parallel()
    return results, odd, from_plain, bf16_run


@pytest.mark.slow
def test_distributed_optimizer_matches_the_plain_one(tmp_path):
    from checkpoint_tools.inspection import inspect_checkpoint
    from megamoe.checkpoint.layout import ParallelLayout
    from checkpoint_tools.reshard import reshard
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    plain_ckpt, dist_ckpt = str(tmp_path / "plain"), str(tmp_path / "dist")
    # The oracle of the checkpoint checks: the plain optimizer at DP 1, saved at SAVE_AT.
    trainer = _single_process_trainer()
    single = train(trainer, SAVE_AT)
    save_training_checkpoint(plain_ckpt, trainer, sampler_state=None, world_group=None)
    single += train(trainer, STEPS - SAVE_AT)

    by_rank = run_on_ranks(_worker, WORLD, args=(LAYOUTS, plain_ckpt, dist_ckpt, str(tmp_path / "bf16")), timeout_s=600)
    results, odd, from_plain, _ = by_rank[0]

    assert all(norm > CLIP for _, norm in single), "the steps must be clipped, else the clipping is not tested"
    assert {row["zero"] for row in LAYOUTS} == {1, 2}
    for row, runs in zip(LAYOUTS, results):
        for name in ("zero1", "zero2"):
            if name not in runs:
                continue
            run = runs[name]
            what = f"{row['name']} {name}"
            assert math.isclose(run["curve"][0][1], single[0][1], rel_tol=NORM_REL_TOL), what
            for step, (got, want) in enumerate(zip(run["curve"], single), start=1):
                assert _close(got, want, REL_TOL), f"{what} step {step}: {got} vs {want}"
            assert run["replicas_identical"], what
            assert run["grads_kept"] == (name == "zero1"), f"{what}: ZeRO-2 frees p.grad, ZeRO-1 keeps it"
            assert run["shards"] > 0, what
            # Optimizer state: 1/N of the plain one's (+1% for padding), dense over DP x CP, experts over edp.
            for kind, size in (("dense", runs["sizes"]["dp_cp"]), ("expert", runs["sizes"]["edp"])):
                assert run["bytes"][kind] <= runs["plain_bytes"][kind] / size * 1.01, (what, kind, run["bytes"])
            if row["eplb"]:
                assert run["moved"] > 0, f"{what}: the rebalancing must move slots, else this cannot fail"
            if not row["traffic"]:
                continue
            # Traffic. The counter records a rank's INPUT bytes: an all-reduce of the gradients G bytes, a
            # reduce-scatter of the same (fp32) gradients G too, and the all-gather of the updated parameters
            # (fp32) its G / N input. So the plain path's all-reduce bytes over each group reappear exactly as
            # reduce-scatter bytes, and N x the all-gather bytes (nothing is padded in this model: checked).
            # The loss, norm and load all-reduces are the same in both runs and cancel in the differences.
            assert run["padding"] == 0, what
            plain = runs["plain_traffic"]
            for ranks in {tuple(r) for r in runs["sizes"]["groups"] if len(r) > 1}:
                reduced = plain[("all_reduce", ranks)] - run["traffic"][("all_reduce", ranks)]
                scattered = run["traffic"][("reduce_scatter", ranks)] - plain[("reduce_scatter", ranks)]
                gathered = run["traffic"][("all_gather", ranks)] - plain[("all_gather", ranks)]
                assert reduced > 0 and reduced == scattered == len(ranks) * gathered, (what, ranks, reduced,
                                                                                       scattered, gathered)

    assert odd["err"] < 1e-6, odd
    assert odd["shapes"] == {"a": (1, 2), "b": (1, 4), "c": (1, 5)}, odd      # ceil(7/4), ceil(15/4), ceil(18/4)
    assert odd["buckets"] == 3 and odd["rs_calls"] == odd["ag_calls"] == 3 * 3, odd
    assert odd["bf16"]["local_exact"] and odd["bf16"]["err"] < 1e-6, odd["bf16"]

    # Checkpoints across optimizers and DP sizes.
    saved = [row["save"] for row in LAYOUTS].index(True)
    uninterrupted = results[saved][f"zero{LAYOUTS[saved]['zero']}"]["curve"]
    for step, (got, want) in enumerate(zip(from_plain, single[SAVE_AT:]), start=SAVE_AT + 1):
        assert _close(got, want, REL_TOL), f"plain DP 1 -> distributed DP 4, step {step}: {got} vs {want}"
    info = inspect_checkpoint(dist_ckpt)
    assert info["verification"]["ok"] and info["optimizer_state"]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    # Logical tensors, the plain optimizer's: the same names and sizes as its checkpoint, whatever the sharding.
    assert info["optimizer_state"] == inspect_checkpoint(plain_ckpt)["optimizer_state"]
    resharded = str(tmp_path / "resharded")
    reshard(dist_ckpt, resharded, ParallelLayout(), progress=False)
    for source in (dist_ckpt, resharded):
        trainer = _single_process_trainer()
        load_training_checkpoint(source, trainer, world_group=None)
        resumed = train(trainer, STEPS - SAVE_AT)
        for step, (got, want) in enumerate(zip(resumed, uninterrupted[SAVE_AT:]), start=SAVE_AT + 1):
            assert _close(got, want, REL_TOL), f"distributed EP 2 x DP 2 -> plain DP 1 via {source}, step {step}"

    # bf16 at DP 4, every rank writing buckets: bit-exact at DP 4, and at DP 1 each master is the ranks' columns.
    bf16_runs = [run for *_, run in by_rank]
    assert all(run["exact"] for run in bf16_runs) and bf16_runs[0]["writers"] == [0, 1, 2, 3]
    # each rank reads about its quarter of the state (whole dim-0 slices: a little more), not all of it
    assert all(0.25 <= run["read_fraction"] < 0.4 for run in bf16_runs), [run["read_fraction"] for run in bf16_runs]
    from parallel_state import ParallelState
    single = ParallelState.single_process()
    bf16 = Trainer(build_model(single, dtype=torch.bfloat16), single, train_config(distributed_optimizer=True))
    load_training_checkpoint(tmp_path / "bf16", bf16, world_group=None)
    for name, p in bf16.model.named_parameters():
        want = torch.cat([torch.tensor(run["masters"][name]) for run in bf16_runs], dim=1)
        if p.dtype == torch.float32:                # a router's gate: the parameter is the master
            assert "master" not in bf16.optimizer.state[p] and torch.equal(p.detach().reshape(want.shape), want), name
            continue
        assert torch.equal(bf16.optimizer.state[p]["master"], want), name
        assert torch.equal(p.detach().reshape(want.shape), want.bfloat16()), name

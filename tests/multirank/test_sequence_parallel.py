"""Sequence parallelism in the model (megamoe.models.sequence_parallel): the oracle is the same layout
without it. Under TP 2 (x DP 2), logits, losses and every parameter's synchronised gradient match for GQA and MLA
models with MoE layers (both dispatchers, every layout check_moe_layout allows in a TP group of 2), a dense layer,
shared experts (with a gate), every balancing loss and packed documents; the comm counter shows the
attention / MLP / embedding / output all-reduces replaced by reduce-scatters (same bytes) and
all-gathers (1/tp of them); training loss curves over 10 steps match on 4 ranks for (tp 2, ep 2) and
(pp 2 x tp 2); bad sequence lengths, generation under sequence parallelism and bad script flags are
refused. One spawn of 4 ranks for all of it."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.models import GPTMoEModel
from megamoe.models.gpt_moe import expert_token_replicas
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.grad_sync import GradientSync
from tests.helpers.sequence_parallel import BATCH, H, SEQ, V, batch, config, gqa, mla
from megamoe.spawned_ranks import run_on_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
REL_TOL = 2e-6            # fp32: another summation order only
CURVE_REL_TOL = 1e-5      # the bound over 10 training steps


# name -> (config(sp), (ep, etp) with SP, (ep, etp) of the oracle without SP). All-to-all with EP over
# the TP ranks (etp 1) folds without SP (tests/multirank/test_moe_folding.py, oracle the single rank); here its
# oracle is etp 2.
CASES = {
    "gqa_allgather_ep2": (lambda sp: config(gqa(), "allgather", sp=sp), (2, 1), (2, 1)),
    "gqa_alltoall_ep2": (lambda sp: config(gqa(), "alltoall", sp=sp, shared=False), (2, 1), (1, 2)),
    "mla_alltoall_etp2": (lambda sp: config(mla(12), "alltoall", sp=sp), (1, 2), (1, 2)),
    "mla_allgather_ep1": (lambda sp: config(mla(None), "allgather", sp=sp, tie=True), (1, 1), (1, 1)),
}


def _run(model, state, inputs, labels, position_ids, document_ids):
    """(logits [B, S, V/tp], loss, aux, {name: synced grad})."""
    packing = {"position_ids": position_ids, "document_ids": document_ids}
    with torch.no_grad():
        logits, _ = model(inputs, **packing)
    loss, aux = model(inputs, labels=labels, **packing)
    (loss + aux).backward()
    GradientSync(model, state, tied_params=model.tied_parameters(),
                 expert_token_replicas=expert_token_replicas(model.config, state)).sync()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if not getattr(p, "expert_parallel", False)}
    return logits, loss.detach(), aux.detach(), {**grads, **_logical_expert_grads(model)}


def _logical_expert_grads(model) -> dict:
    """Every expert's full gradients (HF layout), assembled from all ranks' ETP shards, whatever the layout."""
    mine = {}
    for layer_id, layer in model.moe_layers().items():
        for local_slot, slot in enumerate(layer.local_slots):
            expert = int(layer.placement.slot_to_expert[slot])
            for kind, grad in layer.experts.expert_weight_shards(local_slot, grad=True).items():
                mine[(layer_id, expert, kind, layer.etp_rank)] = grad.clone()
    shards = {}
    for ranks_shards in comms.all_gather_object(mine, dist.group.WORLD):
        shards.update(ranks_shards)
    full = {}
    for (layer_id, expert, kind, _) in shards:
        parts = [t for (l, e, k, _), t in sorted(shards.items(), key=lambda kv: kv[0][3])
                 if (l, e, k) == (layer_id, expert, kind)]
        full[f"layers.{layer_id}.experts.{expert}.{kind}"] = torch.cat(parts, dim=1 if kind == "down" else 0)
    return full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _equivalence_worker(rank, world_size):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    out = {}
    data = batch()
    for name, (build, sp_layout, plain_layout) in CASES.items():
        results = {}
        for sp, (ep, etp) in ((False, plain_layout), (True, sp_layout)):
            state = initialize_model_parallel(tp=2, ep=ep, etp=etp)
            model = GPTMoEModel(build(sp), state)
            initialize_parameters(model, seed=0)
            results[sp] = _run(model, state, *data)
            destroy_model_parallel()
        (lo, lso, ao, go), (ls, lss, as_, gs) = results[False], results[True]
        out[name] = {"logits": _rel(ls, lo), "loss": _rel(lss, lso), "aux": _rel(as_, ao),
                     "grads": {n: _rel(gs[n], go[n]) for n in go}, "aux_value": float(ao)}

    # Communication of a dense model (attention + MLP blocks, embedding, output layer): SP off vs on.
    state = initialize_model_parallel(tp=2)
    dense = dataclasses.replace(config(gqa(), "allgather", moe_layers=()), moe=None)
    counts = {}
    for sp in (False, True):
        model = GPTMoEModel(dataclasses.replace(dense, sequence_parallel=sp), state)
        initialize_parameters(model, seed=0)
        inputs, labels, _, _ = data
        with comms.comm_counter() as counter:
            loss, _ = model(inputs, labels=labels)
            loss.backward()
        counts[sp] = {kind: (counter.calls(kind, state.tp.group), counter.bytes(kind, state.tp.group))
                      for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    out["comms"] = counts
    out["hidden_bytes"] = BATCH * SEQ * H * 4

    # Bad input: a sequence that does not split over tp; generation refused.
    model = GPTMoEModel(dataclasses.replace(dense, sequence_parallel=True), state)
    errors = []
    try:
        model(torch.zeros(1, 7, dtype=torch.long))
    except ValueError as e:
        errors.append(str(e))
    try:
        model(torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 8, dtype=torch.bool))
    except ValueError as e:
        errors.append(str(e))
    out["errors"] = errors
    destroy_model_parallel()

    # Generation's model: a copy without SP holding the same weights computes the same logits.
    state = initialize_model_parallel(tp=2, ep=2)
    model = GPTMoEModel(CASES["gqa_allgather_ep2"][0](True), state)
    initialize_parameters(model, seed=1)
    inputs = data[0]
    plain = model.without_sequence_parallel()
    with torch.no_grad():
        out["plain_copy"] = (_rel(plain(inputs)[0], model(inputs)[0]), plain.sequence_group is None,
                             model.without_sequence_parallel() is not model)
    destroy_model_parallel()
    return out


def _worker(rank, world_size):
    return {"equivalence": _equivalence_worker(rank, world_size), "training": _train_worker(rank, world_size)}


@pytest.fixture(scope="module")
def four_ranks():
    """Both checks in ONE spawn of 4 ranks (tp 2 x dp 2 for the equivalence: both DP replicas get the same
    batch, so the averaged gradients are the batch's)."""
    return run_on_ranks(_worker, 4, timeout_s=400)[0]


@pytest.mark.slow
def test_sequence_parallel_matches_plain_tp(four_ranks):
    result = four_ranks["equivalence"]
    for name in CASES:
        case = result[name]
        assert case["logits"] <= REL_TOL and case["loss"] <= REL_TOL, (name, case["logits"], case["loss"])
        assert case["aux"] <= REL_TOL and case["aux_value"] > 0, (name, case["aux"], case["aux_value"])
        bad = {n: r for n, r in case["grads"].items() if not r <= REL_TOL}
        assert not bad, (name, bad)
    off, on = result["comms"][False], result["comms"][True]
    # Off: the activation all-reduces (embedding, each block's entry grad and exit, the output layer's
    # entry grad). On: each is a reduce-scatter of the same bytes plus an all-gather of 1/tp of them ...
    replaced_bytes = off["all_reduce"][1] - on["all_reduce"][1]
    replaced_calls = off["all_reduce"][0] - on["all_reduce"][0]
    blocks = 2 * 2                                  # 2 layers x (attention, MLP)
    assert replaced_calls == 2 * blocks + 2         # forward + backward per block, embedding, output layer
    assert replaced_bytes == replaced_calls * result["hidden_bytes"]
    assert on["reduce_scatter"] == (replaced_calls, replaced_bytes)
    # ... plus one all-gather per block in backward: the block keeps only its input's chunk for the
    # weight gradients and gathers it again.
    assert on["all_gather"] == (replaced_calls + blocks, (replaced_calls + blocks) * result["hidden_bytes"] // 2)
    assert off["reduce_scatter"] == (0, 0) and off["all_gather"][0] == 0
    too_long, generation = result["errors"]
    assert "7" in too_long and "tp=2" in too_long
    assert "sequence_parallel=False" in generation
    rel, plain_has_no_sp, is_copy = result["plain_copy"]
    assert rel <= REL_TOL and plain_has_no_sp and is_copy


# ----------------------------------------------------------------------------------------------
# Training on 4 ranks
# ----------------------------------------------------------------------------------------------
STEPS, GLOBAL_BATCH, MICRO = 10, 2, 1
# One layout for both of the issue's: tp 2 + sp with ep 2, and pp 2 x tp 2 (stages send [B, S / tp, H]).
TRAIN_LAYOUTS = {"pp2_tp2_ep2": dict(tp=2, ep=2, pp=2)}


def _train_worker(rank, world_size):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    from megamoe.training.evaluation import evaluate_loss
    from megamoe.training.trainer import TrainConfig, Trainer
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (GLOBAL_BATCH, SEQ + 1), generator=g)
    out = {}
    for name, layout in TRAIN_LAYOUTS.items():
        state = initialize_model_parallel(**layout)
        per_rank = GLOBAL_BATCH // state.dp_cp.size
        mine = ids[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
        curves = {}
        for sp in (False, True):
            cfg = config(gqa(), "allgather", sp=sp)
            cfg.moe.router = dataclasses.replace(cfg.moe.router, use_expert_bias=True, expert_bias_update_rate=0.01)
            model = GPTMoEModel(cfg, state)
            initialize_parameters(model, seed=0)
            trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=dist.group.WORLD)
            curve = []
            for _ in range(STEPS):
                m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO)])
                curve.append((m.loss, m.aux_loss, m.grad_norm, [l.tokens_per_expert for l in m.moe_layers.values()]))
            # The held-out loss (forward only, through the pipeline) of the trained model, on other tokens.
            held_out = ids.roll(1, dims=1)[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
            eval_loss = evaluate_loss(model, state, [(mb[:, :-1], mb[:, 1:]) for mb in held_out.split(MICRO)],
                                      world_group=dist.group.WORLD)
            curves[sp] = (curve, eval_loss)
        out[name] = curves
        destroy_model_parallel()
    return out


@pytest.mark.slow
def test_sequence_parallel_training_curve(four_ranks):
    result = four_ranks["training"]
    tokens = GLOBAL_BATCH * SEQ * 2               # every token counted once per MoE layer, top 2
    for name in TRAIN_LAYOUTS:
        (off, eval_off), (on, eval_on) = result[name][False], result[name][True]
        assert abs(eval_on - eval_off) <= CURVE_REL_TOL * abs(eval_off), (name, eval_on, eval_off)
        for step, ((loss_off, aux_off, norm_off, loads_off), (loss_on, aux_on, norm_on, loads_on)) in enumerate(
                zip(off, on)):
            assert abs(loss_on - loss_off) <= CURVE_REL_TOL * abs(loss_off), (name, step, loss_on, loss_off)
            assert abs(aux_on - aux_off) <= CURVE_REL_TOL * abs(aux_off), (name, step, aux_on, aux_off)
            assert abs(norm_on - norm_off) <= 1e-4 * abs(norm_off), (name, step, norm_on, norm_off)
            assert loads_on == loads_off and all(sum(layer) == tokens for layer in loads_on), (name, step)

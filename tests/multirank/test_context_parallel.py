"""Context parallelism (megamoe.transformer.context_parallel): the sequence split over the CP group in
load-balanced chunks, attention over all of it by all-gathering K / V (GQA) or the compressed latents
(MLA). The oracle is the single-rank model with the same seeded weights (the 4 ranks run it on the same
batch). One spawn of 4 ranks checks, for GQA and MLA each under (cp 2, dp 2), (cp 2, tp 2) and
(cp 2, ep 2, all-to-all), and for GQA under (cp 2, tp 2, sequence parallel, ep 2, all-gather) and
(cp 2, dp 2) with packed documents, (cp 2, tp 2, etp 1, ep 2) (MoE folding), MLA under (cp 2, tp 2,
sequence parallel, all-to-all), and with recomputation (full layers under (cp 2, tp 2), MLA's up
projections under (cp 2, ep 2)): the gathered logits, the loss, the aux loss (switch, sequence and
z-loss, shared expert with its gate) and every parameter's synced gradient (experts assembled per
expert) within fp32 tolerance, that every token is routed once and the bytes the CP all-gather moves;
the 10-step training loss curve (rel <= 1e-5), the expert loads and the held-out loss of each layout
(but the plain and packed (cp 2, dp 2) ones, whose layout the *_ep2 curves share, and the folding, SP
all-to-all and recomputation ones) and of (cp 2, pp 2), MLA (cp 2, ep 2) with the distributed optimizer (ZeRO-2); the
refusal of generation and of a sequence 2 cp does not divide. Fast tests: the chunk index and bad sequence lengths."""

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.models import GPTMoEModel
from megamoe.models.sequence_parallel import stage_hidden_shape
from megamoe.sharding import get_shard_spec
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.spawned_ranks import run_on_ranks
from megamoe.transformer.context_parallel import cp_token_index
from megamoe.transformer.recompute import RecomputeConfig
from tests.helpers.synced_gradients import synced_gradients
from tests.helpers.context_parallel import BATCH, E, H, HEAD_DIM, K, KV_LORA, ROPE, SEQ, V, config

pytestmark = pytest.mark.usefixtures("one_thread")
REL_TOL = 1e-5
CURVE_REL_TOL = 1e-5

# name -> (attention kind, initialize_model_parallel kwargs, dispatcher, sequence_parallel, packed documents)
LAYOUTS = {
    "gqa_cp2_dp2": ("gqa", dict(cp=2), "alltoall", False, False),
    "gqa_cp2_tp2": ("gqa", dict(cp=2, tp=2, etp=2), "alltoall", False, False),   # ETP ranks share tokens
    "gqa_cp2_ep2": ("gqa", dict(cp=2, ep=2), "alltoall", False, False),
    "gqa_cp2_tp2_sp_ep2_allgather": ("gqa", dict(cp=2, tp=2, ep=2), "allgather", True, False),
    "gqa_cp2_dp2_packed": ("gqa", dict(cp=2), "alltoall", False, True),
    "mla_cp2_dp2": ("mla", dict(cp=2), "alltoall", False, False),
    "mla_cp2_tp2": ("mla", dict(cp=2, tp=2, etp=2), "alltoall", False, False),
    "mla_cp2_ep2": ("mla", dict(cp=2, ep=2), "alltoall", False, False),
    # The router statistics over tp x cp: MoE parallel folding (etp 1 < tp 2), and SP with all-to-all.
    "gqa_cp2_tp2_fold_etp1_ep2": ("gqa", dict(cp=2, tp=2, etp=1, ep=2), "alltoall", False, False),
    "mla_cp2_tp2_sp_alltoall": ("mla", dict(cp=2, tp=2, etp=2), "alltoall", True, False),
    # Recomputation re-runs the CP all-gather in backward: full layers (GQA), MLA's up projections.
    "gqa_cp2_tp2_recompute_full": ("gqa", dict(cp=2, tp=2, etp=2), "alltoall", False, False),
    "mla_cp2_ep2_recompute_up_proj": ("mla", dict(cp=2, ep=2), "alltoall", False, False),
}
RECOMPUTE = {"gqa_cp2_tp2_recompute_full": RecomputeConfig("full"),
             "mla_cp2_ep2_recompute_up_proj": RecomputeConfig("selective", ("mla_up_proj", "moe"))}
TRAIN_ONLY = {"gqa_cp2_pp2": ("gqa", dict(cp=2, pp=2), "alltoall", False, False)}
# Checked for logits and gradients only: (cp 2, dp 2) is also the layout of the *_ep2 curves.
NO_CURVE = ("gqa_cp2_dp2", "mla_cp2_dp2", "gqa_cp2_dp2_packed", "gqa_cp2_tp2_fold_etp1_ep2", "mla_cp2_tp2_sp_alltoall",
            *RECOMPUTE)
# Trained with the distributed optimizer (ZeRO-2: dense shards over dp x cp, experts over expert-DP).
DISTRIBUTED = ("mla_cp2_ep2",)
CURVES = {name: case for name, case in {**LAYOUTS, **TRAIN_ONLY}.items() if name not in NO_CURVE}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _packing(ids: torch.Tensor):
    """Two documents per row (split at 3 and at 5): per-document positions and document ids [B, S]."""
    batch, seq = ids.shape
    document_ids = torch.zeros(batch, seq, dtype=torch.long)
    document_ids[0, 3:] = 1
    document_ids[1, 5:] = 1
    starts = torch.tensor([3, 5])
    position_ids = torch.arange(seq).expand(batch, seq).clone()
    position_ids[document_ids == 1] -= starts[:, None].expand(batch, seq)[document_ids == 1]
    return {"position_ids": position_ids, "document_ids": document_ids}


def _gather_logits(logits: torch.Tensor, state) -> torch.Tensor:
    """This rank's [B, S / cp, V / tp] logits -> the whole sequence's [B, S, V / tp] in order."""
    cp = state.cp.size
    if cp == 1:
        return logits
    gathered = comms.all_gather_into(logits.contiguous(), state.cp.group, dim=1)
    order = torch.cat([cp_token_index(SEQ, r, cp) for r in range(cp)])
    return gathered.index_select(1, torch.argsort(order))


def _run(model, state, inputs, labels, packing):
    """(gathered logits, loss, aux, {name: synced grad}, {(layer, expert, kind): grad}, tokens counted,
    bytes all-gathered over CP in one forward)."""
    with torch.no_grad(), comms.comm_counter() as counter:
        logits = model(inputs, **packing)[0]
    cp_bytes = counter.bytes("all_gather", state.cp.ranks) if state.cp.size > 1 else 0
    logits = _gather_logits(logits, state)
    model.zero_grad(set_to_none=True)
    for layer in model.moe_layers().values():
        layer.load_counter.reset()
    loss, aux = model(inputs, labels=labels, **packing)
    (loss + aux).backward()
    grads, experts, counted = synced_gradients(model, state)
    # The mean over the CP ranks is the micro-batch's mean token loss (the model's CP loss convention).
    loss = comms.all_reduce_(loss.detach().clone(), state.cp.group) / state.cp.size
    return logits, loss, aux.detach(), grads, experts, counted, cp_bytes


def _equivalence(inputs, labels):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    oracles = {}
    out = {}
    for name, (kind, layout, dispatcher, sp, packed) in LAYOUTS.items():
        packing = _packing(inputs) if packed else {}
        key = (kind, dispatcher, packed)
        if key not in oracles:
            state = initialize_model_parallel()
            oracle_model = GPTMoEModel(config(kind, dispatcher), state)
            initialize_parameters(oracle_model, seed=0)
            oracles[key] = _run(oracle_model, state, inputs, labels, packing)
            destroy_model_parallel()
        o_logits, o_loss, o_aux, o_grads, o_experts, _, _ = oracles[key]
        state = initialize_model_parallel(**layout)
        model = GPTMoEModel(config(kind, dispatcher, sp, RECOMPUTE.get(name)), state)
        initialize_parameters(model, seed=0)
        logits, loss, aux, grads, experts, counted, cp_bytes = _run(model, state, inputs, labels, packing)
        vocab = V // state.tp.size
        expected = {n: get_shard_spec(p).slice_of(o_grads[n]) for n, p in model.named_parameters() if n in grads}
        # Each rank checks its own experts' ETP shards (gate / up: rows, down: columns) against the oracle.
        etp, etp_rank = state.etp.size, state.etp.rank
        mine = {}
        for key, grad in experts.items():
            dim = 1 if key[2] == "down" else 0
            mine[(*key, etp_rank)] = _rel(grad, o_experts[key].chunk(etp, dim=dim)[etp_rank])
        all_experts = {}
        for part in comms.all_gather_object(mine, dist.group.WORLD):
            all_experts.update(part)
        total = torch.tensor([counted], dtype=torch.int64)
        comms.all_reduce_(total, dist.group.WORLD)
        attention = model.layers["0"].self_attn
        out[name] = {
            "logits": _rel(logits, o_logits[..., state.tp.rank * vocab:(state.tp.rank + 1) * vocab]),
            "loss": _rel(loss, o_loss), "aux": _rel(aux, o_aux), "aux_value": float(o_aux),
            "grads": {n: _rel(g, expected[n]) for n, g in grads.items()},
            "experts": {str(k): r for k, r in all_experts.items()},
            "missing_experts": sorted(str(k) for k in set(o_experts) - {k[:3] for k in all_experts}),
            "loads": int(total), "dp": state.dp.size, "cp_bytes": cp_bytes,
            "kv_heads_local": getattr(attention, "num_kv_heads_local", None),
        }
        destroy_model_parallel()
    return out


STEPS = 10


def _training():
    """10 steps on one sequence: every DP rank trains on it (data-parallel replicas of a batch of one, as
    the oracle's ranks do), the CP ranks on their chunks of it. One micro-batch per step: the balancing
    losses are those of a micro-batch, so every layout's micro-batches must hold the same sequences."""
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    from megamoe.data.packing import MicroBatch
    from megamoe.training.evaluation import evaluate_loss
    from megamoe.training.trainer import TrainConfig, Trainer
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (1, SEQ + 1), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    packing = {key: value[:1] for key, value in _packing(torch.cat([inputs, inputs])).items()}
    curves = {}
    # One single-rank oracle per attention kind and data (the dispatcher is the same function on one rank).
    oracle_layouts = {f"oracle_{kind}_{p}": (kind, {}, "alltoall", False, p)
                      for kind, _, _, _, p in CURVES.values()}
    for name, (kind, layout, dispatcher, sp, packed) in {**oracle_layouts, **CURVES}.items():
        state = initialize_model_parallel(**layout)
        model = GPTMoEModel(config(kind, dispatcher, sp), state)
        initialize_parameters(model, seed=0)
        zero = dict(distributed_optimizer=True, zero_stage=2) if name in DISTRIBUTED else {}
        trainer = Trainer(model, state, TrainConfig(lr=1e-2, **zero), world_group=dist.group.WORLD)
        batches = [MicroBatch(inputs, labels, *((packing["position_ids"], packing["document_ids"]) if packed else ()))]
        held_out = evaluate_loss(model, state, batches, world_group=dist.group.WORLD)   # the initial weights
        curve = []
        for _ in range(STEPS):
            m = trainer.train_step(batches)
            # Each DP replica counted the sequence's tokens once.
            curve.append((m.loss, m.aux_loss, [[n // state.dp.size for n in l.tokens_per_expert]
                                               for l in m.moe_layers.values()]))
        curves[name] = {"curve": curve, "eval": held_out,
                        "hidden_shape": list(stage_hidden_shape(model, state, 1, SEQ))}
        destroy_model_parallel()
    return curves


def _refusals():
    """Generation (a KV cache) under CP is refused, naming what to do."""
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    from megamoe.inference.generation import GenerationConfig, generate
    state = initialize_model_parallel(cp=2)
    model = GPTMoEModel(config("gqa"), state)
    model.eval()
    try:
        generate(model, state, [[1, 2, 3]], GenerationConfig(max_new_tokens=2))
        error = None
    except ValueError as e:
        error = str(e)
    try:
        model(torch.zeros(1, 6, dtype=torch.long))
        length_error = None
    except ValueError as e:
        length_error = str(e)
    destroy_model_parallel()
    return {"generate": error, "length": length_error}


def _worker(rank, world_size):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
    return {"equivalence": _equivalence(ids[:, :-1], ids[:, 1:]), "training": _training(), "refusals": _refusals()}


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(_worker, 4, timeout_s=400)[0]


@pytest.mark.slow
def test_context_parallel_matches_single_rank(four_ranks):
    result = four_ranks["equivalence"]
    for name, (kind, layout, _, _, _) in LAYOUTS.items():
        case = result[name]
        assert case["logits"] <= REL_TOL and case["loss"] <= REL_TOL, (name, case["logits"], case["loss"])
        assert case["aux"] <= REL_TOL and case["aux_value"] > 0, (name, case["aux"], case["aux_value"])
        bad = {n: r for n, r in {**case["grads"], **case["experts"]}.items() if not r <= REL_TOL}
        assert not bad and not case["missing_experts"], (name, bad, case["missing_experts"])
        # 1 MoE layer x E experts x (gate, up, down) x ETP shards
        assert len(case["experts"]) == E * 3 * layout.get("etp", 1), (name, len(case["experts"]))
        assert case["loads"] == case["dp"] * BATCH * SEQ * K, (name, case["loads"])   # each token routed once
        # One all-gather per layer (2 layers) of this rank's S / cp tokens: GQA's local KV heads' k and v,
        # MLA's latent + rotated rope key (far fewer bytes).
        local = BATCH * SEQ // 2 * 4
        per_token = 2 * case["kv_heads_local"] * HEAD_DIM if kind == "gqa" else KV_LORA + ROPE
        assert case["cp_bytes"] == 2 * local * per_token, (name, case["cp_bytes"])


@pytest.mark.slow
def test_context_parallel_training_curve(four_ranks):
    curves = four_ranks["training"]
    for name, (kind, layout, dispatcher, _, packed) in CURVES.items():
        oracle = curves[f"oracle_{kind}_{packed}"]
        assert curves[name]["hidden_shape"] == [1, SEQ // 2 // (2 if "sp" in name else 1), H], name
        for step, ((loss, aux, loads), (o_loss, o_aux, o_loads)) in enumerate(zip(curves[name]["curve"],
                                                                                    oracle["curve"])):
            assert abs(loss - o_loss) <= CURVE_REL_TOL * abs(o_loss), (name, step, loss, o_loss)
            assert abs(aux - o_aux) <= CURVE_REL_TOL * abs(o_aux), (name, step, aux, o_aux)
            assert loads == o_loads and all(sum(l) == SEQ * K for l in loads), (name, step)
        assert abs(curves[name]["eval"] - oracle["eval"]) <= CURVE_REL_TOL * abs(oracle["eval"]), name


@pytest.mark.slow
def test_context_parallel_refuses_generation_and_bad_lengths(four_ranks):
    result = four_ranks["refusals"]
    assert result["generate"] is not None and "cp=1" in result["generate"], result
    assert result["length"] is not None and "seq_len=6" in result["length"] and "cp=2" in result["length"], result

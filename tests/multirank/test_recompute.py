"""Activation recomputation (megamoe.transformer.recompute).

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_recompute.py."""

import pytest
import torch

from megamoe import comms
from megamoe.host_values import count_host_reads
from megamoe.spawned_ranks import run_on_ranks
from megamoe.transformer.recompute import RecomputeConfig
from tests.helpers.recompute import NONE, build, model_config, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 2 ranks: recomputed regions re-issue their forward collectives in backward, once --------------------
SETUPS = [(dict(ep=2), dict(dispatcher="alltoall")), (dict(ep=2), dict(dispatcher="allgather", input_sharded=True)),
          (dict(tp=2, ep=2, etp=1), dict(dispatcher="allgather"))]       # EP inside TP: attention and MLPs talk too
COUNTED = [NONE, RecomputeConfig("full"), RecomputeConfig("selective", ("moe",)),
           RecomputeConfig("selective", ("core_attn", "mla_up_proj", "moe_act", "mlp", "layernorm"))]


class _ForwardCounts:
    """Collectives issued inside the forwards of ``modules``, summed: (calls per kind, bytes)."""

    def __init__(self, modules):
        self.kinds, self.bytes, self._open = {}, 0, []
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, module, args):
        context = comms.comm_counter()
        self._open.append((context, context.__enter__()))

    def _exit(self, module, args, output):
        context, counter = self._open.pop()
        context.__exit__(None, None, None)
        for kind, calls in counter.kinds().items():
            self.kinds[kind] = self.kinds.get(kind, 0) + calls
        self.bytes += counter.bytes()


class _CountExchanges:
    """The dispatchers' count exchanges (split sizes, rows per slot) while ``counting``: (calls per kind, bytes).
    A recomputation replays the forward's counts instead of exchanging them again."""

    def __init__(self, monkeypatch):
        from megamoe.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher
        self.kinds, self.bytes, self.counting = {}, 0, False
        for cls in (AllGatherDispatcher, AllToAllDispatcher):
            monkeypatch.setattr(cls, "_exchange_counts", self._counted(cls._exchange_counts))

    def _counted(self, exchange):
        def counted(dispatcher, *args):
            with comms.comm_counter() as counter:
                result = exchange(dispatcher, *args)
            if self.counting:
                for kind, calls in counter.kinds().items():
                    self.kinds[kind] = self.kinds.get(kind, 0) + calls
                self.bytes += counter.bytes()
            return result
        return counted


def _comm_worker(rank, world_size):
    from megamoe.moe.moe_layer import MoELayer
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    monkeypatch = pytest.MonkeyPatch()
    for sizes, layout in SETUPS:
        state = initialize_model_parallel(**sizes)
        per_mode, regions = [], None
        exchanges = _CountExchanges(monkeypatch)
        for mode in COUNTED:
            model = build(model_config("mla", mode, **layout), state)
            if mode == NONE:        # what each kind of region issues in its forward
                layers = list(model.layers.values())
                regions = {"full": _ForwardCounts(layers),
                           "moe": _ForwardCounts([l.mlp for l in layers if isinstance(l.mlp, MoELayer)]),
                           "mlp": _ForwardCounts([l.mlp for l in layers if not isinstance(l.mlp, MoELayer)])}
            inputs = tokens(seed=state.dp.rank)
            exchanges.counting = mode == NONE
            with comms.comm_counter() as forward, count_host_reads() as forward_reads:
                loss, aux = model(inputs, labels=inputs)
            with comms.comm_counter() as backward, count_host_reads() as backward_reads:
                (loss + aux).backward()
            grads = [p.grad for p in model.parameters()]
            reference = grads if not per_mode else reference
            same_grads = all(torch.equal(g, r) for g, r in zip(grads, reference))
            per_mode.append((forward.kinds(), backward.kinds(), forward.bytes(), backward.bytes(), loss.item(),
                             same_grads, len(forward_reads), len(backward_reads)))
        results.append((per_mode, {name: (r.kinds, r.bytes) for name, r in regions.items()},
                        (exchanges.kinds, exchanges.bytes)))
        destroy_model_parallel()
        monkeypatch.undo()
    return results


@pytest.mark.slow
def test_recomputed_regions_reissue_their_forward_collectives_once_in_backward():
    for rank_results in run_on_ranks(_comm_worker, 2, timeout_s=300):
        for (sizes, layout), (per_mode, regions, exchanges) in zip(SETUPS, rank_results):
            fwd, bwd, fwd_bytes, bwd_bytes, loss, _, fwd_reads, bwd_reads = per_mode[0]
            assert regions["moe"][0], (sizes, layout, regions)                 # the MoE dispatch does talk
            # One host read per MoE layer forward (2 layers), none in backward.
            assert (fwd_reads, bwd_reads) == (2, 0), (sizes, layout, fwd_reads, bwd_reads)
            for mode, (f, b, fb, bb, l, same_grads, f_reads, b_reads) in zip(COUNTED[1:], per_mode[1:]):
                assert f == fwd and fb == fwd_bytes, (sizes, layout, mode)     # the forward is the same
                assert l == loss and same_grads, (sizes, layout, mode)         # and so are the results
                # A recomputed MoE layer reuses its forward's host read: none in backward.
                assert (f_reads, b_reads) == (2, 0), (sizes, layout, mode, f_reads, b_reads)
                if mode.full:
                    reissued = [regions["full"]]
                else:
                    reissued = [regions[m] for m in ("moe", "mlp") if mode.recomputes(m)]
                # ... and its count exchange.
                skipped = [exchanges] if mode.full or mode.recomputes("moe") else []
                want = dict(bwd)
                for sign, counted in ((1, reissued), (-1, skipped)):
                    for kinds, _ in counted:
                        for kind, calls in kinds.items():
                            want[kind] = want.get(kind, 0) + sign * calls
                want = {kind: calls for kind, calls in want.items() if calls}
                assert b == want, (sizes, layout, mode, b, want)
                assert bb == bwd_bytes + sum(n for _, n in reissued) - sum(n for _, n in skipped), (sizes, layout, mode)

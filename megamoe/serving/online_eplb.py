"""Online expert rebalancing (EPLB) while the engine serves: between two engine steps, with the KV cache untouched.

Every MoE layer counts the (token, expert) pairs its router picks (``load_counter``, cumulative). After each
engine step (one without work too: every rank counts the same steps, whatever it computed),
:meth:`ServingRebalancer.after_step` records the step's counts into the load window, and every
``EngineConfig.eplb_interval`` steps it runs one round of the trainer's rebalancer
(:class:`~megamoe.moe.placement.eplb.ExpertRebalancer`) over the window of those steps: the counts are reduced
over every rank (each token counted once: TP rank 0, and the data-parallel ranks only under data-parallel
attention, as ``generate(eplb=...)``), every rank plans the same placement (a deterministic function of the
reduced load and the current placement, checked by a digest before anything moves), and the changed slots
receive their new experts' weights (:func:`~megamoe.moe.placement.expert_migration.migrate_layer`; replicas of
hot experts where the layer has more slots than experts). The round logs each rebalance (layers, slots moved,
balancedness before -> after); ``reports`` keeps them.

Every rank runs the same engine steps (rank 0's schedule, :mod:`megamoe.serving.step_broadcast`), so every
rank reaches a round after the same step. The KV cache holds attention entries only, which no placement
changes; a placement never changes the function the model computes (replicas are one expert), so every
request's tokens are those of the engine without rebalancing. The engine's ``metrics().expert_balancedness``
reads each layer's current placement, so it shows the new one from the round on.
"""

from __future__ import annotations

import torch

from megamoe.moe.placement.eplb import EPLBConfig, EPLBReport, ExpertRebalancer

__all__ = ["ServingRebalancer"]


class ServingRebalancer:
    """Rebalances ``model``'s experts every ``interval`` engine steps from the load of those steps (see the
    module docstring). Collective: every rank of the layout calls :meth:`after_step` after the same steps."""

    def __init__(self, model, state, interval: int, data_parallel_attention: bool):
        self.rebalancer = ExpertRebalancer(
            model, state, EPLBConfig(window=interval, interval=interval),
            world_group=torch.distributed.group.WORLD if state.world_size > 1 else None,
            counts_tokens=state.tp.rank == 0 and (data_parallel_attention or state.dp.rank == 0),
            cumulative_counters=True)
        self.steps = 0                      # engine steps so far

    @property
    def reports(self) -> list[EPLBReport]:
        """Every round so far, oldest first."""
        return self.rebalancer.reports

    def after_step(self) -> EPLBReport | None:
        """Record the step's expert loads; the round's report when one was due (collective then)."""
        self.steps += 1
        self.rebalancer.record()
        if not self.rebalancer.due(self.steps):
            return None
        return self.rebalancer.rebalance(self.steps)

"""Expert-parallel mixture of experts: router, expert slots, dispatchers, grouped experts, the layer."""

from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.moe_layer import MoEConfig, MoELayer
from megamoe.moe.placement.eplb import EPLBConfig, EPLBReport, ExpertRebalancer
from megamoe.moe.placement.expert_slots import ExpertLoadCounter, ExpertPlacement, load_expert_load, save_expert_load
from megamoe.moe.placement.replacement import PlacementUpdate, replace_experts
from megamoe.moe.router import Router, RouterConfig, RouterOutput
from megamoe.moe.shared_experts import SharedExperts, SharedExpertsConfig
from megamoe.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher, TokenDispatcher

__all__ = [
    "ExpertLoadCounter", "ExpertPlacement", "load_expert_load", "save_expert_load", "ExpertsConfig", "GroupedExperts",
    "MoEConfig", "MoELayer", "PlacementUpdate", "replace_experts", "EPLBConfig", "EPLBReport", "ExpertRebalancer",
    "Router", "RouterConfig", "RouterOutput", "SharedExperts", "SharedExpertsConfig",
    "AllGatherDispatcher", "AllToAllDispatcher", "TokenDispatcher",
]

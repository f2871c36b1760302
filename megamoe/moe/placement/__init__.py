"""Where the experts live: expert slots and placements, the expert-load counters and files, the placement policy,
EPLB rebalancing, replacement and migration of expert weights between ranks. Below the MoE layer
(:mod:`megamoe.moe`), which holds a placement; they import nothing of the layer or of the expert backends."""

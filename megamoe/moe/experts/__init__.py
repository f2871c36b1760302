"""The routed experts' backends: the grouped-GEMM MLP and its per-expert loop reference, their activations, and
the FP8 and block-FP8 recipes with the kernel probes that pick them. Below the MoE layer (:mod:`megamoe.moe`),
which builds them; they import nothing of the layer or of expert placement."""

"""Pipeline parallelism: which layers each stage holds, stage-to-stage transfers, and schedules."""

from megamoe.pipeline.p2p import StageP2P
from megamoe.pipeline.partition import partition_layers
from megamoe.pipeline.schedule import (ForwardStep, forward_backward, forward_backward_1f1b,
                                       forward_backward_no_pipelining, forward_only)
from megamoe.pipeline.interleaved import (check_interleaved_layout, forward_backward_interleaved,
                                          forward_only_interleaved)
from megamoe.pipeline.stage_dtype import stage_hidden_dtype
from megamoe.pipeline.schedule_simulation import (PipelineOp, PipelineSimulation, TimedOp, describe_pipeline_schedule,
                                                  interleaved_1f1b_order, one_f_one_b_order, simulate_pipeline)

__all__ = [
    "ForwardStep", "PipelineOp", "describe_pipeline_schedule", "check_interleaved_layout", "forward_backward_interleaved",
    "forward_only_interleaved", "PipelineSimulation", "StageP2P", "TimedOp", "forward_backward",
    "forward_backward_1f1b", "forward_backward_no_pipelining", "forward_only", "interleaved_1f1b_order", "one_f_one_b_order",
    "partition_layers", "simulate_pipeline", "stage_hidden_dtype",
]

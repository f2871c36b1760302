"""Pipeline parallelism: which layers each stage holds, stage-to-stage transfers, and schedules."""

from megamoe.pipeline.p2p import StageP2P
from megamoe.pipeline.partition import partition_layers
from megamoe.pipeline.schedule import (ForwardStep, forward_backward, forward_backward_1f1b,
                                       forward_backward_no_pipelining)

__all__ = [
    "ForwardStep", "StageP2P", "forward_backward", "forward_backward_1f1b", "forward_backward_no_pipelining",
    "partition_layers",
]

"""Training: the step (pipeline schedule, gradient sync, clipping, optimizer) and checkpoints."""

from megamoe.training.grad_sync import GradientSync, clip_grad_norm_, global_grad_norm
from megamoe.training.trainable_model import TrainableModel, check_trainable_model
from megamoe.training.trainer import StepMetrics, TrainConfig, Trainer, build_optimizer

__all__ = ["GradientSync", "clip_grad_norm_", "global_grad_norm", "StepMetrics", "TrainConfig", "Trainer",
           "TrainableModel", "build_optimizer", "check_trainable_model"]

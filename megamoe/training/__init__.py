"""Training: the step (pipeline schedule, gradient sync, clipping, optimizer) and checkpoints."""

from megamoe.training.distributed_optimizer import DistributedOptimizer
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.grad_sync import GradientSync, clip_grad_norm_, global_grad_norm
from megamoe.training.loss_scaling import DynamicLossScaler, LossScaleConfig
from megamoe.training.lr_schedule import LRScheduleConfig
from megamoe.training.non_finite import NonFiniteTrainingError
from megamoe.training.trainable_model import TrainableModel, check_trainable_model
from megamoe.training.trainer import StepMetrics, TrainConfig, Trainer, build_optimizer

__all__ = ["DistributedOptimizer",
           "evaluate_loss", "GradientSync", "clip_grad_norm_", "global_grad_norm", "DynamicLossScaler", "LossScaleConfig",
           "LRScheduleConfig", "NonFiniteTrainingError", "StepMetrics", "TrainConfig", "Trainer",
           "TrainableModel", "build_optimizer", "check_trainable_model"]

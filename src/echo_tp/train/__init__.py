"""`echo-tp train`: TP pretraining with Echo in forward and backward (loop.py), seeded token
batches (data.py), CSV + PNG loss log (log.py)."""
from .data import TokenBatches, eval_batches
from .log import LossLog, plot_losses
from .loop import TrainOptions, build_optimizer, lr_at, main

__all__ = ["TrainOptions", "main", "lr_at", "build_optimizer", "TokenBatches", "eval_batches",
           "LossLog", "plot_losses"]

"""`echo-tp train`: TP pretraining with Echo in forward and backward (loop.py), the model per
mode and its checkpoints (model.py), seeded token batches, BOS-started document packing
(data.py), CSV + PNG loss log (log.py)."""
from .data import IGNORE, TokenBatches, eval_batches, pack_documents
from .log import LossLog, TelemetryLog, plot_losses
from .loop import (Stepper, TrainOptions, build_optimizer, lr_at, main, prepare_forward,
                   train_step)

__all__ = ["TrainOptions", "main", "lr_at", "build_optimizer", "TokenBatches", "eval_batches",
           "pack_documents", "IGNORE",
           "LossLog", "TelemetryLog", "plot_losses", "prepare_forward", "train_step", "Stepper"]

"""Training, evaluation and reporting of experiments on nested signals.

:mod:`~hsa_graph.experiments.train` trains any classifier of batches of trees (one
process or many under ``torchrun``) with checkpoints;
:mod:`~hsa_graph.experiments.report` writes results as JSON, a Markdown table and
plots. The experiment modules (``sentiment``, ``multimodal``) are imported on demand
(``from hsa_graph.experiments import sentiment``) since they need more packages.
"""
from .train import (
    TrainConfig,
    evaluate,
    fit,
    init_distributed,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "TrainConfig",
    "evaluate",
    "fit",
    "init_distributed",
    "load_checkpoint",
    "save_checkpoint",
]

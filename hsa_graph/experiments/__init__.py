"""Training, evaluation and reporting of experiments on nested signals.

:mod:`~hsa_graph.experiments.train` trains any classifier of batches of trees (one
process or many under ``torchrun``) with checkpoints;
:mod:`~hsa_graph.experiments.report` writes results as JSON, a Markdown table and
plots. :mod:`~hsa_graph.experiments.listops` (``hsa-graph listops``) needs nothing
beyond the core, so its models, settings and entry points are exported here:
:func:`run_listops`, :class:`ListOpsConfig`, :class:`ListOpsClassifier`, ...; its
command-line hooks (``run``, ``add_arguments``) and its tables and helpers
(``VARIANTS``, ``QUICK``, ``build_model``, ``build_examples``) stay under
:mod:`~hsa_graph.experiments.listops`, since the other experiment modules have a
``run``, an ``add_arguments`` and ``VARIANTS`` of their own. Those modules
(``sentiment``, ``multimodal``) are imported on demand
(``from hsa_graph.experiments import sentiment``) since they need more packages.
"""
from .listops import (
    HTransformerClassifier,
    ListOpsClassifier,
    ListOpsConfig,
    estimate_epoch_seconds,
    evaluate_checkpoint,
    run_listops,
)
from .train import (
    ClassifierOutput,
    TrainConfig,
    evaluate,
    fit,
    init_distributed,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "ClassifierOutput",
    "HTransformerClassifier",
    "ListOpsClassifier",
    "ListOpsConfig",
    "TrainConfig",
    "estimate_epoch_seconds",
    "evaluate",
    "evaluate_checkpoint",
    "fit",
    "init_distributed",
    "load_checkpoint",
    "run_listops",
    "save_checkpoint",
]

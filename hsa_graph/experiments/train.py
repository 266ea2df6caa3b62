r"""Training and evaluation of graph-level classifiers on nested signals.

:func:`fit` trains any ``model(batch) -> logits [num_graphs, C]`` on a sequence of
:class:`~hsa_graph.NestedSignal` (or any PyG ``Data``) objects that carry a graph-level
label ``y`` (shape ``[1]``, ``long``), selects the epoch with the best validation
metric and leaves the model holding those weights. :func:`evaluate` computes accuracy,
macro F1 and the mean loss of a model on a dataset. The same code runs on one process
and under ``torchrun``:

.. code-block:: bash

    torchrun --nproc_per_node 2 my_script.py     # my_script.py calls fit(...)

**One process and many give the same model.** Each epoch draws one permutation of
the training set (:class:`~torch.utils.data.DistributedSampler`, seeded by
``config.seed + epoch`` on every rank) and cuts it into global batches of
``config.batch_size`` samples; with ``W`` processes every global batch is split into
``W`` per-rank batches of ``batch_size / W`` samples (so ``batch_size`` must be a
multiple of ``W``). The sampler pads the permutation with repeated samples to a
multiple of ``W``; those repeats get weight 0. The loss of a step is

.. math::
    \mathcal{L} = \frac{1}{|B|} \sum_{i \in B} \ell(f(x_i), y_i),

the mean over the *real* samples of the global batch ``B``: each rank sums its
weighted per-sample losses, divides by ``|B|`` and multiplies by ``W`` (because
:class:`~torch.nn.parallel.DistributedDataParallel` averages gradients over ranks).
So the gradient, and hence every update, equals that of one process with the same
global batch, including the shorter last batch of an epoch (no sample is dropped:
``drop_last`` is never used). The equality is exact up to floating-point summation
order; dropout masks differ (each rank seeds its own generator with
``config.seed + rank``).

Validation and :func:`evaluate` shard the data over the ranks and all-reduce a
confusion matrix and the loss sum, so every rank gets the metrics of the whole set.

**Checkpoints** (``config.checkpoint_dir``): ``last.pt`` after every epoch (model,
optimizer, epoch, history, best weights so far, random-number generator states of
every rank) and ``best.pt`` whenever the validation metric improves (model weights and
their metrics). Only rank 0 writes; files are written to a temporary name and renamed,
so an interrupted write never leaves a half-written ``last.pt``, and each has a
``.sha256`` file next to it that :func:`load_checkpoint` checks. Checkpoints hold only
plain state dicts, tensors, numbers and strings and are read with
``torch.load(..., weights_only=True)``; ``config.resume`` continues from ``last.pt``
and ends with the same weights as an uninterrupted run.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from torch.utils.data import DataLoader, DistributedSampler
from torch_geometric.data import Batch

from .._hashing import file_sha256

__all__ = [
    "CHECKPOINT_FORMAT",
    "LR_SCHEDULES",
    "SELECT_METRICS",
    "ClassifierOutput",
    "TrainConfig",
    "evaluate",
    "fit",
    "init_distributed",
    "load_checkpoint",
    "save_checkpoint",
]

#: Written into every checkpoint; :func:`load_checkpoint` refuses other files.
CHECKPOINT_FORMAT = "hsa_graph.train/1"

#: The values of :attr:`TrainConfig.lr_schedule`.
LR_SCHEDULES = ("constant", "cosine")

#: ``select_metric`` -> (history key, key of :func:`evaluate`, larger is better).
SELECT_METRICS: Dict[str, Tuple[str, str, bool]] = {
    "accuracy": ("val_accuracy", "accuracy", True),
    "macro_f1": ("val_f1", "macro_f1", True),
    "f1": ("val_f1", "macro_f1", True),
    "loss": ("val_loss", "loss", False),
}

# Settings that define the run: resuming with other values would not continue it.
_RUN_DEFINING = ("seed", "batch_size", "select_metric")


@dataclass
class TrainConfig:
    """Settings of :func:`fit`.

    Args:
        epochs: number of passes over the training set.
        batch_size: the **global** batch size (split evenly over the processes under
            ``torchrun``; must be a multiple of the number of processes).
        lr: learning rate of :class:`torch.optim.AdamW` (the peak rate of a schedule).
        weight_decay: weight decay of AdamW.
        lr_schedule: how the rate moves over the run's optimizer steps
            (:meth:`lr_at`): ``"constant"`` (``lr`` throughout) or ``"cosine"`` (a half
            cosine from ``lr`` after the warm-up down to ``min_lr`` at the last step of
            epoch ``epochs``).
        min_lr: the rate ``"cosine"`` ends at (``0 <= min_lr <= lr``).
        warmup_steps: the first ``warmup_steps`` steps raise the rate linearly to
            ``lr`` (step ``s`` uses ``lr * (s + 1) / warmup_steps``), for any
            schedule. The rate is a function of the step and of ``epochs`` alone, so a
            resumed run follows the same rates as an uninterrupted one (resuming with
            a larger ``epochs`` stretches what is left of a cosine).
        seed: seeds the shuffling (the same on every rank) and the torch random
            generator of rank ``r`` (``seed + r``, for dropout). The model is
            initialised by the caller: seed before building it.
        device: ``"cpu"``, ``"cuda"`` (under ``torchrun``: ``cuda:LOCAL_RANK``) or
            ``"cuda:i"``.
        grad_clip: clip the gradient norm to this value (``None``: no clipping).
        checkpoint_dir: write ``last.pt`` every epoch and ``best.pt`` on the best
            validation metric here (``None``: no checkpoints).
        resume: continue from ``checkpoint_dir/last.pt`` (model, optimizer, epoch,
            random states, history); ``epochs`` may be larger than in the run that
            wrote it.
        select_metric: validation metric that picks the best epoch: ``"accuracy"``,
            ``"macro_f1"`` (alias ``"f1"``) or ``"loss"`` (smaller is better). The
            first epoch that reaches the best value wins.
        progress: show tqdm progress bars (epochs and batches; rank 0 only).
        log_epochs: print one line per epoch to stdout (training loss, validation
            accuracy, seconds; rank 0 only): what a long run without progress bars
            shows in its log.
        eval_batch_size: batch size of validation (``None``: ``batch_size``).
        find_unused_parameters: passed to
            :class:`~torch.nn.parallel.DistributedDataParallel`; ``True`` lets a model
            leave some parameters unused in a step (e.g. position encoders of
            geometries a batch lacks), at a small cost per step.
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    warmup_steps: int = 0
    seed: int = 0
    device: str = "cpu"
    grad_clip: Optional[float] = None
    checkpoint_dir: Optional[Union[str, os.PathLike]] = None
    resume: bool = False
    select_metric: str = "accuracy"
    progress: bool = False
    log_epochs: bool = False
    eval_batch_size: Optional[int] = None
    find_unused_parameters: bool = True

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad setting."""
        for name in ("epochs", "batch_size", "seed", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"TrainConfig.{name} must be an int, got {value!r}")
        for name in ("epochs", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"TrainConfig.batch_size must be >= 1, got {self.batch_size}")
        if self.eval_batch_size is not None and (
                not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1):
            raise ValueError(f"TrainConfig.eval_batch_size must be a positive int or None, "
                             f"got {self.eval_batch_size!r}")
        for name in ("lr", "weight_decay", "min_lr"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"TrainConfig.{name} must be a finite number >= 0, "
                                 f"got {value!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.lr_schedule must be one of {LR_SCHEDULES}, got "
                             f"{self.lr_schedule!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"TrainConfig.min_lr ({self.min_lr}) must not exceed lr "
                             f"({self.lr})")
        if self.grad_clip is not None and (not isinstance(self.grad_clip, (int, float))
                                           or not self.grad_clip > 0):
            raise ValueError(f"TrainConfig.grad_clip must be a positive number or None, got "
                             f"{self.grad_clip!r}")
        if self.select_metric not in SELECT_METRICS:
            raise ValueError(f"TrainConfig.select_metric must be one of "
                             f"{tuple(SELECT_METRICS)}, got {self.select_metric!r}")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("TrainConfig.resume=True needs a checkpoint_dir")
        _device(self.device)

    def lr_at(self, step: int, total_steps: int) -> float:
        r"""The learning rate of optimizer step ``step`` (0-based) of a run of
        ``total_steps`` steps. With :math:`w` warm-up steps, :math:`T` steps in all,
        peak :math:`\eta` and floor :math:`\eta_{min}`:

        .. math::
            \eta_s = \eta \frac{s + 1}{w} \quad (s < w), \qquad
            \eta_s = \eta_{min} + \frac{\eta - \eta_{min}}{2}
            \Big(1 + \cos \frac{\pi (s - w)}{\max(T - w - 1, 1)}\Big)
            \quad (\text{cosine}, s \ge w),

        and :math:`\eta` for ``"constant"`` after the warm-up.

        Example:
            >>> c = TrainConfig(lr=1e-3, lr_schedule="cosine", min_lr=1e-4, warmup_steps=2)
            >>> [round(c.lr_at(s, 7), 6) for s in range(7)]
            [0.0005, 0.001, 0.001, 0.000868, 0.00055, 0.000232, 0.0001]
        """
        for name, value in (("step", step), ("total_steps", total_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"lr_at: {name} must be an int >= 0, got {value!r}")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = max(total_steps - self.warmup_steps - 1, 1)
        progress = min(step - self.warmup_steps, span) / span
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def to_dict(self) -> Dict[str, Any]:
        """The settings as plain numbers and strings (for JSON and checkpoints)."""
        out = dataclasses.asdict(self)
        if out["checkpoint_dir"] is not None:
            out["checkpoint_dir"] = str(out["checkpoint_dir"])
        return out


# ------------------------------------------------------------------ distributed
def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> Tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)


def init_distributed(device: str = "cpu", backend: Optional[str] = None) -> Tuple[int, int]:
    """Join the process group that ``torchrun`` describes; return ``(rank, world_size)``.

    Does nothing (and returns the current group's values) if :mod:`torch.distributed`
    is already initialised, and returns ``(0, 1)`` when the environment variables
    ``RANK`` and ``WORLD_SIZE`` are not set (a plain single-process run). The backend
    is ``nccl`` for a CUDA ``device``, ``gloo`` otherwise, unless ``backend`` is given.
    :func:`fit` calls this itself.

    Example:
        >>> init_distributed()      # no torchrun here
        (0, 1)
    """
    if _dist_on():
        return _rank_world()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    if not dist.is_available():
        raise RuntimeError("RANK/WORLD_SIZE are set but torch.distributed is unavailable "
                           "in this PyTorch build")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"RANK/WORLD_SIZE are set but {name} is not: launch with "
                             f"torchrun, or set {name} too")
    if backend is None:
        backend = "nccl" if _device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend)
    return _rank_world()


def _device(device: Union[str, torch.device]) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"TrainConfig.device: not a device: {device!r}") from error
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device is {device!r} but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"TrainConfig.device must be 'cpu' or 'cuda', got {device!r}")
    return dev


def _rank_device(device: str) -> torch.device:
    dev = _device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return dev


def _all_reduce(tensor: Tensor, op=None) -> Tensor:
    if _dist_on():
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM)
    return tensor


# ------------------------------------------------------------------ data
def _check_dataset(data: Any, name: str) -> None:
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise TypeError(f"{name} must be a sequence (list or torch Dataset) of PyG Data "
                        f"objects, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{name} is empty")


class _Shard:
    """The rank's part of one pass over a dataset: batches plus, per sample, its
    slot in the (padded) global order, so padding repeats can be weighted out (without
    shuffling, a sample's slot is its index in the dataset)."""

    def __init__(self, data: Sequence, batch_size: int, collate: Callable, *, shuffle: bool,
                 seed: int, epoch: int = 0):
        rank, world = _rank_world()
        self.n, self.rank, self.world = len(data), rank, world
        sampler = DistributedSampler(range(self.n), num_replicas=world, rank=rank,
                                     shuffle=shuffle, seed=seed, drop_last=False)
        sampler.set_epoch(epoch)
        self.per_rank = batch_size // world
        self.loader = DataLoader(data, batch_size=self.per_rank, sampler=sampler,
                                 collate_fn=collate)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for step, batch in enumerate(self.loader):
            # rank r holds entries r, r + W, r + 2W, ... of the padded permutation;
            # entries from n on are the sampler's padding
            local = torch.arange(step * self.per_rank, step * self.per_rank + batch.num_graphs)
            slot = self.rank + self.world * local
            weight = (slot < self.n).to(torch.get_default_dtype())
            # real samples in this global batch (batch_size = per_rank * world)
            start = step * self.per_rank * self.world
            real = min(self.per_rank * self.world, self.n - start)
            yield batch, weight, real, slot


def _to(batch: Any, device: torch.device) -> Any:
    # Data.to walks every attribute (token lists included) even when nothing moves
    return batch if device.type == "cpu" else batch.to(device)


def _labels(batch: Any, num_graphs: int) -> Tensor:
    y = getattr(batch, "y", None)
    if not isinstance(y, Tensor):
        raise ValueError("every example needs a graph-level label y (a [1] long tensor); "
                         "the batch has none")
    if y.numel() != num_graphs or y.is_floating_point():
        raise ValueError(f"y must hold one integer class label per graph ([1] long per "
                         f"example), got shape {tuple(y.shape)} {y.dtype} for {num_graphs} "
                         f"graphs")
    return y.reshape(-1).long()


@dataclass
class ClassifierOutput:
    r"""What a model may return to :func:`fit` instead of bare logits: the logits and
    a training term of each graph, added to that graph's loss in training steps (so
    it is averaged with the same weights as the loss) and left out of evaluation.

    Args:
        logits: ``[num_graphs, C]``.
        extra_loss: ``[num_graphs]``, e.g. a weighted loss on the graph's internal
            nodes (``None``: none).
    """

    logits: Tensor
    extra_loss: Optional[Tensor] = None


def _forward(model: Module, batch: Any, loss_fn: Callable
             ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Logits, labels, the loss of each graph and the model's extra loss of each graph
    (``None`` unless the model returns a :class:`ClassifierOutput` with one)."""
    num_graphs = int(batch.num_graphs)
    y = _labels(batch, num_graphs)
    logits, extra = model(batch), None
    if isinstance(logits, ClassifierOutput):
        logits, extra = logits.logits, logits.extra_loss
        if extra is not None and (not isinstance(extra, Tensor) or extra.shape != (num_graphs,)):
            shape = tuple(extra.shape) if isinstance(extra, Tensor) else type(extra).__name__
            raise ValueError(f"ClassifierOutput.extra_loss must have shape [num_graphs="
                             f"{num_graphs}], got {shape}")
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[0] != num_graphs:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"model(batch) must return logits [num_graphs={num_graphs}, C], "
                         f"got {shape}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= logits.shape[1]):
        raise ValueError(f"labels must lie in [0, {logits.shape[1]}) for {logits.shape[1]} "
                         f"logits, got {int(y.min())}..{int(y.max())}")
    loss = loss_fn(logits, y, reduction="none")
    if not isinstance(loss, Tensor) or loss.shape != (num_graphs,):
        raise ValueError("loss_fn(logits, y, reduction='none') must return one loss per "
                         "graph")
    return logits, y, loss, extra


# ------------------------------------------------------------------ metrics
def _metrics(confusion: Tensor, loss_sum: float, n: float) -> Dict[str, float]:
    """Accuracy and macro F1 from a confusion matrix ``[true, predicted]``; macro F1
    averages the classes that occur as a label or a prediction (scikit-learn's
    convention)."""
    confusion = confusion.double()
    tp = confusion.diagonal()
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support + predicted) > 0
    f1 = 2 * tp / (support + predicted).clamp_min(1e-300)
    return {"accuracy": float(tp.sum() / n), "macro_f1": float(f1[present].mean()),
            "loss": loss_sum / n, "n": int(round(n))}


@torch.no_grad()
def _evaluate(model: Module, data: Sequence, batch_size: int, device: torch.device,
              collate: Callable, loss_fn: Callable, predictions: bool = False
              ) -> Dict[str, Any]:
    was_training = model.training
    model.eval()
    confusion: Optional[Tensor] = None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    # each rank writes class + 1 into its samples' slots, zero elsewhere: the sum over
    # ranks is every sample's class + 1
    predicted = torch.zeros(len(data), dtype=torch.long, device=device) if predictions else None
    try:
        for batch, weight, _, slot in _Shard(data, batch_size, collate, shuffle=False, seed=0):
            batch, weight = _to(batch, device), weight.to(device)
            logits, y, loss, _ = _forward(model, batch, loss_fn)
            if confusion is None:
                confusion = torch.zeros(logits.shape[1], logits.shape[1], dtype=torch.float64,
                                        device=device)
            keep = weight > 0
            guess = logits[keep].argmax(1)
            index = y[keep] * logits.shape[1] + guess
            confusion.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
            loss_sum += (loss.double() * weight.double()).sum()
            if predicted is not None:
                predicted[slot.to(device)[keep]] = guess + 1
    finally:
        model.train(was_training)
    _all_reduce(confusion)
    _all_reduce(loss_sum)
    metrics: Dict[str, Any] = _metrics(confusion.cpu(), float(loss_sum), float(len(data)))
    if predicted is not None:
        metrics["predictions"] = (_all_reduce(predicted) - 1).tolist()
    return metrics


def evaluate(model: Module, data: Sequence, *, batch_size: int = 64,
             device: Union[str, torch.device] = "cpu", collate: Callable = Batch.from_data_list,
             loss_fn: Callable = F.cross_entropy, predictions: bool = False
             ) -> Dict[str, Any]:
    r"""Accuracy, macro F1 and mean loss of ``model`` on ``data``.

    .. math::
        \mathrm{accuracy} = \frac{1}{n}\sum_i [\hat y_i = y_i], \qquad
        \mathrm{macro\ F1} = \frac{1}{|K|}\sum_{k \in K}
            \frac{2\,\mathrm{TP}_k}{2\,\mathrm{TP}_k + \mathrm{FP}_k + \mathrm{FN}_k}

    with ``K`` the classes that occur as a label or a prediction. Runs in eval mode
    without gradients and restores the model's mode. Under ``torch.distributed`` every
    rank must call it: each evaluates a shard and the counts are all-reduced.

    Args:
        model: ``model(batch) -> logits [num_graphs, C]``.
        data: a sequence of PyG ``Data`` objects with a label ``y`` (``[1]`` long).
        batch_size: examples per forward pass.
        device: where to run.
        collate: turns a list of examples into a batch.
        loss_fn: ``loss_fn(logits, y, reduction="none")``, one loss per example.
        predictions: also return each example's predicted class (the argmax of its
            logits), from the same forward passes.

    Returns:
        ``{"accuracy", "macro_f1", "loss", "n"}``; with ``predictions``, also
        ``"predictions"``: a list of ``len(data)`` ints, in the order of ``data``.

    Example:
        >>> import hsa_graph
        >>> class Mean(torch.nn.Module):
        ...     def forward(self, batch):
        ...         return hsa_graph.nn.global_leaf_pool(batch.x, batch)
        >>> trees = [hsa_graph.NestedSignal.from_nested([torch.tensor([a, 1.0 - a])] * 2)
        ...          for a in (0.0, 1.0, 1.0)]
        >>> for tree, label in zip(trees, (1, 0, 1)):
        ...     tree.y = torch.tensor([label])
        >>> evaluate(Mean(), trees, batch_size=2)["accuracy"]
        0.6666666666666666
    """
    _check_dataset(data, "data")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    _, world = _rank_world()
    return _evaluate(model, data, max(1, math.ceil(batch_size / world)) * world,
                     _rank_device(str(device)), collate, loss_fn, predictions)


# ------------------------------------------------------------------ checkpoints
def save_checkpoint(state: Dict[str, Any], path: Union[str, os.PathLike]) -> None:
    """Write ``state`` (plain dicts, lists, tensors, numbers, strings) to ``path``.

    The file is written to a temporary name and renamed, and its SHA-256 goes to
    ``path + ".sha256"``, which :func:`load_checkpoint` checks.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": CHECKPOINT_FORMAT, **state}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    tmp_sum = path.with_name(f".{path.name}.sha256.{os.getpid()}.tmp")
    tmp_sum.write_text(f"{digest}  {path.name}\n")
    os.replace(tmp_sum, path.with_name(path.name + ".sha256"))


def load_checkpoint(path: Union[str, os.PathLike],
                    map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Read a checkpoint of :func:`save_checkpoint` with ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file does not match its ``.sha256`` (changed or truncated after
            it was written), cannot be read (truncated, not a checkpoint, or holding
            objects other than tensors, containers, numbers and strings), or is not
            a checkpoint of this module.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():
        expected = sidecar.read_text().split()[:1]
        if expected != [file_sha256(path)]:
            raise ValueError(f"checkpoint {path} does not match its checksum in {sidecar}: "
                             f"the file was modified or truncated after it was written")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise ValueError(f"cannot read checkpoint {path} (truncated, corrupt or not a "
                         f"weights-only checkpoint): {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a checkpoint of hsa_graph.experiments.train "
                         f"(expected format {CHECKPOINT_FORMAT!r})")
    return state


def _load_model_state(model: Module, state: Dict[str, Tensor], path: Path, key: str) -> None:
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, KeyError) as error:
        raise ValueError(f"checkpoint {path} ({key!r}) does not fit this model: "
                         f"{str(error).splitlines()[0]}") from error


def _cpu_state(model: Module) -> Dict[str, Any]:
    # extra states (get_extra_state, e.g. a field-name vocabulary) are plain objects
    return {name: value.detach().to("cpu", copy=True) if isinstance(value, Tensor)
            else copy.deepcopy(value) for name, value in model.state_dict().items()}


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_python_rng(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_rng() -> List[Dict[str, Any]]:
    state = _rng_state()
    if not _dist_on():
        return [state]
    states: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


# ------------------------------------------------------------------ fit
#: What a ``last.pt`` of :func:`fit` holds, and the type of each entry.
_RESUME_KEYS = {"epoch": int, "model": dict, "optimizer": dict, "history": list,
                "best_epoch": int, "best": dict, "best_model": dict, "rng": list}


def _check_resume_state(state: Dict[str, Any], path: Path, config: TrainConfig) -> None:
    """Validate every field of a ``last.pt`` before anything is restored from it.

    The ``.sha256`` sidecar only proves the file is the one that was written; without
    it (deleted, or never copied along) a hand-edited checkpoint must still not resume
    a run into an impossible state (a negative epoch, a history that does not match the
    epoch, random states that torch or Python refuse)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"cannot resume from {path}: {what}")

    missing = sorted(set(_RESUME_KEYS) - set(state))
    if missing:
        raise bad(f"the checkpoint lacks {missing} (it is not a last.pt of fit)")
    for key, kind in _RESUME_KEYS.items():
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"{key!r} is a {type(value).__name__}, expected a {kind.__name__}")
    epoch = state["epoch"]
    if not 1 <= epoch:
        raise bad(f"'epoch' is {epoch}; a checkpoint is written after epoch 1 or later")
    history = state["history"]
    if len(history) != epoch:
        raise bad(f"'history' has {len(history)} entries for epoch {epoch}")
    for i, entry in enumerate(history):
        if not isinstance(entry, dict) or type(entry.get("epoch")) is not int or \
                entry["epoch"] != i + 1:
            raise bad(f"'history' entry {i} is not the record of epoch {i + 1}")
        for name, value in entry.items():
            if not isinstance(name, str) or not isinstance(value, (int, float)) or \
                    isinstance(value, bool):
                raise bad(f"'history' entry {i} has {_short(name)} = {_short(value)}; entries "
                          "map names to numbers")
    if not 1 <= state["best_epoch"] <= epoch:
        raise bad(f"'best_epoch' is {state['best_epoch']}, outside [1, {epoch}]")
    for key in ("model", "best_model"):
        if not all(isinstance(k, str) for k in state[key]):
            raise bad(f"{key!r} must map parameter names to tensors")
    for name, value in state["best"].items():
        if not isinstance(name, str) or not isinstance(value, (int, float)):
            raise bad(f"'best' has {_short(name)} = {_short(value)}; it maps names to numbers")
    if not state["rng"]:
        raise bad("'rng' is empty; fit saves one random state per process")
    reference = torch.get_rng_state()
    for r, rng in enumerate(state["rng"]):
        if not isinstance(rng, dict) or "torch" not in rng or "python" not in rng:
            raise bad(f"'rng' entry {r} must hold the 'torch' and 'python' random states")
        torch_state = rng["torch"]
        if not isinstance(torch_state, Tensor) or torch_state.dtype != torch.uint8 or \
                torch_state.shape != reference.shape:
            raise bad(f"'rng' entry {r} has a torch random state that is not a "
                      f"{list(reference.shape)} uint8 tensor")
        try:
            random.Random().setstate(_python_rng(rng["python"]))
        except Exception as error:  # noqa: BLE001 - setstate raises many kinds on junk
            raise bad(f"'rng' entry {r} has a Python random state that random.setstate "
                      f"refuses: {error}") from None
        cuda_state = rng.get("cuda")
        if cuda_state is not None and (not isinstance(cuda_state, Tensor)
                                       or cuda_state.dtype != torch.uint8):
            raise bad(f"'rng' entry {r} has a CUDA random state that is not a uint8 tensor")


def _short(value: Any) -> str:
    """A bounded description (no recursive repr: a deeply nested forged value would
    raise RecursionError while the message is built)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return repr(value)[:40]
    return f"<a {type(value).__name__}>"


def _python_rng(state: Any) -> Any:
    """A Python random state as torch.load gives it back (lists) in setstate's form."""
    if not isinstance(state, (list, tuple)):
        return state
    return tuple(tuple(s) if isinstance(s, list) else s for s in state)


def _progress(iterable, enabled: bool, **kwargs):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError as error:
        raise ImportError("progress bars need tqdm: pip install tqdm (or set "
                          "TrainConfig.progress=False)") from error
    return tqdm(iterable, **kwargs)


def _resume(path: Path, model: Module, optimizer: torch.optim.Optimizer,
            config: TrainConfig, rank: int, world: int):
    """Restore model, optimizer and random states from ``last.pt``; return
    ``(epoch, history, best_epoch, best_metrics, best_state)``."""
    state = load_checkpoint(path, map_location="cpu")
    _check_resume_state(state, path, config)
    saved = state.get("config", {})
    for name in _RUN_DEFINING:
        if name in saved and saved[name] != getattr(config, name):
            raise ValueError(f"cannot resume from {path}: it was written with "
                             f"{name}={saved[name]!r}, this run has "
                             f"{name}={getattr(config, name)!r}")
    epoch = int(state["epoch"])
    if epoch > config.epochs:
        raise ValueError(f"cannot resume from {path}: it is at epoch {epoch}, past "
                         f"TrainConfig.epochs={config.epochs}")
    _load_model_state(model, state["model"], path, "model")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as error:
        raise ValueError(f"checkpoint {path} ('optimizer') does not fit this model's "
                         f"optimizer: {error}") from error
    rngs = state["rng"]
    if len(rngs) == world:
        _set_rng_state(rngs[rank])
    else:  # another number of processes: fresh, but reproducible, dropout streams
        torch.manual_seed(config.seed + rank + 1_000_003 * epoch)
    return (epoch, [dict(entry) for entry in state["history"]], int(state["best_epoch"]),
            dict(state["best"]), state["best_model"])


def _train_epoch(net: Module, model: Module, optimizer: torch.optim.Optimizer, shard: _Shard,
                 loss_fn: Callable, config: TrainConfig, device: torch.device, show: bool,
                 desc: str, epoch: int) -> Tuple[float, float]:
    """One pass over the rank's shard (epoch ``epoch``, 0-based); returns the sum of the
    per-example losses over all ranks and the slowest rank's wall time."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    total_steps = config.epochs * len(shard)  # every epoch has as many global batches
    start = time.perf_counter()
    for step, (batch, weight, real, _) in enumerate(_progress(shard, show, desc=desc,
                                                           leave=False)):
        lr = config.lr_at(epoch * len(shard) + step, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch, weight = _to(batch, device), weight.to(device)
        _, _, loss, extra = _forward(net, batch, loss_fn)
        if extra is not None:
            loss = loss + extra.to(loss.dtype)
        weighted = (loss * weight.to(loss.dtype)).sum()
        optimizer.zero_grad(set_to_none=True)
        # DDP averages gradients over ranks: scale by W so the update follows the mean
        # loss over the global batch's real examples
        (weighted * (shard.world / real)).backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        loss_sum += weighted.detach().double()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
    _all_reduce(loss_sum)
    _all_reduce(seconds, dist.ReduceOp.MAX if _dist_on() else None)
    return float(loss_sum), float(seconds)


def fit(model: Module, train: Sequence, val: Sequence, config: TrainConfig, *,
        collate: Callable = Batch.from_data_list,
        loss_fn: Callable = F.cross_entropy) -> Dict[str, Any]:
    r"""Train ``model`` with AdamW; keep the weights of the best validation epoch.

    Each epoch shuffles ``train`` (seed ``config.seed + epoch``), takes one step per
    global batch on the mean loss of its examples (see the module docstring for the
    multi-process case) at the rate :meth:`TrainConfig.lr_at` gives that step, then
    evaluates ``val``. The epoch with the best
    ``config.select_metric`` on ``val`` is selected (only ``val``: keep a test split
    apart and score it afterwards with :func:`evaluate`).

    Under ``torchrun`` (or an initialised :mod:`torch.distributed`) the model is
    wrapped in :class:`~torch.nn.parallel.DistributedDataParallel`, rank 0's initial
    weights are broadcast, and all ranks end with the same weights.

    Args:
        model: ``model(batch) -> logits [num_graphs, C]`` (or a
            :class:`ClassifierOutput`: its ``extra_loss`` joins each graph's training
            loss); moved to ``config.device``.
        train: sequence (list or torch ``Dataset``) of PyG ``Data`` /
            :class:`~hsa_graph.NestedSignal` objects with a label ``y`` (``[1]`` long).
        val: the validation examples, same form.
        config: a :class:`TrainConfig`.
        collate: turns a list of examples into a batch
            (:meth:`Batch.from_data_list <torch_geometric.data.Batch.from_data_list>`).
        loss_fn: ``loss_fn(logits, y, reduction="none")`` returning one loss per
            example (any :mod:`torch.nn.functional` classification loss).

    Returns:
        ``{"history": [...], "best_epoch": int, "best": {...}}``: one dict per epoch
        with ``epoch`` (1-based), ``train_loss`` (mean over the epoch's examples, extra
        loss included), ``val_accuracy``, ``val_f1`` (macro), ``val_loss``,
        ``seconds`` (wall time of the epoch's training pass, the slowest rank's) and
        ``lr`` (the learning rate of the epoch's last step);
        ``best_epoch`` (1-based, ``0`` if ``epochs == 0``) and ``best``, the validation
        metrics of :func:`evaluate` at that epoch. The model ends holding the weights
        of ``best_epoch``.

    Example:
        >>> import hsa_graph
        >>> from hsa_graph.nn import global_leaf_pool
        >>> _ = torch.manual_seed(0)
        >>> class Classifier(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...     def forward(self, batch):
        ...         return self.lin(global_leaf_pool(batch.x, batch))
        >>> trees = []
        >>> for i in range(16):
        ...     label = i % 2
        ...     tree = hsa_graph.NestedSignal.from_nested(
        ...         [torch.tensor([float(label), 1.0 - label])] * (2 + i % 3))
        ...     tree.y = torch.tensor([label])
        ...     trees.append(tree)
        >>> result = fit(Classifier(), trees[:12], trees[12:],
        ...              TrainConfig(epochs=20, batch_size=4, lr=0.1))
        >>> len(result["history"]), result["best"]["accuracy"]
        (20, 1.0)
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(model, Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config.validate()
    _check_dataset(train, "train")
    _check_dataset(val, "val")
    rank, world = init_distributed(config.device)
    if config.batch_size % world:
        raise ValueError(f"TrainConfig.batch_size ({config.batch_size}) must be a multiple "
                         f"of the number of processes ({world})")
    eval_batch = config.eval_batch_size or config.batch_size
    eval_batch = math.ceil(eval_batch / world) * world
    device = _rank_device(config.device)
    model.to(device)
    metric_key, best_key, larger = SELECT_METRICS[config.select_metric]
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl collectives use the current device

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    history: List[Dict[str, float]] = []
    best_epoch, best_metrics = 0, {}
    best_state = _cpu_state(model)
    start_epoch = 0
    torch.manual_seed(config.seed + rank)
    random.seed(config.seed + rank)

    ckpt_dir = Path(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    if config.resume:
        start_epoch, history, best_epoch, best_metrics, best_state = _resume(
            ckpt_dir / "last.pt", model, optimizer, config, rank, world)

    net: Module = model
    if _dist_on():
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=config.find_unused_parameters)

    show = config.progress and rank == 0
    epochs = _progress(range(start_epoch, config.epochs), show, desc="epochs",
                       initial=start_epoch, total=config.epochs)
    for epoch in epochs:
        net.train()
        shard = _Shard(train, config.batch_size, collate, shuffle=True, seed=config.seed,
                       epoch=epoch)
        loss_sum, seconds = _train_epoch(net, model, optimizer, shard, loss_fn, config,
                                         device, show, f"epoch {epoch + 1}", epoch)
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"training loss is {loss_sum} in epoch {epoch + 1}: "
                                     f"lower lr or set grad_clip")
        metrics = _evaluate(model, val, eval_batch, device, collate, loss_fn)
        entry = {"epoch": epoch + 1, "train_loss": loss_sum / len(train),
                 "val_accuracy": metrics["accuracy"], "val_f1": metrics["macro_f1"],
                 "val_loss": metrics["loss"], "seconds": seconds,
                 "lr": optimizer.param_groups[0]["lr"]}
        history.append(entry)
        value = entry[metric_key]
        if best_epoch == 0 or (value > best_metrics[best_key] if larger
                               else value < best_metrics[best_key]):
            best_epoch, best_metrics = epoch + 1, metrics
            best_state = _cpu_state(model)
            if ckpt_dir is not None and rank == 0:
                save_checkpoint({"epoch": epoch + 1, "model": best_state, "metrics": metrics,
                                 "config": config.to_dict()}, ckpt_dir / "best.pt")
        if show:
            epochs.set_postfix(loss=f"{entry['train_loss']:.4f}",
                               val_acc=f"{entry['val_accuracy']:.3f}")
        if config.log_epochs and rank == 0:
            print(f"epoch {epoch + 1}/{config.epochs}: train loss {entry['train_loss']:.4f}, "
                  f"val accuracy {entry['val_accuracy']:.4f}, {seconds:.1f} s", flush=True)
        if ckpt_dir is not None:
            rngs = _gather_rng()  # collective: every rank takes part
            if rank == 0:
                save_checkpoint({"epoch": epoch + 1, "model": _cpu_state(model),
                                 "optimizer": optimizer.state_dict(), "history": history,
                                 "best_epoch": best_epoch, "best": best_metrics,
                                 "best_model": best_state, "rng": rngs,
                                 "config": config.to_dict()}, ckpt_dir / "last.pt")
            if _dist_on():
                dist.barrier()  # nobody resumes from a last.pt that is still being written
    if show:
        epochs.close()
    if best_epoch:
        _load_model_state(model, best_state, Path("<best weights>"), "best_model")
    return {"history": history, "best_epoch": best_epoch, "best": best_metrics}


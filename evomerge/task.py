"""What the workers learn: the loss (``[run] loss``), the labels it takes, and the metrics it gives.

One definition for every place a loss is taken: training (:meth:`Task.train_losses`), the winner test and the
population's scoring (:meth:`Task.example_losses`), and evaluation (:meth:`Task.summary`), in the engine, the
reference loops and the calibration.

- ``cross_entropy`` (the default): labels are classes, one per input ``[N]`` or one per position ``[N, T]``
  (language modelling); the model returns ``[B, C]`` or ``[B, T, C]``. Label ``-100`` marks a position that is
  ignored (as ``torch.nn.functional.cross_entropy``'s ``ignore_index``). The loss of a worker's minibatch is the
  mean over its non-ignored positions; accuracy is per position and excludes the ignored ones; with labels per
  position, ``val_perplexity`` is exp(the token-weighted mean negative log-likelihood).
- ``mse``: float targets of exactly the output's shape (never broadcast); an example's loss is the mean of its
  squared errors.
- ``"module:function"``: the user's ``fn(output [B, ...], target [B, ...]) -> [B]`` per-example losses, resolved
  by reference in every process as the model factory is; its targets are what the data holds (float targets, or
  integer classes for a loss of the user's own such as a focal loss), and its outputs need not match their shape.

Only cross-entropy is a likelihood: fields built on ``exp(-loss)`` (data confidence) need it (:meth:`Task.refuse`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import ConfigError, unknown

FIELD = "study.run.loss"
LOSSES = ("cross_entropy", "mse")
IGNORE = -100


class Task:
    """The loss of a study's ``[run] loss`` and the shape of its labels."""

    def __init__(self, loss: str = "cross_entropy", base_dir: str | Path | None = None):
        self.loss, self.base_dir = loss, None if base_dir is None else str(base_dir)
        self.fn = None
        if loss not in LOSSES:
            if not isinstance(loss, str) or ":" not in loss:
                raise ConfigError(FIELD, unknown(loss, LOSSES, " or 'module:function'"))
            from .userref import resolve

            self.fn = resolve(loss, FIELD, self.base_dir, "mylosses:huber")
        self.per_position = False  # labels [N, T] (set by check_labels)
        self.ignores = False  # some labels are -100
        self.top = 0  # the largest training label (class)

    def __reduce__(self):
        return (_rebuild, (self.loss, self.base_dir, self.per_position, self.ignores, self.top))

    def __repr__(self) -> str:
        return f"Task({self.loss!r})"

    @property
    def classification(self) -> bool:
        """Labels are classes and accuracy means something."""
        return self.fn is None and self.loss == "cross_entropy"

    @property
    def likelihood(self) -> bool:
        """``exp(-loss)`` is the probability the model gives the label (data confidence needs it)."""
        return self.classification

    def refuse(self, field: str, value) -> None:
        """One line for a field that needs the loss to be a likelihood."""
        if not self.likelihood:
            raise ConfigError(field, f"{value!r} reads exp(-loss) as the model's confidence in an example, which "
                                     f"needs loss 'cross_entropy'; the study's loss is {self.loss!r}; allowed: its "
                                     "neutral value with this loss")

    # -- labels -----------------------------------------------------------------------------------
    def check_labels(self, y: torch.Tensor) -> None:
        """The training labels ``y`` ``[N, ...]`` against the loss: one line naming ``study.run.loss`` if the loss
        cannot take them. Records whether labels are per position and whether some are ignored."""
        if self.classification:
            if y.dtype.is_floating_point:
                raise ConfigError(FIELD, f"'cross_entropy' takes integer class labels; the data's labels are {y.dtype}; "
                                         "allowed: integer labels (one per input, or one per position), or loss "
                                         "'mse' or 'module:function' for float targets")
            if y.dim() not in (1, 2):
                raise ConfigError(FIELD, f"'cross_entropy' takes labels [N] or [N, T]; the data's labels have shape "
                                         f"{list(y.shape)}")
            self.per_position = y.dim() == 2
            self.ignores = bool((y == IGNORE).any())
            self.top = int(y.max()) if len(y) else 0
        elif self.fn is None and not y.dtype.is_floating_point:
            raise ConfigError(FIELD, f"{self.loss!r} takes float targets; the data's labels are {y.dtype}; allowed: "
                                     "float targets, or loss 'cross_entropy' for integer classes")

    def note_held_out(self, y: torch.Tensor) -> None:
        """Labels elsewhere than in training (the validation split): ``-100`` is counted out there too, and their
        largest class needs a logit as the training labels' does (one only there was a traceback in the first
        evaluation)."""
        if self.classification and not y.dtype.is_floating_point and len(y):
            self.ignores = self.ignores or bool((y == IGNORE).any())
            self.top = max(self.top, int(y.max()))

    def check_output(self, out: torch.Tensor, y: torch.Tensor, what: str) -> None:
        """One example batch's output ``out`` ``[B, ...]`` against its labels ``y`` ``[B, ...]``."""
        if self.classification:
            want = "[" + ", ".join([*map(str, y.shape), "C"]) + "]"
            if out.dim() != y.dim() + 1 or tuple(out.shape[:-1]) != tuple(y.shape):
                hint = ("; labels [N, 1] are one class each: give them as [N] (y.squeeze(1))"
                        if y.dim() == 2 and y.shape[1] == 1 and out.dim() == 2 else "")
                raise ConfigError("study.model.factory", f"{what} returns outputs of shape {list(out.shape)} for "
                                                         f"labels of shape {list(y.shape)}; cross-entropy expects "
                                                         f"{want} (one logit per class){hint}")
            top = max(self.top, int(y.max()) if len(y) else 0)
            if top >= out.shape[-1]:
                raise ConfigError("study.model.factory", f"{what} returns {out.shape[-1]} logits but the data hold "
                                                         f"class {top}; expected at least {top + 1}")
            return
        if self.fn is None and tuple(out.shape) != tuple(y.shape):
            o, t = tuple(out.shape), tuple(y.shape)  # (a new user's [N] targets beside [B, 1] outputs: no allowed)
            how = (" (y.unsqueeze(1) gives targets [N, 1]; out.squeeze(1) in the model's forward, outputs [B])"
                   if o == t + (1,) else " (y.squeeze(1) gives targets [N])" if t == o + (1,) else "")
            raise ConfigError(FIELD, f"{self.loss!r}: the model's outputs have shape {list(out.shape)} and the "
                                     f"targets {list(y.shape)}; they must match exactly (no broadcasting); allowed: "
                                     f"targets from study.data of the outputs' shape, or a study.model.factory whose "
                                     f"outputs have the targets'{how}")
        if self.fn is not None:  # the user's function takes what it takes (float targets, or classes)
            try:
                got = self.fn(out.float(), y)
            except Exception as e:  # noqa: BLE001 - the user's code: one line naming the field
                from .userref import one_line

                raise ConfigError(FIELD, f"{self.loss} raised {one_line(e)} on outputs of shape {list(out.shape)} and "
                                         f"targets {y.dtype} of shape {list(y.shape)}") from None
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (len(y),):
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ConfigError(FIELD, f"{self.loss} returned {shape} for a batch of {len(y)}; expected per-example "
                                         f"losses of shape [{len(y)}]")

    # -- losses -----------------------------------------------------------------------------------
    def _nll(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-position negative log-likelihood, shaped like ``y`` (0 at ignored positions)."""
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none",
                               ignore_index=IGNORE).view(y.shape)

    def example_losses(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example losses ``[W, B]`` of outputs ``[W, B, ...]`` against labels ``[W, B, ...]``."""
        W, B = y.shape[:2]
        if self.classification:
            nll = self._nll(out, y)
            if y.dim() == 2 and not self.ignores:
                return nll
            valid = (y != IGNORE).reshape(W, B, -1)
            return nll.reshape(W, B, -1).sum(-1) / valid.sum(-1).clamp(min=1)
        if self.fn is None:
            return (out - y).pow(2).reshape(W, B, -1).mean(-1)
        return self.fn(out.flatten(0, 1), y.flatten(0, 1)).view(W, B)

    def train_losses(self, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-example losses [W, B], objective [W])``: the objective (what each worker's gradient is of) is its
        mean loss over the minibatch, per non-ignored position for labels with ignored or per-position entries."""
        if self.classification and (y.dim() > 2 or self.ignores):
            W, B = y.shape[:2]
            nll = self._nll(out, y).reshape(W, B, -1)
            valid = (y != IGNORE).reshape(W, B, -1)
            per = nll.sum(-1)
            return per / valid.sum(-1).clamp(min=1), per.sum(1) / valid.sum((1, 2)).clamp(min=1)
        losses = self.example_losses(out, y)
        return losses, losses.mean(1)

    def module_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One plain module's minibatch loss (a scalar): its outputs ``[B, ...]`` against labels ``[B, ...]``, as
        the stacked workers' objective is taken (the reference loops, the calibration)."""
        return self.train_losses(out.unsqueeze(0), y.unsqueeze(0))[1][0]

    def summary(self, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(summed loss [W], correct [W] or None, count [W])`` of outputs ``[W, N, ...]`` against labels
        ``[N, ...]`` shared by every row, counted per position for per-position labels."""
        W = out.shape[0]
        y = y.unsqueeze(0).expand(W, *y.shape)  # one set of labels for every row
        if self.classification:
            nll = self._nll(out, y).reshape(W, -1)
            valid = (y != IGNORE).reshape(W, -1)
            correct = ((out.argmax(-1) == y) & (y != IGNORE)).reshape(W, -1).sum(1)
            return nll.sum(1), correct, valid.sum(1)
        losses = self.example_losses(out, y)
        return losses.sum(1), None, torch.full((W,), losses.shape[1], device=out.device)


def _rebuild(loss, base_dir, per_position, ignores, top) -> Task:
    t = Task(loss, base_dir)
    t.per_position, t.ignores, t.top = per_position, ignores, top
    return t


def of(study) -> Task:
    """The task of a study (its ``[run] loss``, user functions resolved beside the study file)."""
    return Task(study.run.loss, study.path.parent if study.path is not None else None)

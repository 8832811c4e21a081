"""The best trial's consensus model, for the search's parent run in MLflow: the workers' final parameters of the
trial's first seed, averaged into the study's ``nn.Module``. A search in one process keeps it from the trial's own
run (:class:`Keeper`: the best so far, one model's worth of memory); where the best trial ran elsewhere (another
``--jobs`` process, an earlier search of the study, a population, a reused twin) its policy is run again on that
seed at the step size the trial ran with. (The tracker only logs it: :meth:`evomerge.report.tracking.Tracker.log_best`.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Consensus:
    module: Any  # torch.nn.Module, in eval mode
    example: Any  # a few validation inputs, the model's input shape (the logged model's input example)
    val_accuracy: float
    seed: int
    source: str  # "trial run" (kept) or "re-run"


class Keeper:
    """The consensus model of the best complete trial this process ran, by the first objective (as
    ``search.results.best_trials`` ranks them), on the first seed; offered by each trial's evaluation."""

    def __init__(self, maximize: bool):
        self.maximize, self.number, self.value, self.params, self.val_accuracy = maximize, None, None, None, None

    def offer(self, number: int, value: float, params, val_accuracy: float) -> None:
        better = self.value is None or (value > self.value if self.maximize else value < self.value)
        if better and params is not None:
            self.number, self.value, self.params, self.val_accuracy = number, value, params, val_accuracy

    def get(self, number: int):
        return self.params if number == self.number else None


def consensus(study, best: dict[str, Any], *, data=None, data_dir=None, device=None,
              keeper: Keeper | None = None) -> Consensus:
    """``best`` (a ``search.results.trial_summary`` dict) as a model: its first seed's consensus, kept by ``keeper``
    if this process ran it, else its policy run again on ``study``'s first seed."""
    from .. import models as models_mod
    from ..backends.inprocess import run
    from ..engine.setup import normalise, prepare
    from ..policy import MergePolicy
    from ..study import with_run

    study = with_run(study, best.get("run") or {})  # the step size the trial ran with
    setup = prepare(study, data=data, data_dir=data_dir)
    seed = study.run.seeds[0]
    kept = keeper.get(best["number"]) if keeper is not None else None
    if kept is not None:
        center, acc, source = kept, keeper.val_accuracy, "trial run"
    else:
        res = run(setup, MergePolicy.from_dict(best["policy"]), seed, keep_params=True, device=device)
        center, acc, source = res.params.mean(0), res.final.val_accuracy, "re-run"
    module = models_mod.load_row(setup.model.module(), center.float().cpu()).eval()
    x = normalise(setup.data.val_x[:8], setup.data.spec).reshape(-1, *setup.model.input_shape)
    return Consensus(module, x, acc, seed, source)

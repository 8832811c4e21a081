"""The best trial's consensus model, for the search's parent run in MLflow: the policy re-run on the study's first
seed at the step size the trial ran with, the workers' final parameters averaged into the study's ``nn.Module``.
(The tracker only logs it: :meth:`evomerge.report.tracking.Tracker.log_best`.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Consensus:
    module: Any  # torch.nn.Module, in eval mode
    example: Any  # a few validation inputs, the model's input shape (the logged model's input example)
    val_accuracy: float
    seed: int


def consensus(study, best: dict[str, Any], *, data=None, data_dir=None, device=None) -> Consensus:
    """``best`` (a ``search.results.trial_summary`` dict) as a model: its policy on ``study``'s first seed."""
    from .. import models as models_mod
    from ..backends.inprocess import run
    from ..engine.setup import normalise, prepare
    from ..policy import MergePolicy
    from ..study import with_run

    study = with_run(study, best.get("run") or {})  # the step size the trial ran with
    setup = prepare(study, data=data, data_dir=data_dir)
    seed = study.run.seeds[0]
    res = run(setup, MergePolicy.from_dict(best["policy"]), seed, keep_params=True, device=device)
    module = models_mod.load_row(setup.model.module(), res.params.mean(0).float()).eval()
    x = normalise(setup.data.val_x[:8], setup.data.spec).reshape(-1, *setup.model.input_shape)
    return Consensus(module, x, res.final.val_accuracy, seed)

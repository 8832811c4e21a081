"""The engine's round loop: the convergence stop in both backends, and determinism with every schema 2 field on."""

from __future__ import annotations

import dataclasses
import math

import pytest

from conftest import tiny_study
from evomerge import simulate
from evomerge.policy import MergePolicy


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


@pytest.mark.parametrize("backend", ["inprocess", pytest.param("distributed", marks=pytest.mark.system)])
def test_convergence_stop_ends_a_run_whose_learning_rate_is_zero(mnist, backend):
    from evomerge.backends import runner

    setup = simulate.prepare(tiny_study(lr=0.0, rounds=6), data=mnist)
    pol = MergePolicy(topology="ring", mean_interval=2, stop_tol=1e-6, stop_patience=2)
    res = runner(backend)(setup, pol, 0, device="cpu")
    assert res.status == "ok"
    assert len(res.history) == 2 and res.converged_step == res.history[1].step < setup.total_steps
    assert res.metrics()["converged_step"] == res.converged_step
    learning = runner(backend)(simulate.prepare(tiny_study(rounds=6), data=mnist), pol, 0, device="cpu")
    assert learning.converged_step is None and len(learning.history) == 6


def test_same_seed_same_run_with_every_new_field_on(setup):
    pol = MergePolicy(topology="communities", n_communities=2, regroup_every=1, similarity_bias=0.5, data_exchange_k=4,
                      retire_threshold=0.8, swap_p=0.2, stop_tol=1e-9)
    a = simulate.simulate(setup, pol, 5, device="cpu")
    b = simulate.simulate(setup, pol, 5, device="cpu")
    strip = [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in a.history]
    assert strip == [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in b.history]
    assert a.communities == b.communities and a.model_at == b.model_at


def _same(a: dict, b: dict) -> bool:
    """Equal dicts, NaN equal to NaN (a diverged run's loss)."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and isinstance(b[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
        for k in a)


@pytest.mark.parametrize("case", ["gossip", "outer-step", "converges", "diverges"])
def test_a_run_evaluated_at_its_last_round_only_ends_with_the_same_metrics(mnist, case):
    """``curves=False`` (the verdict's runs on fresh seeds, of which only the final values are read): the validation
    split is evaluated at the run's last round only, the one the convergence stop or a divergence ends it at
    included, and the final metrics are the run's with every round evaluated, bit for bit."""
    from evomerge.backends.inprocess import run

    lr = {"converges": 0.0, "diverges": 1e6}.get(case, 0.1)
    setup = simulate.prepare(tiny_study(lr=lr, rounds=5), data=mnist)
    pol = {"gossip": MergePolicy(topology="ring", mean_interval=3),
           "outer-step": MergePolicy(scheme="allreduce", mean_interval=4, mixing_weight=1.0, outer_optimizer="nesterov",
                                     outer_lr=0.7, outer_momentum=0.9),
           "converges": MergePolicy(topology="ring", mean_interval=2, stop_tol=1e-6, stop_patience=2),
           "diverges": MergePolicy()}[case]
    every = run(setup, pol, 3, device="cpu")
    last = run(setup, pol, 3, device="cpu", curves=False)
    strip = [{k: v for k, v in m.items() if k != "wall_time"} for m in (every.metrics(), last.metrics())]
    assert _same(*strip), strip
    assert (last.status, last.converged_step, len(last.history)) == (every.status, every.converged_step,
                                                                     len(every.history))
    assert {"converges": ("ok", 2), "diverges": ("diverged", len(every.history))}.get(
        case, ("ok", 5)) == (every.status, len(every.history))
    # the rounds before the last were not evaluated; every run's were
    assert all(math.isnan(h.val_accuracy) and math.isnan(h.val_loss) for h in last.history[:-1])
    assert all(math.isfinite(h.val_accuracy) for h in every.history if every.status == "ok")
    # a callback reads every round (but a diverged one): with one, every round is evaluated all the same
    seen = []
    run(setup, pol, 3, device="cpu", curves=False, callback=seen.append)
    assert len(seen) == len(every.history) - (every.status == "diverged")
    assert [h.val_accuracy for h in seen] == [h.val_accuracy for h in every.history[:len(seen)]]


def test_the_verdicts_baselines_on_fresh_seeds_are_the_runs_with_curves(tmp_path, data_dir):
    """The verdict's baseline rows on fresh seeds (``curves=False``) hold the same per-seed finals as rows with
    curves, carry no curve, and are cached apart from them."""
    import optuna

    from conftest import write_study
    from evomerge import study as study_mod
    from evomerge.search.baselines import baseline_rows

    s = study_mod.load(write_study(tmp_path, steps=20))
    ostudy = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name="tiny")
    finals = baseline_rows(s, data_dir=data_dir, seeds=[1000, 1001], storage_study=ostudy, curves=False)
    full = baseline_rows(s, data_dir=data_dir, seeds=[1000, 1001], storage_study=ostudy)
    assert [r["name"] for r in finals] == [r["name"] for r in full] == ["no-merging", "ring-gossip"]
    for a, b in zip(finals, full):
        strip = [[{k: v for k, v in f.items() if k != "wall_time"} for f in r["per_seed"]] for r in (a, b)]
        assert [_same(x, y) for x, y in zip(*strip)] == [True, True], strip
        assert a["history"] == [] and b["history"]
    assert len([k for k in ostudy.user_attrs if k.startswith("baselines-")]) == 2

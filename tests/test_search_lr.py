"""The step size searched with the policy (``run.lr`` in [search.space]): each trial runs at its own lr, the
export says which lr its policy was found with, ``run`` replays it there, ``transfer`` carries it, and a user's
loop is told when its lr differs; real SQLite, MLflow, runs and gloo processes."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

import evomerge
from conftest import write_study
from evomerge import simulate, study
from evomerge.errors import ConfigError
from evomerge.study import with_run
from searchutil import cli

LR = '"run.lr" = { kind = "log-float", low = 0.01, high = 1.0 }\n'


def _with_lr(tmp_path, name="lr", line=LR, **kw):
    f = write_study(tmp_path, name=name, **kw)
    f.write_text(f.read_text().replace("[search.space]\n", "[search.space]\n" + line))
    return f


def test_the_dotted_key_reads_as_the_run_field_and_bad_keys_name_the_field(tmp_path):
    s = study.load(_with_lr(tmp_path, line='run.lr = { kind = "log-float", low = 0.01, high = 1.0 }\n'))
    lr = next(p for p in s.search.space if p.name == "run.lr")
    assert (lr.kind, lr.low, lr.high) == ("log-float", 0.01, 1.0)
    for line, where, what in [
        ('run.momentum = { kind = "float", low = 0.0, high = 0.9 }\n', "study.search.space.run.momentum",
         "allowed: run.lr, run.weight_decay"),
        ('"run.lr" = { kind = "int", low = 1, high = 3 }\n', "study.search.space.run.lr.kind", "allowed: float"),
        ('"run.lr" = { kind = "log-float", low = 0.0, high = 1.0 }\n', "study.search.space.run.lr.low", "low > 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            study.load(_with_lr(tmp_path / where, line=line))
        assert e.value.field == where and what in e.value.message


@pytest.mark.system
def test_a_trial_runs_at_its_own_step_size_and_the_export_replays_it(tmp_path, data_dir):
    f = _with_lr(tmp_path)
    res = evomerge.search(study.load(f), n_trials=3, sampler="random", runs_dir=tmp_path / "runs", seed=3,
                          data_dir=data_dir, prune=False)
    assert res.counts == {"COMPLETE": 3}
    trials = res.optuna_study.get_trials()
    lrs = [t.params["run.lr"] for t in trials]
    assert len(set(lrs)) == 3 and all(t.user_attrs["run"] == {"lr": t.params["run.lr"]} for t in trials)
    assert all("run.lr" not in t.user_attrs["policy"] for t in trials)  # the policy is only the policy
    s = study.load(f)
    setup = simulate.prepare(s, data_dir=data_dir)
    t = trials[0]
    pol = evomerge.MergePolicy.from_dict(t.user_attrs["policy"])
    at_found = simulate.simulate(simulate.prepare(with_run(s, {"lr": t.params["run.lr"]}), data_dir=data_dir), pol, 0)
    at_study = simulate.simulate(setup, pol, 0)
    assert t.values[0] == at_found.final.val_accuracy != at_study.final.val_accuracy  # the trial ran at its own lr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'lr' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lr").experiment_id])
    logged = {r.data.tags["optuna.trial_number"]: r.data.params.get("run.lr") for r in runs
              if "optuna.trial_number" in r.data.tags}
    assert logged == {str(t.number): str(t.params["run.lr"]) for t in trials}  # the review's run.lr column

    p = cli("export", "--study", str(f), "-o", "best.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "best.json").read_text())
    best = max(trials, key=lambda t: t.values[0])
    # the status table's policy says the step size each trial searched with it
    p = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    flat = re.sub(r"[\s│]+", " ", p.stdout)  # the table's cells, wrapped over lines, read as one text
    assert p.returncode == 0 and all(f"; run.lr {t.params['run.lr']:.3g} " in flat for t in trials), p.stdout
    assert doc["format"] == 2 and doc["trial"] == best.number
    assert doc["run"] == {"optimizer": "sgd", "lr": best.params["run.lr"], "weight_decay": 0.0, "momentum": 0.0}
    assert doc["run_searched"] == ["lr"]
    # from Python: the same file (the picked_by rule's trial, its step size), and a replay of the search's best
    # trial as `found.best` holds it, at its own step size (a policy taken from it alone runs at the study's)
    again = evomerge.export(res, tmp_path / "py" / "best.json")
    assert {k: again[k] for k in ("trial", "run", "run_searched", "policy", "picked_by")} == \
        {k: doc[k] for k in ("trial", "run", "run_searched", "policy", "picked_by")}
    assert json.loads((tmp_path / "py" / "best.json").read_text())["trial"] == best.number
    # by the study's file and runs folder, as `evomerge export` finds it
    assert evomerge.export(str(f), tmp_path / "t.json", trial=trials[1].number, runs_dir=tmp_path / "runs")[
        "run"]["lr"] == trials[1].params["run.lr"]
    with pytest.raises(ConfigError) as e:
        evomerge.export(res, tmp_path / "t.json", trial=99)
    assert str(e.value).startswith("trial: 'lr' has no trial 99; allowed: the number of a complete trial"), e.value
    with pytest.raises(ConfigError) as e:
        evomerge.export(str(f), tmp_path / "t.json", runs_dir=tmp_path / "elsewhere")
    assert str(e.value).startswith("study: no search results for 'lr' in sqlite:") and str(e.value).endswith(
        f"the runs folder beside the study file holds them: runs_dir {tmp_path / 'runs'}"), e.value  # (the keyword)
    assert not (tmp_path / "elsewhere").exists()  # (nothing made where nothing was)
    with pytest.raises(ConfigError) as e:  # a path under a file: one line, as the command says it
        evomerge.export(res, tmp_path / "best.json" / "x.json")
    assert str(e.value).startswith(f"path: cannot write {tmp_path / 'best.json'}"), e.value
    assert res.best[0]["number"] == best.number
    with pytest.warns(UserWarning, match=f"found with run.lr {best.params['run.lr']:g}"):
        replay = evomerge.run(s, res.best[0], data_dir=data_dir)
    assert replay.final.val_accuracy == best.values[0]
    p = cli("run", "--study", str(f), "--policy", "best.json", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert f"found with run.lr {best.params['run.lr']:g} (the study says 0.05)" in p.stdout
    assert f"validation accuracy matches trial {best.number}" in p.stdout  # replayed at the found lr
    # the dashboard says the step size with the policy: in the top trials and the best policy's section (a user
    # copying the policy from the page lost it)
    p = cli("dashboard", "--study", str(f), "--no-baselines", "--out", "dash", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    page = (tmp_path / "dash" / "index.html").read_text()
    assert all(f"; run.lr {t.params['run.lr']:.3g}" in page for t in trials), page[:2000]
    assert f"Searched with it: run.lr {best.params['run.lr']:.3g} (evomerge export writes it" in page
    # at another step size (--lr): said, and not held to the trial's figures
    p = cli("run", "--study", str(f), "--policy", "best.json", "--quiet", "--lr", "0.07", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert f"note: run.lr 0.07 (--lr), where the exported trial's is {best.params['run.lr']:g}" in p.stdout, p.stdout
    # (it also said "found with run.lr ...; this run uses the found values", which --lr overrode: only lr was searched)
    assert "found with" not in p.stdout, p.stdout
    assert (f"note: lr changed since trial {best.number} ran (run.lr 0.07 by --lr, the exported trial's "
            f"{best.params['run.lr']:g}), so this run's figures are not held to the trial's") in p.stderr, p.stderr

    # transfer re-runs each policy at the step size it was found with
    big = write_study(tmp_path, name="big", workers=2, steps=20)
    p = cli("transfer", "--study", str(f), "--target", str(big), "--top", "2", "--quiet", "--json", "t.json",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    by_number = {t.number: t for t in trials}
    target = study.load(big)
    for r in rows:
        found = by_number[r["trial"]].params["run.lr"]
        assert r["run"] == {"lr": found}
        again = simulate.simulate(simulate.prepare(with_run(target, {"lr": found}), data_dir=data_dir),
                                  evomerge.MergePolicy.from_dict(r["policy"]), r_seed := 1000)
        assert r["target_value"] == again.final.val_accuracy, r_seed


def test_a_population_of_trials_refuses_a_searched_step_size(tmp_path, data_dir):
    f = _with_lr(tmp_path)
    p = cli("search", "--no-verdict", "--study", str(f), "--sampler", "cmaes", "--batch", "2", "--n-trials", "2",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == ("error: --batch: 2 trains trials as one population with one step "
                                                 "size; study.search.space.run.lr gives each trial its own; allowed: 1")


LOOP = textwrap.dedent("""
    import sys, warnings, torch, torch.distributed as dist
    import evomerge
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    model = torch.nn.Linear(4, 2)
    for lr in (0.05, float(sys.argv[3])):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            m = evomerge.Merger(sys.argv[1], model, torch.optim.SGD(model.parameters(), lr=lr), seed=0, total_steps=10)
            m.close()
        print(lr, [str(x.message) for x in w if "lr" in str(x.message)])
    dist.destroy_process_group()
""")


@pytest.mark.system
def test_the_merger_warns_when_the_loops_lr_is_not_the_one_the_policy_was_found_with(tmp_path):
    export = {"format": 2, "trial": 4, "study": "s", "seeds": [0], "policy": {"scheme": "allreduce", "mean_interval": 5},
              "run": {"optimizer": "sgd", "lr": 0.2, "weight_decay": 0.0}, "run_searched": ["lr"]}
    (tmp_path / "best.json").write_text(json.dumps(export))
    (tmp_path / "loop.py").write_text(LOOP)
    p = subprocess.run([sys.executable, "loop.py", "best.json", str(tmp_path / "store"), "0.2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.strip().splitlines()
    assert first.startswith("0.05 [\"policy: found with sgd at lr 0.2; this optimizer's lr is 0.05. The best merge")
    assert second == "0.2 []"  # the found lr: nothing to say


def test_a_found_step_size_is_applied_only_where_it_was_searched_and_with_its_optimizer():
    from conftest import tiny_study
    from evomerge.backends import found_with

    s = tiny_study(lr=0.1)
    export = {"run": {"optimizer": "sgd", "lr": 0.3, "weight_decay": 0.0}, "run_searched": ["lr"]}
    st, note = found_with(s, export)
    assert st.run.lr == 0.3 and note.endswith("this run uses the found values")
    st, note = found_with(s, export | {"run_searched": []})  # the source study's fixed lr: not the policy's
    assert st.run.lr == 0.1 and note is None
    adam = tiny_study(lr=1e-3, optimizer="adam")
    st, note = found_with(adam, export)
    assert st.run.lr == 1e-3 and "this study trains with adam, so its own values are used" in note


def test_the_merger_warns_when_the_loops_optimizer_is_not_the_one_the_policy_was_found_with():
    """(An Adam loop deploying a policy found with SGD at the same lr got no word, and reached 0.17 accuracy.)"""
    import torch

    from evomerge.runtime import step_size_warning

    params = [torch.nn.Parameter(torch.zeros(2))]
    run = {"optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0}
    assert step_size_warning(run, torch.optim.SGD(params, lr=0.05)) is None
    assert step_size_warning(run, torch.optim.Adam(params, lr=0.05)) == (
        "policy: found with sgd at lr 0.05; this optimizer is Adam at lr 0.05. The best merge policy depends on the "
        "optimiser and its step size: train with torch.optim.SGD at lr 0.05, or search with yours (study.run.optimizer, "
        "and run.lr in [search.space])")
    momentum = run | {"momentum": 0.9}  # exported since the momentum lived only in the study
    assert step_size_warning(momentum, torch.optim.SGD(params, lr=0.05, momentum=0.9)) is None
    assert step_size_warning(momentum, torch.optim.SGD(params, lr=0.05)) == (
        "policy: found with sgd at lr 0.05 and momentum 0.9; this optimizer's momentum is 0. The best merge policy "
        "depends on the step size: train with momentum 0.9")
    adamw = {"optimizer": "adamw", "lr": 1e-3}
    assert step_size_warning(adamw, torch.optim.AdamW(params, lr=1e-3)) is None
    assert step_size_warning(adamw, torch.optim.Adam(params, lr=1e-3)).startswith(
        "policy: found with adamw at lr 0.001; this optimizer is Adam at lr 0.001.")
    assert step_size_warning(adamw, torch.optim.AdamW(params, lr=0.01)).startswith(
        "policy: found with adamw at lr 0.001; this optimizer's lr is 0.01.")

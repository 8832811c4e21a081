"""`[baselines] lr`: each baseline compared at its own best step size, not the study's (a comparison of policies
gives each its own tuned step size). Real runs of a user's study file, a real SQLite Optuna study, the commands as
a user runs them."""

import json
import re

import pytest

from conftest import write_study
from evomerge import simulate, study as study_mod
from evomerge.study import with_run
from searchutil import cli

GRID = [0.02, 0.05, 0.08, 0.1]


@pytest.mark.system
def test_each_baseline_runs_at_its_best_step_size_in_the_table_the_verdict_and_the_baselines_command(tmp_path,
                                                                                                       data_dir):
    f = write_study(tmp_path, seeds=(0, 1))
    f.write_text(f.read_text().replace('policies = ["no-merging", "ring-gossip"]',
                                       f'policies = ["no-merging", "ring-gossip"]\nlr = {json.dumps(GRID)}'))
    st = study_mod.load(f)
    assert st.baseline_lr == tuple(GRID)
    # the best of the grid by mean validation accuracy over the study's seeds, run here one by one
    want = {}
    for name in st.baselines:
        pol = st.resolve_policy(name)
        acc = {lr: sum(simulate.simulate(simulate.prepare(with_run(st, {"lr": lr}), data_dir=data_dir), pol, s)
                       .metrics()["val_accuracy"] for s in st.run.seeds) for lr in GRID}
        want[name] = max(GRID, key=lambda lr: acc[lr])
    assert len(set(want.values()) - {st.run.lr}) == 2, want  # each its own, neither the study's lr

    # a process, as the user runs it: Optuna's own line ("A new study created in RDB") was printed there
    p = cli("baselines", "--study", str(f), "--quiet", "--json", "b.json", cwd=tmp_path, data_dir=data_dir,
            process=True)
    assert p.returncode == 0, p.stderr
    assert f"tuning: each baseline's step size of lr {GRID} on the study's seeds [0, 1], 16 runs" in p.stderr
    assert p.stderr.startswith("note: the baselines' step sizes are kept for a search of tiny in sqlite:///"
                               f"{tmp_path / 'runs' / 'tiny' / 'optuna.db'}\n"), p.stderr
    assert "A new study created" not in p.stderr and "[I " not in p.stderr, p.stderr
    assert "not tuned for each" not in p.stderr, p.stderr
    # where its sums ran (a search's table of the same baselines on another number of threads differs in its last
    # digits, and neither said why)
    assert re.search(r"ran in process on cpu with \d+ torch threads?", " ".join(p.stdout.split())), p.stdout
    doc = json.loads((tmp_path / "b.json").read_text())
    assert {n: b["lr"] for n, b in doc["baselines"].items()} == want
    for n in want:  # the row ran at that step size: the engine's run at it, seed 0
        ran = simulate.simulate(simulate.prepare(with_run(st, {"lr": want[n]}), data_dir=data_dir),
                                st.resolve_policy(n), 0).metrics()
        assert doc["baselines"][n]["final"]["val_accuracy"] == pytest.approx(ran["val_accuracy"], abs=1e-9)

    # a best step size at an end of the grid is said (the rival may be better beyond it)
    edges = sorted(n for n, v in want.items() if v in (min(GRID), max(GRID)))
    assert ("note: best step size at an end of [baselines] lr" in p.stderr) == bool(edges), p.stderr
    assert all(n in p.stderr.split("at an end of")[-1] for n in edges)

    # kept for the search, as studies.md says (a study that was never searched was not stored: the search tuned
    # them all again)
    assert (tmp_path / "runs" / "tiny" / "optuna.db").is_file()
    p = cli("search", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--reevaluate", "1", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "each one's step size of lr" not in p.stdout + p.stderr, p.stdout
    said = " ".join(p.stdout.split())  # the table and the notes, unwrapped
    m = re.search(r"note: each baseline ran at its best step size of lr (\[[^]]*\]) on the study's seeds \(([^)]*)\); "
                  r"the picks at the study's lr 0.05", said)
    assert m and m[1] == str(GRID), said
    assert dict(x.rsplit(" ", 1) for x in m[2].split(", ")) == {n: f"{v:g}" for n, v in want.items()}, m[2]
    assert "not tuned for each" not in said
    assert ("best step size at an end of [baselines] lr" in said) == bool(edges), said
    for n in st.baselines:
        assert f"{n} " in said and f"baseline (lr {want[n]:g}, its best)" in said
    # two seeds: the table says so, and each row's spread over them
    assert "tiny: best trials (means over seeds [0, 1])" in said and "spread (sd)" in said, said

    # `run` of a baseline says at which step size the search judged it, and `--lr` runs it there: the row's figures
    # (it ran at the study's lr in silence, and the verdict's numbers could not be had from it)
    name = next(n for n in st.baselines if want[n] != st.run.lr)
    p = cli("run", "--study", str(f), "--policy", name, "--quiet", "--json", "r.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert (f"note: {name} runs at the study's run.lr {st.run.lr:g}; its search judged it at its best step size, "
            f"{want[name]:g} of [baselines] lr (--lr {want[name]:g} runs it there)") in p.stdout, p.stdout
    p = cli("run", "--study", str(f), "--policy", name, "--quiet", "--json", "r.json", "--lr", str(want[name]),
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and f"note: run.lr {want[name]:g} (--lr), where the study's is {st.run.lr:g}" in p.stdout
    assert json.loads((tmp_path / "r.json").read_text())["final"]["val_accuracy"] == \
        doc["baselines"][name]["final"]["val_accuracy"]
    import evomerge
    from evomerge.errors import ConfigError

    with pytest.warns(UserWarning, match=rf"run\.lr {want[name]:g}"):  # evomerge.run(lr=): the same run
        assert evomerge.run(st, name, 0, lr=want[name], data_dir=data_dir).final.val_accuracy == \
            doc["baselines"][name]["final"]["val_accuracy"]
    with pytest.raises(ConfigError, match=r"^lr: '0\.1'; allowed: a step size > 0$"):
        evomerge.run(st, name, 0, lr="0.1", data_dir=data_dir)
    p = cli("run", "--study", str(f), "--policy", name, "--lr", "0", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.strip() == "error: --lr: 0; allowed: a step size > 0", p.stderr

    # the file moved away: `baselines --study NAME` runs the stored definition, at the step sizes the search chose
    # (kept with its trials), without tuning them again
    f.rename(tmp_path / "moved.toml")
    p = cli("baselines", "--study", "tiny", "--quiet", "--json", "b2.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "running the baselines of the definition stored with its trials" in p.stderr
    assert "16 runs" not in p.stderr and "as chosen on the study's seeds [0, 1] and kept with the trials of tiny" \
        in p.stderr, p.stderr
    again = json.loads((tmp_path / "b2.json").read_text())
    assert {n: b["lr"] for n, b in again["baselines"].items()} == want
    for n in want:  # the same runs (the wall time apart)
        assert again["baselines"][n]["final"]["val_accuracy"] == doc["baselines"][n]["final"]["val_accuracy"]


def test_a_baselines_best_step_size_at_an_end_of_the_grid_is_noted(tmp_path):
    """(A verdict said the pick beat every tuned rival where each rival's best was the grid's highest step size: its
    tuning was cut short, and nothing said so.)"""
    from evomerge.search.baselines import edge_note

    f = write_study(tmp_path)
    f.write_text(f.read_text().replace('policies = ["no-merging", "ring-gossip"]',
                                       f'policies = ["no-merging", "ring-gossip"]\nlr = {json.dumps(GRID)}'))
    st = study_mod.load(f)
    assert edge_note(st, {"no-merging": 0.05, "ring-gossip": 0.08}) is None
    assert edge_note(st, {"no-merging": 0.1, "ring-gossip": 0.02}) == (
        "best step size at an end of [baselines] lr [0.02, 0.05, 0.08, 0.1]: no-merging at the grid's highest (0.1); "
        "ring-gossip at the grid's lowest (0.02); a wider grid may find a better one (only the step size is tuned: "
        "each rule's other settings are its policy file's)")


@pytest.mark.integration
def test_untuned_baselines_say_their_step_size_and_the_samples_of_the_workers_accuracies(tmp_path, data_dir):
    """(`evomerge baselines` without `[baselines] lr` named no step size, where the search's verdict says the
    baselines were not tuned; and its mean-worker column stood above the consensus's with no word that it is taken
    on fewer validation samples: `run.eval_samples`.)"""
    f = write_study(tmp_path)
    f.write_text(f.read_text().replace("score_samples = 8", "score_samples = 8\neval_samples = 100"))
    p = cli("baselines", "--study", str(f), "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stderr.splitlines() if line.startswith("note: ")]
    assert notes == ["note: mean and worst worker on 100 of the 500 validation samples (run.eval_samples); val acc on "
                     "all of them",
                     "note: the baselines ran at the study's step size (lr 0.05), not tuned for each ([baselines] lr = "
                     "[...] tunes it)"], p.stderr
    assert not (tmp_path / "runs").exists()  # nothing to keep where nothing is tuned
    r = cli("run", "--study", str(f), "--policy", "ring-gossip", cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0, r.stderr
    assert re.search(r"mean worker accuracy \(100 of 500 val samples\) +│ +0\.\d{4}", r.stdout), r.stdout
    f.write_text(f.read_text().replace("eval_samples = 100", "eval_samples = 0"))  # all of them: no word
    p = cli("baselines", "--study", str(f), "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert "validation samples" not in p.stderr, p.stderr

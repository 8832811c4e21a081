"""The verdict at the end of a search (search/verdict.py): the rule on stored values (a win, a loss, a tie, a
trade-off, minimised metrics, time), and the quick-start search through the command, which prints it, stores
it, shows it in `status` and puts it in the parent MLflow run's description."""

import json

import pytest

from evomerge import study
from evomerge.search import verdict
from searchutil import cli


def _one_objective():
    return study.load("mnist-skewed")  # val_accuracy only, lr 0.05


def _picks(*rows):
    return [{"number": n, "describe": f"policy of trial {n}", "per_seed": per_seed} for n, per_seed in rows]


def _bases(**rows):
    return [{"name": n.replace("_", "-"), "per_seed": v} for n, v in rows.items()]


@pytest.mark.unit
@pytest.mark.parametrize("diffs, maximize, want", [
    ([0.010, 0.012, 0.011], True, "better"),       # every seed agrees and far beyond 2 standard errors
    ([-0.010, -0.012, -0.011], True, "worse"),
    ([-0.010, -0.012, -0.011], False, "better"),   # a minimised metric: lower is better
    ([0.010, -0.001, 0.012], True, "tie"),         # one seed disagrees in sign
    ([0.001, 0.030, 0.0005], True, "tie"),         # all positive, but the mean is within 2 standard errors
    ([0.0, 0.0], True, "tie"),
])
def test_a_difference_is_a_tie_unless_every_seed_agrees_and_it_exceeds_two_standard_errors(diffs, maximize, want):
    assert verdict.decide(diffs, maximize)[2] == want


@pytest.mark.unit
def test_a_win_a_loss_and_a_tie_on_stored_values_lead_with_fedavg_and_ring_gossip():
    s = _one_objective()
    pick = [[0.920], [0.925], [0.918]]  # per seed, per objective
    v = verdict.judge(s, _picks((7, pick)), _bases(
        allreduce=[[0.930], [0.936], [0.929]],          # beats the pick on every seed, by about a point
        fedavg=[[0.900], [0.906], [0.897]],             # the pick wins by two points
        ring_gossip=[[0.922], [0.921], [0.919]]),       # signs disagree: a tie
        [1000, 1001, 1002], True, "the best val_accuracy")
    assert v["lines"] == ["trial 7: policy of trial 7",
                          "  beats fedavg: +2.00 ± 0.06 points val acc",
                          "  ties with ring-gossip: +0.03 ± 0.19 points val acc, higher on only 1 of 3 seeds",
                          "  loses to allreduce: -1.07 ± 0.03 points val acc"]
    assert v["beaten_by"] == ["allreduce"]
    assert v["headline"].startswith("A baseline beats the search: allreduce beats trial 7 on fresh seeds 1000, 1001, 1002")
    assert "-1.07 ± 0.03 points val acc" in v["headline"]
    # two baselines beat it: the bracket says whose figures it holds (it showed one's as if they were both's)
    v = verdict.judge(s, _picks((7, pick)), _bases(allreduce=[[0.930], [0.936], [0.929]],
                                                   fedavg=[[0.940], [0.946], [0.939]]),
                      [1000, 1001, 1002], True, "the best val_accuracy")
    assert v["headline"] == ("A baseline beats the search: fedavg and allreduce beat trial 7 on fresh seeds 1000, "
                             "1001, 1002 (against fedavg: -2.07 ± 0.03 points val acc)"), v["headline"]
    assert any("lr 0.05" in n and "not tuned" in n for n in v["notes"])


@pytest.mark.unit
def test_a_headline_against_tuned_baselines_says_the_picks_step_size_was_not():
    """(A new user read "A baseline beats the search" as a search of no use: the baselines had run at their tuned
    step sizes, the picks at the study's, and only the fourth note said so.)"""
    s = _one_objective()
    bases = _bases(fedavg=[[0.930], [0.936]], ring_gossip=[[0.90], [0.91]])
    for b in bases:
        b["lr"] = 0.2
    v = verdict.judge(s, _picks((7, [[0.920], [0.925]])), bases, [1000, 1001], True, "the best val_accuracy")
    assert v["headline"].startswith("A baseline beats the search: fedavg beats trial 7")
    assert v["headline"].endswith("; the baselines at their tuned step sizes, the picks at the study's lr 0.05 "
                                  "(search run.lr to tune theirs)"), v["headline"]
    picks = _picks((7, [[0.920], [0.925]]))
    picks[0]["run"] = {"lr": 0.1}  # searched with the policy: each side at its own best
    assert "tuned step sizes" not in verdict.judge(s, picks, bases, [1000, 1001], True, "x")["headline"]
    for b in bases:  # tuned to the study's own lr: both sides ran there, no handicap to say
        b["lr"] = s.run.lr
    assert "tuned step sizes" not in verdict.judge(s, _picks((7, [[0.920], [0.925]])), bases, [1000, 1001], True,
                                                   "x")["headline"]
    won = verdict.judge(s, _picks((7, [[0.95], [0.96]])), bases, [1000, 1001], True, "x")["headline"]
    assert won.startswith("trial 7 beats every baseline") and "tuned" not in won  # a win at a handicap stands


@pytest.mark.unit
def test_a_pick_that_beats_every_baseline_says_so():
    s = _one_objective()
    v = verdict.judge(s, _picks((3, [[0.95], [0.96]])), _bases(fedavg=[[0.90], [0.91]], ring_gossip=[[0.92], [0.925]]),
                      [1000, 1001], True, "the best val_accuracy")
    assert v["headline"] == "trial 3 beats every baseline (fedavg and ring-gossip) on fresh seeds 1000, 1001"
    assert v["beaten_by"] == []
    one = verdict.judge(s, _picks((3, [[0.95]])), _bases(fedavg=[[0.90]]), [1000], True, "the best val_accuracy")
    assert one["headline"].endswith(" on fresh seed 1000")  # (it said "on fresh seeds 1000")


@pytest.mark.unit
def test_two_objectives_trade_off_in_points_and_percent_of_bytes():
    s = study.load("mnist-gossip")  # val_accuracy and bytes
    pick = [[0.95, 78e6], [0.951, 78e6]]
    v = verdict.judge(s, _picks((7, pick)), _bases(
        fedavg=[[0.905, 52e6], [0.906, 52e6]],      # more accuracy for more bytes: a trade-off
        ring_gossip=[[0.915, 280e6], [0.916, 281e6]],  # better on both
        no_merging=[[0.78, 0.0], [0.79, 0.0]]),
        [1000, 1001], True, "rule")
    lines = dict(line.strip().split(": ", 1) for line in v["lines"][1:])
    assert lines["trades off with fedavg"] == "+4.50 ± 0.00 points val acc, 50% more bytes"
    assert lines["beats ring-gossip"].startswith("+3.50 ± 0.00 points val acc, 72%") and "fewer bytes" in lines["beats ring-gossip"]
    assert lines["trades off with no-merging"].endswith("78.0 MB more bytes (the baseline sends none)")
    assert v["headline"] == ("trial 7 beats ring-gossip; trades off with fedavg and no-merging "
                             "(on fresh seeds 1000, 1001)")
    # a tie on accuracy beside more bytes: each objective says its part ("loses to" beside a plus sign read oddly)
    v = verdict.judge(s, _picks((7, [[0.951, 78e6], [0.949, 78e6]])), _bases(fedavg=[[0.946, 3e6], [0.948, 3e6]]),
                      [1000, 1001], True, "rule")
    line = v["lines"][1].strip()
    assert line.startswith("loses to fedavg: +0.30 ± 0.20 points val acc (a tie), ") and line.endswith(" (worse)"), line


@pytest.mark.unit
def test_a_run_that_diverged_loses_whatever_its_numbers_say():
    """A diverged run reports accuracy 0 and the few bytes it sent before it blew up: never a win on bytes."""
    s = study.load("mnist-gossip")
    pick = {"number": 4, "describe": "p", "per_seed": [[0.0, 8e6], [0.95, 40e6]], "diverged": [1000]}
    v = verdict.judge(s, [pick], [{"name": "fedavg", "per_seed": [[0.9, 52e6], [0.9, 52e6]]},
                                  {"name": "allreduce", "per_seed": [[0.1, 1e6], [0.92, 2.8e9]], "diverged": [1000]}],
                      [1000, 1001], True, "rule")
    assert v["lines"][1] == "  loses to fedavg: the pick diverged on seed 1000"
    assert v["lines"][2] == "  ties with allreduce: the pick diverged on seed 1000; the baseline diverged on seed 1000"
    assert v["beaten_by"] == ["fedavg"]
    ok = {"number": 5, "describe": "p", "per_seed": [[0.93, 8e6], [0.94, 8e6]]}
    v = verdict.judge(s, [ok], [{"name": "allreduce", "per_seed": [[0.1, 1e6], [0.92, 2.8e9]], "diverged": [1000]}],
                      [1000, 1001], True, "rule")
    assert v["lines"][1] == "  beats allreduce: the baseline diverged on seed 1000"
    assert verdict.decide([float("nan"), 0.01], True)[2] == "tie"  # a metric a run could not give: no call


@pytest.mark.unit
def test_a_tied_objective_is_marked_and_time_is_in_seconds():
    s = study.load("mnist-stragglers")  # time_to_target, minimised
    v = verdict.judge(s, _picks((2, [[3.0], [3.2], [2.9]])), _bases(fedavg=[[15.5], [15.0], [16.1]],
                                                                     ring_gossip=[[3.1], [2.8], [3.3]]),
                      [1000, 1001, 1002], False, "the best time_to_target")
    assert v["lines"][1] == "  beats fedavg: 12.50 ± 0.40 s faster (time to target)"
    assert v["lines"][2].startswith("  ties with ring-gossip: ")
    assert any("--reevaluate 0" in n for n in v["notes"])  # judged on the search's own seeds: said
    assert not any("first evaluation" in n for n in v["notes"])


@pytest.mark.unit
def test_sides_that_all_missed_the_target_are_said_to_be_ranked_by_how_close_they_came():
    """(A time budget of 0.1 s: nothing reached the target, and the verdict said "loses to diloco: 0.00 s slower"
    with no word that both times were penalties.) The difference has its own digits; the note says why."""
    s = study.load("mnist-stragglers")
    budget = s.environment.time_budget
    pick, base = [[2 * budget - 0.003]], [[2 * budget - 0.0042]]
    picks, bases = _picks((1, pick)), _bases(diloco=base)
    picks[0]["missed"], bases[0]["missed"] = [1000], [1000]
    v = verdict.judge(s, picks, bases, [1000], True, "the best time_to_target")
    assert v["lines"][1].startswith("  loses to diloco: 0.0012 s slower (time to target), the target not reached by "
                                    "the pick on 1 of 1 seeds and by the baseline on 1 of 1 seeds"), v["lines"]
    said = [n for n in v["notes"] if n.startswith("no side reached the target")]
    assert said == [f"no side reached the target (val_accuracy {s.target:g}) on any seed: each is ranked by how close "
                    "it came, its penalty time (budget x (2 - best / target)); a longer study.environment.time_budget "
                    "or an easier study.objectives.target tells them apart by time"], v["notes"]
    assert v["none_reached"]  # (the search's next line names no policy to deploy then)
    picks[0]["missed"] = []  # the pick reached it: no such note
    v = verdict.judge(s, picks, bases, [1000], True, "the best time_to_target")
    assert not [n for n in v["notes"] if n.startswith("no side")] and not v["none_reached"]


@pytest.mark.unit
def test_sides_that_all_reach_the_target_at_the_first_round_are_said_to_be_indistinguishable():
    """(Four of six trials and two baselines tied at exactly the first round's end, and nothing said why.)"""
    s = study.load("mnist-stragglers")
    first = s.environment.time_budget / s.run.rounds
    v = verdict.judge(s, _picks((2, [[first], [first]])), _bases(fedavg=[[first], [first]], ring_gossip=[[3.1], [first]]),
                      [1000, 1001], True, "the best time_to_target")
    assert [n for n in v["notes"] if "first evaluation" in n] == [
        f"trial 2 and fedavg reached the target at the first evaluation ({first:g} s, the end of round 1) on every "
        "seed: time to target cannot tell them apart there; a harder study.objectives.target or more run.rounds can"]


@pytest.mark.unit
def test_the_fresh_seeds_runs_are_kept_apart_for_another_target():
    """A run's time to target depends on the target, which the fingerprint's hash leaves out: the verdict's runs on
    fresh seeds were found again for a study whose target changed. A study with no target keeps the key it had."""
    import dataclasses

    s = study.load("mnist-stragglers")
    assert s.target is not None
    keys = {verdict.fresh_key(dataclasses.replace(s, **kw)) for kw in (
        {}, {"target": s.target / 2}, {"target_metric": "mean_worker_accuracy"})}
    assert len(keys) == 3
    plain = _one_objective()
    from evomerge.search import fingerprint

    assert plain.target is None
    assert verdict.fresh_key(plain) == f"{verdict.FRESH_ATTR}{fingerprint.of(plain)['hash'][:16]}"


@pytest.mark.system
@pytest.mark.first  # about 70 s: the last test to start in file order, it ended the suite alone on one of 2 workers
def test_the_quick_start_search_prints_stores_and_logs_one_verdict(tmp_path, data_dir):
    """The README's first command, with a small budget (4 trials, 2 fresh seeds: the default 3 is held by
    test_more_fresh_seeds_run_only_the_seeds_not_run_before): the end screen has a verdict judged on fresh seeds
    against FedAvg and ring gossip first; `status` shows the same headline from the store; the parent MLflow
    run's description carries it; the picks are the trial `export` writes and the ones after it."""
    import optuna
    from mlflow.tracking import MlflowClient

    runs = tmp_path / "runs"
    p = cli("search", "--study", "mnist-gossip", "--n-trials", "4", "--seed", "3", "--reevaluate", "2", "--runs-dir",
            runs, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    ostudy = optuna.load_study(study_name="mnist-gossip", storage=f"sqlite:///{runs / 'mnist-gossip' / 'optuna.db'}")
    v = ostudy.user_attrs["verdict"]
    assert v["fresh"] and v["seeds"] == [1000, 1001] and v["objectives"] == ["val_accuracy", "bytes"]
    assert f"verdict: {v['headline']}" in p.stdout.replace("\n", " ") or f"verdict: {v['headline'][:60]}" in p.stdout
    names = [b["name"] for b in v["baselines"]]
    assert names[:2] == ["fedavg", "ring-gossip"] and set(names) == {"no-merging", "fedavg", "allreduce", "ring-gossip",
                                                                      "diloco"}
    # every pick and baseline ran on the same 2 fresh seeds, paired
    assert all(len(x["per_seed"]) == 2 for x in v["picks"] + v["baselines"])
    assert len(v["comparisons"]) == len(v["picks"]) * len(names)
    # the first pick is the policy `evomerge export` writes
    out = tmp_path / "best.json"
    e = cli("export", "--study", "mnist-gossip", "--runs-dir", runs, "-o", out, cwd=tmp_path, data_dir=data_dir)
    assert e.returncode == 0, e.stderr
    assert json.loads(out.read_text())["trial"] == v["picks"][0]["number"]
    # status reads the same verdict back
    st = cli("status", "--study", "mnist-gossip", "--runs-dir", runs, cwd=tmp_path, data_dir=data_dir)
    assert st.returncode == 0, st.stderr
    assert v["headline"][:60] in st.stdout.replace("\n", " ")
    # the parent MLflow run's description
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mnist-gossip' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("mnist-gossip")
    parents = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    assert v["headline"] in parents[0].data.tags["mlflow.note.content"]
    assert parents[0].data.tags["evomerge.verdict"] == v["headline"]
    # one seed: the table's figures are that seed's, with no spread column (it held a "-" in every row)
    assert "mnist-gossip: Pareto set (seed 0)" in p.stdout and "spread" not in p.stdout, p.stdout
    # the table's baselines are runs beside the trials, with the values the table printed
    import re

    def baseline_runs():
        return {r.data.tags["evomerge.baseline"]: r for r in client.search_runs([exp.experiment_id])
                if r.data.tags.get("evomerge.kind") == "baseline"}

    logged = baseline_runs()
    assert set(logged) == set(names)
    for name, r in logged.items():
        assert r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        shown = re.search(rf"│ {re.escape(name)} +│ +([0-9.]+) +│", p.stdout)
        assert shown and f"{r.data.metrics['final_val_accuracy']:.4f}" == shown.group(1), name
    # the fresh-seed runs are cached: the same command again judges the same values without new trials
    again = cli("search", "--study", "mnist-gossip", "--n-trials", "4", "--seed", "3", "--reevaluate", "2",
                "--runs-dir", runs, cwd=tmp_path, data_dir=data_dir)
    assert again.returncode == 0, again.stderr
    ostudy = optuna.load_study(study_name="mnist-gossip", storage=f"sqlite:///{runs / 'mnist-gossip' / 'optuna.db'}")
    assert ostudy.user_attrs["verdict"]["comparisons"] == v["comparisons"]
    # and logs no second copy of the baselines
    assert {n: r.info.run_id for n, r in baseline_runs().items()} == {n: r.info.run_id for n, r in logged.items()}
    assert len([r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("evomerge.kind") == "baseline"]) == 5


@pytest.mark.integration
def test_a_search_judges_on_three_fresh_seeds_unless_told(tmp_path, data_dir):
    """The default of --reevaluate, end to end (the quick start's test judges on 2 to save time)."""
    from conftest import write_study

    f = write_study(tmp_path)
    f.write_text(f.read_text().replace('policies = ["no-merging", "ring-gossip"]', 'policies = ["no-merging"]'))
    p = cli("search", "--study", f, "--n-trials", "1", "--sampler", "random", "--no-prune", "--no-log-model",
            "--runs-dir", tmp_path / "runs", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    import optuna

    v = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'optuna.db'}"
                          ).user_attrs["verdict"]
    assert v["fresh"] and v["seeds"] == [1000, 1001, 1002] and "fresh seeds 1000, 1001, 1002" in " ".join(
        p.stdout.split()), p.stdout


@pytest.mark.integration
def test_reevaluate_zero_judges_on_the_search_seeds_and_says_so(tmp_path, data_dir):
    from conftest import write_study

    f = write_study(tmp_path, seeds=(0, 1))
    p = cli("search", "--study", f, "--n-trials", "3", "--sampler", "random", "--no-prune", "--reevaluate", "0",
            "--runs-dir", tmp_path / "runs", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "verdict: " in p.stdout and "the search's own seeds 0, 1" in p.stdout
    assert "note: judged on the search's own seeds (--reevaluate 0; reevaluate=0 in Python)" in p.stdout
    bad = cli("search", "--study", f, "--reevaluate", "-1", "--runs-dir", tmp_path / "runs", cwd=tmp_path,
              data_dir=data_dir)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --reevaluate: -1 is out of range; allowed: [0, inf) fresh seeds"]


@pytest.mark.integration
def test_more_fresh_seeds_run_only_the_seeds_not_run_before(tmp_path, data_dir):
    """A verdict on 3 fresh seeds after one on 2 runs the third seed alone, for the picks and the baselines, with
    the same values on the first two (a new user saw "judging: 15 more runs to make" where 6 were new, and 3 runs
    again straight after a verdict that had made them); on 2 again, none."""
    import evomerge
    from conftest import write_study

    f = write_study(tmp_path)
    res = evomerge.search(str(f), n_trials=2, sampler="random", prune=False, verdict=False, runs_dir=tmp_path / "runs",
                          data_dir=data_dir)
    s, ostudy = study.load(f), res.optuna_study
    told = []
    first = verdict.compute(s, ostudy, 2, data_dir=data_dir, announce=lambda n, **kw: told.append(n))
    sides = len(first["picks"]) + len(first["baselines"])
    assert sum(told) == 2 * sides, told
    told.clear()
    more = verdict.compute(s, ostudy, 3, data_dir=data_dir, announce=lambda n, **kw: told.append(n))
    assert sum(told) == sides and more["seeds"] == [1000, 1001, 1002], told
    for a, b in zip(first["picks"] + first["baselines"], more["picks"] + more["baselines"]):
        assert b["per_seed"][:2] == a["per_seed"], (a, b)
    told.clear()
    assert verdict.compute(s, ostudy, 2, data_dir=data_dir, announce=lambda n, **kw: told.append(n))["lines"] == \
        first["lines"] and told == []


@pytest.mark.integration
def test_a_baseline_whose_interval_outlasts_the_run_is_said_to_have_never_merged(tmp_path, data_dir):
    """FedAvg averages every 50 local steps; a worker of this study takes 30: it sends nothing and is no-merging in
    all but name. The verdict and `evomerge run` say so, where the table alone showed 0 bytes."""
    from conftest import write_study

    f = write_study(tmp_path)
    f.write_text(f.read_text().replace('policies = ["no-merging", "ring-gossip"]', 'policies = ["fedavg", "ring-gossip"]')
                 .replace("low = 1.0, high = 30.0", "low = 40.0, high = 45.0")  # the trial never merges either
                 .replace("[policy]\n", '[policy]\nscheme = "allreduce"\n'))
    p = cli("search", "--study", f, "--n-trials", "1", "--sampler", "random", "--no-prune", "--reevaluate", "0",
            "--runs-dir", tmp_path / "runs", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    said = ("fedavg never merged: a worker's 30 local steps ended before its first merge (all workers average every "
            "50 steps, a=1, uniform weighting), so it ran as no-merging")
    assert f"note: {said}" in p.stdout.replace("\n", " ").replace("  ", " "), p.stdout
    assert "ring-gossip never merged" not in p.stdout
    r = cli("run", "--study", f, "--policy", "fedavg", cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")] == [f"note: {said}"]
    r = cli("run", "--study", f, "--policy", "ring-gossip", cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0 and "never merged" not in r.stderr
    # the export of a trial that never merged says so too (it said nothing)
    r = cli("export", "--study", f, "--runs-dir", tmp_path / "runs", "-o", tmp_path / "best.json", cwd=tmp_path,
            data_dir=data_dir)
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")]
    # (first what the search's verdict said of it, then that it never merged)
    assert len(notes) == 2 and notes[0].startswith("note: the search's verdict on trial 0 (the search's own seed 0): "
                                                   "it "), r.stderr
    assert notes[1].startswith("note: trial 0 never merged: a worker's 30 local steps ended before its first merge "
                               "(all workers average every 4") and notes[1].endswith("so it ran as no-merging"), r.stderr


@pytest.mark.integration
def test_a_run_of_one_worker_says_it_has_no_one_to_merge_with(tmp_path, data_dir):
    """A study copied with `workers = 1`: `evomerge run --policy allreduce` said its 30 local steps ended before its
    first merge, with a merge due every step. The reason is the one worker."""
    from conftest import write_study

    f = write_study(tmp_path, workers=1, topologies=("complete",))
    r = cli("run", "--study", f, "--policy", "allreduce", cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")] == [
        "note: allreduce never merged: one worker has no one to merge with (run.workers = 1), so it ran as no-merging"]


@pytest.mark.unit
def test_bytes_read_in_the_unit_that_shows_them():
    """A small model's payloads are kilobytes: in megabytes the verdict read '0.0 MB more bytes'."""
    from evomerge.units import size

    assert [size(n) for n in (0, 512, 20544, 924_886_000)] == ["0 B", "512 B", "20.5 kB", "924.9 MB"]
    text = verdict.difference_text("bytes", [20544.0], [0.0], 20544.0, 0.0, False)
    assert text == "20.5 kB more bytes (the baseline sends none)"
    # equal bytes are the same, not "0% fewer bytes"; a difference of a few percent is said
    assert verdict.difference_text("bytes", [1000.0, 1000.0], [1000.0, 1000.0], 0.0, 0.0, False) == "the same bytes"
    assert verdict.difference_text("bytes", [960.0, 960.0], [1000.0, 1000.0], 0.0, 0.0, False) == "4% fewer bytes"
    # one seed has no spread to say ("± 0.00" read as a measured zero)
    assert verdict.difference_text("val_accuracy", [0.9], [0.8], 0.1, 0.0, True) == "+10.00 points val acc"
    assert verdict.difference_text("val_accuracy", [0.9, 0.9], [0.8, 0.8], 0.1, 0.0, True) == \
        "+10.00 ± 0.00 points val acc"
    # a loss's difference in words: lower or higher, not a sign to read against "loses to"
    assert verdict.difference_text("val_loss", [0.50, 0.52], [0.52, 0.53], -0.015, 0.005, False) == \
        "0.015 ± 0.005 lower val loss (by 2.9%)"  # (of the baseline's 0.525: a regression's loss said no scale)
    assert verdict.difference_text("val_loss", [0.6], [0.5], 0.1, 0.0, False) == "0.1 higher val loss (by 20%)"
    assert verdict.difference_text("val_loss", [0.9], [0.3], 0.6, 0.0, False) == "0.6 higher val loss (by 200%)"
    assert verdict.difference_text("val_loss", [1.0], [1.0], 1e-7, 0.0, False) == "1e-07 higher val loss (by <0.01%)"
    # a ratio's spread beside its figure ("5.2x the bytes (± 0.1x) (worse)" read as two asides)
    assert verdict.difference_text("bytes", [5200.0, 5400.0], [1000.0, 1000.0], 0.0, 0.0, False) == \
        "5.3x ± 0.1x the bytes"
    assert verdict.difference_text("val_loss", [0.5, 0.6], [0.6, 0.5], 0.0, 0.1, False) == \
        "the same val loss on average (± 0.1)"

"""`evomerge export` on a study with several objectives writes one policy by a stated rule (issue 28, part 3): the
best second objective among the Pareto-optimal trials within a tolerance of the best first, under the user's
limits; real SQLite, a real NSGA-II search, the command as a user runs it."""

import json

import pytest

import evomerge
from conftest import write_study
from evomerge import study
from evomerge.search.results import pareto_trials
from searchutil import cli


@pytest.fixture(scope="module")
def searched(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("pick")
    f = write_study(d, name="two", objectives=("val_accuracy", "bytes"))
    res = evomerge.search(study.load(f), n_trials=10, sampler="nsga2", runs_dir=d / "runs", seed=4,
                          data_dir=data_dir, prune=False)
    return d, f, res.optuna_study


@pytest.mark.system
def test_export_picks_the_cheapest_close_to_the_best_accuracy_and_says_so(searched, data_dir):
    d, f, ostudy = searched
    front = pareto_trials(ostudy, study.load(f))
    assert len(front) >= 2  # a trade-off to pick from
    most_accurate = max(front, key=lambda t: t.values[0])
    tol = most_accurate.values[0] - min(t.values[0] for t in front)  # every front trial is close enough
    p = cli("export", "--study", str(f), "-o", "best.json", "--tolerance", str(tol), cwd=d, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((d / "best.json").read_text())
    cheapest = min(front, key=lambda t: t.values[1])
    assert doc["trial"] == cheapest.number != most_accurate.number  # not the first objective's best
    assert doc["picked_by"] == (f"the best bytes among the Pareto-optimal trials within {tol:g} of the best "
                                "val_accuracy")
    assert f"wrote trial {cheapest.number} (" in p.stdout and "picked as the best bytes" in p.stdout
    p = cli("export", "--study", str(f), "-o", "tight.json", "--tolerance", "0", cwd=d, data_dir=data_dir)
    assert json.loads((d / "tight.json").read_text())["trial"] == most_accurate.number
    limit = sorted(t.values[1] for t in front)[1]  # the two cheapest meet it; the most accurate may not
    p = cli("export", "--study", str(f), "-o", "lim.json", "--tolerance", "0", "--limit", f"bytes={limit}", cwd=d,
            data_dir=data_dir)
    got = json.loads((d / "lim.json").read_text())
    meets = [t for t in front if t.values[1] <= limit]
    assert got["trial"] == max(meets, key=lambda t: (t.values[0], -t.number)).number


@pytest.mark.system
def test_a_limit_nothing_meets_is_one_line_naming_the_option(searched, data_dir):
    d, f, _ = searched
    for args, line in [(["--limit", "bytes=1"], "error: --limit: bytes=1: no Pareto-optimal trial meets it"),
                       (["--limit", "nope=3"], "error: --limit: 'nope' is not an objective of two; allowed: "
                                               "val_accuracy, bytes"),
                       (["--limit", "bytes"], "error: --limit: 'bytes' is not OBJECTIVE=VALUE (e.g. bytes=1e8)")]:
        p = cli("export", "--study", str(f), "-o", "x.json", *args, cwd=d, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
    assert not (d / "x.json").exists()  # nothing written

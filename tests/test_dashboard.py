"""The dashboard, opened from file in a real headless Chromium (Debian's, driven by Playwright)."""

import shutil
from pathlib import Path

import numpy as np
import pytest

import evomerge
from conftest import write_study
from evomerge.report import dashboard
from evomerge import study
from evomerge.search.storage import default_storage
from evomerge.report.tracking import default_tracking_uri

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def open_page(path: Path, screenshot: Path, probe: str | None = None):
    """Load the page from file; return (console errors, page errors, {section: drawn?}, text, requests off disk),
    and with ``probe`` (a JavaScript function) what it returns about the page, last."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        console, errors, remote = [], [], []
        page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:", "blob:")) else None)
        page.goto(path.resolve().as_uri(), wait_until="load")
        page.wait_for_timeout(500)
        drawn = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('section')].map(s => [s.id,
            !!s.querySelector('.js-plotly-plot svg.main-svg, .js-plotly-plot canvas')]))""")
        text = page.inner_text("body")
        probed = page.evaluate(probe) if probe else None
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    if probe:
        return console, errors, drawn, text, remote, probed
    return console, errors, drawn, text, remote


# What the plots look like, read from the Plotly figures in the page (the data and layout Plotly drew)
PROBE = """() => {
  const fig = id => document.getElementById(id);
  const rect = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const plots = {};
  for (const div of document.querySelectorAll('.js-plotly-plot')) {
    const title = div.querySelector('.gtitle'), bar = div.querySelector('.modebar');
    plots[div.id] = {title: title ? rect(title) : null, modebar: bar ? rect(bar) : null,
                     subtitles: [...div.querySelectorAll('.annotation')].map(rect)};
  }
  const curves = fig('plot-curves'), par = fig('plot-parallel'), trade = fig('plot-tradeoff'), hist = fig('plot-history');
  return {
    plots,
    curves: curves && {xaxis3: curves.layout.xaxis3.type, yaxis2: curves.layout.yaxis2.type,
                       yaxis2_title: curves.layout.yaxis2.title.text, xaxis3_title: curves.layout.xaxis3.title.text,
                       distances: curves.data.filter(t => t.yaxis === 'y2').flatMap(t => t.y),
                       mb: curves.data.filter(t => t.xaxis === 'x3').flatMap(t => t.x)},
    parallel: par && {lines: par.data.filter(t => t.mode === 'lines').map(t => [t.y[0], t.line.color]),
                      scale: (par.data.find(t => t.marker && t.marker.colorscale) || {marker: {}}).marker},
    tradeoff: trade && Object.fromEntries(trade.data.map(t => [t.name, t.x.length])),
    history: hist && Object.fromEntries(hist.data.map(t => [t.name, t.x.length])),
  };
}"""


def luminance(color: str) -> float:
    """Relative luminance (0 black .. 1 white) of an ``rgb(...)`` or ``#rrggbb`` colour."""
    if color.startswith("#"):
        rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    else:
        rgb = [float(v) for v in color[color.index("(") + 1:color.index(")")].split(",")[:3]]
    return (0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]) / 255


def overlaps(a, b) -> bool:
    return a is not None and b is not None and a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.fixture(scope="module")
def searched(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("dash")
    f = write_study(d, topologies=("ring", "complete"), seeds=(0, 1))
    s = study.load(f)
    evomerge.search(s, n_trials=7, sampler="tpe", runs_dir=d / "runs", data_dir=data_dir)
    evomerge.search(s, n_trials=10, sampler="random", runs_dir=d / "runs", data_dir=data_dir)  # a second sampler
    return d, s


@pytest.mark.xdist_group("dashboard-searched")  # one worker computes the module fixture they share
@pytest.mark.system
def test_dashboard_renders_every_section_in_chromium(searched, data_dir, tmp_path):
    d, s = searched
    study_dir = d / "runs" / "tiny"
    page = dashboard.build(s, default_storage(study_dir), default_tracking_uri(study_dir), tmp_path / "dash",
                           data_dir=data_dir)
    assert (page.parent / "plotly.min.js").stat().st_size > 1_000_000  # plotly.js beside the page, not a CDN
    assert "cdn" not in page.read_text().lower()
    shot = tmp_path / "dashboard.png"
    console, errors, drawn, text, remote, probed = open_page(page, shot, PROBE)
    assert console == [] and errors == [] and remote == []
    for section in dashboard.SECTIONS:
        assert drawn.get(section), (section, drawn)
    assert "Top trials" in text and "ring-gossip" in text and "no-merging" in text
    # the search's verdict (search/verdict.py) heads the page, as stored with the study
    import optuna

    stored = optuna.load_study(study_name="tiny", storage=default_storage(study_dir)).user_attrs["verdict"]
    assert text.index("Verdict") < text.index("Optimisation history") and stored["headline"] in text
    assert all(line.strip() in text for line in stored["lines"])
    assert "tpe: best so far" in page.read_text() and "random: best so far" in page.read_text()
    assert shot.stat().st_size > 50_000
    # importances from a handful of trials are said to be unsteady (a reader took 5 trials' bars at their word)
    complete = sum(1 for t in optuna.load_study(study_name="tiny", storage=default_storage(study_dir)).trials
                   if t.state.name == "COMPLETE")
    assert f"From {complete} complete trials: too few to rank the fields firmly" in text
    # learning curves: accuracy against MB on a log axis (nothing sent: drawn at a positive floor, said so);
    # consensus distance floored at 1e-6 and the axis says so
    curves = probed["curves"]
    assert curves["xaxis3"] == "log" and "0 MB drawn at" in curves["xaxis3_title"]
    assert min(curves["mb"]) > 0
    assert curves["yaxis2"] == "log" and "floored at 1e-06" in curves["yaxis2_title"]
    assert min(v for v in curves["distances"] if v is not None) >= 1e-6
    # parallel coordinates: the best trial's line is dark on the white page, the worst is still visible
    lines = probed["parallel"]["lines"]
    assert len(lines) >= 5
    best_colour = max(lines, key=lambda ln: ln[0])[1]
    worst_colour = min(lines, key=lambda ln: ln[0])[1]
    assert luminance(best_colour) < 0.35 < luminance(worst_colour) < 0.9, (best_colour, worst_colour)
    scale = probed["parallel"]["scale"]
    assert luminance(scale["colorscale"][-1][1]) < 0.35 and not scale["reversescale"]
    # plotly's toolbar covers no title; subplot titles sit below the main title; the small peer graph has none
    plots = probed["plots"]
    for div_id, p in plots.items():
        assert not overlaps(p["title"], p["modebar"]), div_id
    assert plots["plot-policy"]["modebar"] is None and plots["plot-curves"]["modebar"] is not None
    main = plots["plot-curves"]["title"]
    assert all(sub[1] >= main[3] for sub in plots["plot-curves"]["subtitles"])
    # the default (local) MLflow store: run ids are not links, and the page says how to open them
    assert "evomerge ui --study" in text and "workflowType=machine_learning" in text
    assert "go to the address it prints, which ends with /#/experiments/" in text  # (it said "followed by" it)


@pytest.mark.system
def test_a_study_with_no_completed_trials_says_so(tmp_path, data_dir):
    s = study.load(write_study(tmp_path))
    import optuna

    from evomerge.search.config import make_config
    from evomerge.search.storage import load_or_create, open_storage

    cfg = make_config(s, runs_dir=tmp_path / "runs")
    ostudy = load_or_create(cfg, open_storage(cfg.storage))
    ostudy.tell(ostudy.ask(), state=optuna.trial.TrialState.FAIL)  # one failed trial, none completed
    page = dashboard.build(s, cfg.storage, default_tracking_uri(cfg.study_dir), tmp_path / "dash")
    console, errors, drawn, text, _ = open_page(page, tmp_path / "empty.png")
    assert console == [] and errors == []
    assert "No completed trials yet" in text and "1 fail" in text
    # the command that fills this store (it named the study alone: ./runs, another store)
    assert f"Run evomerge search --study {s.path} --runs-dir {tmp_path / 'runs'}, then build" in " ".join(text.split())


def test_the_importances_name_every_field_of_a_large_space(tmp_path):
    """(On mnist-skewed's 30 searched fields every other bar had no name, the most important one's among them.)"""
    import optuna

    s = study.load("mnist-skewed")
    names = [p.name for p in s.search.space]
    ostudy = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    dists = {n: optuna.distributions.FloatDistribution(0.0, 1.0) for n in names}
    for i in range(12):
        t = ostudy.ask(dists)
        ostudy.tell(t, sum(t.params.values()) + 0.1 * i)
    fig = dashboard.importance_figure(ostudy, s)
    shown = list(fig.data[0].y)
    assert len(names) >= 25 and sorted(shown) == sorted(names)
    assert fig.layout.yaxis.dtick == 1 and fig.layout.height >= 22 * len(names)  # a tick per bar, room for each


def test_one_trial_has_no_importances_and_a_failed_trial_says_what_it_is(tmp_path):
    """(One complete trial: Optuna's warning on stderr and every field drawn as equally important, 0.06 each; a
    failed trial without an error message was hovered as "interrupted: ".)"""
    import warnings

    import optuna

    s = study.load("mnist-skewed")
    ostudy = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    dists = {p.name: optuna.distributions.FloatDistribution(0.0, 1.0) for p in s.search.space}
    ostudy.tell(ostudy.ask(dists), 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of Optuna's either
        with pytest.raises(ValueError, match="^importances need at least 2 complete trials; the study has 1$"):
            dashboard.importance_figure(ostudy, s)
    t = ostudy.ask(dists)
    t.set_user_attr("failure", "interrupted")  # (as the search marks one it stopped)
    ostudy.tell(t, state=optuna.trial.TrialState.FAIL)
    fig = dashboard.history_figure(ostudy, s)
    (failed,) = [d for d in fig.data if d.name.startswith("failed")]
    assert list(failed.text) == ["trial 1: interrupted"] and list(failed.y) == [0.9]
    ostudy.tell(ostudy.ask(dists), 0.8)
    assert dashboard.importance_figure(ostudy, s).data  # two complete: drawn


def test_the_top_trials_say_a_time_past_the_budget_is_a_miss(tmp_path):
    """(A trial that missed the target showed its penalty time as "20.4000 | ok", where status and export say
    "(missed)".)"""
    from evomerge.policy import MergePolicy

    f = write_study(tmp_path, name="timed", workers=6, objectives=("time_to_target",))
    f.write_text(f.read_text().replace("[policy]", ENVIRONMENT + "[policy]")
                 .replace('metrics = ["time_to_target"]', 'metrics = ["time_to_target"]\ntarget = 0.5'))
    s = study.load(f)
    rows = [{"number": n, "values": [v], "policy": MergePolicy().to_dict()} for n, v in ((0, 2.5), (1, 4.2))]
    cells = [r["cells"] for r in dashboard._top_table(s, rows, {}, None, "sqlite:///x.db")["rows"]]
    assert cells == [["2.5000"], ["4.2000 (missed)"]]  # the budget: 3 s


def test_pareto_front_keeps_only_non_dominated_points():
    pts = [(0.9, 100.0, "a"), (0.8, 50.0, "b"), (0.85, 120.0, "c"), (0.9, 80.0, "d"), (0.7, 10.0, "e")]
    assert [k for _, _, k in dashboard.pareto_2d(pts)] == ["e", "b", "d"]


@pytest.mark.parametrize("fields, said, unsaid", [
    ({"scheme": "gossip", "mixing_weight": 0.4}, "The weight on the incoming model is 0.4 throughout.",
     "workers' average"),
    ({"scheme": "allreduce", "mixing_weight": 0.4}, "The weight on the workers' average is 0.4 throughout.",
     "incoming"),
    ({"scheme": "allreduce", "outer_optimizer": "nesterov", "mixing_weight": 1.0}, "outer nesterov step", "weight on"),
    ({"scheme": "allreduce", "payload": "gradient", "mean_interval": 1, "mixing_weight": 1.0}, "gradient",
     "weight on")])
def test_the_policy_section_says_what_a_merge_moves_toward_and_not_a_weight_no_merge_takes(fields, said, unsaid):
    """An all-reduce lerps toward the workers' average, not an "incoming model"; an outer step and an all-reduce of
    gradients lerp toward nothing (their mixing_weight is inert)."""
    from evomerge.policy import MergePolicy

    words = dashboard.policy_words(MergePolicy.from_dict(fields), 100)
    assert said in words and unsaid not in words, words


@pytest.mark.xdist_group("dashboard-searched")  # one worker computes the module fixture they share
@pytest.mark.system
def test_dashboard_command_writes_the_page(searched, tmp_path, data_dir):
    import subprocess
    import sys

    d, s = searched
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "dashboard", "--study", str(s.path), "--runs-dir",
                        str(d / "runs"), "--out", str(tmp_path / "out"), "--no-baselines"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"wrote {tmp_path / 'out' / 'index.html'}" in p.stdout and (tmp_path / "out" / "index.html").is_file()
    assert "note:" not in p.stderr  # the search's own MLflow store: nothing left out of the page
    # an MLflow server that does not answer: the page is written at once and says why it shows no runs (this and the
    # next in this process, cli.main: the command's code without a Python start-up each)
    from searchutil import cli

    p = cli("dashboard", "--study", s.path, "--runs-dir", d / "runs", "-o", tmp_path / "dead", "--no-baselines",
            "--tracking-uri", "http://127.0.0.1:9", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "MLflow runs not read: --tracking-uri: cannot reach the MLflow server at http://127.0.0.1:9" in \
        (tmp_path / "dead" / "index.html").read_text()
    # and the terminal says so too, in one line: the page is not the only place a user would see it
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith("note: MLflow runs not read: --tracking-uri: cannot reach the "
                                                   "MLflow server at http://127.0.0.1:9 ("), p.stderr
    # a server that answers but turns the tracking API away: why, not "no runs found"
    from conftest import refusing_server

    with refusing_server() as uri:
        p = cli("dashboard", "--study", s.path, "--runs-dir", d / "runs", "--out", tmp_path / "refused", "--no-baselines",
                "--tracking-uri", uri, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    said = f"MLflow runs not read: --tracking-uri: {uri} answers, but not as an MLflow tracking server (PERMISSION_DENIED"
    assert said in (tmp_path / "refused" / "index.html").read_text() and f"note: {said}" in p.stderr, p.stderr
    # a study read from its database elsewhere, its runs tracked elsewhere: the page says where it looked, and the
    # command makes no empty MLflow store there (the dashboard only reads; it left a blank runs/<study>/mlflow.db)
    other = tmp_path / "other"
    other.mkdir()
    p = cli("dashboard", "--study", s.path, "--storage", f"sqlite:///{d / 'runs' / s.name / 'optuna.db'}", "--out",
            other / "dash", "--no-baselines", cwd=other, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert f"note: No MLflow store at sqlite:///{other / 'runs' / s.name / 'mlflow.db'} (a search that tracked its " \
           "runs elsewhere: pass --tracking-uri, or set MLFLOW_TRACKING_URI)" in p.stderr, p.stderr
    assert not (other / "runs").exists()
    # --out a file, or under one: one line naming --out (a FileExistsError traceback), the file kept
    (tmp_path / "best.json").write_text("{}")
    for out, said in ((tmp_path / "best.json", f"{str(tmp_path / 'best.json')!r} is a file; allowed: a folder"),
                      (tmp_path / "best.json" / "dash", f"cannot write in {str(tmp_path / 'best.json')!r} (not a "
                                                        "folder); allowed: a folder this user can write in"),
                      # (a page's name: it made a folder dash.html, and wrote dash.html/index.html)
                      (tmp_path / "dash.html", f"{str(tmp_path / 'dash.html')!r} names a page; allowed: a folder for "
                                               f"index.html and plotly.min.js (made if missing), e.g. "
                                               f"{str(tmp_path / 'dash')!r}")):
        p = cli("dashboard", "--study", s.path, "--runs-dir", d / "runs", "--out", out, "--no-baselines",
                cwd=tmp_path, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.startswith(f"error: --out: {said}") and len(p.stderr.splitlines()) == 1, \
            p.stderr
    assert (tmp_path / "best.json").read_text() == "{}" and not (tmp_path / "dash.html").exists()


@pytest.mark.system
def test_the_browser_check_catches_a_broken_page(tmp_path):
    """Negative control: a script error and an undrawn plot are seen by the same check."""
    (tmp_path / "broken.html").write_text('<html><body><section id="history"><div class="js-plotly-plot"></div></section>'
                                          '<script>console.error("boom"); undefinedFunction();</script></body></html>')
    console, errors, drawn, _, _ = open_page(tmp_path / "broken.html", tmp_path / "broken.png")
    assert console == ["boom"] and len(errors) == 1 and drawn == {"history": False}


@pytest.mark.system
def test_diverged_trials_are_marked_and_kept_off_the_pareto_front(tmp_path, data_dir):
    """A real search whose runs blow up (lr = 1e30): Optuna stores them as complete, with accuracy 0 and few
    bytes (a run that stops early sends little), which would look Pareto-optimal. The dashboard marks them
    diverged and draws no front through them; MLflow names and tags their runs."""
    from mlflow import MlflowClient

    f = write_study(tmp_path, name="blowup", objectives=("val_accuracy", "bytes"))
    f.write_text(f.read_text().replace("rounds = 3", "rounds = 3\nlr = 1e30"))
    s = study.load(f)
    res = evomerge.search(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir)
    assert [r.get("run_status") for r in res.records] == ["diverged"] * 3
    study_dir = tmp_path / "runs" / "blowup"
    page = dashboard.build(s, default_storage(study_dir), default_tracking_uri(study_dir), tmp_path / "dash",
                           data_dir=data_dir, compute_baselines=False)
    console, errors, drawn, text, _, probed = open_page(page, tmp_path / "blowup.png", PROBE)
    assert console == [] and errors == []
    assert drawn["history"] and drawn["tradeoff"]
    assert probed["history"]["diverged"] == 3 and not any(k.endswith(": complete") and v for k, v in probed["history"].items())
    assert probed["tradeoff"]["diverged (not on the front)"] == 3
    assert probed["tradeoff"]["Pareto front"] == 0 and probed["tradeoff"]["trials"] == 0
    assert "3 of the complete diverged" in text
    rows = [ln.split("\t") for ln in text.splitlines() if "gossip" in ln and "\t" in ln]  # the top trials table
    assert rows and all(r[3] == "diverged" for r in rows), rows  # trial, accuracy, bytes, status, ...
    client = MlflowClient(tracking_uri=default_tracking_uri(study_dir))
    exp = client.get_experiment_by_name("blowup")
    runs = [r for r in client.search_runs([exp.experiment_id]) if "optuna.trial_number" in r.data.tags]
    assert sorted(r.info.run_name for r in runs) == [f"trial-{i} (diverged)" for i in range(3)]
    assert all(r.data.tags["evomerge.status"] == "diverged" and r.info.status == "FAILED" for r in runs)


# the tiny study (conftest.write_study) on a two-site cluster with stragglers, judged on time to target
ENVIRONMENT = """[environment]
step_time = 0.01
sites = 2
bandwidth = 1e9
bandwidth_inter = 2e6
latency_inter = 0.01
speeds = [1.0, 1.0, 0.5, 1.0, 1.0, 0.25]
time_budget = 3.0
"""

TIME_PROBE = """() => {
  const data = id => document.getElementById(id).data;
  const tl = data('plot-timeline'), cl = data('plot-cluster'), trade = document.getElementById('plot-tradeoff');
  return {
    timeline: tl.map(t => [t.name, t.yaxis, t.x.length]),
    speeds: cl.find(t => t.type === 'bar').y,
    heat: cl.find(t => t.type === 'heatmap').z,
    tradeoff_y: trade.layout.yaxis.title.text,
    first: [...document.querySelectorAll('section')].map(s => s.id)[0],
  };
}"""


@pytest.mark.system
def test_a_time_study_shows_its_cluster_and_where_the_time_went(tmp_path, data_dir):
    """A study with an [environment]: the trade-off plots time to target (not accuracy) against bytes; the page
    draws the cluster (speeds by site, links) and each worker's compute, idle and sending under the best policy and
    under all-reduce every step, which idles at the barriers. When a baseline beats every trial, the page says so
    at the top and in the best policy's title."""
    import optuna

    from evomerge.search import verdict

    f = write_study(tmp_path, name="timed", workers=6, steps=60, objectives=("time_to_target",))
    f.write_text(f.read_text().replace("[policy]", ENVIRONMENT + "[policy]")
                 .replace('metrics = ["time_to_target"]', 'metrics = ["time_to_target"]\ntarget = 0.5'))
    s = study.load(f)
    evomerge.search(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir, reevaluate=0)
    study_dir = tmp_path / "runs" / "timed"
    page = dashboard.build(s, default_storage(study_dir), default_tracking_uri(study_dir), tmp_path / "dash",
                           data_dir=data_dir)
    console, errors, drawn, text, remote, probed = open_page(page, tmp_path / "timed.png", TIME_PROBE)
    assert console == [] and errors == [] and remote == []
    for section in dashboard.SECTIONS + dashboard.TIME_SECTIONS:
        assert drawn.get(section), (section, drawn)
    assert probed["tradeoff_y"].startswith("simulated seconds to the target")
    assert probed["speeds"] == pytest.approx([1.0, 1.0, 0.5, 1.0, 1.0, 0.25])
    heat = probed["heat"]  # log10 MB/s: 1000 MB/s inside a site, 2 MB/s between the two
    assert heat[0][1] == pytest.approx(3.0) and heat[0][5] == pytest.approx(0.30103, abs=1e-4) and heat[0][0] is None
    bars = {(name, axis): n for name, axis, n in probed["timeline"]}
    assert bars[("compute", "y")] >= 6 and bars[("compute", "y2")] >= 6  # every worker computes in both panels
    assert bars[("idle", "y2")] > 6 and bars[("sending", "y2")] > 6  # all-reduce: barriers, then the ring
    assert "allreduce (every step): compute" in text and "idle" in text
    # a baseline that beats every trial is said at the top, from the stored verdict
    ostudy = optuna.load_study(study_name="timed", storage=default_storage(study_dir))
    best = ostudy.best_trial
    v = verdict.judge(s, [{"number": best.number, "describe": "its policy", "per_seed": [[2.0], [2.1]]}],
                      [{"name": "ring-gossip", "per_seed": [[1.0], [1.05]]}], [1000, 1001], True, "the best")
    ostudy.set_user_attr("verdict", v)
    page = dashboard.build(s, default_storage(study_dir), default_tracking_uri(study_dir), tmp_path / "dash2",
                           data_dir=data_dir, compute_baselines=False)
    _, _, _, text, _, probed = open_page(page, tmp_path / "beaten.png", TIME_PROBE)
    assert probed["first"] == "verdict"
    assert "A baseline beats the search: ring-gossip beats trial" in text.split("Optimisation history")[0]
    assert f"The best trial, beaten by ring-gossip: trial {best.number}" in text


def test_the_pages_commands_name_a_shipped_study_by_its_name(tmp_path):
    """(`dashboard --study mnist-gossip` said `evomerge ui --study /…/site-packages/…/mnist-gossip.toml`.)"""
    assert dashboard._command_for("ui", study.load("mnist-gossip"), "sqlite:///elsewhere/m.db", "mlflow.db",
                                  "--tracking-uri") == "evomerge ui --study mnist-gossip --tracking-uri sqlite:///elsewhere/m.db"
    own = study.load(write_study(tmp_path))  # a user's file, which the name alone would not find
    assert dashboard._command_for("ui", own, "sqlite:///x/m.db", "mlflow.db", "--tracking-uri").startswith(
        f"evomerge ui --study {own.path} ")


def test_a_language_models_curves_are_of_its_metric():
    """A language model's histories hold a next-token accuracy beside its perplexity: the curves follow the
    study's metric (perplexity), as the trade-off picture does, not the accuracy first found (they did)."""
    from evomerge.report.dashboard import curves_figure

    def history(ppl):
        return {"step": [0, 10, 20], "bytes": [0, 1e5, 2e5], "consensus_distance": [0.0, 0.1, 0.05],
                "val_accuracy": [0.1, 0.2, 0.3], "val_perplexity": ppl, "val_loss": [float(np.log(p)) for p in ppl]}

    best, base = {"number": 3, "history": history([60.0, 30.0, 20.0])}, [{"name": "fedavg", "history": history(
        [61.0, 33.0, 25.0])}]
    for prefer, want, title in (("val_perplexity", [60.0, 30.0, 20.0], "validation perplexity"),
                                ("val_accuracy", [0.1, 0.2, 0.3], "validation accuracy"),
                                ("time_to_target", [0.1, 0.2, 0.3], "validation accuracy")):  # not a curve: the task's
        fig = curves_figure(best, base, prefer)
        assert list(fig.data[0].y) == want and fig.layout.annotations[0].text == title, prefer
    # a tuned baseline's step size is in its name ([baselines] lr: each at its best)
    base[0]["lr"] = 0.2
    assert [t.name for t in curves_figure(best, base).data if t.showlegend is not False] == ["best: trial 3",
                                                                                              "fedavg (lr 0.2)"]
    # a history without the study's metric: the one every history has
    del best["history"]["val_perplexity"]
    assert fig.layout.annotations[0].text == "validation accuracy"
    assert curves_figure(best, base, "val_perplexity").layout.annotations[0].text == "validation accuracy"


@pytest.mark.parametrize("fields, title, edges", [
    ({"scheme": "async", "outer_optimizer": "nesterov", "mean_interval": 3}, "Each worker pushes to the server", 6),
    ({"scheme": "allreduce"}, "Everybody averages with everybody", 15),
    ({"scheme": "gossip", "topology": "ring"}, "Who merges with whom: ring", 6),
    ({"scheme": "none"}, "No merging until the end", 0)])
def test_the_policy_graph_draws_who_merges_with_whom(fields, title, edges):
    """(Asynchronous DiLoCo's best trial, 616 merge events, was drawn as "No merging until the end".)"""
    fig = dashboard.policy_figure(evomerge.MergePolicy(**fields), 6)
    assert fig.layout.title.text.startswith(title)
    assert sum(1 for t in fig.data if t.mode == "lines") == edges


def test_baselines_at_one_point_share_one_label():
    """(No-merging and a FedAvg that never merged, both at no bytes and the same accuracy, had their labels printed
    over each other: "nofedavg (0 bytes)".)"""
    base = [{"name": "no-merging", "bytes": 0, "val_accuracy": 0.61}, {"name": "fedavg", "bytes": 0, "val_accuracy": 0.61},
            {"name": "ring-gossip", "bytes": 0, "val_accuracy": 0.70},
            {"name": "diloco", "bytes": 2e6, "val_accuracy": 0.8}]
    fig = dashboard.tradeoff_figure([], base)
    (stars,) = [t for t in fig.data if t.name == "baselines"]
    assert list(stars.text) == ["no-merging, fedavg (0 bytes)", "ring-gossip (0 bytes)", "diloco"]
    # two at one x: the higher's label above it, the lower's below (both between them, they read as one)
    assert list(stars.textposition) == ["bottom center", "top center", "top center"]

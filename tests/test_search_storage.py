"""search/storage.py and search/fingerprint.py: the stored study, its fingerprint, the lock, Optuna's logging."""

import contextlib
import importlib.util
import json
import re
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from conftest import write_study
from evomerge import study
from evomerge.errors import ConfigError
from evomerge.search import fingerprint, storage
from searchutil import cli, edit_study, states


def _study_attr(db, key):
    with sqlite3.connect(db) as c:
        row = c.execute("select value_json from study_user_attributes where key = ?", (key,)).fetchone()
    return json.loads(row[0]) if row else None


@pytest.mark.system
def test_a_changed_study_under_its_old_name_is_refused_in_one_line(tmp_path, data_dir):
    f = write_study(tmp_path)
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    args = ["search", "--study", str(f), "--sampler", "random", "--quiet"]
    assert cli(*args, "--n-trials", "2", cwd=tmp_path, data_dir=data_dir).returncode == 0
    stored = _study_attr(db, "fingerprint")
    assert stored["summary"]["run.workers"] == 4 and len(stored["hash"]) == 64

    edit_study(f, "workers = 4", "workers = 2")
    p = cli(*args, "--n-trials", "4", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2
    assert p.stderr == ("error: study tiny: run.workers changed (4 -> 2) since its 2 stored trials; "
                        "use another [study] name or --runs-dir to start afresh\n")
    assert states(db) == {"COMPLETE": 2}  # nothing asked, nothing lost

    # a changed space is a mismatch too, and several changes are all named
    edit_study(f, "high = 1.0 }", "high = 0.9 }")
    p = cli(*args, "--n-trials", "4", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "run.workers changed (4 -> 2), search.space.mixing_weight changed" in p.stderr

    # another runs folder starts afresh with the changed study
    p = cli(*args, "--n-trials", "2", "--runs-dir", "runs-4", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert states(tmp_path / "runs-4" / "tiny" / "optuna.db") == {"COMPLETE": 2}


@pytest.mark.system
def test_a_users_model_file_changed_under_the_old_study_name_is_refused(tmp_path, data_dir):
    """(The fingerprint held the study file only: a user who edited the model module beside it searched on under the
    old name, mixing trials of two models, and the verdict reused runs of the old one.) The source of a model,
    loader or loss module beside the study is in the fingerprint; one from sys.path is not."""
    f = write_study(tmp_path, slow=True)  # factory "slowmlp:make", the module copied beside the study
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    args = ["search", "--study", str(f), "--sampler", "random", "--quiet", "--reevaluate", "0"]
    assert cli(*args, "--n-trials", "1", cwd=tmp_path, data_dir=data_dir).returncode == 0
    assert len(_study_attr(db, "fingerprint")["summary"]["model.factory_source"]) == 16
    module = tmp_path / "slowmlp.py"
    module.write_text(module.read_text() + "\nWIDER = True  # the user's edit\n")
    p = cli(*args, "--n-trials", "2", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2
    assert p.stderr == ("error: study tiny: model.factory_source changed (slowmlp.py edited) since its 1 stored "
                        "trial; use another [study] name or --runs-dir to start afresh\n"), p.stderr
    assert states(db) == {"COMPLETE": 1}
    # an export made after the edit carries what the trials ran under: its replay names the change
    p = cli("export", "--study", str(f), "-o", "best.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    p = cli("run", "--study", str(f), "--policy", "best.json", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "matches" not in p.stdout and "DIFFERS" not in p.stdout, p.stdout
    assert re.search(r"note: tiny changed since trial 0 ran \(model\.factory_source changed", p.stderr), p.stderr
    # a named model has no module of the user's to hash
    assert not any(k.endswith("_source") for k in fingerprint.of(study.load(write_study(tmp_path / "named")))["summary"])

    # a module beside the study that the model's module imports (own-model.md's `import helpers`): an edit of it
    # is a change too (a helper's new data seed or layer resumed the search on the old trials in silence)
    d = tmp_path / "neighbour"
    d.mkdir()
    f = write_study(d, slow=True)
    (d / "slowhelp.py").write_text("WIDTH = 8\n")
    module = d / "slowmlp.py"
    module.write_text("import slowhelp  # noqa: F401\n" + module.read_text())
    assert cli(*args[:2], str(f), *args[3:], "--n-trials", "1", cwd=d, data_dir=data_dir).returncode == 0
    # the names of the files are words for the line, not part of the hash: a study stored before they were kept has
    # the same one (its kept runs, the baselines' step sizes, are found again)
    now = fingerprint.summary(study.load(f))
    assert now["model.factory_file"] == "slowmlp.py" and now["model.factory_imports"].endswith(" (slowhelp.py)")
    assert fingerprint.digest(now) == fingerprint.digest({k: v for k, v in now.items() if not k.endswith("_file")})
    (d / "slowhelp.py").write_text("WIDTH = 16\n")
    p = cli(*args[:2], str(f), *args[3:], "--n-trials", "2", cwd=d, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr == ("error: study tiny: model.factory_imports changed (slowhelp.py edited) "
                                              "since its 1 stored trial; use another [study] name or --runs-dir to "
                                              "start afresh\n"), p.stderr


@pytest.mark.system
def test_a_search_stopped_by_its_trials_errors_goes_on_once_the_user_fixed_the_model(tmp_path, data_dir):
    """(The search stopped on errors said "fix the cause and run the same command again", and once the user fixed
    their model file the same command was refused: the module had changed since the stored trials, all of them
    failed.) A study whose stored trials all failed takes the study as it is now, and says so."""
    f = write_study(tmp_path, slow=True)
    module = tmp_path / "slowmlp.py"
    good = module.read_text()
    module.write_text(good.replace("    def forward(self, x):\n", "    def forward(self, x):\n"
                                   "        if x.shape[0] == 16:  # the user's bug: every training batch\n"
                                   "            raise IndexError('index out of range in self')\n"))
    args = ["search", "--no-log-model", "--study", str(f), "--sampler", "random", "--quiet", "--no-verdict", "--n-trials", "2"]
    p = cli(*args, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == (
        "error: search stopped: the last 10 trials failed with an error (the last: IndexError: index out of range in "
        "self); finished trials are kept; fix the cause and run the same command again"), p.stderr
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    assert states(db) == {"FAIL": 10}
    module.write_text(good)  # fixed (a new process: this one holds the module as it was imported)
    p = cli(*args, cwd=tmp_path, data_dir=data_dir, process=True)
    assert p.returncode == 0, p.stderr
    assert ("note: study tiny: model.factory_source changed (slowmlp.py edited) since its 10 stored trials, none of "
            "which finished (they failed): the search goes on with the study as it is now") in p.stderr, p.stderr
    assert states(db) == {"FAIL": 10, "COMPLETE": 2}
    # once a trial finished, a change is refused again
    module.write_text(good + "\nWIDER = True\n")
    p = cli(*args[:-1], "3", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and "since its 12 stored trials; use another [study] name" in p.stderr, p.stderr


@pytest.mark.integration
def test_a_stored_study_with_a_trial_still_running_is_not_taken_for_one_whose_trials_all_failed(tmp_path):
    """(The note's rule counted finished trials: a trial running in another process, or waiting to be asked again,
    made a study of none finished, and an edited file was adopted under its fingerprint.) Only a study whose every
    stored trial failed, or that holds none, takes the file as it is now."""
    from evomerge.search.config import make_config

    f = write_study(tmp_path)
    cfg = make_config(study.load(f), runs_dir=tmp_path / "runs")
    cfg.study_dir.mkdir(parents=True)
    o = storage.load_or_create(cfg, storage.open_storage(cfg.storage))
    o.ask()  # RUNNING (another process's)
    edit_study(f, "score_samples = 8", "score_samples = 8\nlr = 0.5")
    cfg = make_config(study.load(f), runs_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"run.lr changed \(0.05 -> 0.5\) since its 1 stored trial; use another"):
        storage.load_or_create(cfg, storage.open_storage(cfg.storage))


@pytest.mark.system
def test_a_study_stored_by_baselines_takes_the_file_as_it_is_at_the_first_search(tmp_path, data_dir):
    """(`evomerge baselines` stores the study to keep its baselines' step sizes for the search: the file edited
    after it, its lr or its objectives, was refused "since its 0 stored trials".)"""
    f = write_study(tmp_path)
    f.write_text(f.read_text().replace('policies = ["no-merging", "ring-gossip"]',
                                       'policies = ["no-merging", "ring-gossip"]\nlr = [0.05, 0.1]'))
    assert cli("baselines", "--study", str(f), "--quiet", cwd=tmp_path, data_dir=data_dir).returncode == 0
    assert (tmp_path / "runs" / "tiny" / "optuna.db").is_file()
    edit_study(f, "score_samples = 8", "score_samples = 8\nlr = 0.07")
    edit_study(f, 'metrics = ["val_accuracy"]', 'metrics = ["val_loss"]')
    p = cli("search", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--no-verdict", "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert states(tmp_path / "runs" / "tiny" / "optuna.db") == {"COMPLETE": 1}
    assert _study_attr(tmp_path / "runs" / "tiny" / "optuna.db", "fingerprint")["summary"]["run.lr"] == 0.07


@pytest.mark.system
def test_a_search_on_another_storage_into_the_same_mlflow_experiment_says_so(tmp_path, data_dir):
    """(A search given a new --storage kept the default MLflow store of the study's folder: its experiment held two
    `trial-0` runs of two Optuna studies, with nothing said.)"""
    f = write_study(tmp_path)
    args = ["search", "--study", str(f), "--sampler", "random", "--n-trials", "1", "--no-verdict"]
    assert cli(*args, cwd=tmp_path, data_dir=data_dir).returncode == 0
    p = cli(*args, "--storage", f"sqlite:///{tmp_path / 'other.db'}", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    said = " ".join(p.stderr.split())
    assert re.search(r"note: the MLflow experiment tiny \(sqlite:///\S+/runs/tiny/mlflow\.db\) holds the runs of "
                     r"searches of sqlite:///\S+/runs/tiny/optuna\.db too: give --tracking-uri to keep this storage's "
                     r"runs apart", said), said
    p = cli(*args, "--n-trials", "2", cwd=tmp_path, data_dir=data_dir)  # the first storage again: it names the other
    assert p.returncode == 0 and "other.db too" in " ".join(p.stderr.split()), p.stderr


@pytest.mark.integration
def test_a_store_searched_for_other_objectives_says_what_changed_and_what_to_do(tmp_path, data_dir):
    """The quick-start study gained `bytes` as a second objective: a `runs/mnist-gossip/` searched before is
    refused in one line naming both lists of objectives and the way to start afresh; nothing is lost."""
    f = write_study(tmp_path)
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    args = ["search", "--study", str(f), "--sampler", "random", "--quiet", "--reevaluate", "0"]
    assert cli(*args, "--n-trials", "2", cwd=tmp_path, data_dir=data_dir).returncode == 0
    edit_study(f, 'metrics = ["val_accuracy"]', 'metrics = ["val_accuracy", "bytes"]')
    p = cli(*args, "--n-trials", "4", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2
    assert p.stderr == ("error: study.objectives.metrics: the 2 stored trials of 'tiny' were searched for "
                        "['val_accuracy']; the study now asks ['val_accuracy', 'bytes']; to start afresh, move "
                        "runs/tiny away or search with another --runs-dir (the old results stay readable there)\n")
    assert states(db) == {"COMPLETE": 2}


@pytest.mark.system
def test_description_size_and_sampler_changes_are_not_mismatches(tmp_path, data_dir):
    f = write_study(tmp_path)
    args = ["search", "--study", str(f), "--quiet"]
    assert cli(*args, "--n-trials", "2", "--sampler", "random", cwd=tmp_path, data_dir=data_dir).returncode == 0
    edit_study(f, '[study]\nname = "tiny"\n', '[study]\nname = "tiny"\ndescription = "now described"\n')
    edit_study(f, "[search]\nn_trials = 6\n", '[search]\nn_trials = 9\nsampler = "tpe"\n')
    p = cli(*args, "--n-trials", "3", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert states(tmp_path / "runs" / "tiny" / "optuna.db").get("COMPLETE", 0) + \
        states(tmp_path / "runs" / "tiny" / "optuna.db").get("PRUNED", 0) == 3


@pytest.mark.system
def test_a_study_stored_before_fingerprints_adopts_one_silently(tmp_path, data_dir):
    f = write_study(tmp_path)
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    args = ["search", "--study", str(f), "--sampler", "random", "--quiet"]
    assert cli(*args, "--n-trials", "1", cwd=tmp_path, data_dir=data_dir).returncode == 0
    with sqlite3.connect(db) as c:  # as an older evomerge left it
        c.execute("delete from study_user_attributes where key = 'fingerprint'")
    edit_study(f, "workers = 4", "workers = 2")  # whatever the file says now is adopted
    p = cli(*args, "--n-trials", "2", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert _study_attr(db, "fingerprint")["summary"]["run.workers"] == 2
    assert states(db) == {"COMPLETE": 2}


def test_fingerprint_summary_and_changes(tmp_path):
    s = study.load(write_study(tmp_path))
    fp = fingerprint.of(s)
    summ = fp["summary"]
    assert summ["environment"] == "none" and summ["objectives"] == ["val_accuracy"]
    assert summ["data.dataset"] == "mnist" and summ["model.name"] == "mlp" and summ["policy.degree"] == 3
    assert summ["space.topology"] == {"kind": "categorical", "choices": ["ring", "complete"]}
    assert not any(k.startswith(("search.n_trials", "search.sampler", "description", "baselines")) for k in summ)
    assert fp["hash"] == fingerprint.of(study.load(s.path))["hash"]  # stable
    # a field added to evomerge since the study was stored is not a change
    older = {k: v for k, v in summ.items() if k != "run.eval_samples"}
    assert fingerprint.changes(older, summ) == []
    assert fingerprint.changes(summ | {"run.lr": 0.5}, summ) == [f"run.lr changed (0.5 -> {summ['run.lr']})"]
    assert fingerprint.changes({**summ, "space.swap_p": {"kind": "float"}}, summ) == ["search.space.swap_p removed"]
    assert fingerprint.changes(summ | {"model.options": {"channels": "16"}}, summ | {"model.options": {"channels": 16}}) \
        == ['model.options changed ({"channels": "16"} -> {"channels": 16})']
    assert fingerprint.changes(summ | {"data.loader": "m:lod"}, summ | {"data.loader": "m:load"}) == [
        'data.loader changed ("m:lod" -> "m:load")']
    # the target time to target waits for is part of what a trial means (a changed target resumed the search in
    # silence, old and new values side by side); a study without one, or stored before it was kept, is unchanged
    f = tmp_path / "timed.toml"
    f.write_text(s.path.read_text() + '\n[environment]\ntime_budget = 5.0\nstep_time = 0.1\n')
    f.write_text(f.read_text().replace('metrics = ["val_accuracy"]', 'metrics = ["time_to_target"]\ntarget = 0.85'))
    timed = fingerprint.summary(study.load(f))
    assert timed["objectives.target"] == 0.85 and timed["objectives.target_metric"] == "val_accuracy"
    assert "objectives.target" not in summ and "environment.step_budget" not in timed  # (the default: no key)
    f.write_text(f.read_text().replace("target = 0.85", "target = 0.87"))
    assert fingerprint.changes(timed, fingerprint.summary(study.load(f))) == ["objectives.target changed (0.85 -> 0.87)"]
    assert fingerprint.changes({k: v for k, v in timed.items() if not k.startswith("objectives.target")}, timed) == []


API_THRICE = """
import sys
import optuna
import evomerge
kw = dict(n_trials=2, sampler="tpe", runs_dir=sys.argv[2], data_dir=sys.argv[3], batch=2)
evomerge.search(sys.argv[1], **kw)
kw["n_trials"] += 1
evomerge.search(sys.argv[1], **kw)
print("verbosity", optuna.logging.get_verbosity())
print("-- the caller sets DEBUG --", file=sys.stderr, flush=True)
optuna.logging.set_verbosity(optuna.logging.DEBUG)
kw["n_trials"] += 1
evomerge.search(sys.argv[1], **kw)
print("verbosity", optuna.logging.get_verbosity())
"""


@pytest.mark.system
def test_the_python_api_prints_no_existing_study_line_and_leaves_the_callers_optuna_logging_alone(tmp_path, data_dir):
    """A user's script searches one study three times with ``evomerge.search``: at Optuna's default level, then at
    DEBUG, which the user set. (One process for both: a process that imports torch, MLflow and torch.export costs
    about 10 s of CPU on the test machine.)"""
    # TPE's batches are asked against an in-memory copy of the study (search/asking.py), whose creation is no study
    # of the user's either: only the stored study's creation is said
    f = write_study(tmp_path)
    script = tmp_path / "api.py"
    script.write_text(API_THRICE)
    p = subprocess.run([sys.executable, str(script), str(f), str(tmp_path / "runs"), str(data_dir)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    info, debug = p.stderr.split("-- the caller sets DEBUG --\n")
    assert "Using an existing study" not in info + p.stdout
    assert "in memory" not in info + p.stdout
    assert info.count("A new study created") == 1  # Optuna's own INFO lines are left as they are
    assert "A new study created in RDB with name: tiny" in info
    # the caller's level is untouched: Optuna's default (INFO), then the caller's DEBUG
    assert p.stdout.splitlines()[-2:] == [f"verbosity {20}", f"verbosity {10}"], p.stdout


def test_the_study_names_its_metrics_for_optuna_dashboard(tmp_path, data_dir):
    import optuna

    import evomerge

    s = study.load(write_study(tmp_path, objectives=("val_accuracy", "bytes")))
    evomerge.search(s, verdict=False, n_trials=1, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir)
    ost = optuna.load_study(study_name="tiny", storage=storage.default_storage(tmp_path / "runs" / "tiny"))
    assert ost.metric_names == ["val_accuracy", "bytes"]
    # both of the study's SQLite files are left in write-ahead-log mode (evomerge/sqlitefiles.py), read here by plain
    # sqlite3 as any other program would open them
    for name in ("optuna.db", "mlflow.db"):
        with contextlib.closing(sqlite3.connect(tmp_path / "runs" / "tiny" / name)) as con:
            assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",), name
            table = "trials" if name == "optuna.db" else "runs"
            assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] >= 1


def test_the_study_file_takes_wal_and_evomerges_connections_commit_with_synchronous_normal(tmp_path):
    """open_storage: the file in WAL mode (kept in it: another program's connection reads it back), and every
    connection of the storage's engine with synchronous = NORMAL (1), the ones made before the pragma's listener
    included. The path is SQLAlchemy's reading of the URL (a query string is not part of the file's name); a database
    that is not a file is left alone. A file that cannot be a database is refused in one line naming --storage, as
    before."""
    import os

    from evomerge.sqlitefiles import sqlite_wal

    st = storage.open_storage(f"sqlite:///{tmp_path / 'o.db'}?timeout=30")
    with st.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA synchronous").fetchone() == (1,)
        assert c.exec_driver_sql("PRAGMA journal_mode").fetchone() == ("wal",)
    with contextlib.closing(sqlite3.connect(tmp_path / "o.db")) as con:
        assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert {p.name for p in tmp_path.iterdir()} <= {"o.db", "o.db-wal", "o.db-shm"}  # none named after the query
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert not sqlite_wal("sqlite://") and not sqlite_wal("sqlite:///:memory:")  # in memory: nothing to keep
    finally:
        os.chdir(here)
    assert {p.name for p in tmp_path.iterdir()} <= {"o.db", "o.db-wal", "o.db-shm"}  # no file "sqlite:" made
    (tmp_path / "not.db").write_text("not a database")
    with pytest.raises(ConfigError, match="--storage"):
        storage.open_storage(f"sqlite:///{tmp_path / 'not.db'}")


@pytest.mark.system
def test_the_lock_file_excludes_other_processes(tmp_path):
    lock = tmp_path / "s" / "search.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from evomerge.search.storage import file_lock\n"
        "with file_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(3)\n"), str(lock)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        got = []
        t = threading.Thread(target=lambda: (storage.file_lock(lock).__enter__(), got.append(time.monotonic())))
        t0 = time.monotonic()
        t.start()
        t.join(timeout=30)
        assert got and got[0] - t0 > 1.0  # it waited for the other process to let go
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.system
def test_a_lock_held_by_a_killed_process_is_released(tmp_path):
    lock = tmp_path / "search.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from evomerge.search.storage import file_lock\n"
        "with file_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)\n"), str(lock)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with storage.file_lock(lock):
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("where, said", [
    ("under-a-file", "cannot open sqlite:///{tmp}/file/optuna.db: cannot make the folder {tmp}/file ("),
    ("no-such-driver", "nosuchdriver://x is not a database address (SQLAlchemy has no dialect for nosuchdriver://"),
    ("a-folder", "{tmp} is not a database address (Could not parse SQLAlchemy URL from given URL string); for a SQLite "
                 "file there: sqlite:///{tmp}/optuna.db; allowed: sqlite:///PATH/optuna.db, postgresql://"),
    ("http", "http://me:***@127.0.0.1:1/db is not a database address (SQLAlchemy has no dialect for http://"),
    ("postgres", "postgres://me:***@127.0.0.1:1/db is not a database address (SQLAlchemy has no dialect for postgres://"),
    ("psycopg2", "cannot reach the database at postgresql+psycopg2://me:***@127.0.0.1:1/optuna ("
                 if importlib.util.find_spec("psycopg2") else
                 "cannot open postgresql+psycopg2://me:***@127.0.0.1:1/optuna: the driver psycopg2 that the address "
                 "names is not installed (no module named 'psycopg2'); pip install it, or write postgresql:// to use "
                 'psycopg 3 (pip install "evomerge[postgres]")'),
], ids=["under-a-file", "no-such-driver", "a-folder", "http", "postgres", "psycopg2"])
def test_a_storage_that_cannot_be_opened_is_one_line(tmp_path, where, said):
    from evomerge.errors import ConfigError

    (tmp_path / "file").write_text("")
    url = {"under-a-file": f"sqlite:///{tmp_path}/file/optuna.db", "no-such-driver": "nosuchdriver://x",
           "a-folder": str(tmp_path), "http": "http://me:secret@127.0.0.1:1/db",
           "postgres": "postgres://me:secret@127.0.0.1:1/db",
           "psycopg2": "postgresql+psycopg2://me:secret@127.0.0.1:1/optuna"}[where]
    with pytest.raises(ConfigError) as e:
        storage.open_storage(url)
    assert e.value.field == "--storage" and "\n" not in str(e.value) and "secret" not in str(e.value)
    assert said.format(tmp=tmp_path) in str(e.value), str(e.value)
    assert str(e.value).endswith("; did you mean postgresql://?") == (where == "postgres")  # libpq's short scheme
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made


def test_a_search_whose_storage_cannot_be_opened_leaves_no_folder(tmp_path, data_dir):
    """As a user types it: one line naming --storage, exit status 2, and no runs/<study>/ left behind."""
    p = cli("search", "--study", write_study(tmp_path), "--storage", str(tmp_path / "elsewhere"), "--n-trials", "1",
            "--no-verdict", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: --storage: {tmp_path / 'elsewhere'} is not a database address (")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "elsewhere").exists()


@pytest.mark.integration
def test_a_wrong_database_address_is_said_before_the_data_is_read(tmp_path):
    """(The search read its data first, then opened the store: with the data missing too, the data's line was the one
    a user saw, and a user's slow loader ran before a typo in --storage was said.) The command and the Python API."""
    import evomerge

    f = write_study(tmp_path)
    no_data = tmp_path / "no-data"  # nothing is read: the address's line comes first
    p = cli("search", "--study", str(f), "--storage", "http://me:secret@127.0.0.1:1/db", cwd=tmp_path, data_dir=no_data)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --storage: http://me:***@127.0.0.1:1/db is not a database address (SQLAlchemy has no dialect for "
        "http:// (Can't load plugin: sqlalchemy.dialects:http)); allowed: sqlite:///PATH/optuna.db, "
        "postgresql://USER@HOST/DB, mysql+pymysql://USER@HOST/DB (an Optuna storage: a database SQLAlchemy opens)"]
    with pytest.raises(ConfigError) as e:  # a server that is not there: refused, port 1
        evomerge.search(f, storage="postgresql://me@127.0.0.1:1/db", runs_dir=tmp_path / "runs", data_dir=no_data)
    assert e.value.field == "storage" and str(e.value).startswith(
        "storage: cannot reach the database at postgresql+psycopg://me@127.0.0.1:1/db ("), str(e.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_a_password_with_a_character_an_address_must_encode_is_one_line_that_shows_none_of_it(tmp_path):
    """`postgresql://evo:Secret@2024@host/db`: PostgreSQL's driver looked up the host "2024@127.0.0.1" and printed it
    (half the password) under a masked address that looked right; with a '/' in the password most of it was shown.
    Now one line, before anything is read, that says how to write it, and none of the password."""
    f = write_study(tmp_path)
    for url in ("postgresql://evo:Secret@2024@127.0.0.1:1/optuna", "postgresql://evo:p@ss:w/rd@127.0.0.1:1/optuna"):
        for option in ("--storage", "--tracking-uri"):
            p = cli("search", "--study", str(f), option, url, cwd=tmp_path, data_dir=tmp_path / "no-data")
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, p.stderr  # (postgresql+psycopg: the driver installed)
            assert re.fullmatch(
                re.escape(f"error: {option}: ") + r"postgresql(\+psycopg)?" + re.escape(
                    "://evo:***@127.0.0.1:1/optuna: the password holds an '@', which an address must encode; "
                    "allowed: the password percent-encoded (@ as %40, / as %2F, ? as %3F, # as %23; "
                    "urllib.parse.quote(password, safe=''))"), lines[0]), lines[0]
            for part in ("Secret", "2024", "ss:w", "rd@"):
                assert part not in p.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.unit
@pytest.mark.parametrize("url, said", [
    # a password with '/', '?' or '#' but no '@': SQLAlchemy reads it whole and connects; it was printed as it was
    ("postgresql://evo:pa/ss@host/db", "postgresql://evo:***@host/db"),
    ("postgresql://evo:pa?ss@host/db", "postgresql://evo:***@host/db"),
    # an '@' in the query, a user name holding an '@' (Azure's user@server): addresses that work, shown whole
    ("postgresql://u:pw@host/db?application_name=a@b", "postgresql://u:***@host/db?application_name=a@b"),
    ("postgresql://user@server:pw@host.example/db", "postgresql://user@server:***@host.example/db"),
    ("https://user@mlflow:5000/a/b@c", "https://user@mlflow:5000/a/b@c"),
    ("sqlite:////home/a@b/optuna.db", "sqlite:////home/a@b/optuna.db"),
])
def test_an_address_is_shown_as_the_storage_reads_it_with_only_its_password_masked(url, said):
    from evomerge.dburls import shown, unencoded_password

    assert shown(url) == said
    unencoded_password(url, "--storage")  # not refused: they connect as written


@pytest.mark.integration
@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_two_processes_that_start_on_the_study_as_it_stands_draw_different_trials(tmp_path, sampler):
    """Two machines sharing a study, started at the same moment, are both worker 0 and see the same trials: their
    samplers had the same seed, and every trial of one repeated a trial of the other (half the budget trained twice).
    The second start on the study as it stood seeds apart; a lone search keeps its seed (the same trials as ever)."""
    from evomerge.search.config import make_config
    from evomerge.search.storage import load_or_create, open_storage
    from evomerge.search import space as space_mod

    cfg = make_config(study.load(write_study(tmp_path)), runs_dir=tmp_path / "runs", sampler=sampler, seed=3)
    dists = space_mod.distributions(cfg.study.search.space)
    a = load_or_create(cfg, open_storage(cfg.storage), 0, asking=True)
    b = load_or_create(cfg, open_storage(cfg.storage), 0, asking=True)
    drawn = [s.ask(dists).params for s in (a, b, a, b)]
    assert drawn[0] != drawn[1] and drawn[2] != drawn[3], drawn
    # a lone search's first trial, drawn anew in a study of its own: the seed of a first start is unchanged
    alone = make_config(study.load(write_study(tmp_path / "alone")), runs_dir=tmp_path / "alone-runs",
                        sampler=sampler, seed=3)
    assert load_or_create(alone, open_storage(alone.storage), 0, asking=True).ask(dists).params == drawn[0]
    # a start with nothing left to run counts none: the search after it keeps the seed it would have had
    from evomerge.search.storage import STARTS

    import optuna

    done = make_config(study.load(write_study(tmp_path / "done")), runs_dir=tmp_path / "done-runs",
                       sampler=sampler, seed=3, n_trials=1)
    load_or_create(done, open_storage(done.storage), 0).add_trial(optuna.trial.create_trial(values=[0.5]))
    assert STARTS not in load_or_create(done, open_storage(done.storage), 0, asking=True).user_attrs


@pytest.mark.system
def test_a_search_sharing_its_study_counts_every_process_trials_on_its_bar(tmp_path, data_dir, monkeypatch):
    """Two searches of one study (its SQLite file shared, as on two machines with a database): each bar counted its
    own trials only and ended at 4/8 with another's best. The progress now carries the study's count and best,
    read every few seconds, and the bar shows them."""
    import os

    from evomerge.report.search_view import SearchView
    from evomerge.search.config import make_config
    from evomerge.search.loop import run_search

    f = write_study(tmp_path, steps=200, slow=True)  # trials of 2 s or so, for little CPU
    monkeypatch.setenv("SLOWMLP_DELAY", "0.01")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    other = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "search", "--study", str(f), "--storage", url,
                              "--runs-dir", "runs-b", "--n-trials", "8", "--sampler", "random", "--seed", "1",
                              "--no-prune", "--no-verdict", "--quiet"], cwd=tmp_path,
                             env=os.environ | {"EVOMERGE_DATA_DIR": str(data_dir)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        cfg = make_config(study.load(f), storage=url, runs_dir=tmp_path / "runs-a", n_trials=8, sampler="random",
                          prune=False, verdict=False, data_dir=data_dir)
        view, said, own = SearchView(cfg, quiet=True), [], [0]

        def progress(kind, **info):
            view.event(kind, **info)
            if kind == "trial":
                own[0] += info["record"]["state"] in ("COMPLETE", "PRUNED")
                said.append((own[0], info.get("study"), view.done, view.best))

        res = run_search(cfg, progress=progress)
        _, err = other.communicate(timeout=300)
    finally:
        if other.poll() is None:
            other.kill()
    assert other.returncode == 0, err[-2000:]
    assert res.counts.get("COMPLETE", 0) == 8 and 0 < own[0] < 8, (own, res.counts)  # both processes ran trials
    reads = [(mine, st, done, best) for mine, st, done, best in said if st is not None]
    assert any(st["done"] > mine for mine, st, _, _ in reads), said  # it saw the other's trials
    for mine, st, done, best in reads:  # and the bar shows the study's count and best
        assert done >= st["done"] and best == st["best"], said
    assert view.done == 8  # at the end, the whole study's (read once more: the other's last trials came after)


def test_the_source_digest_of_a_users_package_skips_what_is_not_its_code(tmp_path):
    """(An editor's lock file `.#layers.py`, a dangling link, raised FileNotFoundError from the study's fingerprint.)
    Hidden files and folders are not the package's code; a checkout's line ends are not a change; an edit is."""
    from evomerge.userref import source_digest

    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_bytes(b"WIDTH = 16\n")
    before = source_digest("mypkg:make", tmp_path)
    (pkg / ".#layers.py").symlink_to(tmp_path / "nowhere")
    (pkg / "gone.py").symlink_to(tmp_path / "nowhere")
    (pkg / ".venv").mkdir()
    (pkg / ".venv" / "site.py").write_text("print()\n")
    (pkg / "__init__.py").write_bytes(b"WIDTH = 16\r\n")
    assert source_digest("mypkg:make", tmp_path) == before
    (pkg / "__init__.py").write_bytes(b"WIDTH = 32\n")
    assert source_digest("mypkg:make", tmp_path) != before
    assert source_digest("json:loads", tmp_path) is None  # from sys.path: not the user's to hash


@pytest.mark.parametrize("given, meant", [
    ("postgresql:/evo:secretpw@127.0.0.1:55432/optuna", "postgresql://evo:***@127.0.0.1:55432/optuna"),
    ("postgresql:evo:secretpw@h/db", "postgresql://evo:***@h/db"),
    ("postgresql+psycopg:/evo:secretpw@h/db", "postgresql+psycopg://evo:***@h/db"),
    ("sqlite:/tmp/o.db", "sqlite:////tmp/o.db"),
])
def test_an_address_whose_scheme_lost_a_slash_is_one_line_that_shows_none_of_its_password(tmp_path, given, meant,
                                                                                          monkeypatch):
    """(A user's `postgresql:/evo:secretpw@...` was taken for a folder: the line offered a SQLite file there and
    printed the password whole; `sqlite:/tmp/o.db` made a folder named sqlite:.) The address it means, masked, and
    nothing made."""
    from pathlib import Path

    from evomerge.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # (a folder made from the address would be made here)

    with pytest.raises(ConfigError) as e:
        storage.check_storage(given)
    with pytest.raises(ConfigError) as opened:
        storage.open_storage(given)
    for err in (e.value, opened.value):
        assert err.field == "--storage" and "secretpw" not in str(err) and "\n" not in str(err)
        assert f"(its scheme wants '://'); did you mean {meant}? allowed: sqlite:///PATH" in str(err), str(err)
    assert not list(tmp_path.iterdir()) and not Path("sqlite:").exists()


def test_a_tracking_address_whose_scheme_lost_its_colon_is_not_taken_for_a_folder(tmp_path, data_dir):
    """(`--tracking-uri http//127.0.0.1:5055` was a folder MLflow would not write, and the line advised
    MLFLOW_ALLOW_FILE_STORE=true, which would have written runs into a folder named http.) As a user types it."""
    for given, meant in (("http//127.0.0.1:5055", "http://127.0.0.1:5055"),
                         ("postgresql:/evo:secretpw@127.0.0.1:1/mlflow", "postgresql://evo:***@127.0.0.1:1/mlflow")):
        p = cli("search", "--study", write_study(tmp_path), "--tracking-uri", given, "--n-trials", "1", "--no-verdict",
                cwd=tmp_path, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "secretpw" not in p.stderr, p.stderr
        assert p.stderr.startswith("error: --tracking-uri: ") and f"did you mean {meant}?" in p.stderr, p.stderr
        assert "MLFLOW_ALLOW_FILE_STORE" not in p.stderr
        assert not (tmp_path / "runs").exists() and not (tmp_path / "http").exists()


@pytest.mark.parametrize("given", [
    "postgresql///evo:secretpw@h/db", " postgresql:/evo:secretpw@h/db", "psql:/evo:secretpw@h/db",
    "pg:/evo:secretpw@h/db", "evo:secretpw@h/db", "postgresql:/evo:sec/retpw@host/db",
    "postgresql:/evo:secretpw@h/d/b@x", "postgresql:///evo:secretpw@h/db", "postgresql://evo@h/db?password=secretpw",
    "mariadb:/evo:secretpw@h/db", "postgresql://evo:secretpw@h/db#src"])
def test_no_mistyped_address_shows_its_password_in_any_commands_line(tmp_path, given, monkeypatch, capsys):
    """(A second read found addresses the first fix missed: a third slash, a leading space, a scheme that is no
    database's, a password holding '/', the user in an empty host's path, a password in the query; and
    --warm-start-from, whose lines and MLflow parameter printed it as given.) Each command's line, as a user sees it."""
    from evomerge import cli as cli_mod

    monkeypatch.chdir(tmp_path)
    f = write_study(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv in (["status", "--study", str(f), "--storage", given], ["export", "--study", str(f), "--storage", given, "-o", "best.json"],
                 ["search", "--study", str(f), "--tracking-uri", given, "--n-trials", "1"],
                 ["search", "--study", str(f), "--warm-start-from", given, "--n-trials", "1"]):
        rc = cli_mod.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and "secretpw" not in err and "sec/retpw" not in err, (argv, err)
        assert err.count("\n") == 1 and err.startswith("error: "), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made


@pytest.mark.parametrize("why, advice", [
    ('connection failed: FATAL:  password authentication failed for user "evo"',
     "check the user and its password (PGPASSWORD or ~/.pgpass give libpq one and keep it out of the address)"),
    ('connection failed: FATAL:  database "optuna_shar" does not exist', "create it (createdb optuna_shar)"),
    ('connection failed: FATAL:  role "evo" does not exist',  # (a missing role was told to create the database)
     "check the user and its password (PGPASSWORD or ~/.pgpass give libpq one and keep it out of the address)"),
    ("connection failed: Connection refused", "start it"),
])
def test_a_database_that_answers_no_is_told_what_to_do_by_its_reason(why, advice):
    """(A wrong password and a missing database were told to start it.)"""
    from evomerge.dburls import _reach_advice

    assert _reach_advice(why, "postgresql://evo:pw@127.0.0.1:1/optuna_shar") == advice

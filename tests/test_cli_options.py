"""The command line's options against the Python API and their help: one list of settings, stated defaults."""

import argparse
import inspect
import os
import re
import subprocess
import sys

import pytest

import evomerge
from evomerge import cli

FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._VersionAction, argparse._HelpAction)


commands = cli.commands


def options(parser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))}


def test_run_keywords_are_the_run_command_options_with_the_same_defaults():
    from evomerge.search.config import default_runs_dir

    cmd = dict(commands(cli.build_parser()))[("run",)]
    opts = options(cmd)
    params = inspect.signature(evomerge.run).parameters
    cli_only = {"json_out", "quiet", "reevaluate", "against"}  # printing, re-evaluation, the job: reports
    api_only = {"callback", "evaluate_test"}  # a Python callable; the test set (--reevaluate uses it)
    assert set(opts) - cli_only == set(params) - api_only, "an option exists in `evomerge run` or in evomerge.run() only"
    for name in set(opts) - cli_only:
        p, a = params[name], opts[name]
        if name == "policy":  # required, but with --against, which evomerge.run() has not (the job's policy)
            assert p.default is inspect.Parameter.empty and a.default is None and "required, but with --against" in a.help
        elif p.default is inspect.Parameter.empty:
            assert a.required, f"{name}: required in evomerge.run(), optional in the command"
        elif name == "runs_dir":  # the command's default is $EVOMERGE_RUNS_DIR else runs, read when it starts; the
            assert p.default is None and a.default == str(default_runs_dir())  # function's None reads it when called
        else:
            assert not a.required and a.default == p.default, f"{name}: default {a.default!r} vs {p.default!r}"


def test_every_option_states_its_default_and_every_command_ends_with_an_example():
    env = os.environ.get("EVOMERGE_RUNS_DIR")
    seen = 0
    for path, p in commands(cli.build_parser()):
        text = p.format_help()
        assert f"example:\n  evomerge {' '.join(path)}" in text or f"example:\n  evomerge {path[0]}" in text, path
        for a in options(p).values():
            where = f"evomerge {' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
            assert a.help, f"{where}: no help"
            if isinstance(a, FLAGS) or not a.option_strings:
                continue
            if a.required:
                assert "required" in a.help, where
                continue
            assert "(default: " in a.help, f"{where}: the default is not stated"
            assert a.help.count("(default") == 1, f"{where}: states two defaults"
            if a.default not in (None, "") and a.dest != "runs_dir":
                assert f"(default: {a.default}" in a.help, f"{where}: states a default other than {a.default!r}"
            seen += 1
        if "--study" in {s for a in p._actions for s in a.option_strings}:
            assert "study name" in p.format_help()
        if any("--runs-dir" in a.option_strings for a in p._actions):
            assert "EVOMERGE_RUNS_DIR" in text and (env or "runs") in text
        if any("--data-dir" in a.option_strings for a in p._actions):
            assert "EVOMERGE_DATA_DIR" in text
    assert seen > 20
    top = cli.build_parser().format_help()
    assert "EVOMERGE_DATA_DIR" in top and "EVOMERGE_RUNS_DIR" in top and "example:" in top


@pytest.mark.system
def test_help_answers_with_the_example_through_the_real_command():
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "status", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0
    assert "--study STUDY" in p.stdout and "study name" in p.stdout
    assert p.stdout.rstrip().endswith("environment:\n  EVOMERGE_RUNS_DIR   the default of --runs-dir (else ./runs)")
    assert "example:\n  evomerge status --study mnist-gossip" in p.stdout


@pytest.mark.system
def test_run_checks_its_inputs_as_the_command_does_before_reading_data(tmp_path):
    """Each refusal names the keyword the caller wrote (``procs``), where the command's names its flag (``--procs``;
    they named the flag in Python too)."""
    import pytest

    from conftest import write_study
    from evomerge.errors import ConfigError

    f = write_study(tmp_path, workers=4)
    no_data = tmp_path / "no-data"  # nothing is read: every error comes first
    with pytest.raises(ConfigError, match=r"^policy: nope: no such file or named policy; named: .*fedavg"):
        evomerge.run(f, "nope", data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^policy.degree: 4 \(the default\) with 4 workers is impossible"):
        evomerge.run(f, evomerge.MergePolicy(topology="random_regular", degree=4), data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^policy.degree: 4 \(the default\) with 4 workers is impossible"):  # a dict, as Merger takes
        evomerge.run(f, {"topology": "random_regular", "degree": 4}, data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^policy.scheme: unknown 'gosip'; allowed: "):
        evomerge.run(f, {"scheme": "gosip"}, data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^policy: must be a MergePolicy, a dict of its fields, a file or a named "):
        evomerge.run(f, 3, data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^procs: applies to backend distributed only"):
        evomerge.run(f, "ring-gossip", procs=2, data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^backend: unknown 'mpi'; allowed: inprocess, distributed$"):
        evomerge.run(f, "ring-gossip", backend="mpi", data_dir=no_data)
    # the seed and the device as `evomerge run` checks them, before anything is read (were after the data)
    with pytest.raises(ConfigError, match=r"^seed: -1 is out of range; allowed: an integer >= 0$"):
        evomerge.run(f, "ring-gossip", seed=-1, data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^device: 'tpu' is not a torch device; allowed: cpu, cuda, cuda:N$"):
        evomerge.run(f, "ring-gossip", device="tpu", data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^policy.swap_p: 0.5 is not supported by the distributed backend"):
        evomerge.run(f, evomerge.MergePolicy(swap_p=0.5), backend="distributed", data_dir=no_data)
    # the wrong type (a TypeError from deep inside); a study that is none; a study misspelt, named as `study`
    for seed in ("x", 1.5, True):
        with pytest.raises(ConfigError, match=rf"^seed: {re.escape(repr(seed))} is not an integer; allowed: an "
                                              r"integer >= 0$"):
            evomerge.run(f, "ring-gossip", seed=seed, data_dir=no_data)
    for call in (evomerge.run, lambda s, p, **kw: evomerge.search(s, **kw)):
        with pytest.raises(ConfigError, match=r"^study: 123 \(int\) is not a study; allowed: a study's name, its "
                                              r"file's path, or an evomerge.study.Study$"):
            call(123, "ring-gossip", data_dir=no_data)
    with pytest.raises(ConfigError, match=r"^study: unknown study 'mnist-gosip'; known: .*did you mean mnist-gossip"):
        evomerge.search("mnist-gosip", data_dir=no_data, runs_dir=tmp_path / "runs")


@pytest.mark.parametrize("kwargs, said", [
    ({"n_trials": 0}, "n_trials: 0 is out of range; allowed: [1, inf)"),
    ({"reevaluate": -1}, "reevaluate: -1 is out of range; allowed: [0, inf) fresh seeds"),
    ({"sampler": "tpee"}, "sampler: unknown 'tpee'; allowed: tpe, random, nsga2, cmaes; did you mean tpe?"),
    ({"seed": -2}, "seed: -2 is out of range; allowed: an integer >= 0"),
    ({"device": "tpu"}, "device: 'tpu' is not a torch device; allowed: cpu, cuda, cuda:N"),
    ({"backend": "mpi"}, "backend: unknown 'mpi'; allowed: inprocess, distributed"),
    # the wrong type: a TypeError from deep inside ("'<' not supported"), or after trials ran (n_trials=2.5), or
    # taken (verdict="no" ran the verdict)
    ({"n_trials": "5"}, "n_trials: '5' is not an integer; allowed: an integer"),
    ({"n_trials": 2.5}, "n_trials: 2.5 is not an integer; allowed: an integer"),
    ({"reevaluate": 2.7}, "reevaluate: 2.7 is not an integer; allowed: an integer"),
    ({"seed": "a"}, "seed: 'a' is not an integer; allowed: an integer"),
    ({"verdict": "no"}, "verdict: 'no' is not True or False; allowed: True, False"),
    ({"prune": 1}, "prune: 1 is not True or False; allowed: True, False"),
    # a contradiction said in the keywords' words (it said --no-prune)
    ({"pruner": "hyperband", "prune": False}, "pruner: hyperband given with prune=False, which prunes nothing; "
                                              "allowed: one of them"),
])
def test_search_names_the_keyword_the_caller_wrote_before_reading_data(tmp_path, kwargs, said):
    """evomerge.search() refuses as `evomerge search` does, in one line, before any data is read or store made;
    the line names the keyword (``n_trials``), not the command's flag (``--n-trials``), as it did."""
    from conftest import write_study
    from evomerge.errors import ConfigError

    f = write_study(tmp_path, workers=4)
    with pytest.raises(ConfigError) as e:
        evomerge.search(f, runs_dir=tmp_path / "runs", data_dir=tmp_path / "no-data", **kwargs)
    assert str(e.value) == said and e.value.field == said.split(":")[0]
    assert not (tmp_path / "runs").exists()


def test_a_commands_help_lists_the_environment_variables_of_the_flags_it_has():
    """(calibrate and run listed MLFLOW_TRACKING_URI as the default of --tracking-uri, which neither has.)"""
    said = {"EVOMERGE_DATA_DIR": "--data-dir", "EVOMERGE_RUNS_DIR": "--runs-dir", "MLFLOW_TRACKING_URI": "--tracking-uri"}
    seen = set()
    for path, p in commands(cli.build_parser()):
        text = p.format_help()
        flags = {s for a in p._actions for s in a.option_strings}
        for var, flag in said.items():
            assert (var in text) == (flag in flags), (path, var)
            seen.add((var, flag in flags))
        assert ("EVOMERGE_THREADS" in text) == ("--data-dir" in flags), path
    assert ("MLFLOW_TRACKING_URI", True) in seen and ("MLFLOW_TRACKING_URI", False) in seen

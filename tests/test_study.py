import tomllib

import pytest

from evomerge import study
from evomerge.errors import ConfigError
from evomerge.models import MODELS


def test_shipped_study_loads_with_its_space_and_baselines():
    s = study.load("mnist-gossip")
    assert s.name == "mnist-gossip" and s.run.workers == 8 and s.data.partition == "dirichlet"
    names = {p.name for p in s.search.space}
    assert {"mean_interval", "topology", "mixing_weight"} <= names
    assert s.objectives == ("val_accuracy", "bytes") and s.directions == ["maximize", "minimize"]
    for b in s.baselines:
        s.resolve_policy(b)


def test_model_names_known_without_torch_match_the_registry():
    assert set(study.MODEL_NAMES) == set(MODELS)


def _raw(**over):
    raw = {"data": {"dataset": "mnist"}, "run": {"workers": 4}}
    for k, v in over.items():
        raw[k] = v
    return raw


@pytest.mark.parametrize("over, field", [
    ({"run": {"workers": "8"}}, "study.run.workers"),
    ({"run": {"workers": 0}}, "study.run.workers"),
    ({"run": {"wokers": 8}}, "study.run.wokers"),
    ({"data": {"dataset": "cifar"}}, "study.data.dataset"),
    ({"data": {"partition": "zipf"}}, "study.data.partition"),
    ({"model": {"name": "resnet"}}, "study.model.name"),
    ({"policy": {"topology": "star"}}, "study.policy.topology"),
    ({"policy": {"mixing_weight": 1.5}}, "study.policy.mixing_weight"),
    ({"search": {"space": {"nope": {"kind": "float", "low": 0, "high": 1}}}}, "study.search.space.nope"),
    ({"search": {"space": {"mixing_weight": {"kind": "float", "low": 0.9, "high": 0.1}}}}, "study.search.space.mixing_weight"),
    ({"search": {"space": {"mixing_weight": {"kind": "float", "low": 0.1, "high": 3}}}}, "study.search.space.mixing_weight"),
    ({"search": {"space": {"mean_interval": {"kind": "log-float", "low": 0, "high": 3}}}}, "study.search.space.mean_interval.low"),
    ({"search": {"space": {"topology": {"kind": "categorical", "choices": ["ring", "star"]}}}}, "study.search.space.topology.choices"),
    # a choice listed twice (it doubled the sampler's prior on it, in silence)
    ({"search": {"space": {"scheme": {"kind": "categorical", "choices": ["gossip", "allreduce", "allreduce"]}}}},
     "study.search.space.scheme.choices"),
    ({"search": {"space": {"degree": {"kind": "float", "low": 2, "high": 4}}}}, "study.search.space.degree.kind"),
    ({"search": {"space": {"topk_fraction": {"kind": "float", "low": 0.01, "high": 1}}}}, "study.search.space"),
    ({"objectives": {"metrics": ["loss"]}}, "study.objectives.metrics"),
    ({"objectives": {"metrics": []}}, "study.objectives.metrics"),
    ({"baselines": {"policies": ["no-merging", "no-such-policy"]}}, "study.baselines.policies"),
    ({"baselines": {"lr": [0.05, 0]}}, "study.baselines.lr"),
    ({"baselines": {"lr": [0.1, 0.1]}}, "study.baselines.lr"),
    ({"baselines": {"lr": 0.1}}, "study.baselines.lr"),
    ({"baselines": {"lr": ["x"]}}, "study.baselines.lr"),
    ({"run": {"seeds": [0, "1"]}}, "study.run.seeds"),
    ({"run": {"momentum": 1.0}}, "study.run.momentum"),
    ({"search": {"space": {"degree": {"kind": "int", "low": 4, "high": 6}}}}, "study.search.space.degree"),
    ({"search": {"space": {"degree": {"kind": "int", "low": 2, "high": 3.5}}}}, "study.search.space.degree.high"),
    ({"search": {"space": {"degree": {"kind": "int", "low": 2, "high": 3, "step": 1}}}}, "study.search.space.degree.step"),
    ({"search": {"space": {"quantize_bits": {"kind": "int", "low": 0, "high": 20}}}, "policy": {"payload": "delta"}},
     "study.search.space.quantize_bits"),
    ({"unknown_table": {}}, "study.unknown_table"),
])
def test_bad_studies_are_rejected_before_anything_runs(over, field):
    with pytest.raises(ConfigError) as e:
        study.from_dict(_raw(**over))
    assert e.value.field == field


@pytest.mark.parametrize("text, words", [
    ("", "empty file"),
    ("[run\nworkers = 3", "invalid TOML"),
    ("[run]\nworkers = 'x'", "study.run.workers"),
    ("# model: 407080 bytes\n[environment]\nstep_time = 0.02\n", 'holds only an \\[environment\\] table: a cluster .*'
                                                              '\\[environment\\] from = "s.toml"'),
])
def test_bad_study_files(tmp_path, text, words):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words):
        study.load(f)


def test_unknown_study_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known: .*mnist-gossip"):
        study.load("no-such-study")


def test_error_lines_name_the_field_and_what_is_allowed():
    cases = [
        ({"run": {"workers": "8"}}, 'study.run.workers: must be an integer, got str "8"; allowed: [1, inf)'),
        # a number in quotes, for a field with no range: how to write it (it said no "allowed:" at all)
        ({"run": {"epochs": "3"}}, 'study.run.epochs: must be a number, got str "3"; allowed: a number without quotes (3)'),
        ({"data": {"partition": 2}}, "study.data.partition: must be a string, got int 2; allowed: iid, dirichlet, by_file"),
        ({"run": {"lr": -1}}, "study.run.lr: -1 is out of range; allowed: [0, inf)"),
        ({"data": {"partition": "zipf"}}, "study.data.partition: unknown 'zipf'; allowed: iid, dirichlet, by_file"),
        ({"baselines": {"policies": ["nope"]}},
         "study.baselines.policies: nope: no such file or named policy; named: allreduce, allreduce-backup, allreduce-sign, allreduce-topk, async-diloco, diloco, fedavg, no-merging, ring-gossip, snoo, streaming-diloco"),
        ({"search": {"space": {"degree": {"kind": "int", "low": 4, "high": 6}}}},
         "study.search.space.degree: [4, 6] is impossible with 4 workers; allowed: at most 3"),
        ({"objectives": {"metrics": ["time_to_target"], "target": -0.2}, "environment": {"time_budget": 2.0}},
         "study.objectives.target: -0.2 is out of range; allowed: [0, 1] for val_accuracy"),
        ({"objectives": {"metrics": ["time_to_target"], "target": 1.5}, "environment": {"time_budget": 2.0}},
         "study.objectives.target: 1.5 is out of range; allowed: [0, 1] for val_accuracy (a perplexity or a loss to "
         'reach: target_metric = "val_perplexity" or "val_loss")'),
        ({"objectives": {"metrics": ["time_to_target"], "target": -1, "target_metric": "val_loss"},
          "environment": {"time_budget": 2.0}}, "study.objectives.target: -1.0 is out of range; allowed: [0, inf) for val_loss"),
    ]
    for over, line in cases:
        with pytest.raises(ConfigError) as e:
            study.from_dict(_raw(**over))
        assert str(e.value) == line


def test_a_target_or_its_metric_that_nothing_waits_for_is_one_line(tmp_path):
    """(A new user's regression study ran with `target` and `target_metric` and no [environment], in silence: no
    clock, no time to target.) A study's file is checked; a stored definition, accepted when it was searched, reads."""
    f = _copy_of_mnist_gossip(tmp_path)
    text = f.read_text()
    assert 'metrics = ["val_accuracy", "bytes"]' in text
    for extra, line in [("target = 0.5",
                         "study.objectives.target: 0.5 has no effect: time to target is measured on a simulated "
                         "cluster, and the study has no [environment]; allowed: an [environment] (time to target is timed "
                         "there), or no target"),
                        ('target_metric = "val_loss"',
                         "study.objectives.target_metric: 'val_loss' has no effect without study.objectives.target; "
                         "allowed: a target beside it (time_to_target, with an [environment]), or no target_metric")]:
        f.write_text(text.replace('metrics = ["val_accuracy", "bytes"]', f'metrics = ["val_accuracy", "bytes"]\n{extra}'))
        with pytest.raises(ConfigError) as e:
            study.load(f)
        assert str(e.value) == line
        assert study.from_dict(tomllib.loads(f.read_text())).objectives == ("val_accuracy", "bytes")  # as stored
    # a search stored with such a target (before this check) goes on once it is taken out: no change of the study
    from evomerge.search import fingerprint

    stored = fingerprint.of(study.from_dict(tomllib.loads(text.replace('metrics = ["val_accuracy", "bytes"]',
                                                                       'metrics = ["val_accuracy", "bytes"]\ntarget = 0.5'))))
    now = study.load(_copy_of_mnist_gossip(tmp_path / "now"))
    assert fingerprint.changed_since(stored["summary"], fingerprint.of(now)["summary"], now) == ""
    # calibrate reads the study as on a cluster: its target is not refused there
    f.write_text(text.replace('metrics = ["val_accuracy", "bytes"]', 'metrics = ["val_accuracy", "bytes"]\ntarget = 0.5'))
    assert study.load(f, calibrating=True).target == 0.5
    # with a clock, a target is reported (run's table, each round's time to target) without being an objective
    timed = f.read_text().replace('target_metric = "val_loss"', "target = 0.5") + "\n[environment]\ntime_budget = 5.0\n"
    f.write_text(timed)
    assert study.load(f).target == 0.5


def test_a_key_other_tools_spell_otherwise_is_met_with_the_name_evomerge_uses():
    """(`run.learning_rate` got the list of keys, and no hint: nothing in it is spelt alike.)"""
    for over, line in [({"run": {"learning_rate": 0.1}}, "; did you mean lr?"),
                       ({"run": {"num_workers": 8}}, "; did you mean workers?"),
                       ({"run": {"lerning_rate": 0.1}}, "; did you mean lr?")]:  # (a synonym misspelt: no hint)
        with pytest.raises(ConfigError) as e:
            study.from_dict(_raw(**over))
        assert str(e.value).startswith(f"study.run.{next(iter(over['run']))}: unknown key; allowed: ") and \
            str(e.value).endswith(line), str(e.value)
    with pytest.raises(ConfigError) as e:  # a letter is no misspelt synonym ("w" was "did you mean weight_decay?")
        study.from_dict(_raw(run={"w": 1}))
    assert "did you mean" not in str(e.value), str(e.value)


def test_a_bad_policy_file_in_the_baselines_is_named_with_the_field_that_lists_it(tmp_path):
    """(It said `policy.topology: unknown 'star'; ...` alone: which of the study's files, and where it is listed?)"""
    f = _copy_of_mnist_gossip(tmp_path)
    (tmp_path / "pol").mkdir()
    (tmp_path / "pol" / "bad.json").write_text('{"topology": "star"}')
    bad = tmp_path / "pol" / "bad.json"
    f.write_text(f.read_text().replace('policies = ["no-merging"', f'policies = ["{bad}", "no-merging"'))
    with pytest.raises(ConfigError) as e:
        study.load(str(f))
    assert e.value.field == "study.baselines.policies"
    assert str(e.value).startswith(f"study.baselines.policies: {bad}: policy.topology: unknown 'star'; allowed: ")


def _copy_of_mnist_gossip(folder, workers=None):
    """The shipped study copied into another folder under another name, as a new user does."""
    text = (study.shipped_studies_dir() / "mnist-gossip.toml").read_text().replace('name = "mnist-gossip"', 'name = "mine"')
    if workers:
        text = text.replace("workers = 8", f"workers = {workers}")
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "my-study.toml"
    f.write_text(text)
    return f


def test_a_copied_study_finds_the_shipped_named_policies(tmp_path):
    s = study.load(_copy_of_mnist_gossip(tmp_path / "elsewhere"))
    assert not s.policies_dir().exists()
    assert [s.resolve_policy(b).name for b in s.baselines] == ["no-merging", "fedavg", "allreduce", "ring-gossip", "diloco"]
    own = s.policies_dir()
    own.mkdir()
    (own / "fedavg.json").write_text('{"name": "my-fedavg", "scheme": "allreduce", "mean_interval": 7}')
    assert s.resolve_policy("fedavg").name == "my-fedavg"  # the study's own folder comes first
    with pytest.raises(ConfigError, match=r"^--policy: nope: no such file or named policy; named: allreduce, allreduce-backup, allreduce-sign, allreduce-topk, async-diloco, diloco, fedavg"):
        s.resolve_policy("nope")


def test_impossible_corners_of_the_space_are_resolved_when_the_study_is_loaded(tmp_path):
    s = study.load(_copy_of_mnist_gossip(tmp_path, workers=4))
    assert s.policy.degree == 3  # random_regular is in the space: 4 with 4 workers is impossible
    assert s.notes == ("study.policy.degree: 4 (the default) is impossible with 4 workers; using 3",)
    s3 = study.load(_copy_of_mnist_gossip(tmp_path, workers=3))
    ranges = {p.name: (p.low, p.high) for p in s3.search.space}
    assert ranges["n_communities"] == (2, 3) and s3.policy.degree == 2
    assert any("n_communities: [2, 4] -> [2, 3]" in n for n in s3.notes)
    assert study.load("mnist-gossip").notes == ()  # nothing to resolve with 8 workers


def test_a_shipped_study_copied_with_fewer_workers_names_the_baseline_that_cannot_run(tmp_path):
    """(A copy of mnist-stragglers on 2 workers ran its trials, then failed on `policy.backup_workers: 2 with 2
    workers`, a field the user never wrote.) Refused at load, naming the baseline."""
    import shutil

    text = (study.shipped_studies_dir() / "mnist-stragglers.toml").read_text()
    text = text.replace("workers = 16", "workers = 2").replace("slow_workers = [15]", "slow_workers = [1]")
    (tmp_path / "my.toml").write_text(text)
    shutil.copytree(study.shipped_studies_dir() / "policies", tmp_path / "policies")
    with pytest.raises(ConfigError) as e:
        study.load(tmp_path / "my.toml")
    assert str(e.value) == ("study.baselines.policies: allreduce-backup cannot run on 2 workers (policy.backup_workers: "
                            "2 with 2 workers; allowed: 0..1); allowed: policies that can, or more run.workers")
    (tmp_path / "my.toml").write_text(text.replace('"allreduce-backup", ', ""))
    assert "allreduce-backup" not in study.load(tmp_path / "my.toml").baselines


def test_a_ragged_matrix_in_a_cluster_file_is_said_as_it_is(tmp_path):
    """(A row of three entries in a 2 x 2 matrix was reported as "got 2 x 2", with a hint to fit another number of
    ranks.)"""
    (tmp_path / "cluster.toml").write_text("[environment]\nstep_time = 0.05\n"
                                           "bandwidth_matrix = [[0, 1e9, 5], [1e9, 0]]\n")
    (tmp_path / "s.toml").write_text('[study]\nname = "s"\n[run]\nworkers = 2\n[environment]\nfrom = "cluster.toml"\n')
    with pytest.raises(ConfigError) as e:
        study.load(tmp_path / "s.toml")
    assert str(e.value) == ("study.environment.bandwidth_matrix: must be 2 x 2 (run.workers), got 2 rows of 2, 3 "
                            f"entries (from {tmp_path / 'cluster.toml'})")


def test_a_bad_entry_of_a_cluster_files_list_names_the_file(tmp_path):
    """(speeds[0] = 0 left out "(from cluster.toml)", which every other error of that file says.)"""
    (tmp_path / "cluster.toml").write_text("[environment]\nstep_time = 0.05\nspeeds = [0.0, 1.0]\n")
    (tmp_path / "s.toml").write_text('[study]\nname = "s"\n[run]\nworkers = 2\n[environment]\nfrom = "cluster.toml"\n')
    with pytest.raises(ConfigError) as e:
        study.load(tmp_path / "s.toml")
    assert str(e.value) == ("study.environment.speeds[0]: 0.0 is out of range; allowed: a speed > 0 (1.0 = step_time "
                            f"per step) (from {tmp_path / 'cluster.toml'})")


def test_a_study_of_the_defaults_on_a_calibrated_cluster_loads(tmp_path):
    """Only `[environment] from = ...` is a study (the defaults on that cluster), not a cluster file given as one."""
    (tmp_path / "cluster.toml").write_text("[environment]\nstep_time = 0.02\nspeeds = \"lognormal\"\nsigma = 0.2\n")
    (tmp_path / "s.toml").write_text('[environment]\nfrom = "cluster.toml"\n')
    s = study.load(tmp_path / "s.toml")
    assert s.environment.step_time == 0.02 and s.environment.sigma == 0.2
    with pytest.raises(ConfigError, match="holds only an"):
        study.load(tmp_path / "cluster.toml")


def test_a_cluster_file_in_studies_is_not_offered_as_a_study(tmp_path, monkeypatch):
    """calibrate's file kept beside the studies in ./studies/ is not in the list of known studies an unknown name
    gets; the study that reads it is."""
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "cluster.toml").write_text("[environment]\nstep_time = 0.02\n")
    (tmp_path / "studies" / "mine.toml").write_text('[environment]\nfrom = "cluster.toml"\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        study.load("nosuch")
    known = str(e.value).split("known: ", 1)[1].split(" (or give", 1)[0].split(", ")
    assert "mine" in known and "mnist-gossip" in known and "cluster" not in known
    assert study.load("mine").environment.step_time == 0.02


def test_a_name_with_its_file_beside_the_command_is_pointed_at_the_file(tmp_path, monkeypatch):
    """`--study my` where ./my.toml is: the one line names the file, as `did you mean` does a misspelt name."""
    (tmp_path / "my.toml").write_text("[run]\nworkers = 2\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        study.load("my")
    assert str(e.value).endswith("(or give a path to a .toml file); did you mean my.toml?")
    with pytest.raises(ConfigError) as e:
        study.load("mnist-gosip")
    assert str(e.value).endswith("; did you mean mnist-gossip?")


def test_an_unknown_model_name_points_at_the_factory_not_at_module():
    """'module' is the factory's own name, not a choice to type: the line offers the named models and the factory."""
    with pytest.raises(ConfigError) as e:
        study.from_dict({"model": {"name": "resnet"}})
    assert str(e.value) == ('study.model.name: unknown \'resnet\'; allowed: mlp, cnn (or your own nn.Module: '
                            'factory = "mymodels:build")')


def test_a_users_model_with_no_dataset_or_loader_is_told_it_trains_on_mnist(tmp_path, data_dir, capsys):
    """(A forgotten `[data] loader`: the run failed with MNIST's download error, or the user's model refused
    [B, 28, 28] inputs, with no word of why MNIST.)"""
    from evomerge import cli

    model = {"factory": "user_mlp:mlp"}
    said = [n for n in study.from_dict({"model": model}).notes if n.startswith("study.data")]
    assert said == ['study.data: names no dataset or loader, so your model (user_mlp:mlp) trains on mnist, the '
                    'default; your own data: [data] loader = "module:function" (or dataset = "mnist" to say it)']
    for data in ({"dataset": "mnist"}, {"loader": "mydata:load"}):
        assert not [n for n in study.from_dict({"model": model, "data": data}).notes if n.startswith("study.data")]
    assert not [n for n in study.from_dict({}).notes if n.startswith("study.data")]  # a named model: mnist is its own
    # the command says it, before the data's own line
    f = tmp_path / "mine.toml"
    f.write_text('[model]\nfactory = "user_mlp:mlp"\n[data]\nval_size = 100\ntrain_size = 400\n')
    assert cli.main(["run", "--study", str(f), "--policy", "fedavg", "--data-dir", str(tmp_path / "nowhere")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"note: {said[0]}" and lines[1].startswith("error: --data-dir: ") and len(lines) == 2, lines


def test_a_searched_field_that_never_takes_effect_is_a_note():
    """(`outer_optimizer` searched over a gossip scheme with outer_every 0: Optuna stored 'nesterov' for trials whose
    policy, MLflow params and export said 'none', with no word; the sampler spent a dimension on it.)"""
    def inert(policy, space):
        raw = {"policy": policy, "search": {"space": space}}
        return [n for n in study.from_dict(raw).notes if "never takes effect" in n]

    outer = {"kind": "categorical", "choices": ["none", "nesterov"]}
    weight = {"kind": "float", "low": 0.1, "high": 1.0}
    assert inert({"scheme": "gossip"}, {"outer_optimizer": outer, "mixing_weight": weight}) == [
        "study.search.space.outer_optimizer: never takes effect: every policy the space gives has outer_optimizer "
        "'none' (it does not apply with [policy]'s fields and the other searched ones); the search spends a "
        "dimension on it"]
    # where another searched field lets it apply, it is no note: SlowMo's outer_every, or the scheme itself
    assert inert({"scheme": "gossip"}, {"outer_optimizer": outer, "outer_every": {"kind": "int", "low": 0,
                                                                                   "high": 8}}) == []
    assert inert({}, {"outer_optimizer": outer, "scheme": {"kind": "categorical",
                                                           "choices": ["gossip", "allreduce"]}}) == []
    # DiLoCo's outer step takes the whole average: a searched mixing weight is spent for nothing there
    said = inert({"scheme": "allreduce", "outer_optimizer": "nesterov"}, {"mixing_weight": weight})
    assert len(said) == 1 and said[0].startswith("study.search.space.mixing_weight: never takes effect: every policy "
                                                 "the space gives has mixing_weight 1.0 "), said
    for f in ("mnist-gossip", "mnist-stragglers", "mnist-two-sites", "mnist-skewed", "tiny-lm"):  # the shipped: none
        assert not [n for n in study.load(f).notes if "never takes effect" in n], f


def test_a_searched_interval_past_the_runs_steps_is_a_note():
    """(A search's trials with mean_interval past the run's local steps merged never, each said so only after it
    ran, as "never merged"; the space that gave them was said nothing of.)"""
    def note(space, steps=100, **raw):
        return study.from_dict({"run": {"steps": steps}, "search": {"space": {"mean_interval": space}}, **raw}
                               ).interval_note(steps)

    part = note({"kind": "log-float", "low": 1.0, "high": 200.0})
    assert part == ("study.search.space.mean_interval: [1, 200] reaches past the run's 100 local steps a worker: a "
                    "policy with mean_interval above 100 merges never (every round(mean_interval) steps) or seldom "
                    "(gossip's random intervals), and runs much as no-merging does")
    every = note({"kind": "categorical", "choices": [150, 400]})
    assert every.startswith("study.search.space.mean_interval: [150, 400] is past the run's 100 local steps a "
                            "worker: every policy it gives merges never") and every.endswith(
        "; lower the range, or raise study.run.steps (or epochs)")
    assert note({"kind": "float", "low": 101, "high": 300}).startswith(
        "study.search.space.mean_interval: [101, 300] is past ")
    # within the steps (round(100.4) is 100): no note
    assert note({"kind": "float", "low": 1.0, "high": 100.4}) is None
    assert note({"kind": "categorical", "choices": [10, 50]}) is None
    # on a time budget: the steps a worker at step_time takes in it (a budget of 0.1 s: every trial said "never
    # merged" after it ran, and the search's start said nothing)
    assert note({"kind": "float", "low": 1.0, "high": 500.0},
                environment={"step_time": 0.01, "time_budget": 5.0}) is None  # (500 steps in it: none past them)
    assert note({"kind": "log-float", "low": 4.0, "high": 40.0}, environment={"step_time": 0.05, "time_budget": 0.1}) \
        == ("study.search.space.mean_interval: [4, 40] is past the 2 local steps a worker at step_time 0.05 s takes "
            "in study.environment.time_budget 0.1 s: every policy it gives merges never (every round(mean_interval) "
            "steps) or seldom (gossip's random intervals), and runs much as no-merging does; lower the range, or "
            "raise the time budget")
    # the shipped studies' steps: none (mnist-gossip's 2 epochs are 400 or so local steps, its range ends at 200)
    assert study.load("tiny-lm").interval_note(200) is None


def test_baseline_step_sizes_that_are_no_list_of_numbers_say_what_is_allowed():
    """(`lr = 0.1` said "must be a list, got float 0.1", and `["x"]` "must be a number", without the allowed values.)"""
    for v in (0.1, ["x"], [0.05, 0]):
        with pytest.raises(ConfigError) as e:
            study.from_dict(_raw(baselines={"lr": v}))
        assert str(e.value).endswith("; allowed: distinct step sizes > 0, e.g. [0.025, 0.05, 0.1, 0.2] (each baseline "
                                     "runs at its best)"), str(e.value)
    assert study.from_dict(_raw(baselines={"lr": [0.05, 1]})).baseline_lr == (0.05, 1.0)
    # the element at fault is named (a new user's [-0.01, 0.01] was named as the list alone)
    for v, said in (([-0.01, 0.01], "list [-0.01, 0.01]: float -0.01 is not a step size > 0; allowed: "),
                    ([0.1, 0.1], "list [0.1, 0.1]: 0.1 is listed twice; allowed: ")):
        with pytest.raises(ConfigError) as e:
            study.from_dict(_raw(baselines={"lr": v}))
        assert str(e.value).startswith(f"study.baselines.lr: {said}"), str(e.value)


def test_a_regressions_target_is_its_loss_unless_the_study_names_another_metric():
    """(A regression with a target and no target_metric was refused: "'val_accuracy' needs class labels; ... allowed
    here: val_loss", the only metric it could be.)"""
    env = {"environment": {"time_budget": 5.0}}
    reg = study.from_dict(_raw(run={"loss": "mse"}, objectives={"metrics": ["time_to_target"], "target": 0.05}, **env))
    assert reg.target_metric == "val_loss" and reg.target == 0.05
    cls = study.from_dict(_raw(objectives={"metrics": ["time_to_target"], "target": 0.8}, **env))
    assert cls.target_metric == "val_accuracy"
    named = study.from_dict(_raw(run={"loss": "mse"}, objectives={"metrics": ["time_to_target"], "target": 0.05,
                                                                  "target_metric": "val_loss"}, **env))
    assert named.target_metric == "val_loss"


def test_a_per_worker_step_budget_takes_no_note_of_a_long_time_budget():
    """The time budget's note (a budget of many times the step budget's steps, every run taking them) is not so
    where each worker stops at its own steps."""
    shared = study.from_dict(_raw(environment={"time_budget": 1000.0, "step_time": 0.1}))
    assert "every run takes them" in shared.budget_note(100)
    each = study.from_dict(_raw(environment={"time_budget": 1000.0, "step_time": 0.1, "step_budget": "per_worker"}))
    assert each.environment.step_budget == "per_worker" and each.budget_note(100) is None


def test_a_fixed_policy_that_needs_a_searched_field_takes_the_search_s_values(tmp_path):
    """(SlowMo's outer step fixed in [policy] with outer_every searched was refused: "study.policy.outer_every: 0 with
    outer_optimizer 'sgd' over a gossip base ...; allowed: >= 1", the field named as though nothing drew it.) The
    search's values fill it; unsearched, it is refused as before."""
    base = ('[study]\nname = "s"\n[run]\nworkers = 4\nsteps = 20\n[policy]\nscheme = "gossip"\nouter_optimizer = "sgd"\n'
            '[objectives]\nmetrics = ["val_accuracy"]\n')
    f = tmp_path / "s.toml"
    f.write_text(base + '[search.space]\nouter_every = { kind = "int", low = 2, high = 10 }\n')
    s = study.load(f)
    assert [p.name for p in s.search.space] == ["outer_every"] and s.policy.outer_every == 2
    f.write_text(base + '[search.space]\nmixing_weight = { kind = "float", low = 0.1, high = 0.9 }\n')
    with pytest.raises(ConfigError) as e:
        study.load(f)
    assert e.value.field == "study.policy.outer_every" and "allowed: >= 1, or scheme allreduce" in str(e.value)
    f.write_text(base + '[search.space]\nouter_every = { kind = "int", low = 0, high = 10 }\n')
    with pytest.raises(ConfigError) as e:
        study.load(f)
    assert e.value.field == "study.search.space.outer_every" and str(e.value).startswith(
        "study.search.space.outer_every: its first value 0, taken to check [policy]: 0 with outer_optimizer 'sgd'"), e.value


def test_a_key_given_twice_and_a_metric_listed_twice_are_named(tmp_path):
    """(A second `speeds` was "invalid TOML: Cannot overwrite a value (at line 4, column 1)", and a metric listed twice
    "must list one or more distinct metrics": neither named what was twice.)"""
    f = tmp_path / "s.toml"
    f.write_text('[study]\nname = "s"\n[environment]\nspeeds = "lognormal"\nspeeds = [1.0, 2.0]\n')
    with pytest.raises(ConfigError) as e:
        study.load(f)
    assert str(e.value).endswith("invalid TOML: Cannot overwrite a value (at line 5, column 20): line 5 reads "
                                 "'speeds = [1.0, 2.0]'"), str(e.value)
    f.write_text('[study]\nname = "s"\n[objectives]\nmetrics = ["val_accuracy", "bytes", "bytes"]\n')
    with pytest.raises(ConfigError) as e:
        study.load(f)
    assert str(e.value) == ("study.objectives.metrics: lists 'bytes' more than once; allowed: one or more distinct "
                            "metrics")

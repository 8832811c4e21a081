import pytest

from evomerge import study
from evomerge.errors import ConfigError
from evomerge.models import MODELS


def test_shipped_study_loads_with_its_space_and_baselines():
    s = study.load("mnist-gossip")
    assert s.name == "mnist-gossip" and s.run.workers == 8 and s.data.partition == "dirichlet"
    names = {p.name for p in s.search.space}
    assert {"mean_interval", "topology", "mixing_weight"} <= names
    assert s.directions == ["maximize"]
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
    ({"policy": {"topology": "star"}}, "policy.topology"),
    ({"search": {"space": {"nope": {"kind": "float", "low": 0, "high": 1}}}}, "study.search.space.nope"),
    ({"search": {"space": {"mixing_weight": {"kind": "float", "low": 0.9, "high": 0.1}}}}, "study.search.space.mixing_weight"),
    ({"search": {"space": {"mixing_weight": {"kind": "float", "low": 0.1, "high": 3}}}}, "study.search.space.mixing_weight"),
    ({"search": {"space": {"mean_interval": {"kind": "log-float", "low": 0, "high": 3}}}}, "study.search.space.mean_interval.low"),
    ({"search": {"space": {"topology": {"kind": "categorical", "choices": ["ring", "star"]}}}}, "study.search.space.topology.choices"),
    ({"search": {"space": {"degree": {"kind": "float", "low": 2, "high": 4}}}}, "study.search.space.degree.kind"),
    ({"search": {"space": {"topk_fraction": {"kind": "float", "low": 0.01, "high": 1}}}}, "study.search.space"),
    ({"objectives": {"metrics": ["loss"]}}, "study.objectives.metrics"),
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
])
def test_bad_study_files(tmp_path, text, words):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words):
        study.load(f)


def test_unknown_study_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known: .*mnist-gossip"):
        study.load("no-such-study")

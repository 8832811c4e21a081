import json

import pytest

from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy, field_specs, json_schema
from evomerge.study import shipped_studies_dir


def test_round_trip_keeps_every_field():
    p = MergePolicy(scheme="gossip", topology="communities", n_communities=3, p_intra=0.7, payload="delta",
                    topk_fraction=0.1, quantize_bits=4, winner_bias=0.3, mixing_schedule="linear")
    assert MergePolicy.from_json(p.to_json()) == p
    assert MergePolicy.from_dict(json.loads(p.to_json(indent=None))).to_dict() == p.to_dict()


def test_ints_given_for_floats_become_floats():
    p = MergePolicy.from_dict({"mean_interval": 5})
    assert p.mean_interval == 5.0 and isinstance(p.mean_interval, float)


def test_policy_is_frozen():
    with pytest.raises(AttributeError):
        MergePolicy().mean_interval = 3.0


@pytest.mark.parametrize("data, field, words", [
    ({"topology": "star"}, "policy.topology", "allowed: ring, complete, random_regular, communities"),
    ({"mean_interval": "x"}, "policy.mean_interval", 'must be a number, got str "x"; allowed: [1.0, 1000000.0]'),
    ({"topology": 3}, "policy.topology", "must be a string, got int 3; allowed: ring, complete, random_regular, "
                                         "communities"),
    ({"local_steps_by_speed": "yes"}, "policy.local_steps_by_speed", 'must be true or false, got str "yes"'),
    ({"mean_interval": 0.5}, "policy.mean_interval", "out of range"),
    ({"mixing_weight": 0.0}, "policy.mixing_weight", "(0.0, 1.0]"),
    ({"degree": True}, "policy.degree", "must be an integer"),
    ({"degree": 2.5}, "policy.degree", "must be an integer"),
    ({"foo": 1}, "policy.foo", "unknown key"),
    ({"payload": "delta", "quantize_bits": 17}, "policy.quantize_bits", "allowed: [0, 16]"),
    ({"topk_fraction": 0.1}, "policy.topk_fraction", "needs payload 'delta'"),
    ({"schema_version": 99}, "policy.schema_version", "newer"),
    ({"schema_version": 0}, "policy.schema_version", "allowed: [1, 10]"),
    ({"schema_version": 1, "swap_p": 0.5}, "policy.swap_p", "is a schema 2 field"),
    ({"payload": "weights", "quantize_bits": 4}, "policy.quantize_bits", "needs payload 'delta'"),
    ({"p_intra": float("nan")}, "policy.p_intra", "finite"),
])
def test_bad_values_name_the_field_and_what_is_allowed(data, field, words):
    with pytest.raises(ConfigError) as e:
        MergePolicy.from_dict(data)
    assert e.value.field == field
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, words", [("", "empty file"), ("{", "invalid JSON"), ("[1, 2]", "JSON object")])
def test_bad_files(tmp_path, text, words):
    f = tmp_path / "p.json"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words):
        MergePolicy.load(f)


def test_load_takes_a_shipped_policys_name_as_the_command_does(tmp_path, monkeypatch):
    """(`MergePolicy.load("diloco")` said "no such file", where `evomerge run --policy diloco` runs it.)"""
    from evomerge.registry import shipped_studies_dir

    monkeypatch.chdir(tmp_path)  # no file of that name here
    assert MergePolicy.load("diloco") == MergePolicy.load(shipped_studies_dir() / "policies" / "diloco.json")
    with pytest.raises(ConfigError, match=r"^dilocoo: no such file or shipped policy; named: .*diloco.*; did you mean "
                                          r"diloco\?$"):
        MergePolicy.load("dilocoo")
    (tmp_path / "diloco").write_text('{"scheme": "allreduce", "mean_interval": 3}')  # a file of that name wins
    assert MergePolicy.load("diloco").mean_interval == 3.0


def test_load_accepts_an_exported_file_with_metadata(tmp_path):
    f = tmp_path / "best.json"
    f.write_text(json.dumps({"policy": {"mean_interval": 7}, "study": "x", "trial": 3}))
    assert MergePolicy.load(f).mean_interval == 7.0


def test_schema_lists_every_field_and_validates_the_shipped_policies():
    import jsonschema  # a test dependency (pyproject [test])
    schema = json_schema()
    assert set(schema["properties"]) == set(MergePolicy().to_dict())
    assert schema["properties"]["topology"]["enum"] == ["ring", "complete", "random_regular", "communities"]
    files = sorted((shipped_studies_dir() / "policies").glob("*.json"))
    assert len(files) >= 4
    for f in files:
        jsonschema.validate(json.loads(f.read_text()), schema)
        MergePolicy.load(f)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"topology": "star"}, schema)


def test_field_specs_cover_the_searchable_fields():
    specs = field_specs()
    assert "name" not in specs and "schema_version" not in specs
    assert specs["topology"]["choices"] == ("ring", "complete", "random_regular", "communities")
    assert specs["mean_interval"]["low"] == 1.0


def test_describe_mentions_the_topology():
    assert "communities" in MergePolicy(topology="communities").describe()
    assert "every 50 steps" in MergePolicy(scheme="allreduce", mean_interval=50).describe()


def test_a_policy_is_hashable_and_replace_validates():
    p = MergePolicy(topology="complete")
    assert hash(p) == hash(MergePolicy(topology="complete")) and len({p, MergePolicy()}) == 2
    assert p.replace(mean_interval=3).mean_interval == 3.0
    with pytest.raises(ConfigError, match=r"^policy.topology: unknown 'star'; allowed: ring, complete"):
        p.replace(topology="star")


def test_choices_come_from_the_registries():
    from evomerge.engine.topology import TOPOLOGIES

    assert field_specs()["topology"]["choices"] == tuple(TOPOLOGIES)
    assert json_schema()["properties"]["topology"]["enum"] == list(TOPOLOGIES)


def test_schema_refuses_what_the_model_refuses():
    import jsonschema

    schema = json_schema()
    for bad in ({"schema_version": 0}, {"quantize_bits": 17}, {"mixing_weight": 0}, {"speed": 1}, {"degree": 2.5}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(ConfigError):
            MergePolicy.from_dict(bad)
    assert schema["properties"]["schema_version"]["minimum"] == 1


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 8])
def test_degree_and_communities_are_fitted_to_the_workers(workers):
    import numpy as np

    from evomerge.policy import check_workers, fit_to_workers
    from evomerge.engine.topology import build

    for d in range(1, 12):
        fitted = fit_to_workers({"degree": d, "n_communities": d}, workers)
        for topology in ("random_regular", "communities"):
            pol = MergePolicy(topology=topology, **fitted)
            check_workers(pol, workers)  # raises if impossible
            build(pol, workers, np.random.default_rng(0))  # and so would the run's topology
        if workers > 1 and d < workers and (d * workers) % 2 == 0:
            assert fitted["degree"] == d  # possible values are kept
    with pytest.raises(ConfigError, match=r"^policy.degree: 4 \(the default\) with 4 workers is impossible; allowed: "
                                          r"degree < workers and degree \* workers even, e.g. 3$"):
        check_workers(MergePolicy(topology="random_regular"), 4)  # (a degree never set: what to set is said)
    with pytest.raises(ConfigError, match=r"^policy.degree: 3 with 7 workers is impossible; .*, e.g. 2$"):
        check_workers(MergePolicy(topology="random_regular", degree=3), 7)


@pytest.mark.parametrize("fields", [dict(topology="random_regular", degree=d) for d in range(1, 8)]
                         + [dict(topology="communities", n_communities=n) for n in (2, 3, 5)]
                         + [dict(topology="ring"), dict(scheme="allreduce", topology="random_regular", degree=5)])
def test_the_workers_a_policy_needs_in_words_are_those_check_workers_takes(fields):
    """What `export` and `policy validate` say before a launch (a user found out from a refusal under torchrun)."""
    import re

    from evomerge.policy import check_workers, workers_needed

    p = MergePolicy(**fields)
    taken = []
    for w in range(2, 21):
        try:
            check_workers(p, w)
            taken.append(w)
        except ConfigError:
            pass
    words = workers_needed(p)
    if words is None:
        assert taken == list(range(2, 21))
        return
    m = re.fullmatch(r"at least (\d+) workers(, an even number)?", words)
    assert m, words
    assert taken == [w for w in range(2, 21) if w >= int(m[1]) and not (m[2] and w % 2)]


def _another_value(name: str, value):
    """A value of field ``name`` other than ``value`` that the policy's own bounds allow, or None."""
    spec = field_specs()[name]
    if isinstance(value, bool):
        return not value
    if spec["kind"] == "choice":
        return next(c for c in spec["choices"] if c != value)
    low, high = spec["low"], spec["high"]
    if spec["kind"] == "int":
        return next((v for v in (2, 3) if v != value and low <= v <= high), None)
    return next((v for v in (0.3, 0.7) if v != value and low <= v <= high and not (spec["low_open"] and v == low)), None)


@pytest.mark.parametrize("fields", [{"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 0.8},
                                    {"scheme": "gossip", "topology": "ring", "mean_interval": 4},
                                    {"scheme": "allreduce", "mean_interval": 5, "outer_optimizer": "nesterov",
                                     "mixing_weight": 1.0},
                                    {"scheme": "allreduce", "mean_interval": 8, "outer_optimizer": "nesterov",
                                     "mixing_weight": 1.0, "fragments": 2},
                                    {"scheme": "none"}])
def test_the_words_say_no_field_that_takes_no_effect(fields):
    """describe() (an export's "description", the `evomerge.policy` tag) changes with no field that no_effect names
    (they said "optimiser state averaged on merge" of no merging, and "streamed in 1 strided fragment" of a
    DiLoCo whose one fragment has no pattern)."""
    from evomerge.policy import no_effect

    base = MergePolicy.from_dict(fields)
    said = []
    for name in sorted(no_effect(base.to_dict())):
        value = _another_value(name, base.to_dict()[name])
        try:
            other = MergePolicy.from_dict({**base.to_dict(), name: value})
        except ConfigError:
            continue
        if value is not None and other.describe() != base.describe():
            said.append((name, other.describe()))
    assert not said, said


def test_asynchronous_diloco_pushing_after_every_step_says_so():
    words = MergePolicy.from_dict({"scheme": "async", "outer_optimizer": "nesterov", "mean_interval": 1}).describe()
    assert "each worker pushes after every local step, the server" in words, words
    words = MergePolicy.from_dict({"scheme": "async", "outer_optimizer": "nesterov", "mean_interval": 4}).describe()
    assert "each worker pushes after 4 local steps, the server" in words, words


@pytest.mark.parametrize("fields, change, words", [
    ({"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 0.8}, {"lerp": "random"}, "random lerp a=0.8"),
    ({"scheme": "none"}, {"stop_tol": 0.3}, "stops when updates stay below 0.3"),
    # (a new user read "streamed in 1 fragment" and "pushes after 1 local steps")
    ({"scheme": "allreduce", "outer_optimizer": "nesterov"}, {"fragment_alpha": 0.2}, "streamed whole (delay 0 steps"),
    ({"scheme": "none"}, {"data_exchange_k": 2}, "sends its 2 least confident examples"),
    ({"scheme": "none"}, {"retire_threshold": 0.3}, "retires examples confident above 0.3")])
def test_the_words_say_what_changes_a_run(tmp_path, data_dir, fields, change, words):
    """Fields that change a run are in its words (an all-reduce's random lerp, and no merging's stopping rule,
    data exchange and retiring, were not): the run changes, and so do the words."""
    import evomerge
    from conftest import write_study

    st = write_study(tmp_path, steps=12)
    base, other = MergePolicy.from_dict(fields), MergePolicy.from_dict({**fields, **change})

    def rounds(policy):
        return [{k: v for k, v in vars(m).items() if k != "wall_time"}
                for m in evomerge.run(str(st), policy, 0, data_dir=data_dir).history]

    assert rounds(other) != rounds(base)
    assert words in other.describe() and words not in base.describe(), other.describe()


@pytest.mark.parametrize("fields", [{"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 0.8},
                                    {"scheme": "gossip", "topology": "ring", "mean_interval": 4},
                                    {"scheme": "allreduce", "mean_interval": 5, "outer_optimizer": "nesterov",
                                     "mixing_weight": 1.0},
                                    {"scheme": "none"}])
def test_fields_said_to_take_no_effect_change_nothing_in_a_run(tmp_path, data_dir, fields):
    """What no_effect names (an export's "no_effect"; the fields `run --against` and a resumed Merger leave out of
    a difference): each set to another value the policy takes (a value it refuses there is no policy), all in one
    policy, the same run, bit for bit."""
    import evomerge
    from conftest import write_study
    from evomerge.errors import ConfigError
    from evomerge.policy import no_effect

    st = write_study(tmp_path, steps=12)
    base = MergePolicy.from_dict(fields)
    changed = base.to_dict()
    for name in sorted(no_effect(changed)):
        value = _another_value(name, changed[name])
        try:
            MergePolicy.from_dict({**changed, name: value})
        except ConfigError:
            continue
        if value is not None:
            changed[name] = value
    moved = sorted(k for k in changed if changed[k] != base.to_dict()[k])
    assert len(moved) >= 5, moved  # (most of what it names was changed)

    def rounds(policy):
        return [{k: v for k, v in vars(m).items() if k != "wall_time"}
                for m in evomerge.run(str(st), policy, 0, data_dir=data_dir).history]

    assert rounds(MergePolicy.from_dict(changed)) == rounds(base), moved

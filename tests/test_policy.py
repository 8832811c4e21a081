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
    ({"mean_interval": "x"}, "policy.mean_interval", "must be a number"),
    ({"mean_interval": 0.5}, "policy.mean_interval", "out of range"),
    ({"mixing_weight": 0.0}, "policy.mixing_weight", "(0.0, 1.0]"),
    ({"degree": True}, "policy.degree", "must be an integer"),
    ({"degree": 2.5}, "policy.degree", "must be an integer"),
    ({"foo": 1}, "policy.foo", "unknown key"),
    ({"quantize_bits": 1}, "policy.quantize_bits", "0 (off) or 2..16"),
    ({"topk_fraction": 0.1}, "policy.topk_fraction", "needs payload 'delta'"),
    ({"schema_version": 99}, "policy.schema_version", "newer"),
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

"""Schema 2 as a user meets it: version 1 files still read, the distributed backend refuses what it cannot run, the new fields are searchable."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import tiny_study, write_study
from evomerge import simulate
from evomerge.errors import ConfigError
from evomerge.policy import SCHEMA_VERSION, MergePolicy, json_schema


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


def test_schema_two_reads_version_one_files(tmp_path):
    v1 = {"name": "old", "scheme": "gossip", "topology": "ring", "mean_interval": 4, "schema_version": 1}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(v1))
    pol = MergePolicy.load(f)
    assert pol.schema_version == SCHEMA_VERSION == 10
    assert (pol.swap_p, pol.data_exchange_k, pol.similarity_bias, pol.regroup_every, pol.stop_tol) == (0, 0, 0, 0, 0)
    with pytest.raises(ConfigError, match=r"policy.swap_p: is a schema 2 field; this file says schema_version 1"):
        MergePolicy.from_dict({**v1, "swap_p": 0.5})
    # the file's first late field, and the versions that take all of them (it named the alphabetical first of the
    # oldest schema's, and no allowed value)
    with pytest.raises(ConfigError) as e:
        MergePolicy.from_dict({**v1, "outer_optimizer": "nesterov", "outer_lr": 0.7, "swap_p": 0.5})
    assert str(e.value) == ("policy.outer_optimizer: is a schema 4 field; this file says schema_version 1; allowed: "
                            "schema_version 4 to 10, or leave schema_version out (the current one)")
    props = json_schema()["properties"]
    assert props["similarity_bias"]["minimum"] == -1.0 and props["similarity"]["enum"] == ["sketch", "cka"]
    with pytest.raises(ConfigError, match=r"policy.regroup_every: 2 needs topology 'communities'"):
        MergePolicy(regroup_every=2)


@pytest.mark.system
def test_distributed_backend_refuses_what_it_cannot_run(tmp_path, data_dir):
    study = write_study(tmp_path, workers=4)
    pol = tmp_path / "swap.json"
    pol.write_text(json.dumps({"topology": "ring", "swap_p": 0.5}))
    r = subprocess.run([sys.executable, "-m", "evomerge.cli", "run", "--study", str(study), "--policy", str(pol),
                        "--backend", "distributed", "--data-dir", str(data_dir)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: policy.swap_p: 0.5 is not supported by the distributed backend (models are "
                                "swapped between workers); allowed: 0, or --backend inprocess")


@pytest.mark.system
def test_the_new_fields_are_searchable(tmp_path, mnist):
    import evomerge
    from evomerge import study as study_mod

    f = write_study(tmp_path, workers=4, steps=40, topologies=("communities", "complete"))
    text = f.read_text().replace("[objectives]", "\n".join([
        'similarity_bias = { kind = "float", low = -1.0, high = 1.0 }',
        'regroup_every = { kind = "int", low = 0, high = 2 }',
        'data_exchange_k = { kind = "int", low = 0, high = 8 }',
        'swap_p = { kind = "float", low = 0.0, high = 0.5 }',
        'stop_tol = { kind = "float", low = 0.0, high = 0.001 }',
        'similarity = { kind = "categorical", choices = ["sketch", "cka"] }',
        "[objectives]"]))
    f.write_text(text)
    s = study_mod.load(f)
    res = evomerge.search(s, verdict=False, n_trials=5, sampler="random", runs_dir=tmp_path / "runs", seed=2, data=mnist)
    assert res.counts.get("COMPLETE", 0) == 5 and not res.errors
    policies = [r["policy"] for r in res.records]
    assert len({p["swap_p"] for p in policies}) == 5 and len({p["similarity_bias"] for p in policies}) == 5
    for p in policies:  # regrouping only where it applies
        assert p["regroup_every"] == 0 or p["topology"] == "communities"
        assert p["schema_version"] == SCHEMA_VERSION
    with pytest.raises(ConfigError, match=r"study.search.space.similarity_bias: is not supported by the distributed"):
        evomerge.search(s, verdict=False, n_trials=1, runs_dir=tmp_path / "runs2", data=mnist, backend="distributed")

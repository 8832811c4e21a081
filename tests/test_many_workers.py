"""Runs with many workers in one process (issue 13, part 5): 1024 MLP workers on MNIST train, merge and judge;
a label-skewed partition that cannot give so many workers their score slices says so in one line."""

import dataclasses

import pytest

from evomerge import simulate, study
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy


def _study(workers, partition="iid"):
    return study.from_dict({
        "study": {"name": f"w{workers}"},
        "data": {"dataset": "mnist", "val_size": 1000, "partition": partition, "seed": 0},
        "model": {"name": "mlp", "hidden": [16]},
        "run": {"workers": workers, "batch_size": 8, "steps": 4, "lr": 0.05, "rounds": 1, "score_samples": 8,
                "eval_samples": 20},
    })


def test_1024_workers_train_merge_and_are_judged_in_one_process(data_dir):
    setup = simulate.prepare(_study(1024), data_dir=data_dir)
    assert len(setup.shards) == 1024 and min(len(s) for s in setup.shards) >= 8
    ring = MergePolicy(scheme="gossip", topology="ring", exchange="push_pull", mean_interval=2.0, mixing_weight=0.5)
    r = simulate.simulate(setup, ring, seed=0, device="cpu")
    assert r.status == "ok" and r.final.step == 4 and r.final.merges > 1024  # about W/2 events per local step
    assert 0.1 < r.final.val_accuracy <= 1.0 and r.final.bytes > 0


def test_a_skewed_partition_too_thin_for_1024_workers_is_one_line(data_dir):
    s = _study(1024, "dirichlet")
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, score_samples=32))
    with pytest.raises(ConfigError) as e:
        simulate.prepare(s, data_dir=data_dir)
    assert e.value.field == "study.data.alpha" and "1024 workers" in str(e.value)

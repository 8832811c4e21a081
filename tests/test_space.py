import optuna
import pytest

from conftest import write_study
from evomerge.search import space
from evomerge import study
from evomerge.study import Param


@pytest.fixture
def tiny(tmp_path):
    return study.load(write_study(tmp_path))


def test_trial_params_make_a_validated_policy(tiny):
    t = optuna.trial.FixedTrial({"mean_interval": 4.0, "mixing_weight": 0.3, "topology": "complete"})
    p = space.suggest(t, tiny)
    assert (p.mean_interval, p.mixing_weight, p.topology) == (4.0, 0.3, "complete")
    assert p.exchange == tiny.policy.exchange and p.degree == 3  # fixed fields keep the study's values


def test_distributions_follow_the_kinds(tiny):
    d = space.distributions(tiny.search.space)
    assert d["mean_interval"].log and d["mean_interval"].low == 1.0
    assert not d["mixing_weight"].log and d["topology"].choices == ("ring", "complete")


def test_vectors_decode_inside_the_ranges_and_round_trip():
    sp = (Param("mean_interval", "log-float", 1.0, 100.0), Param("degree", "int", 2, 5), Param("p_intra", "float", 0.0, 1.0),
          Param("topology", "categorical", choices=("ring",)))
    assert space.decode(sp, [0.0, 0.0, 0.0]) == {"mean_interval": 1.0, "degree": 2, "p_intra": 0.0}
    assert space.decode(sp, [1.0, 1.0, 1.0]) == {"mean_interval": 100.0, "degree": 5, "p_intra": 1.0}
    assert space.decode(sp, [-3, 7, 2]) == space.decode(sp, [0, 1, 1])  # clipped
    assert space.decode(sp, [0.5, 0.5, 0.25])["mean_interval"] == pytest.approx(10.0)
    ints = [space.decode(sp, [0, x / 100, 0])["degree"] for x in range(101)]
    assert sorted(set(ints)) == [2, 3, 4, 5] and all(abs(ints.count(v) - 25) <= 2 for v in (2, 3, 4, 5))  # equal shares
    v = {"mean_interval": 7.0, "degree": 3, "p_intra": 0.4}
    assert space.decode(sp, space.encode(sp, v)) == pytest.approx(v)


def test_compression_fields_sampled_with_a_weights_payload_are_switched_off(tiny):
    p = space.policy_from_params(tiny, {"payload": "weights", "topk_fraction": 0.1, "quantize_bits": 4})
    assert p.topk_fraction == 1.0 and p.quantize_bits == 0
    p = space.policy_from_params(tiny, {"payload": "delta", "topk_fraction": 0.1, "quantize_bits": 4})
    assert p.topk_fraction == 0.1 and p.quantize_bits == 4


def _mnist_gossip_with(folder, workers: int, extra: str = "") -> "study.Study":
    text = (study.shipped_studies_dir() / "mnist-gossip.toml").read_text().replace("workers = 8", f"workers = {workers}")
    f = folder / f"w{workers}.toml"
    f.write_text(text.replace("[objectives]", extra + "\n[objectives]"))
    return study.load(f)


@pytest.mark.parametrize("workers", [2, 3, 4, 5])
def test_no_point_of_the_space_makes_a_policy_the_workers_cannot_run(tmp_path, workers):
    import dataclasses
    import math
    import random

    import numpy as np

    from evomerge.policy import check_workers
    from evomerge.engine.topology import build

    s = _mnist_gossip_with(tmp_path, workers, 'degree = { kind = "int", low = 1, high = 6 }')
    in_code = dataclasses.replace(study.load("mnist-gossip"), run=dataclasses.replace(s.run, workers=workers))
    rng = random.Random(workers)
    for st in (s, in_code):  # loaded (ranges clamped) and built in code (only the mapping resolves)
        for _ in range(150):
            params = {}
            for p in st.search.space:
                if p.kind == "categorical":
                    params[p.name] = rng.choice(p.choices)
                elif p.kind == "int":
                    params[p.name] = rng.randint(p.low, p.high)
                elif p.kind == "log-float":
                    params[p.name] = math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
                else:
                    params[p.name] = rng.uniform(p.low, p.high)
            params["topology"] = rng.choice(["random_regular", "communities"])
            pol = space.policy_from_params(st, params)
            check_workers(pol, workers)
            build(pol, workers, np.random.default_rng(0))  # what the run builds: raises for an impossible degree


def test_cmaes_vectors_map_into_the_clamped_ranges(tmp_path):
    s = _mnist_gossip_with(tmp_path, 3, 'degree = { kind = "int", low = 1, high = 6 }')
    ranges = {p.name: (p.low, p.high) for p in s.search.space}
    assert ranges["degree"] == (1, 2) and ranges["n_communities"] == (2, 3)
    corner = space.decode(s.search.space, [1.0] * len(space.numeric(s.search.space)))
    assert corner["degree"] == 2 and corner["n_communities"] == 3
    pol = space.policy_from_params(s, corner | {"topology": "random_regular"})
    assert pol.degree == 2


def test_an_outer_step_is_off_where_it_does_not_apply_and_takes_what_it_needs_where_it_does():
    s = study.load("mnist-gossip")  # its space holds scheme and the outer optimiser's fields
    p = space.policy_from_params(s, {"scheme": "gossip", "outer_optimizer": "nesterov", "outer_lr": 1.5})
    assert p.scheme == "gossip" and p.outer_optimizer == "none"  # no SlowMo over gossip yet: off, not a failure
    p = space.policy_from_params(s, {"scheme": "allreduce", "outer_optimizer": "nesterov", "outer_lr": 1.5,
                                     "outer_momentum": 0.5, "mixing_weight": 0.3, "lerp": "random",
                                     "mixing_schedule": "cosine", "mean_interval": 20.0})
    assert (p.outer_optimizer, p.outer_lr, p.outer_momentum) == ("nesterov", 1.5, 0.5)
    assert (p.mixing_weight, p.lerp, p.mixing_schedule, p.payload) == (1.0, "fixed", "constant", "weights")
    p = space.policy_from_params(s, {"scheme": "allreduce", "outer_optimizer": "nesterov", "outer_momentum": 0.0})
    assert p.outer_optimizer == "sgd"  # Nesterov with momentum 0 is the plain step: written so, not refused
    p = space.policy_from_params(s, {"scheme": "allreduce", "outer_optimizer": "none", "mixing_weight": 0.3})
    assert p.mixing_weight == 0.3  # no outer step: the lerp toward the mean applies


@pytest.mark.parametrize("name", ["mnist-gossip", "mnist-gossip-64", "mnist-skewed", "mnist-stragglers",
                                  "mnist-two-sites"])
def test_every_shipped_study_searches_the_outer_step_and_has_a_diloco_baseline(name):
    import random

    from evomerge.policy import check_timed

    s = study.load(name)
    names = {p.name for p in s.search.space}
    assert {"scheme", "outer_optimizer", "outer_lr", "outer_momentum"} <= names
    assert s.resolve_policy("diloco").outer_optimizer == "nesterov" and "diloco" in s.baselines
    rng, seen, streamed = random.Random(0), set(), 0
    for _ in range(200):
        x = [rng.random() for _ in space.numeric(s.search.space)]
        params = space.decode(s.search.space, x) | {p.name: rng.choice(p.choices)
                                                    for p in s.search.space if p.kind == "categorical"}
        pol = space.policy_from_params(s, params)  # validated: every point is a policy the run accepts
        if s.environment is not None:
            check_timed(pol)
        seen.add(pol.outer_optimizer)
        streamed += pol.fragments > 1 or pol.fragment_delay > 0
    assert seen == {"none", "sgd", "nesterov"}
    if s.environment is not None:  # the time studies also search Streaming DiLoCo's fields
        assert "streaming-diloco" in s.baselines and streamed > 10

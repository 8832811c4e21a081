"""Random streams: one table of purposes (schedule.STREAMS), one tag each, and every call names its tag there."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from evomerge.engine import schedule

PACKAGE = Path(schedule.__file__).resolve().parent


def test_no_two_purposes_share_a_tag():
    tags = list(schedule.STREAMS.values())
    assert len(tags) == len(set(tags)), schedule.STREAMS


def test_why_tags_must_differ_seedsequence_pads_with_zeros():
    """Two purposes with one tag would share a stream even with different arguments: (seed, t) is (seed, t, 0, 0)."""
    a = schedule.rng_for(5, 41).random(3)
    assert np.array_equal(a, schedule.rng_for(5, 41, 0, 0).random(3))
    streams = {k: schedule.rng_for(5, t, 0, 0).random(3).tolist() for k, t in schedule.STREAMS.items()}
    assert len({tuple(v) for v in streams.values()}) == len(streams)


def test_every_call_of_rng_for_takes_its_tag_from_the_table():
    """No literal tags: the first tag of every rng_for call is a name (TAG_... from STREAMS), never a number."""
    calls = 0
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "rng_for":
                if path.name == "schedule.py" and not node.args[1:]:
                    continue
                calls += 1
                tag = node.args[1]
                assert not isinstance(tag, ast.Constant), f"{path.name}:{node.lineno} passes a literal tag"
    assert calls >= 15
    names = {n for path in PACKAGE.rglob("*.py") for n in _tag_constants(path)}
    assert names >= {"TAG_PASSES", "TAG_SPEEDS", "TAG_BATCHES", "TAG_QUANT", "TAG_SKETCH", "TAG_INIT"}


def _tag_constants(path: Path):
    """TAG_ names assigned in a module: each must come from STREAMS, not from a number."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            tag_names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.startswith("TAG_")]
            if tag_names:
                assert not any(isinstance(v, ast.Constant) for v in ast.walk(node.value)
                               if isinstance(v, ast.Constant) and isinstance(v.value, int)), f"{path.name}: {tag_names}"
                yield from tag_names

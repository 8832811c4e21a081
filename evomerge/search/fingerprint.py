"""What a study's results depend on, stored with the Optuna study (user attribute
``fingerprint``: a hash and a readable summary), so that a changed study file under an old
name is refused instead of silently resuming the old results.

The summary is flat, ``section.field -> value``, over: ``data``, ``model``, ``run`` (with the source of the
user's own model, loader or loss module where it sits beside the study file: ``model.factory_source``, ...),
``environment`` (``none`` when the study has none), the fixed ``policy``, the searched
``space`` and the ``objectives`` (with the target and its metric, where the study has one). Not in it: the study's description, ``search.n_trials``
and ``search.sampler`` (how much and how to search do not change what a trial means), the
baselines, the policy's name.

A study stored before fingerprints existed adopts the current one silently. A field that the
stored summary lacks (added to evomerge since) is not a change: the stored fingerprint is
brought up to date.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..policy import what_merges

if TYPE_CHECKING:
    from ..study import Study
    from .config import SearchConfig

ATTR = "fingerprint"


def _plain(obj: Any) -> Any:
    """JSON-able values of dataclasses, pydantic models, policies, tuples."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return _plain(obj.to_dict())
    if hasattr(obj, "model_dump") and callable(obj.model_dump):
        return _plain(obj.model_dump())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


#: the summary's name of the file an [environment] was read from (``from``), "" where the study file writes it
FROM_FILE = "environment.from_file"

#: fields added to a study after studies were stored, left out of the summary at their defaults
ADDED_LATER = {"environment.step_budget": "shared", "environment.merge_time": 0.0}


def summary(study: "Study", corpus: bool = True) -> dict[str, Any]:
    """``corpus``: with the digest of a text study's corpus (read whole; left out where only the files beside the
    study are looked at)."""
    out: dict[str, Any] = {}
    for section in ("data", "model", "run"):
        _flat(section, _plain(getattr(study, section)), out)
    base = study.path.parent if study.path is not None else None
    if study.data.dataset == "text" and not study.data.loader and corpus:  # the corpus's content (evomerge.text)
        from .. import text

        out["data.text_digest"] = study.data.sha256 or text.digest(text.root_of(study.data, base))
    # the user's own code beside the study (a model factory, a loader, a loss): its source, so that an edited
    # model file under the old study name is a change (the data a loader reads are not hashed)
    from ..userref import neighbours, source_digest, source_file

    for field, ref in (("model.factory", study.model.factory), ("data.loader", study.data.loader),
                       ("run.loss", study.run.loss)):
        code = source_digest(ref, base) if ref else None
        if code is not None:
            out[f"{field}_source"] = code[:16]
            out[f"{field}_file"] = source_file(ref, base)  # (for the line that says what changed)
            more = neighbours(ref, base)  # the modules beside the study it imports: an edited helper is a change
            if more is not None:
                out[f"{field}_imports"] = f"{more[1][:16]} ({', '.join(more[0])})"
    env = getattr(study, "environment", None)
    _flat("environment", _plain(env) if env is not None else "none", out)
    if env is not None:  # the file it was read from ("" where the study file writes it): words for the line that
        src = getattr(study, "environment_from", None)  # says what changed, not hashed (a *_file)
        out["environment.from_file"] = src[0] if src is not None else ""
    for key, default in ADDED_LATER.items():  # at its default, as every study before the field ran: their hashes,
        if key in out and out[key] == default:  # and the runs kept by them, stay
            del out[key]
    policy = what_merges(_plain(study.policy))
    _flat("policy", policy, out)
    for p in study.search.space:
        out[f"space.{p.name}"] = {k: v for k, v in _plain(p).items() if k != "name" and v not in (None, [])}
    out["objectives"] = list(study.objectives)
    if study.target is not None:  # what time to target waits for (and the verdict's runs judged by it)
        out["objectives.target"] = study.target
        out["objectives.target_metric"] = study.target_metric
    return json.loads(json.dumps(out, sort_keys=True))  # as it reads back from the storage


#: summary keys the hash leaves out, compared by :func:`check` itself: the target (added to the summary after
#: studies with one were stored: the runs kept by their hashes stay found; the keys that cache runs whose values
#: depend on the target hold it themselves)
UNHASHED = ("objectives.target", "objectives.target_metric")


def digest(s: dict[str, Any]) -> str:
    """The hash of a summary, less the names of the user's files (``*_file``: words for a line, not what a trial
    depends on; the runs kept by the hash, a baseline's tuned step size, stay found after they were added) and
    :data:`UNHASHED`."""
    kept = {k: v for k, v in s.items() if not k.endswith("_file") and k not in UNHASHED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def of(study: "Study") -> dict[str, Any]:
    s = summary(study)
    return {"hash": digest(s), "summary": s}


def changes(stored: dict[str, Any], now: dict[str, Any], unused: frozenset[str] = frozenset()) -> list[str]:
    """What changed from ``stored`` to ``now`` (keys only in ``now`` are fields added since: not changes; ``unused``:
    keys whose value changes nothing now, such as an [environment] key its environment ignores)."""
    out = []
    for k in sorted(stored):
        if k in unused:
            continue
        if k.startswith("space.") and k not in now:
            out.append(f"search.{k} removed")
        elif k not in now:
            out.append(f"{k} changed ({_show(stored[k])} -> absent)")
        elif stored[k] != now[k] and k.endswith(("_source", "_imports")):  # the code, by its files' names
            what = (now.get(k.removesuffix("_source") + "_file") if k.endswith("_source") else
                    now[k].split(" ", 1)[-1].strip("()") if isinstance(now[k], str) else None)
            out.append(f"{k} changed ({what or 'the code'} edited)")
        elif stored[k] != now[k]:
            out.append(f"{'search.' if k.startswith('space.') else ''}{k} changed ({_show(stored[k])} -> {_show(now[k])})")
    for k in sorted(now):
        if k.startswith("space.") and k not in stored and any(s.startswith("space.") for s in stored):
            out.append(f"search.{k} added")
    return out


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list, str)) else str(v)  # "16" -> 16: a string became a number


def changed_since(stored: dict[str, Any], now: dict[str, Any], study: "Study") -> str:
    """What changed from the summary ``stored`` to ``now`` (``study``'s), in words (the first three and how many more;
    an ``[environment]`` key the study's environment ignores may have left the file: no change); empty if nothing."""
    from ..study import FROM_REPLACES, ignored_keys

    env = getattr(study, "environment", None)
    unused = frozenset(f"environment.{k}" for k in ignored_keys(env)) if env is not None else frozenset()
    if env is None:  # a target with no clock waited for nothing (a file's, refused since; taken out: no change)
        unused |= {"objectives.target", "objectives.target_metric"}
    src = getattr(study, "environment_from", None)
    if src is not None:  # the file's keys a key beside `from` replaces: not read (the key beside it is the change)
        unused |= {f"environment.{theirs}" for mine, theirs in FROM_REPLACES if mine in src[1]}
    diff = changes(stored, now, unused | {FROM_FILE})
    was = stored.get(FROM_FILE)  # None: a study stored before the file was kept
    if env is not None and (src is not None or was):  # the cluster file's keys that moved, not each matrix in full
        ref, own = src if src is not None else ("", ())  # (own: the keys set beside `from`; the others the file's)

        def key_of(d: str) -> str | None:
            k = d.split(" ", 1)[0].removeprefix("environment.").split(".", 1)[0]
            return k if d.startswith("environment.") and k not in own else None
        moved = [key_of(d) for d in diff if key_of(d)]
        if moved:
            said = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
            head = (f"environment.from {ref} changed ({said})" if was is None or was == ref else
                    f"[environment] is now from {ref}, not written in the study file ({said} differ)" if was == "" else
                    f"[environment] is now written in the study file, not from {was} ({said} differ)" if not ref else
                    f"environment.from changed ({was} -> {ref}: {said} differ)")
            diff = [head] + [d for d in diff if not key_of(d)]
    return ", ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")


def check(ostudy, cfg: "SearchConfig", n_trials: int, failed: int = 0) -> None:
    """Refuse, in one line, to search a stored study whose fingerprint differs from the study file's;
    store the fingerprint when the stored study has none (or lacks fields added since), when it holds no trial
    (``evomerge baselines`` stored it, to keep their step sizes), or when every trial it holds failed (``failed ==
    n_trials``: the user fixed the cause, as the search's stop told them to; nothing stored was measured with the
    study as it was; a trial still running or waiting is not failed)."""
    current = of(cfg.study)
    stored = ostudy.user_attrs.get(ATTR)
    held = (stored or {}).get("summary", {})
    # the same hash, the same keys the hash leaves out, and no key added since: nothing to look at or to store
    if stored and stored.get("hash") == current["hash"] and held.keys() >= current["summary"].keys() and \
            all(held.get(k) == current["summary"].get(k) for k in UNHASHED):
        return
    if stored:
        shown = changed_since(stored.get("summary", {}), current["summary"], cfg.study)
        if shown and n_trials and failed == n_trials:
            import sys

            print(f"note: study {cfg.study.name}: {shown} since its {n_trials} stored trial{'s' * (n_trials != 1)}, "
                  "none of which finished "
                  "(they failed): the search goes on with the study as it is now", file=sys.stderr)
        elif shown and n_trials:
            afresh = "--runs-dir" if cfg.default_store else "--storage"
            raise ConfigError(f"study {cfg.study.name}", f"{shown} since its {n_trials} stored "
                                                         f"trial{'s' * (n_trials != 1)}; "
                                                         f"use another [study] name or {afresh} to start afresh")
    ostudy.set_user_attr(ATTR, current)

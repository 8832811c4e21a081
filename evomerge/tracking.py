"""MLflow tracking, written against ``mlflow.MlflowClient`` (no fluent global run).

One experiment per study, one parent run per ``search`` invocation, one nested run
per trial: the policy as params, per-round metrics with the step in local steps (a
trial that averages several seeds logs seed k's rounds at ``k * total_steps + step``),
final metrics (means over seeds, and their spread), the trial's state, the Optuna
trial number as a tag, and ``policy.json`` as an artifact.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .errors import ConfigError


def default_tracking_uri(runs_dir: Path) -> str:
    return f"sqlite:///{(runs_dir / 'mlflow.db').resolve()}"


def resolve_tracking_uri(explicit: str | None, study_dir: Path) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the study's own SQLite store."""
    import os

    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(study_dir)


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """For an HTTP tracking server, fail now, in one line, if it does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as r:
            if r.status != 200:
                raise ConfigError("--tracking-uri", f"{uri} answered /health with HTTP {r.status}")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ConfigError("--tracking-uri", f"cannot reach the MLflow server at {uri} ({getattr(e, 'reason', e)}); "
                                            "start it or pass another --tracking-uri") from None


# per-round metrics logged as MLflow metric histories (x axis: local steps)
ROUND_METRICS = ("val_accuracy", "val_loss", "mean_worker_accuracy", "worst_worker_accuracy", "consensus_distance",
                 "bytes", "update_norm", "train_loss", "local_update_norm", "merge_update_norm", "similarity_mean",
                 "similarity_min", "label_skew", "examples_moved")


class Tracker:
    def __init__(self, uri: str, study_name: str, artifact_dir: Path | None = None):
        from mlflow import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            location = artifact_dir.resolve().as_uri() if artifact_dir and not uri.startswith("http") else None
            self.experiment_id = self.client.create_experiment(study_name, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        self.parent_id: str | None = None

    def start_parent(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        self.parent_id = run.info.run_id
        self._params(self.parent_id, params)
        return self.parent_id

    def end_parent(self, status: str = "FINISHED", metrics: dict[str, float] | None = None) -> None:
        if self.parent_id is None:
            return
        if metrics:
            self._metrics(self.parent_id, {k: v for k, v in metrics.items() if v is not None})
        self.client.set_terminated(self.parent_id, status=status)

    def log_trial(self, record: dict[str, Any]) -> str:
        """One nested run for a finished (or interrupted) trial record from the search."""
        from mlflow.entities import Metric

        tags = {
            "mlflow.parentRunId": self.parent_id or "",
            "optuna.trial_number": str(record["number"]),
            "optuna.trial_state": record["state"],
            "evomerge.study": record["study"],
            "evomerge.sampler": record["sampler"],
        }
        if record.get("error"):
            tags["evomerge.error"] = record["error"][:5000]
        run = self.client.create_run(self.experiment_id, run_name=f"trial-{record['number']}", tags=tags,
                                     start_time=int(record["start"] * 1000))
        rid = run.info.run_id
        self._params(rid, {**record["policy"], "seeds": ",".join(map(str, record["seeds"]))})
        history = []
        for k, h in enumerate(record["histories"]):
            offset = k * record["total_steps"]
            ts = int(record["start"] * 1000)
            for r in h:
                for key in ROUND_METRICS:
                    if key not in r:  # histories written before a metric existed
                        continue
                    v = r[key]
                    if v == v and abs(v) != float("inf"):
                        history.append(Metric(key, float(v), ts, offset + r["step"]))
        for i in range(0, len(history), 900):
            self.client.log_batch(rid, metrics=history[i:i + 900])
        self._metrics(rid, {f"final_{k}": v for k, v in record["final"].items()})
        self.client.log_text(rid, json.dumps(record["policy"], indent=2), "policy.json")
        status = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED"}.get(record["state"], "KILLED")
        if record.get("failure") == "interrupted":
            status = "KILLED"
        self.client.set_terminated(rid, status=status, end_time=int(record["end"] * 1000))
        return rid

    def _params(self, rid: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(rid, params=[Param(k, str(v)) for k, v in params.items()])

    def _metrics(self, rid: str, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, 0) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v]
        if ms:
            self.client.log_batch(rid, metrics=ms)

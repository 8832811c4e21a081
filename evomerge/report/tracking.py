"""MLflow tracking, written against ``mlflow.MlflowClient`` (no fluent global run, no global tracking URI).

One experiment per study, one parent run per ``search`` invocation, one nested run
per trial: the policy as params, per-round metrics with the step in local steps (a
trial that averages several seeds logs seed k's rounds at ``k * total_steps + step``),
final metrics (means over seeds, and their spread), the trial's state, the Optuna
trial number as a tag, and ``policy.json`` as an artifact.

What a person sees in the MLflow UI (MLflow 3):

- the experiment is tagged as a model-training experiment (``mlflow.experimentKind`` =
  ``custom_model_development``), its description is the study's;
- MLflow 3.17's UI opens every experiment in its GenAI view unless the address says
  ``workflowType=machine_learning``; :func:`review_url` is the address to hand out: the
  runs list, flat (not collapsed under the parent), sorted by the first objective, with the
  objectives and the searched policy fields as columns (a shared view stored as the
  experiment tag ``mlflow.sharedViewState.evomerge``);
- every run has the study's data as dataset inputs (training and validation splits) and a
  source (the study file);
- the objectives are ``final_<objective>`` on every trial run, and on the parent run the best
  trial's values under the same names (:meth:`Tracker.log_best`);
- a pruned trial's run is KILLED and named ``trial-N (pruned)``, a failed one FAILED and
  ``trial-N (failed)``, a diverged one FAILED and ``trial-N (diverged)``; the tag
  ``evomerge.status`` says the same;
- the best trial's consensus model is an MLflow 3 logged model (pytorch flavour), output of
  the best trial's run and of the parent run, beside ``policy.json``.
- the baselines of the search's end screen are runs ``baseline-NAME`` beside the trials (nested
  under the search's run, tag ``evomerge.kind`` = ``baseline``), with the same ``final_<metric>``
  names: sorted by an objective, the list shows where each rival falls among the trials.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from ..dburls import first_line
from ..policy import describe_policy
from ..study import RUN_PREFIX


def default_tracking_uri(runs_dir: Path) -> str:
    return f"sqlite:///{(runs_dir / 'mlflow.db').resolve()}"


def resolve_tracking_uri(explicit: str | None, study_dir: Path) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the study's own SQLite store. A ``postgresql://``
    address uses psycopg 3 (``evomerge[postgres]``) when psycopg2 is not installed, as ``--storage`` does."""
    import os

    from ..dburls import normalise_url

    return normalise_url(explicit or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(study_dir))


DATABASES = ("postgresql", "mysql", "mssql")  # SQLAlchemy dialects MLflow stores runs in, besides sqlite
HOSTED = ("databricks", "databricks-uc", "uc")  # MLflow's hosted stores: their own credentials, their own checks
ALLOWED_URIS = "http(s)://HOST:PORT (an MLflow server), sqlite:///PATH/mlflow.db, postgresql://USER@HOST/DB, mysql://..., mssql://..."


def check_reachable(uri: str, timeout: float = 5.0, reading: bool = False) -> None:
    """Fail now, in one line naming ``--tracking-uri``, for a store MLflow could not use: an HTTP server that does not
    answer, a database that refuses or does not answer within ``timeout`` seconds (MLflow itself retries for minutes),
    a missing database driver, a SQLite file in a folder that cannot be made or written, a scheme neither MLflow nor
    an installed MLflow plugin knows, or a folder MLflow will not write (MLflow 3's file store). Nothing is written.
    ``reading`` (the dashboard, which only reads): a server's or a database's answer alone (MLflow would retry for minutes)."""
    from ..dburls import check_database, check_mistyped, shown

    said = shown(uri)  # never a password in a message
    check_mistyped(uri, "--tracking-uri", ALLOWED_URIS)  # (http//HOST was a folder MLflow would not write)
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    base = scheme.split("+", 1)[0]
    if base in DATABASES:
        check_database(uri, "--tracking-uri", ALLOWED_URIS, timeout)
    elif base in ("http", "https"):
        try:
            with _health(uri, timeout) as r:
                if r.status != 200:
                    raise ConfigError("--tracking-uri", f"{said} answered /health with HTTP {r.status}")
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            from ..dburls import host_advice

            why = str(getattr(e, "reason", e))
            raise ConfigError("--tracking-uri", f"cannot reach the MLflow server at {said} ({why}); "
                                                f"{host_advice(why) or 'start it'} or pass another --tracking-uri") from None
    elif reading:
        return
    elif base == "sqlite":
        _check_sqlite(uri, said)
    elif uri in HOSTED or base in HOSTED or uri.startswith("databricks:"):
        return
    elif base in ("", "file"):
        _check_folder(uri, said)
    elif base not in _plugin_schemes():
        raise ConfigError("--tracking-uri", f"{said}: MLflow does not store runs at {scheme}:// addresses (nor does an "
                                            "installed MLflow plugin); allowed: " + ALLOWED_URIS)


def _health(uri: str, timeout: float):
    """GET the server's /health as MLflow's client would reach it: a user and password in the address as basic
    authentication, ``MLFLOW_TRACKING_TOKEN`` as a bearer token, ``MLFLOW_TRACKING_INSECURE_TLS`` and
    ``MLFLOW_TRACKING_SERVER_CERT_PATH`` for TLS."""
    import base64
    import os
    import ssl
    import urllib.parse

    parts = urllib.parse.urlsplit(uri.rstrip("/") + "/health")
    headers = {}
    if parts.username is not None:
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = "Bearer " + os.environ["MLFLOW_TRACKING_TOKEN"]
    context = None
    if parts.scheme == "https":
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true"):
            context = ssl._create_unverified_context()
        elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
    request = urllib.request.Request(urllib.parse.urlunsplit(parts), headers=headers)
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def _plugin_schemes() -> set[str]:
    """The schemes installed packages add to MLflow's tracking stores (entry points ``mlflow.tracking_store``)."""
    from importlib.metadata import entry_points

    return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}


def _writable(folder: Path, said: str) -> None:
    """The folder exists and takes a file, or its nearest existing parent does (the store's first write makes the
    rest): tried with a temporary file there, removed at once; no folder is made."""
    from ..userdirs import cannot_write_in

    refused = cannot_write_in(folder)
    if refused is not None:
        raise ConfigError("--tracking-uri", f"cannot write in {folder}, the folder of {said} ({refused[1]}); pass "
                                            "another --tracking-uri")


def _check_sqlite(uri: str, said: str) -> None:
    from ..sqlitefiles import sqlite_file

    db = sqlite_file(uri)
    if db is not None:  # else in memory, or an address SQLAlchemy reads its own way
        _writable(Path(db).resolve().parent, said)


def _check_folder(uri: str, said: str) -> None:
    """A folder is MLflow's file store: MLflow 3 refuses it (maintenance mode) unless MLFLOW_ALLOW_FILE_STORE=true;
    MLflow 2 writes it. Whether this MLflow takes a file store at all is tried on a temporary folder of its own (a
    store MLflow accepts is made on first use: the user's folder is not touched), then the user's folder is checked
    for writing."""
    import tempfile
    import warnings

    from mlflow import MlflowClient

    try:
        with tempfile.TemporaryDirectory(prefix="evomerge-filestore-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            MlflowClient(tracking_uri=str(Path(tmp) / "mlruns")).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001
        why = first_line(e).split(". ")[0].rstrip(".")
        if "MLFLOW_ALLOW_FILE_STORE" in str(e):
            why += "; MLFLOW_ALLOW_FILE_STORE=true makes MLflow write it anyway"
        raise ConfigError("--tracking-uri", f"MLflow cannot store runs in the folder {said} ({why}); "
                                            "allowed: " + ALLOWED_URIS) from None
    _writable(Path(uri[len("file://"):] if uri.startswith("file://") else uri).expanduser().resolve(), said)


# per-round metrics logged as MLflow metric histories (x axis: local steps)
ROUND_METRICS = ("val_accuracy", "val_loss", "val_perplexity", "mean_worker_accuracy", "worst_worker_accuracy", "consensus_distance",
                 "bytes", "update_norm", "train_loss", "local_update_norm", "merge_update_norm", "similarity_mean",
                 "similarity_min", "label_skew", "examples_moved", "travel_visitors", "sim_time", "steps_min", "steps_mean", "steps_max",
                 "idle_fraction", "staleness", "time_to_target", "accuracy_at_time", "loss_at_time", "perplexity_at_time")

SUMMARY_METRICS = ("val_accuracy", "val_loss", "mean_worker_accuracy", "worst_worker_accuracy", "consensus_distance",
                   "bytes", "merges", "local_steps", "wall_time", "sim_time", "time_to_target", "accuracy_at_time",
                   "val_perplexity", "loss_at_time", "perplexity_at_time")
# MLflow 3 reads this experiment tag; "genai_development" is the GenAI kind, this one is model training
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
VIEW_KEY = "evomerge"
VIEW_TAG = "mlflow.sharedViewState." + VIEW_KEY  # MLflow's shared-view tag prefix + our key


MODEL_PENDING = "evomerge.model_pending"  # on a stopped search's run: its best's model is still to be logged
MODEL_NOT_LOGGED = "evomerge.model_not_logged"  # on a run of a search told not to log the model (--no-log-model)
POLICY_TAG = "evomerge.policy"  # on a trial's or a baseline's run: its policy in words (its params are every field)


def objective_metric(objective: str) -> str:
    """The metric a trial run (and the parent run, for the best trial) holds an objective under."""
    return f"final_{objective}"


def review_url(server: str, experiment_id: str) -> str:
    """The study's runs list in the MLflow UI, served at ``server``: model-training view, flat,
    sorted by the first objective, the objective and policy columns shown (the stored shared view)."""
    return (f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs"
            f"?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}")


def run_url(server: str, experiment_id: str, run_id: str) -> str:
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def _column(kind: str, key: str) -> str:
    return f"{kind}.`{key}`"  # the MLflow UI's column ids


def review_view(study) -> dict[str, Any]:
    """The runs-list view stored with the experiment (MLflow's shared view state). Sorting by a
    metric also makes the UI list nested runs flat, so the trials are not collapsed under the parent."""
    columns = [_column("metrics", objective_metric(o)) for o in study.objectives]
    columns += [_column("metrics", objective_metric(k)) for k in ("val_accuracy", "bytes") if k not in study.objectives]
    # a searched step size beside the objectives (it was past the 420 px of words, off the screen)
    columns += [_column("params", p.name) for p in study.search.space if p.name.startswith(RUN_PREFIX)]
    columns += [_column("tags", POLICY_TAG)]  # the policy in words: which of the params below take effect
    columns += [_column("params", p.name) for p in study.search.space if not p.name.startswith(RUN_PREFIX)]
    columns += [_column("attributes", a) for a in ("Models", "Dataset", "Source")]
    return {"searchFilter": "", "orderByKey": _column("metrics", objective_metric(study.objectives[0])),
            "orderByAsc": study.directions[0] == "minimize", "startTime": "ALL", "lifecycleFilter": "Active",
            "modelVersionFilter": "All Runs", "datasetsFilter": [], "selectedColumns": columns,
            "columnOrder": columns,  # the objectives first, the wide dataset column last
            "columnWidths": {_column("tags", POLICY_TAG): 420}}  # the words' first 60 characters, not their first 15


def study_datasets(study) -> list:
    """The study's data as MLflow dataset inputs: the training split the workers share and the
    validation split the search judges on (carved from the training file; the test set is not used).
    Meta datasets: MLflow records what the data is (source, split, digest), not the data."""
    import hashlib

    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    from .. import data as data_mod

    d = study.data
    name = d.loader or d.dataset  # a user's loader names its data
    spec = None if d.loader else data_mod.DATASETS.get(d.dataset)
    url = (spec.urls[0] + spec.files[("train", "images")]) if spec and spec.urls else f"https://example.invalid/{name}"
    if d.dataset == "text" and d.path and not d.loader:  # the corpus where the study names it (a text study showed
        from ..text import root_of                       # example.invalid/text, the same for every corpus)

        try:
            url = root_of(d, Path(study.path).parent if study.path else None).resolve().as_uri()
        except ConfigError:  # (gone since the study was read: its name, as written)
            url = f"file:{d.path}"
    out = []
    for context, desc in (("training", f"train_size={d.train_size or 'rest'} partition={d.partition}"
                                       + (f"(alpha={d.alpha})" if d.partition == "dirichlet" else "")
                                       + f" workers={study.run.workers}"),
                          ("validation", f"val_size={d.val_size}")):
        key = json.dumps({"dataset": name, "split": context, "val_size": d.val_size, "train_size": d.train_size,
                          "partition": d.partition, "alpha": d.alpha, "seed": d.seed, "workers": study.run.workers,
                          "files": dict(sorted(spec.checksums.items())) if spec else {},
                          **({"corpus": url, "sha256": d.sha256} if d.dataset == "text" else {})}, sort_keys=True)
        ds = MetaDataset(HTTPDatasetSource(url), name=f"{name}-{context}",
                         digest=hashlib.sha256(key.encode()).hexdigest()[:10])
        out.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context),
                                                               InputTag("evomerge.split", f"{desc} seed={d.seed}")]))
    return out


def trial_status(record: dict[str, Any]) -> tuple[str, str]:
    """(what the trial's run is called and tagged, its MLflow run status) for a search record."""
    state = record.get("state")
    if record.get("failure") == "interrupted":
        return "interrupted", "KILLED"
    if state == "PRUNED":
        return "pruned", "KILLED"  # stopped early by the pruner: not a green FINISHED in the list
    if state == "FAIL":
        return "failed", "FAILED"
    if state == "COMPLETE" and diverged(record):
        return "diverged", "FAILED"
    if state == "COMPLETE":
        return "complete", "FINISHED"
    return (state or "unknown").lower(), "KILLED"


def _finite(v) -> bool:
    """A round's value MLflow can hold as a metric (not missing, NaN or infinite)."""
    return v is not None and v == v and abs(v) != float("inf")


def diverged(record_or_attrs: dict[str, Any]) -> bool:
    """A search record's (or an Optuna trial's user attributes') run diverged."""
    return "diverged" in (record_or_attrs.get("status"), record_or_attrs.get("run_status"))


#: seconds one call to a tracking server may wait before the search says so (MLflow's own retries take minutes)
SLOW_SERVER_S = 30.0


class _Watched:
    """An ``MlflowClient`` whose calls say, once, that the server has not answered for ``after`` seconds (a server
    stopped mid-search froze the bar for 8 minutes of MLflow's retries, without a word, before the one line)."""

    def __init__(self, client, uri: str, after: float):
        self._client, self._uri, self._after, self._said = client, uri, after, False

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (not the client's: copy and pickle look these up first)
            raise AttributeError(name)
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            import threading

            timer = threading.Timer(self._after, self._say)
            timer.daemon = True
            timer.start()
            try:
                return attr(*args, **kwargs)
            finally:
                timer.cancel()
        return call

    def _say(self) -> None:
        if self._said:
            return
        self._said = True
        import sys

        from ..dburls import shown

        print(f"note: the MLflow tracking server at {shown(self._uri)} has not answered for {self._after:g} s; MLflow "
              "retries a request for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT set "
              "them) before it gives up; Ctrl-C stops the command now (a search keeps its finished trials)",
              file=sys.stderr, flush=True)


class Tracker:
    def __init__(self, uri: str, study_name: str, artifact_dir: Path | None = None, study=None,
                 slow_after: float = SLOW_SERVER_S):
        """``slow_after``: seconds one call to a tracking server (not a local file) waits before a note says so."""
        from mlflow import MlflowClient

        from ..sqlitefiles import new_mlflow_store, sqlite_wal

        self.uri = uri
        self.study = study
        new_mlflow_store(uri)  # a new SQLite store: a copy of the blank one MLflow made before (sqlitefiles.py)
        self.client = MlflowClient(tracking_uri=uri)
        if not uri.startswith(("sqlite:", "file:", "/", ".")):  # a server, which can stop answering
            self.client = _Watched(self.client, uri, slow_after)
        exp = self.client.get_experiment_by_name(study_name)
        if uri.startswith("sqlite:"):  # the file MLflow has just made, in WAL mode as the study's (sqlitefiles.py)
            sqlite_wal(uri)
        tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        if study is not None:
            tags[VIEW_TAG] = json.dumps(review_view(study))
            tags["mlflow.note.content"] = (study.description or f"evomerge study {study.name}") + (
                "\n\nOne parent run per `evomerge search` that runs trials, one nested run per trial, and the study's "
                "baselines as `baseline-NAME` runs beside them. Objectives: "
                + ", ".join(f"`{objective_metric(o)}` ({d})" for o, d in zip(study.objectives, study.directions)) + ".")
        if exp is None:
            from mlflow.exceptions import MlflowException

            location = artifact_dir.resolve().as_uri() if artifact_dir and not uri.startswith("http") else None
            try:
                self.experiment_id = self.client.create_experiment(study_name, artifact_location=location, tags=tags)
            except MlflowException:  # another machine's search made it at the same moment: that one is used
                exp = self.client.get_experiment_by_name(study_name)
                if exp is None:
                    raise
        if exp is not None:
            self.experiment_id = exp.experiment_id
            for k, v in tags.items():  # an experiment made by an older evomerge, or a changed space
                if exp.tags.get(k) != v:
                    self.client.set_experiment_tag(self.experiment_id, k, v)
        self.parent_id: str | None = None
        self._reopened: str | None = None  # the status of a parent run taken up again (reopen_parent)
        self._datasets = study_datasets(study) if study is not None else []

    def _source_tags(self) -> dict[str, str]:
        if self.study is None:
            return {}
        return {"mlflow.source.type": "LOCAL", "mlflow.source.name": str(self.study.path or f"{self.study.name}.toml")}

    def other_storages(self, storage: str) -> list[str]:
        """The Optuna storages (as the search runs' ``storage`` parameter shows them) of this experiment's earlier
        searches other than ``storage``: one study name searched on two storages logs both into one experiment."""
        from pathlib import Path

        try:
            found = self.client.search_runs([self.experiment_id], filter_string="attributes.run_name LIKE 'search-%'",
                                            max_results=500)
        except Exception:  # noqa: BLE001 - a server that cannot answer this: nothing to say, the search goes on
            return []
        others = {r.data.params["storage"] for r in found if r.data.params.get("storage") not in (None, storage)}
        # a SQLite file no longer there (the project folder moved) is no other storage
        return sorted(o for o in others if not o.startswith("sqlite:///") or Path(o[len("sqlite:///"):]).exists())

    def start_parent(self, name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        import os
        import socket

        from ..procs import process_tag

        # where it runs: a later search on this host ends it if the process was killed (end_orphans)
        where = {"evomerge.host": socket.gethostname(), "evomerge.pid": str(os.getpid()),
                 "evomerge.process": process_tag()}
        run = self.client.create_run(self.experiment_id, run_name=name, tags={**self._source_tags(), **tags, **where})
        self.parent_id = run.info.run_id
        self._params(self.parent_id, params)
        if self._datasets:
            self.client.log_inputs(self.parent_id, datasets=self._datasets)
        return self.parent_id

    def end_orphans(self) -> list[str]:
        """The search runs of this experiment left RUNNING by a process of this machine that is gone (killed with
        SIGKILL, or the machine stopped under it): marked KILLED, with a tag saying why; their ids. A run of another
        machine or container, or of a process still running, is left as it is (it cannot be told from a search
        running)."""
        import socket

        from ..procs import still_running

        host = socket.gethostname().replace("'", "")
        found = self.client.search_runs([self.experiment_id], max_results=1000,
                                        filter_string=f"attributes.status = 'RUNNING' and tags.`evomerge.host` = '{host}'")
        ended = []
        for run in found:
            if still_running(run.data.tags.get("evomerge.process", "")) is not False:
                continue
            self.client.set_tag(run.info.run_id, "evomerge.ended", f"its process ({run.data.tags.get('evomerge.pid')} "
                                                                   f"on {host}) was gone; marked by a later search")
            self.client.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
        # a trial's or a baseline's run left RUNNING under a search that has ended (its logging cut short: the
        # tracking server stopped answering between the run's start and its end)
        nested = self.client.search_runs([self.experiment_id], max_results=1000,
                                         filter_string="attributes.status = 'RUNNING'")
        status: dict[str, str] = {}
        for run in nested:
            parent = run.data.tags.get("mlflow.parentRunId")
            if parent is None:
                continue
            if parent not in status:
                try:
                    status[parent] = self.client.get_run(parent).info.status
                except Exception:  # noqa: BLE001 - a parent deleted since: its search is over
                    status[parent] = "DELETED"
            if status[parent] == "RUNNING":
                continue
            where = ("the next search logs this baseline again" if run.data.tags.get("evomerge.kind") == "baseline"
                     else "see the trial in the Optuna study for its results")
            self.client.set_tag(run.info.run_id, "evomerge.ended", "its search ended before this run's logging did "
                                                                   f"({where}); marked by a later search")
            self.client.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
        return ended

    def reopen_parent(self) -> str | None:
        """The study's latest search run, taken up again as the parent (a search with no trial left to run adds
        no run of its own, only its verdict); None when there is none, or it is still running (another process's
        search)."""
        found = self.client.search_runs(
            [self.experiment_id], filter_string="attributes.run_name LIKE 'search-%'", max_results=1,
            order_by=["attributes.start_time DESC"])
        if not found or found[0].data.tags.get("mlflow.parentRunId") or found[0].info.status == "RUNNING":
            return None
        self.parent_id, self._reopened = found[0].info.run_id, found[0].info.status
        return self.parent_id

    def logged_best(self) -> str | None:
        """The trial number the parent run says is the best (its tag), or None."""
        if self.parent_id is None:
            return None
        tags = self.client.get_run(self.parent_id).data.tags
        # a stopped search's run names its best but holds no model of it yet: not "held already"
        # (nor one whose search was told not to log the model: a search without --no-log-model logs it)
        return None if MODEL_PENDING in tags or MODEL_NOT_LOGGED in tags else tags.get("evomerge.best_trial")

    def end_parent(self, status: str = "FINISHED", metrics: dict[str, float] | None = None) -> None:
        if self.parent_id is None:
            return
        if metrics:
            self._metrics(self.parent_id, {k: v for k, v in metrics.items() if v is not None})
        # a parent taken up again keeps the status its own search ended with
        self.client.set_terminated(self.parent_id, status=self._reopened or status)

    def describe_parent(self, markdown: str, headline: str) -> None:
        """The search's verdict as the parent run's description (what the MLflow UI shows on the run's page) and
        its headline as a tag (a column of the runs table)."""
        if self.parent_id is None:
            return
        self.client.set_tag(self.parent_id, "mlflow.note.content", markdown)
        self.client.set_tag(self.parent_id, "evomerge.verdict", headline[:5000])

    def log_trial(self, record: dict[str, Any]) -> str:
        """One nested run for a finished (or interrupted) trial record from the search."""
        from mlflow.entities import Metric

        label, status = trial_status(record)
        tags = {
            **self._source_tags(),
            "mlflow.parentRunId": self.parent_id or "",
            "optuna.trial_number": str(record["number"]),
            "optuna.trial_state": record["state"],
            "evomerge.kind": "trial",  # (the baselines' runs beside them: "baseline")
            "evomerge.status": label,
            "evomerge.study": record["study"],
            "evomerge.sampler": record["sampler"],
        }
        if record.get("policy"):  # what the trial's policy does, in words (its params hold every field)
            tags[POLICY_TAG] = describe_policy(record["policy"], record.get("run"))[:5000]
        if record.get("error"):
            tags["evomerge.error"] = record["error"][:5000]
        if record.get("pruned_at") is not None:
            tags["evomerge.pruned_at_step"] = str(record["pruned_at"])
        if record.get("execution"):
            tags["evomerge.execution"] = record["execution"][:5000]
        if record.get("ran_on"):
            tags["evomerge.ran_on"] = record["ran_on"]
        if record.get("reused_from") is not None:  # proposed again: the earlier trial's results, not a new run
            tags["evomerge.reused_from"] = str(record["reused_from"])
        name = f"trial-{record['number']}" + ("" if label == "complete" else f" ({label})")
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags, start_time=int(record["start"] * 1000))
        rid = run.info.run_id
        params = self._param_list({**record["policy"], **{f"run.{k}": v for k, v in (record.get("run") or {}).items()},
                                   "seeds": ",".join(map(str, record["seeds"]))})
        if self._datasets:
            self.client.log_inputs(rid, datasets=self._datasets)
        history = []
        for k, h in enumerate(record["histories"]):
            offset = k * record["total_steps"]
            ts = int(record["start"] * 1000)
            for r in h:
                for key in ROUND_METRICS:
                    if key not in r:  # histories written before a metric existed
                        continue
                    if _finite(r[key]):
                        history.append(Metric(key, float(r[key]), ts, offset + r["step"]))
        final = self._metric_list({objective_metric(k): v for k, v in record["final"].items()})
        self._write(rid, params, history + final)
        self.client.log_text(rid, json.dumps(record["policy"], indent=2), "policy.json")
        self.client.set_terminated(rid, status=status, end_time=int(record["end"] * 1000))
        return rid

    def log_baselines(self, rows: list[dict[str, Any]], study_hash: str) -> list[str]:
        """Each baseline of the end screen's table (:func:`evomerge.search.baselines.baseline_rows`, on the study's
        seeds) as a run beside the trials: ``baseline-NAME``, nested under the search's run, its final metrics under
        the trial runs' names (``final_<metric>``, means over the same seeds), its first seed's rounds, its policy
        and the step size it ran at (``run.lr``) as params, ``policy.json``. Sorted by an objective, the runs list
        then shows where each rival falls among the trials. A baseline logged before with the same results for the
        same study (``study_hash``: its fingerprint; an earlier search of it), policy, step size and seeds is not
        logged again. The run ids, in the rows' order."""
        import hashlib
        import time

        from mlflow.entities import Metric

        if self.parent_id is None or self.study is None:
            return []
        now = int(time.time() * 1000)
        study = self.study
        ids = []
        for row in rows:
            # what the row depends on (as its cache in the Optuna study), not its results: two processes that ended a
            # search together may each have run it, with other wall times
            what = {"study": study_hash, "target": study.target, "name": row["name"], "policy": row["policy"],
                    "lr": row.get("lr"), "seeds": row["seeds"]}
            digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]
            earlier = self.client.search_runs([self.experiment_id], max_results=1,
                                              filter_string=f"tags.`evomerge.baseline_digest` = '{digest}' and "
                                                            "attributes.status != 'RUNNING' and "
                                                            "attributes.status != 'KILLED'")  # (cut short: again)
            if earlier:
                ids.append(earlier[0].info.run_id)
                continue
            label = "diverged" if diverged(row) else "complete"
            tuned = row.get("lr") is not None  # its best of [baselines] lr; else the study's
            lr = row["lr"] if tuned else study.run.lr
            tags = {**self._source_tags(), "mlflow.parentRunId": self.parent_id, "evomerge.kind": "baseline",
                    "evomerge.baseline": row["name"], "evomerge.status": label, "evomerge.study": study.name,
                    "evomerge.baseline_digest": digest,
                    POLICY_TAG: describe_policy(row["policy"])[:5000],
                    "mlflow.note.content": f"Baseline `{row['name']}` (a rival of the search's trials) on the study's "
                                           f"seeds {row['seeds']}, at lr {lr:g}"
                                           + (" (its best of [baselines] lr)" if tuned else " (the study's step size)")
                                           + "."}
            name = f"baseline-{row['name']}" + ("" if label == "complete" else f" ({label})")
            rid = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
            if self._datasets:
                self.client.log_inputs(rid, datasets=self._datasets)
            params = self._param_list({**row["policy"], "run.lr": lr,
                                       "seeds": ",".join(map(str, row["seeds"]))})
            curve = row.get("history") or {}
            steps = curve.get("step") or []
            history = [Metric(k, float(v), now, int(step)) for k in ROUND_METRICS if k in curve
                       for step, v in zip(steps, curve[k]) if _finite(v)]
            final = self._metric_list({objective_metric(k): v for k, v in row.items()
                                       if k.removesuffix("_std") in SUMMARY_METRICS})
            self._write(rid, params, history + final)
            self.client.log_text(rid, json.dumps(row["policy"], indent=2), "policy.json")
            self.client.set_terminated(rid, status="FINISHED" if label == "complete" else "FAILED")
            ids.append(rid)
        return ids

    def trial_run_id(self, number: int) -> str | None:
        """The latest run logged for Optuna trial ``number`` in this experiment (any search invocation)."""
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`optuna.trial_number` = '{number}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def log_best(self, best: dict[str, Any], *, model: Callable[[], Any] | None = None,
                 not_logged: str | None = None) -> str | None:
        """Put the best trial on the parent run: its objective values under the trial runs' metric names
        (``final_<objective>``), its number and run as tags, its policy as ``best/policy.json``; and, given
        ``model`` (called only when a model is to be logged: the search's :func:`evomerge.search.consensus.consensus`),
        its consensus model as a logged pytorch model, output of the best trial's run and of the parent. ``best`` is
        a ``search.results.trial_summary`` dict; ``not_logged``: why no model is logged (a search's
        ``--no-log-model``), kept as a tag on the parent. Returns the logged model's id (or None)."""
        if self.parent_id is None or self.study is None:
            return None
        study, pid = self.study, self.parent_id
        seeds = list((best.get("metrics") or {}).values())
        means = {}
        for k in SUMMARY_METRICS:  # the keys a trial run's final metrics have (means over seeds)
            vals = [float(m[k]) for m in seeds if isinstance(m.get(k), (int, float))]
            if vals:
                means[objective_metric(k)] = sum(vals) / len(vals)
        means.update({objective_metric(o): v for o, v in zip(study.objectives, best["values"])})
        means["best_trial"] = best["number"]
        self._metrics(pid, means)
        best_rid = self.trial_run_id(best["number"])
        self.client.set_tag(pid, "evomerge.best_trial", str(best["number"]))
        if best_rid:
            self.client.set_tag(pid, "evomerge.best_run_id", best_rid)
        self.client.log_text(pid, json.dumps(best["policy"], indent=2), "best/policy.json")
        if diverged(best):  # every trial diverged: its weights are not a model
            self.client.set_tag(pid, "evomerge.model_error", "the best trial diverged; no consensus model logged")
            return None
        if model is None and not_logged is None:  # a stopped search: the search that goes on logs it (logged_best
            # says it is not held)
            self.client.set_tag(pid, MODEL_PENDING, "the search stopped before the best trial's model was logged; "
                                                    "the same command, going on, logs the best's model at its end (on "
                                                    "this run where no trial is left to run, else on its own)")
            return None
        tags = self.client.get_run(pid).data.tags
        for tag in (MODEL_PENDING, MODEL_NOT_LOGGED):
            if tag in tags:
                self.client.delete_tag(pid, tag)
        try:
            kept = self._logged_model_of(best_rid)  # an earlier search (nothing left to run) logged it: linked again
            if kept is not None:
                from mlflow.entities import LoggedModelOutput

                self.client.log_outputs(pid, [LoggedModelOutput(kept, step=0)])
                return kept
            if not_logged is not None:  # (told not to log one, and none logged for this best before)
                self.client.set_tag(pid, MODEL_NOT_LOGGED, not_logged)
                return None
            return self.log_consensus_model(best, best_rid, model())
        except Exception as e:  # data missing here, a store that refuses models: the search's results stand
            self.client.set_tag(pid, "evomerge.model_error", f"{type(e).__name__}: {e}"[:5000])
            return None

    def _logged_model_of(self, run_id: str | None) -> str | None:
        """The id of the consensus model already logged, complete, from the trial run ``run_id``; else None."""
        if run_id is None:
            return None
        from mlflow.entities import LoggedModelStatus

        found = self.client.search_logged_models(  # (MLflow 3.17's filter on status matches nothing: checked here)
            [self.experiment_id], filter_string=f"source_run_id = '{run_id}' AND model_type = 'consensus'")
        return next((m.model_id for m in found if m.status == LoggedModelStatus.READY), None)

    def log_consensus_model(self, best: dict[str, Any], run_id: str | None, consensus: Any) -> str:
        """Log ``consensus`` (a :class:`evomerge.search.consensus.Consensus`: the best trial's ``nn.Module``, an input
        example, its validation accuracy and seed) with
        MLflow's pytorch flavour, as output of the trial's run and of the parent.

        This is what ``mlflow.pytorch.log_model`` does, written against this tracker's client: the
        fluent call would log to the process-wide tracking URI and active run instead."""
        import tempfile

        import torch
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus
        from mlflow.models import Model, infer_signature
        import mlflow.pytorch

        module, x = consensus.module, consensus.example
        with torch.no_grad():
            signature = infer_signature(x.numpy(), module(x).numpy())
        source = run_id or self.parent_id
        logged = self.client.create_logged_model(
            self.experiment_id, name=f"consensus-trial-{best['number']}", source_run_id=source,
            params={k: str(v) for k, v in best["policy"].items()} |
            {f"run.{k}": str(v) for k, v in (best.get("run") or {}).items()}, model_type="consensus",
            tags={"evomerge.trial": str(best["number"]), "evomerge.seed": str(consensus.seed),
                  "evomerge.study": self.study.name, "evomerge.val_accuracy": f"{consensus.val_accuracy:.6f}" if consensus.val_accuracy is not None else "n/a",
                  "evomerge.consensus_from": consensus.source})
        try:
            for rid in dict.fromkeys(r for r in (source, self.parent_id) if r):
                self.client.log_outputs(rid, [LoggedModelOutput(logged.model_id, step=0)])
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "model"
                # torch.export's warnings about the user's module (an LSTM's _flat_weights "assigned during export")
                # are about how torch traces it, not about the search: kept on the model, not printed mid-search
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        mlflow.pytorch.save_model(
                            module, str(path), signature=signature, input_example=x.numpy(),
                            serialization_format="pt2", pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                            mlflow_model=Model(artifact_path=logged.artifact_location, run_id=source,
                                               model_uuid=logged.model_id, model_id=logged.model_id))
                    finally:  # kept whether it saved or not: they may say why it did not
                        said = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
                        if said:
                            self.client.set_logged_model_tags(logged.model_id,
                                                              {"evomerge.save_warnings": "\n".join(said)[:5000]})
                self.client.log_model_artifacts(logged.model_id, str(path))
            self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        except BaseException:
            self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        return logged.model_id

    def _write(self, rid: str, params: list, metrics: list) -> None:
        """A run's params and metrics: one write where they fit MLflow's limits on one batch (100 params, 1000
        entries), else the params, then the metrics 900 at a time."""
        if len(params) <= 100 and len(params) + len(metrics) <= 1000:
            self.client.log_batch(rid, metrics=metrics, params=params)
            return
        self.client.log_batch(rid, params=params)
        for i in range(0, len(metrics), 900):
            self.client.log_batch(rid, metrics=metrics[i:i + 900])

    def _params(self, rid: str, params: dict[str, Any]) -> None:
        self.client.log_batch(rid, params=self._param_list(params))

    @staticmethod
    def _param_list(params: dict[str, Any]) -> list:
        from mlflow.entities import Param

        return [Param(k, str(v)) for k, v in params.items()]

    def _metrics(self, rid: str, metrics: dict[str, float]) -> None:
        ms = self._metric_list(metrics)
        if ms:
            self.client.log_batch(rid, metrics=ms)

    @staticmethod
    def _metric_list(metrics: dict[str, float]) -> list:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        # 7 significant digits: what float32 results hold; the runs list shows 0.738, not 0.73799997... A count (bytes,
        # merges: a whole number) as it is: rounded, 924885760 bytes read 924885800
        return [Metric(k, float(v) if float(v).is_integer() else float(f"{float(v):.7g}"), ts, 0)
                for k, v in metrics.items() if isinstance(v, (int, float)) and v == v]

    def log_transfer(self, result: dict[str, Any]) -> tuple[str, bool]:
        """One run ``transfer-to-TARGET`` in this (the source study's) experiment: the rank correlations as
        metrics, the settings as params, both rankings as ``transfer.json`` (:mod:`evomerge.search.transfer`).
        (run id, True), or (the id, False) of a finished run an earlier transfer logged with the same results (a
        re-run whose runs were all kept added a copy each time)."""
        import hashlib

        same = {k: v for k, v in result.items() if k not in ("when", "wall_time", "reused")}
        digest = hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:20]
        earlier = self.client.search_runs([self.experiment_id], max_results=1,
                                          filter_string=f"tags.`evomerge.transfer_digest` = '{digest}' and "
                                                        "attributes.status = 'FINISHED'")
        if earlier:
            return earlier[0].info.run_id, False
        tags = {**self._source_tags(), "evomerge.kind": "transfer", "evomerge.study": result["source"],
                "evomerge.target": result["target"], "evomerge.transfer_digest": digest}
        run = self.client.create_run(self.experiment_id, run_name=f"transfer-to-{result['target']}", tags=tags)
        rid = run.info.run_id
        self._params(rid, {"target": result["target"], "top": result["top"], "metric": result["metric"],
                           "seeds": ",".join(map(str, result["seeds"])), "target_workers": result["target_workers"]})
        self._metrics(rid, {k: result[k] for k in ("spearman", "spearman_p", "kendall", "kendall_p")
                            if result.get(k) is not None and result[k] == result[k]})
        self.client.log_text(rid, json.dumps(result, indent=2), "transfer.json")
        self.client.set_terminated(rid, status="FINISHED")
        return rid, True

"""A study's dashboard: one self-contained HTML page built from the Optuna storage
and the MLflow store.

Plots come from Optuna's visualisation module where it has them (parameter
importances, parallel coordinates) and from plotly otherwise. plotly.js is written
once beside the page (``plotly.min.js``), so the page works offline and never asks
a CDN.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from . import __version__
from .policy import MergePolicy
from .study import Study

SECTIONS = ("history", "importance", "parallel", "tradeoff", "curves", "policy")


def _div(fig, div_id: str) -> str:
    fig.update_layout(template="plotly_white", margin=dict(l=60, r=30, t=50, b=50))
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config={"displaylogo": False})


def _target(study: Study):
    return (lambda t: t.values[0]), OBJECTIVES_LABEL.get(study.objectives[0], study.objectives[0])


OBJECTIVES_LABEL = {"val_accuracy": "validation accuracy (consensus)", "mean_worker_accuracy": "mean worker accuracy",
                    "bytes": "bytes sent", "wall_time": "wall time (s)"}


# -- figures ---------------------------------------------------------------------------
def history_figure(ostudy, study: Study):
    """Each trial's value and the best so far, per sampler; pruned and failed trials shown as such."""
    import plotly.graph_objects as go
    from optuna.trial import TrialState

    trials = ostudy.get_trials(deepcopy=False)
    maximize = study.directions[0] == "maximize"
    fig = go.Figure()
    samplers = sorted({t.user_attrs.get("sampler", "?") for t in trials})
    for s in samplers:
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("sampler", "?") == s]
        fig.add_scatter(x=[t.number for t in done], y=[t.values[0] for t in done], mode="markers", name=f"{s}: complete",
                        marker=dict(size=8))
        best, bx, by = None, [], []
        for t in sorted(done, key=lambda t: t.number):
            v = t.values[0]
            best = v if best is None or (v > best if maximize else v < best) else best
            bx.append(t.number)
            by.append(best)
        fig.add_scatter(x=bx, y=by, mode="lines", line=dict(shape="hv"), name=f"{s}: best so far")
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        fig.add_scatter(x=[t.number for t in pruned], y=[t.user_attrs.get("last_value") for t in pruned], mode="markers",
                        name="pruned (last reported value)", marker=dict(symbol="x", color="gray", size=8))
    failed = [t for t in trials if t.state == TrialState.FAIL]
    if failed:
        done_vals = [t.values[0] for t in trials if t.state == TrialState.COMPLETE]
        floor = min(done_vals) if done_vals else 0.0
        fig.add_scatter(x=[t.number for t in failed], y=[floor] * len(failed), mode="markers", name="failed",
                        marker=dict(symbol="triangle-down", color="crimson", size=10),
                        text=[t.user_attrs.get("failure", "") + ": " + t.user_attrs.get("error", "")[:80] for t in failed],
                        hoverinfo="text+x")
    fig.update_layout(title="Optimisation history", xaxis_title="trial", yaxis_title=OBJECTIVES_LABEL.get(study.objectives[0]))
    return fig


def importance_figure(ostudy, study: Study):
    """PED-ANOVA ranks fields by how they lead to low target values, so a maximised objective is negated."""
    import warnings

    import optuna

    _, name = _target(study)
    sign = -1.0 if study.directions[0] == "maximize" else 1.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes the importances")
        return optuna.visualization.plot_param_importances(
            ostudy, evaluator=optuna.importance.PedAnovaImportanceEvaluator(), target=lambda t: sign * t.values[0],
            target_name=f"importance for {'high' if sign < 0 else 'low'} {name}")


def parallel_figure(ostudy, study: Study):
    import optuna

    target, name = _target(study)
    return optuna.visualization.plot_parallel_coordinate(ostudy, target=target, target_name=name)


def pareto_2d(points: list[tuple[float, float, Any]]) -> list[tuple[float, float, Any]]:
    """Non-dominated points for (accuracy up, bytes down), sorted by bytes."""
    from .searcher import dominated_count

    xy = [(a, b) for a, b, _ in points]
    front = [p for p in points if dominated_count(p[:2], xy, ["maximize", "minimize"]) == 0]
    return sorted(front, key=lambda p: (p[1], -p[0]))


def tradeoff_figure(summaries: list[dict], baselines: list[dict]):
    import plotly.graph_objects as go

    pts = [(_mean(s, "val_accuracy"), _mean(s, "bytes"), s["number"]) for s in summaries]
    pts = [p for p in pts if p[0] is not None and p[1] is not None]
    positive = [p[1] for p in pts if p[1] > 0] + [b["bytes"] for b in baselines if b["bytes"] > 0]
    floor = 0.5 * min(positive) / 1e6 if positive else 1e-3  # no bytes cannot sit on a log axis: drawn at a floor

    def mb(b):
        return b / 1e6 if b > 0 else floor

    fig = go.Figure()
    fig.add_scatter(x=[mb(p[1]) for p in pts], y=[p[0] for p in pts], mode="markers", name="trials",
                    text=[f"trial {p[2]}: {p[1] / 1e6:,.2f} MB" for p in pts], marker=dict(size=8, color="steelblue", opacity=0.6))
    front = pareto_2d(pts)
    fig.add_scatter(x=[mb(p[1]) for p in front], y=[p[0] for p in front], mode="lines+markers", name="Pareto front",
                    text=[f"trial {p[2]}: {p[1] / 1e6:,.2f} MB" for p in front], line=dict(color="darkorange", width=2),
                    marker=dict(size=11))
    if baselines:
        fig.add_scatter(x=[mb(b["bytes"]) for b in baselines], y=[b["val_accuracy"] for b in baselines],
                        mode="markers+text", name="baselines", textposition="top center",
                        text=[b["name"] + (" (0 bytes)" if b["bytes"] == 0 else "") for b in baselines],
                        marker=dict(symbol="star", size=14, color="black"))
    fig.update_layout(title="Accuracy against bytes communicated", xaxis_title="MB sent (log; no bytes drawn at the left edge)",
                      xaxis_type="log", yaxis_title="validation accuracy (consensus)")
    return fig


def curves_figure(best: dict, baselines: list[dict]):
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("validation accuracy", "consensus distance", "accuracy against MB sent"))
    from plotly.colors import qualitative

    series = [(f"best: trial {best['number']}", best["history"])] + [(b["name"], b["history"]) for b in baselines if b.get("history")]
    for i, (name, h) in enumerate(series):
        if not h:
            continue
        color = qualitative.Plotly[i % len(qualitative.Plotly)]  # one colour per policy in every panel
        common = dict(name=name, legendgroup=name, mode="lines+markers", line=dict(width=3 if i == 0 else 1.5, color=color),
                      marker=dict(color=color))
        fig.add_scatter(x=h["step"], y=h["val_accuracy"], row=1, col=1, **common)
        fig.add_scatter(x=h["step"], y=h["consensus_distance"], row=1, col=2, showlegend=False, **common)
        fig.add_scatter(x=[b / 1e6 for b in h["bytes"]], y=h["val_accuracy"], row=1, col=3, showlegend=False, **common)
    fig.update_xaxes(title_text="local steps", row=1, col=1)
    fig.update_xaxes(title_text="local steps", row=1, col=2)
    fig.update_xaxes(title_text="MB sent", row=1, col=3)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(title="Learning curves (first seed): best policy against the baselines", height=420)
    return fig


def policy_figure(policy: MergePolicy, workers: int, seed: int = 0):
    """The best policy's peer graph: workers on a circle, edges weighted by how often they merge."""
    import numpy as np
    import plotly.graph_objects as go

    from . import topology

    fig = go.Figure()
    angle = np.linspace(0, 2 * np.pi, workers, endpoint=False)
    x, y = np.cos(angle), np.sin(angle)
    if policy.scheme == "gossip" and workers > 1:
        topo = topology.build(policy, workers, np.random.default_rng(seed))
        p = topo.probabilities()
        groups = getattr(topo, "groups", np.zeros(workers, dtype=int))
        sym = (p + p.T) / 2
        peak = sym.max() or 1.0
        for i in range(workers):
            for j in range(i + 1, workers):
                if sym[i, j] > 0:
                    fig.add_scatter(x=[x[i], x[j]], y=[y[i], y[j]], mode="lines", showlegend=False, hoverinfo="skip",
                                    line=dict(width=0.5 + 4 * sym[i, j] / peak, color="rgba(70,110,160,0.55)"))
        title = f"Who merges with whom: {policy.topology.replace('_', ' ')}"
    elif policy.scheme == "allreduce":
        groups = np.zeros(workers, dtype=int)
        for i in range(workers):
            for j in range(i + 1, workers):
                fig.add_scatter(x=[x[i], x[j]], y=[y[i], y[j]], mode="lines", showlegend=False, hoverinfo="skip",
                                line=dict(width=1, color="rgba(70,110,160,0.4)"))
        title = "Everybody averages with everybody"
    else:
        groups = np.zeros(workers, dtype=int)
        title = "No merging until the end"
    from plotly.colors import qualitative

    palette = qualitative.Set2
    fig.add_scatter(x=x, y=y, mode="markers+text", text=[str(i) for i in range(workers)], textposition="middle center",
                    marker=dict(size=28, color=[palette[int(g) % len(palette)] for g in groups], line=dict(width=1, color="black")),
                    textfont=dict(color="black"), name="workers", hovertext=[f"worker {i}, group {g}" for i, g in enumerate(groups)])
    fig.update_layout(title=title, showlegend=False, height=420, width=460,
                      xaxis=dict(visible=False, scaleanchor="y"), yaxis=dict(visible=False))
    return fig


def _mean(summary: dict, key: str):
    vals = [m[key] for m in summary.get("metrics", {}).values() if key in m]
    return sum(vals) / len(vals) if vals else None


def policy_words(policy: MergePolicy, total_steps: int | None) -> str:
    p = policy
    lines = [p.describe() + "."]
    if p.scheme == "gossip":
        merges = f" (about {total_steps / p.mean_interval:.0f} per worker in a run)" if total_steps else ""
        lines.append(f"Each worker merges after a Poisson-distributed number of local steps, {p.mean_interval:.3g} on average{merges}.")
        who = "both workers move towards each other" if p.exchange == "push_pull" else "only the peer moves towards the initiator"
        lines.append(f"In a merge {who}.")
    if p.scheme != "none":
        if p.mixing_schedule == "constant":
            lines.append(f"The weight on the incoming model is {p.mixing_weight:.3g} throughout.")
        else:
            lines.append(f"The weight on the incoming model goes from {p.mixing_weight:.3g} to {p.mixing_weight_final:.3g} "
                         f"over the run ({p.mixing_schedule}).")
        if p.lerp == "random":
            lines.append("Each merge scales it by a uniform random draw.")
        if p.winner_bias > 0:
            lines.append(f"The worker with the lower validation loss moves {1 - p.winner_bias:.0%} as far as the other.")
        if p.weighting != "uniform":
            lines.append({"examples": "Models are weighted by the examples each has seen.",
                          "adaptive": "Each coordinate is weighted by the workers' squared-gradient accumulators."}[p.weighting])
        if p.payload == "delta":
            lines.append(f"Workers send the change since their last synchronised state: the top {p.topk_fraction:.1%} of "
                         f"coordinates, {p.quantize_bits or 32} bits each, the rest kept as error feedback.")
    return " ".join(lines)


# -- the page ---------------------------------------------------------------------------
def mlflow_runs(tracking_uri: str, study_name: str) -> tuple[dict[int, str], str | None]:
    """Optuna trial number -> MLflow run id (the latest), and the experiment id."""
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        exp = client.get_experiment_by_name(study_name)
        if exp is None:
            return {}, None
        out: dict[int, str] = {}
        for r in client.search_runs([exp.experiment_id], filter_string="tags.`optuna.trial_number` != ''",
                                    order_by=["attributes.start_time ASC"], max_results=5000):
            out[int(r.data.tags["optuna.trial_number"])] = r.info.run_id
        return out, exp.experiment_id
    except Exception:  # no store yet, or a server that does not answer: the page says so
        return {}, None


def build(study: Study, storage_url: str, tracking_uri: str, out_dir: Path, *, data_dir=None, device=None,
          compute_baselines: bool = True) -> Path:
    """Write ``out_dir/index.html`` and ``out_dir/plotly.min.js``; return the page's path."""
    import optuna
    from plotly.offline import get_plotlyjs

    from .export import load_study_trials
    from .searcher import baseline_rows, best_trials, count_states, trial_summary

    ostudy = load_study_trials(study, storage_url)
    trials = ostudy.get_trials(deepcopy=False)
    counts = count_states(trials)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plotly.min.js").write_text(get_plotlyjs(), encoding="utf-8")
    sections: list[str] = []
    notes: list[str] = []
    summary_line = ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "no trials"

    if not complete:
        sections.append('<section id="empty"><h2>No completed trials yet</h2><p>This study has no completed trials yet '
                        f'({html.escape(summary_line)}). Run <code>evomerge search --study {html.escape(study.name)}</code>, '
                        'then build this page again.</p></section>')
    else:
        baselines: list[dict] = []
        if compute_baselines:
            try:
                baselines = baseline_rows(study, data_dir=data_dir, device=device, storage_study=ostudy)
            except Exception as e:  # data missing here: the page still shows the search
                notes.append(f"Baselines could not be run here ({html.escape(str(e))}); they are left out.")
        best = best_trials(ostudy, study, 10)
        summaries = [trial_summary(t, study) for t in complete]
        top = best[0]
        top_full = next(t for t in complete if t.number == top["number"])
        top["history"] = top_full.user_attrs.get("history")
        policy = MergePolicy.from_dict(top["policy"])

        sections.append(_section("history", "Optimisation history",
                                 "Every trial's value in the order it was asked; the line is the best so far for each sampler.",
                                 _div(history_figure(ostudy, study), "plot-history")))
        for sid, title, fn, text in (
            ("importance", "Parameter importances", importance_figure,
             "How much each searched policy field explains the objective (PED-ANOVA, Optuna)."),
            ("parallel", "Searched policy fields", parallel_figure,
             "Each line is a completed trial through its policy fields, coloured by the objective (Optuna)."),
        ):
            try:
                sections.append(_section(sid, title, text, _div(fn(ostudy, study), f"plot-{sid}")))
            except Exception as e:
                sections.append(_section(sid, title, f"Not available yet: {html.escape(str(e))}", ""))
        sections.append(_section("tradeoff", "Accuracy against bytes",
                                 "Every completed trial (mean over its seeds); the Pareto front is highlighted, baselines are stars.",
                                 _div(tradeoff_figure(summaries, baselines), "plot-tradeoff")))
        if top["history"]:
            sections.append(_section("curves", "Learning curves",
                                     "The best policy against every baseline, on the study's first seed.",
                                     _div(curves_figure(top, baselines), "plot-curves")))
        words = html.escape(policy_words(policy, top_full.user_attrs.get("history", {}).get("step", [None])[-1]))
        sections.append(_section("policy", f"The best policy: trial {top['number']}", words,
                                 _div(policy_figure(policy, study.run.workers), "plot-policy")
                                 + f"<details><summary>policy JSON</summary><pre>{html.escape(json.dumps(policy.to_dict(), indent=2))}</pre></details>"))
        runs, exp_id = mlflow_runs(tracking_uri, study.name)
        if not runs:
            notes.append(f"No MLflow runs found at {html.escape(tracking_uri)}.")
        sections.append(_section("top", "Top trials", "", _top_table(study, best, runs, exp_id, tracking_uri)))

    page = _PAGE.format(
        title=html.escape(f"evomerge: {study.name}"), study=html.escape(study.name),
        description=html.escape(study.description), summary=html.escape(summary_line),
        storage=html.escape(storage_url), tracking=html.escape(tracking_uri), version=__version__,
        when=time.strftime("%Y-%m-%d %H:%M"), notes="".join(f'<p class="note">{n}</p>' for n in notes),
        sections="\n".join(sections))
    path = out_dir / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def _section(sid: str, title: str, text: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2><p>{text}</p>{body}</section>'


def _top_table(study: Study, best: list[dict], runs: dict[int, str], exp_id, tracking_uri: str) -> str:
    head = "".join(f"<th>{html.escape(OBJECTIVES_LABEL.get(o, o))}</th>" for o in study.objectives)
    rows = []
    for b in best:
        rid = runs.get(b["number"])
        if rid and tracking_uri.startswith(("http://", "https://")):
            run = f'<a href="{html.escape(tracking_uri.rstrip("/"))}/#/experiments/{exp_id}/runs/{rid}">{rid[:8]}</a>'
        else:
            run = f"<code>{rid[:8]}</code>" if rid else "-"
        vals = "".join(f"<td>{v / 1e6:,.1f} MB</td>" if o == "bytes" else f"<td>{v:.4f}</td>"
                       for o, v in zip(study.objectives, b["values"]))
        desc = html.escape(MergePolicy.from_dict(b["policy"]).describe())
        rows.append(f"<tr><td>{b['number']}</td>{vals}<td>{desc}</td><td>{run}</td></tr>")
    return (f'<table class="top"><thead><tr><th>trial</th>{head}<th>policy</th><th>MLflow run</th></tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<script src="plotly.min.js"></script>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1250px; color: #222; padding: 0 1rem; }}
header p {{ color: #555; margin: .2rem 0; }}
section {{ margin: 2.2rem 0; border-top: 1px solid #ddd; padding-top: .6rem; }}
h2 {{ margin-bottom: .3rem; }}
table.top {{ border-collapse: collapse; width: 100%; font-size: .92rem; }}
table.top th, table.top td {{ border-bottom: 1px solid #eee; padding: .35rem .5rem; text-align: left; }}
.note {{ color: #8a5a00; }}
code, pre {{ background: #f6f6f6; padding: .1rem .3rem; }}
</style></head>
<body>
<header><h1>{study}</h1><p>{description}</p><p>Trials: {summary}.</p>
<p>Optuna: <code>{storage}</code> · MLflow: <code>{tracking}</code> · built {when} by evomerge {version}</p>{notes}</header>
{sections}
</body></html>
"""

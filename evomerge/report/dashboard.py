"""A study's dashboard: one self-contained HTML page built from the Optuna storage
and the MLflow store.

Plots come from Optuna's visualisation module where it has them (parameter
importances, parallel coordinates) and from plotly otherwise. plotly.js is written
once beside the page (``plotly.min.js``), so the page works offline and never asks
a CDN. The page itself is a Jinja2 template with its style sheet, ``dashboards/page.html.j2``
and ``dashboards/style.css`` (shipped as ``evomerge.dashboards``).

Diverged trials (a run whose loss blew up: Optuna stores them as complete, with the
objective of a broken model) are drawn and listed as ``diverged`` and kept off the
Pareto front.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from ..dburls import shown
from ..errors import ConfigError
from ..version import __version__
from ..policy import MergePolicy
from ..study import Study
from ..units import size
from .tracking import diverged

CURVE_METRICS = ("val_accuracy", "val_perplexity", "val_loss")  # a learning curve's: the first a task has
FEW_FOR_IMPORTANCE = 20  # complete trials below which the importances are said to be unsteady
SECTIONS = ("history", "importance", "parallel", "tradeoff", "curves", "policy")
TIME_SECTIONS = ("cluster", "timeline")  # a study with an [environment] adds these
DISTANCE_FLOOR = 1e-6  # consensus distances below this are floating-point noise (all-reduce sits at ~1e-12)
# the parallel coordinates' colours: worst trials light grey-blue, best dark blue (never white on the white page)
OBJECTIVE_SCALE = [[0.0, "#c9d3e3"], [0.5, "#6a8cc4"], [1.0, "#08306b"]]


def _div(fig, div_id: str, *, toolbar: bool = True, top: int = 80) -> str:
    """The figure as a ``<div>``: its title at the top left of a taller top margin, so that plotly's toolbar
    (top right, on hover) covers no title and subplot titles do not crowd it; ``toolbar=False`` for small plots."""
    fig.update_layout(template="plotly_white", margin=dict(l=60, r=40, t=top, b=50))
    if fig.layout.title.text:
        fig.update_layout(title=dict(x=0.01, xanchor="left", y=1.0, yanchor="top", yref="container", pad=dict(t=12)))
    config = {"displaylogo": False, "displayModeBar": "hover" if toolbar else False}
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=config)


def _target(study: Study):
    return (lambda t: t.values[0]), OBJECTIVES_LABEL.get(study.objectives[0], study.objectives[0])


OBJECTIVES_LABEL = {"val_accuracy": "validation accuracy (consensus)", "mean_worker_accuracy": "mean worker accuracy",
                    "bytes": "bytes sent", "time_to_target": "simulated seconds to the target",
                    "accuracy_at_time": "validation accuracy at the time budget",
                    "loss_at_time": "validation loss at the time budget",
                    "perplexity_at_time": "validation perplexity at the time budget",
                    "val_loss": "validation loss (consensus)", "val_perplexity": "validation perplexity (consensus)", "sim_time": "simulated seconds"}


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
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("sampler", "?") == s
                and not diverged(t.user_attrs)]
        fig.add_scatter(x=[t.number for t in done], y=[t.values[0] for t in done], mode="markers", name=f"{s}: complete",
                        marker=dict(size=8))
        best, bx, by = None, [], []
        for t in sorted(done, key=lambda t: t.number):
            v = t.values[0]
            best = v if best is None or (v > best if maximize else v < best) else best
            bx.append(t.number)
            by.append(best)
        fig.add_scatter(x=bx, y=by, mode="lines", line=dict(shape="hv"), name=f"{s}: best so far")
    bad = [t for t in trials if t.state == TrialState.COMPLETE and diverged(t.user_attrs)]
    if bad:
        fig.add_scatter(x=[t.number for t in bad], y=[t.values[0] for t in bad], mode="markers", name="diverged",
                        marker=dict(symbol="x-thin-open", color="#b00020", size=11, line=dict(width=2)),
                        text=[f"trial {t.number}: diverged" for t in bad], hoverinfo="text+y")
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        fig.add_scatter(x=[t.number for t in pruned], y=[t.user_attrs.get("last_value") for t in pruned], mode="markers",
                        name="pruned (last reported value)", marker=dict(symbol="x", color="gray", size=8))
    failed = [t for t in trials if t.state == TrialState.FAIL]
    if failed:
        done_vals = [t.values[0] for t in trials if t.state == TrialState.COMPLETE and not diverged(t.user_attrs)]
        floor = min(done_vals) if done_vals else 0.0
        fig.add_scatter(x=[t.number for t in failed], y=[floor] * len(failed), mode="markers",
                        name="failed (no value; drawn at the lowest)",
                        marker=dict(symbol="triangle-down", color="crimson", size=10),
                        text=[f"trial {t.number}: {t.user_attrs.get('failure') or 'failed'}"
                              + (f": {t.user_attrs['error'][:80]}" if t.user_attrs.get("error") else "") for t in failed],
                        hoverinfo="text")
    fig.update_layout(title="Optimisation history", xaxis_title="trial", yaxis_title=OBJECTIVES_LABEL.get(study.objectives[0]))
    return fig


def importance_figure(ostudy, study: Study):
    """PED-ANOVA ranks fields by how they lead to low target values, so a maximised objective is negated."""
    import warnings

    import optuna

    _, name = _target(study)
    sign = -1.0 if study.directions[0] == "maximize" else 1.0
    n = sum(1 for t in ostudy.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE)
    if n < 2:  # Optuna's warning on stderr, and every field drawn equally important, as if it had found that
        raise ValueError(f"importances need at least 2 complete trials; the study has {n}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes the importances")
        fig = optuna.visualization.plot_param_importances(
            ostudy, evaluator=optuna.importance.PedAnovaImportanceEvaluator(), target=lambda t: sign * t.values[0],
            target_name=f"importance for {'high' if sign < 0 else 'low'} {name}")
    # every field's name beside its bar: plotly thinned the labels of a tall list to every other one (30 fields)
    bars = max((len(d.y) for d in fig.data if getattr(d, "y", None) is not None), default=0)
    fig.update_yaxes(dtick=1, automargin=True)
    fig.update_layout(height=max(fig.layout.height or 450, 160 + 22 * bars))
    return fig


def parallel_figure(ostudy, study: Study):
    import optuna

    target, name = _target(study)
    from plotly.colors import sample_colorscale

    fig = optuna.visualization.plot_parallel_coordinate(ostudy, target=target, target_name=name)
    # Optuna colours with a reversed Blues that draws the best trials near-white on the white page. Its lines
    # are scatter traces whose first point is the objective scaled to [0, 1]: recolour them with a scale whose
    # best end is dark, and draw the best trials last (on top).
    minimize = study.directions[0] == "minimize"
    lines, others = [], []
    for tr in fig.data:
        if tr.type == "scatter" and tr.mode == "lines" and tr.y and tr.y[0] is not None:
            good = 1.0 - tr.y[0] if minimize else tr.y[0]
            tr.line.color = sample_colorscale(OBJECTIVE_SCALE, [min(1.0, max(0.0, good))])[0]
            tr.opacity = 0.6 + 0.4 * good
            lines.append((good, tr))
        else:
            if tr.marker is not None and tr.marker.colorscale is not None:  # the colour bar
                tr.marker.colorscale, tr.marker.reversescale = OBJECTIVE_SCALE, minimize
            others.append(tr)
    fig.data = [tr for _, tr in sorted(lines, key=lambda p: p[0])] + others
    fig.update_layout(title=f"Searched policy fields, coloured by {name} (darker is better)")
    return fig


def pareto_2d(points: list[tuple[float, float, Any]], direction: str = "maximize") -> list[tuple[float, float, Any]]:
    """Non-dominated points for (the metric in ``direction``, bytes down), sorted by bytes."""
    from ..search.results import dominated_count

    xy = [(a, b) for a, b, _ in points]
    front = [p for p in points if dominated_count(p[:2], xy, [direction, "minimize"]) == 0]
    sign = -1 if direction == "maximize" else 1
    return sorted(front, key=lambda p: (p[1], sign * p[0]))


def tradeoff_metric(study: Study) -> str:
    """What the trade-off picture sets against bytes: the study's first objective (accuracy when that is bytes, or
    the loss for a task without classes)."""
    first = study.objectives[0]
    if first != "bytes":
        return first
    return "val_accuracy" if study.run.loss == "cross_entropy" else "val_loss"  # a task without classes: its loss


def tradeoff_figure(summaries: list[dict], baselines: list[dict], metric: str = "val_accuracy"):
    """Every trial's ``metric`` (the study's objective: accuracy, or time to target on a simulated cluster) against
    the bytes it sent, the Pareto front of the two, and the baselines as stars."""
    import plotly.graph_objects as go

    from ..search.config import OBJECTIVES

    direction = OBJECTIVES[metric].direction if metric in OBJECTIVES else "maximize"

    def points(rows):
        pts = [(_mean(s, metric), _mean(s, "bytes"), s["number"]) for s in rows]
        return [p for p in pts if p[0] is not None and p[1] is not None]

    bad = points([s for s in summaries if diverged(s)])  # stopped early, few bytes: never on the front
    pts = points([s for s in summaries if not diverged(s)])
    positive = [p[1] for p in pts + bad if p[1] > 0] + [b["bytes"] for b in baselines if b["bytes"] > 0]
    floor = 0.5 * min(positive) / 1e6 if positive else 1e-3  # no bytes cannot sit on a log axis: drawn at a floor

    def mb(b):
        return b / 1e6 if b > 0 else floor

    fig = go.Figure()
    fig.add_scatter(x=[mb(p[1]) for p in pts], y=[p[0] for p in pts], mode="markers", name="trials",
                    text=[f"trial {p[2]}: {p[1] / 1e6:,.2f} MB" for p in pts], marker=dict(size=8, color="steelblue", opacity=0.6))
    if bad:
        fig.add_scatter(x=[mb(p[1]) for p in bad], y=[p[0] for p in bad], mode="markers", name="diverged (not on the front)",
                        text=[f"trial {p[2]}: diverged" for p in bad], marker=dict(symbol="x-thin-open", size=10,
                                                                                     color="#b00020", line=dict(width=2)))
    front = pareto_2d(pts, direction)
    fig.add_scatter(x=[mb(p[1]) for p in front], y=[p[0] for p in front], mode="lines+markers", name="Pareto front",
                    text=[f"trial {p[2]}: {p[1] / 1e6:,.2f} MB" for p in front], line=dict(color="darkorange", width=2),
                    marker=dict(size=11))
    shown = [b for b in baselines if b.get(metric) is not None]
    if shown:
        # baselines at one point share one label (no-merging and a FedAvg that never merged, both at no bytes, were
        # printed over each other: "nofedavg (0 bytes)"); others at one x alternate above and below
        at: dict[tuple, list[dict]] = {}
        for b in shown:
            at.setdefault((mb(b["bytes"]), b[metric]), []).append(b)
        # at one x, from the highest down: above, below, above ... (the highest's label above it, the lowest's below)
        nth, count = {}, {}
        for x, y in sorted(at, key=lambda k: (k[0], -k[1])):
            nth[x, y] = count[x] = count.get(x, -1) + 1
        where = ["top center" if nth[key] % 2 == 0 else "bottom center" for key in at]
        fig.add_scatter(x=[x for x, _ in at], y=[y for _, y in at], mode="markers+text", name="baselines",
                        textposition=where,
                        text=[", ".join(b["name"] for b in group) + (" (0 bytes)" if group[0]["bytes"] == 0 else "")
                              for group in at.values()],
                        marker=dict(symbol="star", size=14, color="black"))
    label = OBJECTIVES_LABEL.get(metric, metric)
    fig.update_layout(title=f"{label[0].upper() + label[1:]} against bytes communicated",
                      xaxis_title="MB sent (log; no bytes drawn at the left edge)", xaxis_type="log",
                      yaxis_title=label + (" (lower is better)" if direction == "minimize" else ""))
    return fig


def transfer_figure(result: dict):
    """A transfer check (:mod:`evomerge.search.transfer`): each policy's value on the source study against its value on
    the target, labelled by trial; a rising cloud means the small study ranks policies as the target does."""
    import plotly.graph_objects as go

    rows = result["rows"]
    fig = go.Figure()
    fig.add_scatter(x=[r["source_value"] for r in rows], y=[r["target_value"] for r in rows], mode="markers+text",
                    text=[str(r["trial"]) for r in rows], textposition="top center", name="policy (trial)",
                    customdata=[[r["source_rank"], r["target_rank"], r["description"]] for r in rows],
                    hovertemplate="trial %{text}<br>rank %{customdata[0]} on the source, %{customdata[1]} on the "
                                  "target<br>%{customdata[2]}<extra></extra>")
    metric = result["metric"]
    fig.update_layout(xaxis_title=f"{metric} on {result['source']}", yaxis_title=f"{metric} on {result['target']}",
                      height=420, margin=dict(t=30))
    return fig


def transfer_table(result: dict) -> dict[str, Any]:
    """The transfer rows for the template, by rank on the source."""
    rows = [{"source_rank": f"{r['source_rank']:g}", "trial": r["trial"], "source_value": f"{r['source_value']:.4f}",
             "target_value": f"{r['target_value']:.4f}" + (" (diverged)" if r.get("diverged") else ""),
             "target_rank": f"{r['target_rank']:g}", "policy": r["description"]}
            for r in sorted(result["rows"], key=lambda r: r["source_rank"])]
    return {"source": result["source"], "target": result["target"], "rows": rows}


def transfer_text(result: dict) -> str:
    from ..search.transfer import verdict

    def num(v):
        return "n/a" if v is None or v != v else f"{v:.3f}"  # nan: two policies, or tied values

    seeds = ", ".join(map(str, result["seeds"]))
    return (f"The top {result['top']} policies of {result['source']} re-run on {result['target']} "
            f"({result['target_workers']} workers, {result['target_total_steps']} local steps) on fresh seeds {seeds}, "
            f"on {result['when']}: Spearman rho {num(result.get('spearman'))}, Kendall tau {num(result.get('kendall'))}. "
            f"{verdict(result.get('spearman'), result.get('top'), result.get('spearman_p')).capitalize()}.")


def curves_figure(best: dict, baselines: list[dict], prefer: str = "val_accuracy"):
    """The best policy's and the baselines' validation curves: of ``prefer`` (the study's metric, e.g. perplexity
    for a language model, whose histories hold a next-token accuracy too) where every history has it, else of what
    the task has."""
    from plotly.subplots import make_subplots

    from plotly.colors import qualitative

    # a tuned baseline's step size beside its name ([baselines] lr: each ran at its best)
    series = [(f"best: trial {best['number']}", best["history"])] + [
        (b["name"] + (f" (lr {b['lr']:g})" if b.get("lr") is not None else ""), b["history"])
        for b in baselines if b.get("history")]
    series = [(n, h) for n, h in series if h]
    # the curve of the study's metric, else of what the task has: accuracy where there are classes, else
    # perplexity (a language model) or loss
    metric = next((m for m in dict.fromkeys((prefer, *CURVE_METRICS)) if m in CURVE_METRICS
                   if series and all(any(v is not None for v in h.get(m) or []) for _, h in series)), "val_accuracy")
    what = {"val_accuracy": "accuracy", "val_perplexity": "perplexity", "val_loss": "loss"}[metric]
    fig = make_subplots(rows=1, cols=3, subplot_titles=(f"validation {what}", "consensus distance",
                                                        f"{what} against MB sent"))
    # on a simulated cluster the curves are drawn against simulated seconds
    timed = bool(series) and all(h.get("sim_time") for _, h in series)
    xkey, xtitle = ("sim_time", "simulated seconds") if timed else ("step", "local steps")
    positive = [b for _, h in series for b in h["bytes"] if b and b > 0]
    mb_floor = float(f"{0.5 * min(positive) / 1e6:.1g}") if positive else 1e-3  # no bytes cannot sit on a log axis

    def distance(v):
        return None if v is None or v != v else max(float(v), DISTANCE_FLOOR)

    for i, (name, h) in enumerate(series):
        color = qualitative.Plotly[i % len(qualitative.Plotly)]  # one colour per policy in every panel
        common = dict(name=name, legendgroup=name, mode="lines+markers", line=dict(width=3 if i == 0 else 1.5, color=color),
                      marker=dict(color=color))
        fig.add_scatter(x=h[xkey], y=h.get(metric), row=1, col=1, **common)
        fig.add_scatter(x=h[xkey], y=[distance(v) for v in h["consensus_distance"]], row=1, col=2, showlegend=False,
                        **common)
        fig.add_scatter(x=[b / 1e6 if b > 0 else mb_floor for b in h["bytes"]], y=h.get(metric), row=1, col=3,
                        showlegend=False, text=[f"{b / 1e6:,.3f} MB" for b in h["bytes"]], **common)
    fig.update_xaxes(title_text=xtitle, row=1, col=1)
    fig.update_xaxes(title_text=xtitle, row=1, col=2)
    fig.update_xaxes(title_text=f"MB sent (log; 0 MB drawn at {mb_floor:g} MB)", type="log", row=1, col=3)
    fig.update_yaxes(title_text=f"log; floored at {DISTANCE_FLOOR:g}", type="log", row=1, col=2)
    fig.update_layout(title="Learning curves (first seed): best policy against the baselines", height=460)
    return fig


def cluster_figure(env, workers: int, seed: int):
    """The simulated cluster: each worker's speed (1 / its step-time multiplier), coloured by site, and every
    link's bandwidth (MB/s) with its latency on hover."""
    import numpy as np
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    from ..engine import clock

    speeds = 1.0 / clock.speed_factors(env, workers, seed)
    net = clock.Network(env, workers)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55],
                        subplot_titles=("speed of each worker (1 = step_time)", "link bandwidth, MB/s (hover: latency)"))
    colours = [qualitative.Plotly[int(s) % len(qualitative.Plotly)] for s in net.sites]
    fig.add_bar(x=list(range(workers)), y=speeds.tolist(), marker_color=colours, name="speed",
                text=[f"site {int(s)}" for s in net.sites], hovertemplate="worker %{x}: speed %{y:.3g}, %{text}<extra></extra>",
                showlegend=False, row=1, col=1)
    mbs = np.where(np.isfinite(net.bandwidth), net.bandwidth / 1e6, np.nan)
    np.fill_diagonal(mbs, np.nan)
    finite = mbs[np.isfinite(mbs)]
    # a log colour scale: links 10-1000x apart (inside a site and between sites) both stay readable
    z = np.log10(mbs) if finite.size else np.zeros_like(mbs)
    info = [[f"{'unlimited' if not np.isfinite(net.bandwidth[i, j]) else f'{net.bandwidth[i, j] / 1e6:,.3g} MB/s'}, "
             f"{net.latency[i, j] * 1e3:.3g} ms" for j in range(workers)] for i in range(workers)]
    ticks = [v for v in range(-3, 7) if finite.size and np.log10(finite.min()) - 1 <= v <= np.log10(finite.max()) + 1]
    fig.add_heatmap(z=z.tolist(), x=list(range(workers)), y=list(range(workers)), colorscale="Blues",
                    customdata=info, colorbar=dict(title="MB/s", x=1.0, tickvals=ticks,
                                                   ticktext=[f"{10.0 ** v:g}" for v in ticks]),
                    hovertemplate="%{y} -> %{x}: %{customdata}<extra></extra>", row=1, col=2)
    fig.update_xaxes(title_text="worker", row=1, col=1)
    fig.update_yaxes(title_text="speed", row=1, col=1)
    fig.update_xaxes(title_text="to worker", row=1, col=2)
    fig.update_yaxes(title_text="from worker", autorange="reversed", row=1, col=2)
    fig.update_layout(title=f"The simulated cluster: step_time {env.step_time:g} s, {env.sites} site(s), "
                            f"overlap {env.overlap}", height=420)
    return fig


COMPUTE, IDLE, SEND = "#4c78a8", "#c7c7c7", "#f58518"


def timeline_figure(timelines: list, window: float):
    """Per worker, what it did in the first ``window`` simulated seconds: compute (each local step), idle (waiting
    at a barrier, for a blocking merge, a fragment or the server) and, on a thin lane above, sending. One panel per
    policy (``timelines``: (name, clock.Timeline))."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(timelines), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[f"{name}: compute {c:.0%}, idle {i:.0%} of the workers' time"
                                        for name, tl in timelines for c, i in [busy_shares(tl)]])
    legend: set[str] = set()
    for row, (name, tl) in enumerate(timelines, start=1):
        for kind, colour, spans, lane, width in (
                ("compute", COMPUTE, step_spans(tl), 0.0, 0.6), ("idle", IDLE, tl.idle_spans, 0.0, 0.6),
                ("sending", SEND, tl.send_spans, 0.42, 0.18)):
            xs, bases, ys = [], [], []
            for w, per in enumerate(spans):
                for a, b in merged(per, window):
                    xs.append(b - a)
                    bases.append(a)
                    ys.append(w + lane)
            fig.add_bar(x=xs, base=bases, y=ys, orientation="h", width=width, marker_color=colour, name=kind,
                        legendgroup=kind, showlegend=bool(xs) and kind not in legend,
                        hovertemplate=f"{kind} %{{base:.3f}} s + %{{x:.3f}} s<extra></extra>", row=row, col=1)
            if xs:
                legend.add(kind)
        fig.update_yaxes(title_text="worker", autorange="reversed", row=row, col=1)
    fig.update_xaxes(title_text="simulated seconds", row=len(timelines), col=1)
    fig.update_layout(title=f"Where the time went: the first {window:.3g} simulated seconds", barmode="overlay",
                      height=260 + 200 * len(timelines), bargap=0)
    return fig


def merged(spans, window: float) -> list[tuple[float, float]]:
    """Spans ``(start, end)`` clipped to ``[0, window]``, sorted, with touching or overlapping ones joined (a worker's
    back-to-back local steps are one bar)."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        a, b = max(a, 0.0), min(b, window)
        if b <= a:
            continue
        if out and a <= out[-1][1] + 1e-12:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def step_spans(tl) -> list[list[tuple[float, float]]]:
    """Each worker's local steps as spans (start, end) of a timeline (``clock.Timeline``)."""
    return [list(zip(st, c.tolist())) for st, c in zip(tl.step_starts, tl.completions)]


def busy_shares(tl) -> tuple[float, float]:
    """The workers' time spent computing and idle, as shares of all workers' time to the run's end."""
    W, end = len(tl.completions), tl.end or 1.0
    compute = sum(b - a for per in step_spans(tl) for a, b in per)
    return compute / (W * end), float(tl.idle.sum()) / (W * end)  # the rounds' idle time is the run's


def policy_figure(policy: MergePolicy, workers: int, seed: int = 0):
    """The best policy's peer graph: workers on a circle, edges weighted by how often they merge."""
    import numpy as np
    import plotly.graph_objects as go

    from ..engine import topology

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
    elif policy.scheme == "async":  # asynchronous DiLoCo: each worker to the server and back, at its own pace
        groups = np.zeros(workers, dtype=int)
        for i in range(workers):
            fig.add_scatter(x=[0.0, x[i]], y=[0.0, y[i]], mode="lines", showlegend=False, hoverinfo="skip",
                            line=dict(width=1.5, color="rgba(70,110,160,0.55)"))
        fig.add_scatter(x=[0.0], y=[0.0], mode="markers+text", text=["server"], textposition="bottom center",
                        marker=dict(size=22, symbol="square", color="white", line=dict(width=1, color="black")),
                        hovertext=["the server: an outer step on each push"], showlegend=False)
        title = "Each worker pushes to the server and takes its model back"
    else:
        groups = np.zeros(workers, dtype=int)
        title = "No merging until the end"
    from plotly.colors import qualitative

    palette = qualitative.Set2
    fig.add_scatter(x=x, y=y, mode="markers+text", text=[str(i) for i in range(workers)], textposition="middle center",
                    marker=dict(size=28, color=[palette[int(g) % len(palette)] for g in groups], line=dict(width=1, color="black")),
                    textfont=dict(color="black"), name="workers", hovertext=[f"worker {i}, group {g}" for i, g in enumerate(groups)])
    fig.update_layout(title=title, showlegend=False, height=440, width=520,
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
    # a lerp toward the peer's model or the workers' average (an outer step or an all-reduce of gradients takes none)
    lerps = p.scheme == "gossip" or (p.scheme == "allreduce" and p.outer_optimizer == "none" and p.payload != "gradient")
    if lerps:
        toward = "the incoming model" if p.scheme == "gossip" else "the workers' average"
        if p.mixing_schedule == "constant":
            lines.append(f"The weight on {toward} is {p.mixing_weight:.3g} throughout.")
        else:
            lines.append(f"The weight on {toward} goes from {p.mixing_weight:.3g} to {p.mixing_weight_final:.3g} "
                         f"over the run ({p.mixing_schedule}).")
        if p.lerp == "random":
            lines.append("Each merge scales it by a uniform random draw.")
    if p.scheme != "none":
        if p.winner_bias > 0 and p.scheme == "gossip":  # a gossip pair's winner test; other schemes carry it unused
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
    except Exception as e:  # noqa: BLE001 (no store yet: no runs; a server that turns the API away: the page says so)
        if tracking_uri.startswith(("http://", "https://")):
            from ..dburls import first_line

            raise ConfigError("--tracking-uri", f"{shown(tracking_uri)} answers, but not as an MLflow tracking server "
                                                f"({first_line(e)})") from None
        return {}, None


def template_dir() -> Path:
    """``dashboards/``: the page template and its style (the ``evomerge.dashboards`` package, or the source tree)."""
    try:
        import evomerge.dashboards as shipped  # mapped onto ``dashboards/`` by pyproject

        return Path(shipped.__file__).resolve().parent
    except ImportError:
        return Path(__file__).resolve().parents[2] / "dashboards"


def render(**context: Any) -> str:
    """The page from ``dashboards/page.html.j2`` (autoescaped; plot divs come in as markup)."""
    import jinja2

    d = template_dir()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(d)), autoescape=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template("page.html.j2").render(style=(d / "style.css").read_text(encoding="utf-8"), **context)


def build(study: Study, storage_url: str, tracking_uri: str, out_dir: Path, *, data_dir=None, device=None,
          compute_baselines: bool = True, warn: Callable[[str], None] | None = None) -> Path:
    """Write ``out_dir/index.html`` and ``out_dir/plotly.min.js``; return the page's path. What the page could not
    hold (baselines, MLflow runs, the picture of the time it could not compute) is noted in it, and passed to
    ``warn`` as well (the command prints it)."""
    import optuna
    from markupsafe import Markup
    from plotly.offline import get_plotlyjs

    from .export import load_study_trials
    from ..search.baselines import baseline_rows
    from ..search.results import best_trials, count_states, pick_one, trial_summary
    from .tracking import review_url

    ostudy = load_study_trials(study, storage_url)
    trials = ostudy.get_trials(deepcopy=False)
    counts = count_states(trials)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plotly.min.js").write_text(get_plotlyjs(), encoding="utf-8")
    sections: list[dict[str, Any]] = []
    notes: list[str] = []

    def problem(text: str) -> None:
        notes.append(text)
        if warn is not None:
            warn(text)

    n_diverged = sum(diverged(t.user_attrs) for t in complete)
    summary_line = ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "no trials"
    if n_diverged:
        summary_line += f" ({n_diverged} of the complete diverged)"
    http = tracking_uri.startswith(("http://", "https://"))
    exp_id = None

    if complete:
        baselines: list[dict] = []
        if compute_baselines:
            try:
                baselines = baseline_rows(study, data_dir=data_dir, device=device, storage_study=ostudy)
            except Exception as e:  # data missing here: the page still shows the search
                problem(f"Baselines could not be run here ({e}); they are left out.")
        summaries = [trial_summary(t, study) for t in complete]
        # the best (diverged trials may be left out of it): else every complete trial, ranked by the first objective
        best = best_trials(ostudy, study, 10) or sorted(summaries, key=lambda b: b["values"][0],
                                                         reverse=study.directions[0] == "maximize")[:10]
        # the policy `evomerge export` writes (one rule: search.results.pick_one), else the best by the first objective
        picked, picked_by = pick_one(ostudy, study)
        top = picked if picked is not None else best[0]
        top_full = next(t for t in complete if t.number == top["number"])
        top["history"] = top_full.user_attrs.get("history")
        policy = MergePolicy.from_dict(top["policy"])

        def section(sid, title, text, body="", **extra):
            sections.append({"id": sid, "title": title, "text": text, "body": Markup(body), "details": None,
                             "table": None, "transfer": None, **extra})

        stored_verdict = ostudy.user_attrs.get("verdict")  # the last search's (search/verdict.py)
        if stored_verdict:
            from ..search.verdict import stale_note

            stale = stale_note(stored_verdict, len(complete))
            section("verdict", "Verdict", stored_verdict["headline"],
                    verdict_html(stored_verdict, [stale] if stale else []))
        else:  # (the page left the section out, and a reader looked for it)
            section("verdict", "Verdict", "No verdict yet: the search of these trials ended before it (--no-verdict, "
                                          "or stopped). The same evomerge search command without --no-verdict judges "
                                          "the trials the study has, and runs no new trial once they are done.")
        section("history", "Optimisation history",
                "Every trial's value in the order it was asked; the line is the best so far for each sampler."
                + (" Diverged trials are marked and left out of the best so far." if n_diverged else ""),
                _div(history_figure(ostudy, study), "plot-history"))
        complete = sum(1 for t in ostudy.get_trials(deepcopy=False) if t.state.name == "COMPLETE")
        few = (f" From {complete} complete trials: too few to rank the fields firmly (PED-ANOVA sets the best 10% "
               f"against the rest; a few dozen trials steady it)." if complete < FEW_FOR_IMPORTANCE else "")
        for sid, title, fn, text in (
            ("importance", "Parameter importances", importance_figure,
             "How much each searched policy field explains the objective (PED-ANOVA, Optuna)." + few),
            ("parallel", "Searched policy fields", parallel_figure,
             "Each line is a completed trial through its policy fields, coloured by the objective: the darker, the "
             "better (Optuna)."),
        ):
            try:
                section(sid, title, text, _div(fn(ostudy, study), f"plot-{sid}"))
            except Exception as e:
                section(sid, title, f"Not available yet: {e}")
        metric = tradeoff_metric(study)
        section("tradeoff", "Accuracy against bytes" if metric == "val_accuracy" else
                f"{OBJECTIVES_LABEL.get(metric, metric).capitalize()} against bytes",
                "Every completed trial (mean over its seeds); the Pareto front is highlighted, baselines are stars"
                + (", diverged trials are crosses and never on the front." if n_diverged else "."),
                _div(tradeoff_figure(summaries, baselines, metric), "plot-tradeoff"))
        if top["history"]:
            section("curves", "Learning curves",
                    "The best policy against every baseline, on the study's first seed. Bytes and consensus distance "
                    f"are on log axes: a policy that sends nothing is drawn at the left edge, and distances below "
                    f"{DISTANCE_FLOOR:g} (floating-point noise, e.g. right after an all-reduce) are drawn at {DISTANCE_FLOOR:g}.",
                    _div(curves_figure(top, baselines, metric if metric in CURVE_METRICS else study.target_metric),
                         "plot-curves", top=90))  # (a time objective: its target's metric)
        if study.environment is not None:  # a simulated cluster: what it is, and where the time went
            cluster_and_time(study, policy, top["number"], section, notes, data_dir, problem)
        words = policy_words(policy, top_full.user_attrs.get("history", {}).get("step", [None])[-1])
        # "beaten" only for a trial the verdict judged (a multi-objective study's best first objective may not be)
        judged = {p["number"] for p in (stored_verdict or {}).get("picks", [])}
        beaten = (stored_verdict or {}).get("beaten_by") if top["number"] in judged else None
        searched_run = top.get("run") or {}
        if searched_run:  # the step size the trial searched with the policy is part of it (export writes both)
            words += (" Searched with it: " + ", ".join(f"run.{k} {v:.3g}" for k, v in sorted(searched_run.items()))
                      + " (evomerge export writes it beside the policy; a replay and the Merger's warning use it).")
        if picked is not None:
            words = f"The policy evomerge export writes: {picked_by}. " + words
        section("policy", f"The best trial, beaten by {', '.join(beaten)}: trial {top['number']}" if beaten
                else f"The best policy: trial {top['number']}", words,
                _div(policy_figure(policy, study.run.workers), "plot-policy", toolbar=False),
                details_title="policy JSON", details=json.dumps(policy.to_dict(), indent=2))
        from ..search.transfer import stored

        for tr in stored(ostudy):  # `evomerge transfer` checks of this study against bigger ones
            section(f"transfer-{tr['target']}", f"Transfer to {tr['target']}", transfer_text(tr),
                    _div(transfer_figure(tr), f"plot-transfer-{tr['target']}"), transfer=transfer_table(tr))
        from .tracking import check_reachable

        from ..sqlitefiles import sqlite_file

        try:
            missing = sqlite_file(tracking_uri)
            if missing and not Path(missing).exists():  # not made here (MLflow makes an empty store when asked)
                runs, exp_id = {}, None
                problem(f"No MLflow store at {shown(tracking_uri)} (a search that tracked its runs elsewhere: pass "
                        "--tracking-uri, or set MLFLOW_TRACKING_URI).")
            else:
                check_reachable(tracking_uri, reading=True)  # a database that does not answer: seconds, not minutes
                runs, exp_id = mlflow_runs(tracking_uri, study.name)
                if not runs:
                    problem(f"No MLflow runs found at {shown(tracking_uri)}.")
        except ConfigError as e:
            runs, exp_id = {}, None
            problem(f"MLflow runs not read: {e}.")
        section("top", "Top trials", "", table=_top_table(study, best, runs, exp_id, tracking_uri))

    # the command that fills this study's store (it named the study alone, which searches ./runs: another store)
    search_command = _command_for("search", study, storage_url, "optuna.db", "--storage")
    page = render(study=study, summary=summary_line, storage=shown(storage_url), tracking=shown(tracking_uri), version=__version__,
                  search_command=search_command,
                  when=time.strftime("%Y-%m-%d %H:%M"), notes=notes, sections=sections,
                  review_url=review_url(tracking_uri, exp_id) if http and exp_id else None)
    path = out_dir / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def cluster_and_time(study: Study, policy: MergePolicy, number: int, section, notes: list[str], data_dir,
                     problem: Callable[[str], None]) -> None:
    """A time study's two pictures: the simulated cluster, and each worker's compute, idle and sending under the
    best policy and under all-reduce every step (the first seed's clock, re-simulated: nothing is trained)."""
    from ..engine import optim
    from ..engine.setup import prepare
    from ..engine.timed import build_timeline, decides_with_state

    env, seed = study.environment, study.run.seeds[0]
    if decides_with_state(policy):
        notes.append("The best policy decides with the workers' state (peers or examples by similarity, regrouping, "
                     "swaps by confidence); nothing is trained for this page, so its picture of where the time went "
                     "takes the schedule's own peers and unconditioned swaps.")
    section("cluster", "The simulated cluster",
            "Each worker's speed (its steps take step_time / speed), coloured by site, and every link's bandwidth; "
            "from the study's [environment] and its first seed.",
            _div(cluster_figure(env, study.run.workers, seed), "plot-cluster"))
    try:
        setup = prepare(study, data_dir=data_dir)
    except Exception as e:  # data missing here: the page still shows the rest
        problem(f"Where the time went could not be simulated here ({e}).")
        return
    stacks = optim.state_stacks(study.run)
    lines = [(f"best: trial {number}", build_timeline(setup, policy, seed, stacks))]
    reference = study.resolve_policy("allreduce")
    lines.append(("allreduce (every step)", build_timeline(setup, reference, seed, stacks)))
    window = min(tl.round_ends[0] for _, tl in lines)
    section("timeline", "Where the time went",
            "Each worker's first round on the simulated clock (seed "
            f"{seed}): computing its local steps, idle (waiting at a barrier, for a blocking merge, a fragment or the "
            "server), and, on the thin lane, its link sending. The shares in the titles are of the whole run.",
            _div(timeline_figure(lines, window), "plot-timeline", top=90))


def verdict_html(verdict: dict[str, Any], extra_notes: list[str] = ()) -> str:
    """The verdict's lines (each pick against each baseline) and notes, as HTML (escaped)."""
    from markupsafe import escape

    items, sub = [], []
    for line in verdict["lines"]:
        if line.startswith("  "):
            sub.append(f"<li>{escape(line.strip())}</li>")
            continue
        if items:
            items[-1] += f"<ul>{''.join(sub)}</ul></li>"
        items.append(f"<li>{escape(line)}")
        sub = []
    if items:
        items[-1] += f"<ul>{''.join(sub)}</ul></li>"
    notes = "".join(f"<li>{escape(n)}</li>" for n in [*verdict["notes"], *extra_notes])
    return f'<ul class="verdict">{"".join(items)}</ul><ul class="notes">{notes}</ul>'


def _study_ref(study: Study) -> str:
    """What ``--study`` takes for ``study`` where the page is built: its name where the name finds its file (a
    shipped study, or ./studies/NAME.toml), else the file's path."""
    from ..study import find

    if study.path is None:
        return study.name
    try:
        same = find(study.name).resolve() == Path(study.path).resolve()
    except ConfigError:
        same = False
    return study.name if same else str(study.path)


def _command_for(name: str, study: Study, url: str, default_file: str, flag: str) -> str:
    """``evomerge NAME --study ...`` on the store at ``url``: ``--runs-dir`` where it is the default file of another
    runs folder (RUNS_DIR/STUDY/``default_file``), else ``flag`` and the address (a password hidden). Without it
    the command opened the default store, another one (empty)."""
    command = f"evomerge {name} --study {_study_ref(study)}"
    if url.startswith("sqlite:///") and url.endswith(f"/{study.name}/{default_file}"):
        runs_dir = Path(url[len("sqlite:///"):]).parent.parent
        if runs_dir.resolve() != Path("runs").resolve():
            command += f" --runs-dir {runs_dir}"
    else:
        command += f" {flag} {shown(url)}"
    return command


def _top_table(study: Study, best: list[dict], runs: dict[int, str], exp_id, tracking_uri: str) -> dict[str, Any]:
    """The top trials for the template: values, status (``diverged`` or ``ok``), policy, MLflow run (a link
    for an HTTP store; for the default local store, how to open it)."""
    from ..policy import describe_policy
    from ..search.results import missed
    from .tracking import VIEW_KEY, run_url

    http = tracking_uri.startswith(("http://", "https://"))
    rows = []
    for b in best:
        rid = runs.get(b["number"])
        rows.append({
            "number": b["number"],
            # a time to target past the budget is a miss's penalty, as status and export say (it read as a time)
            "cells": [size(v) if o == "bytes" else f"{v:.4f}{missed(study, o, v)}"
                      for o, v in zip(study.objectives, b["values"])],
            "status": "diverged" if diverged(b) else "ok",
            "policy": describe_policy(b["policy"], b.get("run")),  # with the step size searched with it
            "run_id": rid,
            "run_url": run_url(tracking_uri, exp_id, rid) if rid and http and exp_id else None,
        })
    command = _command_for("ui", study, tracking_uri, "mlflow.db", "--tracking-uri") if not http and runs else None
    return {"head": [OBJECTIVES_LABEL.get(o, o) for o in study.objectives], "rows": rows, "ui_command": command,
            "runs_path": f"/#/experiments/{exp_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"}

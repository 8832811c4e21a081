"""The simulated clock held against real runs: predicted against measured time to a target accuracy.

    .venv/bin/python benchmarks/sim_vs_real.py [--scenarios compute network] [--rate 50mbit] [--json FILE]

Needs root (``../shared/netlab/netlab.sh``: ``unshare``, ``ip``, ``tc``). For each scenario, 4 gloo ranks, each
in its own network namespace with its own link to a bridge (shaped to ``--rate`` by tbf in both directions for
``network``, unshaped for ``compute``), train the study's model (``benchmarks/sim_vs_real.toml``) in a plain
PyTorch loop with ``evomerge.Merger``: the study's data order (each rank's shard, ``batch_indices``), SGD at the
study's lr, and every rank sleeping ``--step-sleep`` per step after its compute, rank ``--slow-rank`` sleeping
``--slow-factor`` times that (a slower device). Every ``--dt`` seconds of wall clock after a common start, each
rank keeps a copy of its model; afterwards the consensus at each mark (the ranks' copies averaged) is scored on
the validation split, and the real time to the target is found as the simulated clock finds it
(:func:`evomerge.engine.judge.crossing`, on the same grid of marks).

Then ``evomerge calibrate --from-trace`` fits an ``[environment]`` from the traces of the scenario's ring-gossip
run (step times and point-to-point transfers), the study takes it (``[environment] from = ...``) and each
policy is simulated on it. The table gives predicted against measured and the error of each; the target is
every prediction within 25% and the policies in the same order.

The policies: all-reduce every step, FedAvg (all-reduce every 50 steps), ring gossip (push-pull every 10), and
the best found on mnist-stragglers (benchmarks/RESULTS.md, CMA-ES: push-pull gossip on the complete graph every
~10.7 steps, mixing 0.5, winner bias 0.08, adaptive weighting; with the running score, since a loop has no
validation slices for the holdout one), and asynchronous DiLoCo (push every 10 steps, Nesterov 0.7 / 0.9; rank 0
serves the pushes at its step boundaries, the clock's server serves them as they land).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NETLAB = HERE.parent.parent / "shared" / "netlab" / "netlab.sh"
STUDY = HERE / "sim_vs_real.toml"
W = 4
POLICIES = {
    "allreduce": {"scheme": "allreduce", "mean_interval": 1.0, "mixing_weight": 1.0},
    "fedavg": {"scheme": "allreduce", "mean_interval": 50.0, "mixing_weight": 1.0},
    "ring-gossip": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 10.0,
                    "mixing_weight": 0.5},
    "best-stragglers": {"scheme": "gossip", "topology": "complete", "exchange": "push_pull", "mean_interval": 10.7,
                        "mixing_weight": 0.5, "winner_bias": 0.08, "score": "running", "weighting": "adaptive"},
    # asynchronous DiLoCo: rank 0 serves the pushes (the clock: a server at worker 0's node)
    "async-diloco": {"scheme": "async", "mean_interval": 10.0, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                     "outer_lr": 0.7, "outer_momentum": 0.9},
}
CALIBRATE_FROM = "ring-gossip"


# -- one rank (started by netlab as `sim_vs_real.py --worker ...`) ---------------------------------------------
def worker(args) -> int:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import evomerge
    from evomerge import simulate, study as study_mod
    from evomerge.engine.setup import batch_indices, normalise
    from evomerge.engine.state import initial_row

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    out = Path(args.out)
    st = study_mod.load(args.study)
    setup = simulate.prepare(st, data_dir=args.data_dir)
    T, B = setup.total_steps, st.run.batch_size
    model = setup.model.module()  # the plain nn.Module (the same parameter order as the simulated model)
    tensors = list(model.parameters()) + list(model.buffers())
    row = initial_row(setup.model, args.seed)
    with torch.no_grad():
        o = 0
        for t in tensors:
            t.copy_(row[o:o + t.numel()].view_as(t))
            o += t.numel()
    opt = torch.optim.SGD(model.parameters(), lr=st.run.lr)
    policy = json.loads(args.policy)
    merger = evomerge.Merger(policy, model, opt, seed=args.seed, total_steps=T, overlap=args.overlap,
                             timeout=60.0, trace=out / "trace")
    synchronous = policy.get("scheme") == "allreduce"
    idx = batch_indices(setup.shards[rank], B, 0, T, args.seed, rank)
    x_all, y_all, spec = setup.data.train_x, setup.data.train_y, setup.data.spec
    sleep = args.step_sleep * (args.slow_factor if rank == args.slow_rank else 1.0)
    marks = int(round(args.budget / args.dt))

    def flat() -> torch.Tensor:
        return torch.cat([t.detach().float().reshape(-1) for t in tensors])

    snaps = [flat()]  # the model at each mark: t = 0, dt, 2 dt, ...
    stop = torch.zeros(1)
    dist.barrier()
    t0 = time.perf_counter()
    steps, merges = 0, 0
    for t in range(T):
        bi = torch.as_tensor(idx[t])
        loss = F.cross_entropy(model(normalise(x_all[bi], spec)), y_all[bi])
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(sleep)
        merger.step(loss=loss)
        steps += 1
        now = time.perf_counter() - t0
        while len(snaps) <= marks and now >= len(snaps) * args.dt:
            snaps.append(flat())
        if synchronous:  # ranks leave together: decide at an all-reduce, all at once
            if merger.merges != merges:
                merges = merger.merges
                stop.fill_(float(now >= args.budget))
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():
                    break
        elif now >= args.budget:
            break
    seconds = time.perf_counter() - t0
    merger.finish()
    torch.save({"marks": torch.stack(snaps), "steps": steps, "merges": merger.merges, "seconds": seconds},
               out / f"snap-{rank}.pt")
    dist.destroy_process_group()
    return 0


# -- the driver ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _setup(data_dir):
    """The study's data and model, loaded once for every run's scoring."""
    from evomerge import simulate, study as study_mod

    return simulate.prepare(study_mod.load(STUDY), data_dir=data_dir)


def real_run(name: str, rate: str, out: Path, args) -> dict:
    """Run policy ``name`` on 4 netlab ranks; its real time to target from the consensus at each mark."""
    import torch

    from evomerge.engine.judge import _accuracy, crossing, validation

    reuse = args.reuse and all((out / f"snap-{r}.pt").exists() for r in range(W))
    if not reuse:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    cmd = ["bash", str(NETLAB), str(W), rate, "--", sys.executable, str(Path(__file__).resolve()), "--worker",
           "--study", str(STUDY), "--policy", json.dumps(POLICIES[name]), "--out", str(out),
           "--budget", str(args.budget), "--dt", str(args.dt), "--step-sleep", str(args.step_sleep),
           "--slow-rank", str(args.slow_rank), "--slow-factor", str(args.slow_factor), "--seed", str(args.seed),
           "--overlap", args.overlap]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.budget + 300) if not reuse else None
    if p is not None and p.returncode != 0:
        sys.exit(f"error: the real run of {name} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    setup = _setup(args.data_dir)
    vx, vy = validation(setup, torch.device("cpu"))
    ranks = [torch.load(out / f"snap-{r}.pt") for r in range(W)]
    n = max(len(r["marks"]) for r in ranks)
    accs, reached, prev = [], None, None
    with torch.no_grad():
        for m in range(n):
            center = torch.stack([r["marks"][min(m, len(r["marks"]) - 1)] for r in ranks]).mean(0)
            acc = _accuracy(setup.model, setup.model.views(center.unsqueeze(0)), vx, vy)[0][0]
            accs.append(acc)
            if m and reached is None and acc >= setup.study.target:
                reached = crossing(prev, m * args.dt, acc, setup.study.target)
            prev = (m * args.dt, acc)
    return {"time_to_target": reached, "accuracy": accs, "steps": [r["steps"] for r in ranks],
            "merges": ranks[0]["merges"], "seconds": max(r["seconds"] for r in ranks),
            "wall": time.perf_counter() - t}


def predict(name: str, cluster: Path, out: Path, args) -> dict:
    """Simulate policy ``name`` on the study with the calibrated environment."""
    import evomerge

    text = STUDY.read_text(encoding="utf-8").split("\n[environment]")[0] + "\n"
    rounds = int(round(args.budget / args.dt))
    text, n = re.subn(r"(?m)^rounds = \d+", f"rounds = {rounds}", text)
    assert n == 1, f"{STUDY} has no [run] rounds to set"
    text += (f'[environment]\nfrom = "{cluster.name}"\noverlap = "{args.overlap}"\ntime_budget = {args.budget}\n\n'
             f'[objectives]\nmetrics = ["time_to_target"]\ntarget = {_setup(args.data_dir).study.target}\n')
    path = out / "calibrated.toml"
    path.write_text(text, encoding="utf-8")
    res = evomerge.run(str(path), evomerge.MergePolicy.from_dict(POLICIES[name]), seed=args.seed,
                       data_dir=args.data_dir)
    f = res.final
    return {"time_to_target": f.time_to_target if f.time_to_target <= args.budget else None,
            "accuracy": [h.val_accuracy for h in res.history], "steps": [f.steps_min, f.steps_max]}


def fmt(v, acc=None) -> str:
    return (f"not reached ({max(acc):.3f})" if acc else "not reached") if v is None else f"{v:.2f} s"


def scenario(kind: str, args) -> list[dict]:
    from evomerge import calibrate

    rate = args.rate if kind == "network" else "none"
    root = Path(args.out) / kind
    rows = []
    real = {}
    for name in args.policies:
        real[name] = real_run(name, rate, root / name, args)
        r = real[name]
        print(f"  {kind}: {name} real {fmt(r['time_to_target'], r['accuracy'])} ({r['merges']} merges, "
              f"steps {r['steps']}, "
              f"{r['seconds']:.1f} s)", flush=True)
    cluster = root / "cluster.toml"
    env, warned = calibrate.write(calibrate.from_trace(root / CALIBRATE_FROM / "trace"), cluster)
    print("  " + calibrate.summary(env, W, cluster), flush=True)
    for w in warned:
        print("  " + w, flush=True)
    for name in args.policies:
        p = predict(name, cluster, root, args)
        m, s = real[name]["time_to_target"], p["time_to_target"]
        err = (s - m) / m if m and s else None
        rows.append({"scenario": kind, "policy": name, "measured": m, "predicted": s, "error": err,
                     "real": real[name], "simulated": p})
        print(f"  {kind}: {name} predicted {fmt(s, p['accuracy'])}, measured {fmt(m, real[name]['accuracy'])}, error "
              f"{'n/a' if err is None else f'{err:+.0%}'}", flush=True)
    return rows


def order(rows, key) -> list[str]:
    return [r["policy"] for r in sorted(rows, key=lambda r: math.inf if r[key] is None else r[key])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--study", default=str(STUDY), help=argparse.SUPPRESS)
    ap.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--scenarios", nargs="+", default=["compute", "network"], choices=["compute", "network"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
                    help=f"which to run (the calibration reads {CALIBRATE_FROM}'s traces, so it is always run)")
    ap.add_argument("--rate", default="50mbit", help="each rank's link in the network scenario (tbf rate)")
    ap.add_argument("--step-sleep", type=float, default=0.02, help="seconds every rank sleeps per step")
    ap.add_argument("--slow-rank", type=int, default=3)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--overlap", default="nonblocking", choices=["nonblocking", "blocking"])
    ap.add_argument("--budget", type=float, default=20.0, help="wall-clock seconds of each real run")
    ap.add_argument("--dt", type=float, default=0.2, help="seconds between the marks (and the simulated rounds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=os.environ.get("EVOMERGE_DATA_DIR")
                    or str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--out", default="/tmp/evomerge-sim-vs-real")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    ap.add_argument("--reuse", action="store_true", help="score the real runs already in --out instead of running "
                                                           "them again (to try changes to the time model)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.policies = [CALIBRATE_FROM] + [p for p in args.policies if p != CALIBRATE_FROM]
    if os.geteuid() != 0 or not shutil.which("unshare"):
        sys.exit("error: netlab needs root and unshare (each rank gets its own network namespace)")
    rows = []
    for kind in args.scenarios:
        rows += scenario(kind, args)
    print("\n| scenario | policy | measured | predicted | error |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['policy']} | {fmt(r['measured'])} | {fmt(r['predicted'])} | "
              f"{'n/a' if r['error'] is None else format(r['error'], '+.0%')} |")
    for kind in args.scenarios:
        mine = [r for r in rows if r["scenario"] == kind]
        real, sim = order(mine, "measured"), order(mine, "predicted")
        print(f"{kind}: measured order {', '.join(real)}; predicted {', '.join(sim)}"
              f"{'' if real == sim else ' (differs)'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

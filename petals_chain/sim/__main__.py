"""``python -m petals_chain.sim``: reproduce the paper's §4.1 figures, the overall comparison and a trace replay.

Sub-commands: fig3 fig4 fig5 fig6 fig7 fig8 overall trace planner-scale reproduce, and the seeds' experiments:
fairness (seed 002: FCFS/LPM/VTC/DLPM/D2LPM on a token-step simulator, ``--experiment heavy|prefix|distributed|
sweep|bound|all``), deadlines (seed 003: FLEX/FLEX-NP/EDF/FCFS and HERD, ``fig11a|load|herd|chain|all``) and
multimodel (seed 001: DB/FCFS/MLFQ, unserved-index placement, adaptive replacement, ``db|shift|ablation|sweep|all``). Tables go to stdout
(``--json``: one JSON object instead), PNG plots and JSON files to ``--out DIR``; progress bars on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from petals_chain.sim import experiments as ex
from petals_chain.sim.scenarios import DEFAULT_ETA, DEFAULT_J, DEFAULT_LAMBDA, DISPATCHERS
from petals_chain.swarm.jsonsafe import json_safe

FIGS = ("fig3", "fig4", "fig5", "fig6", "fig7", "fig8")
REPRODUCE = (*FIGS, "overall", "trace")
# The sub-commands that read each option (reproduce: any of its own). Given to another, it was accepted and ignored:
# a --trace to fig5 or multimodel ran on the default data, a --jobs to fig3 changed nothing, and nothing said so.
USED_BY = {
    "runs": REPRODUCE, "jobs": ("fig5", "fig6", "fig7", "fig8", "overall"),
    "quick": (*REPRODUCE, "fairness", "deadlines", "multimodel"),
    "servers": ("overall", "planner-scale"), "eta": ("overall",), "arrival_rate": ("overall",),
    "planner_rate": ("planner-scale",), "experiment": ("fairness", "deadlines", "multimodel"),
    "trace": ("trace", "fairness", "deadlines"), "rtt_file": (*REPRODUCE, "planner-scale"),
    "requests": ("trace",), "service_scale": ("trace",), "petals_cache_tokens": ("fig8", "overall", "trace"),
    "bprr_r": ("fig8", "overall"),
}
TRACE_EXPERIMENT = {"fairness": "heavy", "deadlines": "load"}  # the one experiment of these that reads --trace


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "inf"
        return f"{v:.{nd}f}"
    return str(v)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None) -> None:
    """A table via rich when available, else plain text."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for h in headers:
            t.add_column(str(h), justify="right")
        for r in rows:
            t.add_row(*[_fmt(v) for v in r])
        Console(file=file, width=200).print(t)
    except ImportError:  # pragma: no cover
        print(title, file=file)
        print("\t".join(headers), file=file)
        for r in rows:
            print("\t".join(_fmt(v) for v in r), file=file)


# ------------------------------------------------------------------------------------ plotting


def _num(v: Any) -> float:
    """None (JSON for inf/nan) -> nan, for plotting."""
    return float("nan") if v is None else float(v)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path | None, name: str) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=80)
    _plt().close(fig)


def plot_fig3(res: dict, out: Path | None) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, case in zip(axes, ("homogeneous", "heterogeneous")):
        rows = [r for r in res["cases"][case] if r.get("feasible_runs") and r.get("random_median") is not None]
        xs = list(range(len(rows)))
        stats = [{"med": r["random_median"], "q1": r["random_q1"], "q3": r["random_q3"], "whislo": r["random_min"],
                  "whishi": r["random_max"], "label": f"{r['lambda']:g}"} for r in rows]
        if stats:
            ax.bxp(stats, positions=xs, showfliers=False)
            ax.plot(xs, [_num(r["gbp_cr_mean"]) for r in rows], "r*", ms=12, label="GBP-CR")
        ax.set_title(f"{case} (c={res['c']})")
        ax.set_xlabel("arrival rate λ (req/s)")
        ax.set_ylabel("c·|K| (objective 10a × c)")
        ax.legend()
    _save(fig, out, "fig3_gbp_cr")


def plot_fig4(res: dict, out: Path | None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = [100 * r["load"] for r in res["rows"]]
    for key, label, st in (("ck", "c·K(c)", "s--"), ("gca", "GCA", "o-"), ("ilp", "Optimal ILP", "x:"), ("lower", "Lower bound", "v-.")):
        ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in res["rows"]], st, label=label)
    ax.set_xlabel("λ (% of total service rate of GCA chains)")
    ax.set_ylabel("# job servers Σ c_k")
    ax.legend()
    _save(fig, out, "fig4_gca")


def plot_fig5(res: dict, out: Path | None) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = [r["load"] for r in res["rows"]]
    for kind in DISPATCHERS:
        axes[0].errorbar(x, [_num(r[kind]) for r in res["rows"]], yerr=[_num(r[f"{kind}_ci"]) for r in res["rows"]],
                         label=kind.upper(), capsize=2)
    axes[0].set_title("(a) policies")
    axes[1].plot(x, [_num(r["jffc"]) for r in res["rows"]], "o-", label="JFFC (sim)")
    axes[1].plot(x, [_num(r["lower"]) for r in res["rows"]], "v--", label="lower bound")
    axes[1].plot(x, [_num(r["upper"]) for r in res["rows"]], "^--", label="upper bound")
    axes[1].set_title("(b) JFFC vs Thm 3.7 bounds")
    for ax in axes:
        ax.set_xlabel("load factor ρ = λ/ν")
        ax.set_ylabel("mean response time (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    _save(fig, out, "fig5_jffc")


def plot_fig6(res: dict, out: Path | None) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    sim = {int(c): v for c, v in res["simulated"].items()}
    cur = {m: {int(c): v for c, v in d.items()} for m, d in res["curves"].items()}
    for ax, zoom in zip(axes, (False, True)):
        lim = 40 if zoom else 10**9
        for m, st in (("surrogate", "-"), ("lower", "--"), ("upper", "-.")):
            cs = sorted(c for c in cur[m] if c <= lim and cur[m][c] is not None and math.isfinite(cur[m][c]))
            ax.plot(cs, [cur[m][c] for c in cs], st, label={"surrogate": "c·K(c)/λ"}.get(m, f"{m} bound"))
        cs = sorted(c for c in sim if c <= lim and sim[c] is not None and math.isfinite(sim[c]))
        ax.plot(cs, [sim[c] for c in cs], "ko-", ms=3, label="simulated")
        for m, mk in (("simulated", "k*"), ("surrogate", "C0*"), ("lower", "C1*"), ("upper", "C2*")):
            c = res["c_star"].get(m)
            src = sim if m == "simulated" else cur[m]
            if c is not None and c <= lim and src.get(int(c)) is not None:
                ax.plot([c], [src[int(c)]], mk, ms=14)
        ax.set_yscale("log")
        ax.set_xlabel("c")
        ax.set_ylabel("mean response time (s)")
        ax.set_title("(b) zoomed" if zoom else "(a) overall")
        ax.legend(fontsize=8)
    _save(fig, out, "fig6_c_tuning")


def plot_fig7(res: dict, out: Path | None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = [r["lambda"] for r in res["rows"]]
    for m, st in (("simulated", "ko-"), ("surrogate", "s--"), ("lower", "v-"), ("upper", "^-.")):
        ax.plot(x, [r[m] if r[m] is not None else float("nan") for r in res["rows"]], st, label=m)
    ax.set_xlabel("λ (req/s)")
    ax.set_ylabel("c*")
    ax.set_yscale("log")
    ax.legend()
    _save(fig, out, "fig7_c_star")


def plot_fig8(res: dict, out: Path | None) -> None:
    plt = _plt()
    Js = sorted({c["servers"] for c in res["cells"]})
    fig, axes = plt.subplots(1, len(Js), figsize=(3.2 * len(Js), 3.4), squeeze=False)
    for ax, J in zip(axes[0], Js):
        cells = [c for c in res["cells"] if c["servers"] == J]
        x = [c["eta"] for c in cells]
        for p, st in (("proposed", "o-"), ("petals", "s--"), ("bprr", "^-.")):
            ax.plot(x, [c[p]["mean_response_s"] if c[p]["mean_response_s"] is not None else float("nan") for c in cells], st, label=p)
        ax.set_title(f"J={J}")
        ax.set_xlabel("η")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("mean response time (s)")
    axes[0][0].legend(fontsize=8)
    _save(fig, out, "fig8_overall")


# ---------------------------------------------------------------------------------- printing


def show(cmd: str, res: dict) -> None:
    if cmd == "fig3":
        for case, rows in res["cases"].items():
            print_table(f"Fig. 3 {case}: c|K| of GBP-CR vs {res['num_random']} random feasible placements (c={res['c']}, {res['runs']} runs)",
                        ["lambda", "GBP-CR", "rand min", "rand median", "rand max", "runs GBP-CR<=best"],
                        [[r["lambda"], r.get("gbp_cr_mean"), r.get("random_min"), r.get("random_median"), r.get("random_max"),
                          f"{r.get('gbp_cr_le_best_random_runs', 0)}/{r['feasible_runs']}"] for r in rows])
    elif cmd == "fig4":
        print_table(f"Fig. 4: job servers to reach λ/ρ̄ on a GBP-CR(c={res['c']}) placement ({res['runs']} runs)",
                    ["load %", "c·K(c)", "GCA", "ILP on GCA chains", "lower bound"],
                    [[100 * r["load"], r["ck"], r["gca"], r["ilp"], r["lower"]] for r in res["rows"]])
    elif cmd == "fig5":
        print_table(f"Fig. 5: mean response (s), GBP-CR(c={res['c']})+GCA chains ({res['runs']} runs x {res['jobs']} jobs)",
                    ["load", *[d.upper() for d in DISPATCHERS], "lower", "upper", "JFFC svc/resp"],
                    [[r["load"], *[r[d] for d in DISPATCHERS], r["lower"], r["upper"], r["jffc_service_frac"]] for r in res["rows"]])
    elif cmd == "fig6":
        cs = res["c_values"]
        sim = {int(c): v for c, v in res["simulated"].items()}
        cur = {m: {int(c): v for c, v in d.items()} for m, d in res["curves"].items()}
        print_table(f"Fig. 6: mean response (s) vs c (λ={res['arrival_rate']}, {res['runs']} runs)",
                    ["c", "simulated", "cK(c)/λ", "lower", "upper"],
                    [[c, sim.get(c), cur["surrogate"].get(c), cur["lower"].get(c), cur["upper"].get(c)] for c in cs if c <= 40 or c % 40 == 0])
        print_table("Fig. 6: c*", ["simulated", "surrogate", "lower", "upper"],
                    [[res["c_star"]["simulated"], res["c_star"]["surrogate"], res["c_star"]["lower"], res["c_star"]["upper"]]])
    elif cmd == "fig7":
        print_table(f"Fig. 7: c* vs λ ({res['runs']} runs)", ["lambda", "simulated", "surrogate", "lower", "upper",
                                                              "T@sim", "T@lower", "T@surrogate"],
                    [[r["lambda"], r["simulated"], r["surrogate"], r["lower"], r["upper"], r["simulated_T"], r["T_at_lower"],
                      r["T_at_surrogate"]] for r in res["rows"]])
    elif cmd == "fig8":
        print_table(f"Fig. 8: mean response (s), {res['runs']} runs x {res['jobs']} jobs", ["J", "eta", "proposed", "PETALS", "BPRR",
                                                                                          "-% vs PETALS", "-% vs BPRR"],
                    [[c["servers"], c["eta"], c["proposed"]["mean_response_s"], c["petals"]["mean_response_s"], c["bprr"]["mean_response_s"],
                      c["reduction_vs_petals_pct"], c["reduction_vs_bprr_pct"]] for c in res["cells"]])
        print(f"reduction range: {res['reduction_range_pct']} % (paper: {res['paper_reduction_range_pct']} %)")
    elif cmd == "overall":
        print_table("Overall comparison", ["policy", "mean resp", "±95%", "P95 resp", "mean wait", "mean service",
                                           "runs", "rate/s (routed: bound)"],
                    [[p, d.get("mean_response_s"), d.get("mean_response_ci_s"), d.get("p95_response_s"), d.get("mean_wait_s"),
                      d.get("mean_service_s"), d.get("runs"), _service_rate(d)] for p, d in res.items()])
        show_overall_stability(res)
    elif cmd == "trace":
        # _fmt: the std ratio of fewer than three requests is NaN, null in the JSON (its :.2f crashed the table)
        print(f"trace: {res['source']}, {res['requests']} requests, {_fmt(res['rate_per_s'], 2)} req/s, service scale "
              f"{res['service_scale']}, inter-arrival std / exponential's = {_fmt(res['interarrival_std_ratio'], 2)}, "
              f"c* (lower bound) = {res['c_lower_bound']}")
        print_table("Trace replay (ours | paper Table 1)", ["policy", "mean resp", "paper", "P95", "paper", "mean wait", "paper", "mean svc"],
                    [[p, d.get("mean_response_s"), res["paper"].get(p, {}).get("mean_response_s"), d.get("p95_response_s"),
                      res["paper"].get(p, {}).get("p95_response_s"), d.get("mean_wait_s"), res["paper"].get(p, {}).get("mean_wait_s"),
                      d.get("mean_service_s")] for p, d in res["policies"].items()])
    elif cmd == "fairness":
        for name, r in res.items():
            show_fairness(name, r)
    elif cmd == "deadlines":
        from petals_chain.sim import deadlines as dl

        for name, r in res.items():
            for title, hdr, rows in dl.tables(name, r):
                print_table(title, hdr, rows)
            print(f"seed 003: {r['seed_claim']}")
    elif cmd == "multimodel":
        from petals_chain.sim import multimodel as mmsim

        for name, r in res.items():
            for title, hdr, rows in mmsim.tables(name, r):
                print_table(title, hdr, rows)
            print(f"seed 001: {r['seed_claim']}")
    elif cmd == "planner-scale":
        print_table("Planner scale (tune_capacity: c* by lower bound + GBP-CR + GCA)",
                    ["J", "seconds", "c", "chains", "λ", "chains' rate"],
                    [[res[k] for k in ("servers", "seconds", "c", "chains", "arrival_rate", "service_rate")]])
        if not res["stable"]:
            print(f"unstable: λ = {res['arrival_rate']:g} req/s is not below what the swarm's chains serve "
                  f"({res['service_rate']:.3f} req/s) at any c: the queue grows without bound; the plan shown is "
                  "the one that serves the most")


def _service_rate(d: dict) -> str | None:
    """A policy's capacity (chains) or ``<= bound`` (routed) for the overall table, req/s."""
    if d.get("service_rate") is not None:
        return f"{d['service_rate']:.3f}"
    if d.get("service_rate_bound") is not None:
        return f"<= {d['service_rate_bound']:.3f}"
    return None


def show_overall_stability(res: dict) -> None:
    """Say which policies cannot keep up with the arrival rate: their queues grow without bound, so the means shown
    are those of the first --jobs jobs (they grow with --jobs), not of a steady state (they read as one)."""
    unknown = []
    for p, d in res.items():
        n, runs = d.get("unstable_runs"), d.get("runs")
        if not runs or n is None:
            continue
        routed = d.get("service_rate_bound") is not None
        rate = d["service_rate_bound"] if routed else d["service_rate"]
        if n:
            what = ("not below an upper bound on what its per-request routes serve" if routed
                    else "not below its chains' total service rate")
            print(f"unstable: {p}: the arrival rate is {what} ({'<= ' if routed else ''}{rate:.3f} req/s, mean over "
                  f"runs) in {n} of {runs} run(s): its queue grows without bound; the means shown are those of the "
                  "first --jobs jobs and grow with --jobs")
        elif routed:
            unknown.append(p)
    if unknown:
        print(f"{', '.join(unknown)}: per-request routes have no simple capacity; the arrival rate is below the upper "
              "bound shown, so whether the queue stays bounded is not known")


def show_fairness(name: str, r: dict) -> None:
    """Tables of one fairness experiment (petals_chain.sim.fairness), the seed's claim under each."""
    if name == "bound":
        print_table(f"Thm 4.1 / 5.1: max |W_f - W_g| change over backlogged windows (Q^u = {r['quantum']:g})",
                    ["policy", "workers", "seed", "requests", "max gap", "gap (any-worker backlog)", "bound", "gap/bound"],
                    [[x["policy"], x["workers"], x["seed"], x["requests"], x["max_gap"], x.get("max_gap_any"), x["bound"],
                      x["ratio"]] for x in r["rows"]])
    else:
        heavy = name == "heavy"
        hdr = ["policy", "units/s", "req/s", "hit rate", "Jain (all backlogged)", "mean latency s"]
        if heavy:
            hdr = ["policy", "units/s", "vs fcfs", "Jain (all backlogged)", "Jain vs max-min share",
                   "light lat / alone (max)", "light lat / lights alone", "light service time / alone", "light wait s",
                   "heavy lat s"]
        rows = []
        for p, m in r["policies"].items():
            if heavy:
                rows.append([p, m["throughput_units_s"], m["throughput_vs_fcfs"], m["jain"], m["jain_vs_share"],
                             m["light_ratio_max"], m["light_ratio_together_max"], m["light_service_ratio_max"],
                             max(v["wait_s"] for v in m["light"].values()), m["latency"]["heavy"]["mean_s"]])
            else:
                rows.append([p, m["throughput_units_s"], m["throughput_req_s"], m["cache_hit_rate"], m["jain"],
                             m["mean_latency_s"]])
        print_table(f"fairness {name} ({r.get('workers', 1)} worker(s), {r['requests']} requests)", hdr, rows)
        if r.get("accept"):
            print(f"acceptance: {r['accept']}")
    print(f"seed 002: {r['seed_claim']}")


def plot_fairness_sweep(res: dict, out: Path | None) -> None:
    r = res.get("sweep")
    if not r:
        return
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, m in r["policies"].items():
        ax.plot([m["jain"]], [m["throughput_units_s"]], "o" if label.startswith("dlpm") else "s", ms=8)
        ax.annotate(label, (m["jain"], m["throughput_units_s"]), textcoords="offset points", xytext=(5, 3), fontsize=8)
    ax.set_xlabel("Jain's index (client-view service, all clients backlogged)")
    ax.set_ylabel("throughput (service units/s)")
    ax.set_title("DLPM Q^u sweep (seed 002 Fig. 1)")
    _save(fig, out, "fairness_sweep")


PLOTS = {"fig3": plot_fig3, "fig4": plot_fig4, "fig5": plot_fig5, "fig6": plot_fig6, "fig7": plot_fig7, "fig8": plot_fig8, "fairness": plot_fairness_sweep}


# ------------------------------------------------------------------------------------ commands


def run_command(cmd: str, a: argparse.Namespace) -> dict:
    q = a.quick
    runs = a.runs if a.runs is not None else (3 if q else 20)
    jobs = a.jobs if a.jobs is not None else (1000 if q else 5000)
    prog = not a.no_progress
    if cmd == "fig3":
        return ex.fig3(runs=runs, seed=a.seed, num_random=30 if q else 100, progress=prog)
    if cmd == "fig4":
        return ex.fig4(runs=runs, seed=a.seed, progress=prog)
    if cmd == "fig5":
        return ex.fig5(runs=runs, seed=a.seed, jobs=jobs, progress=prog,
                       loads=(0.1, 0.3, 0.5, 0.7, 0.9) if q else (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
    if cmd == "fig6":
        return ex.fig6(runs=runs, seed=a.seed, jobs=jobs, progress=prog,
                       c_values=list(range(1, 21)) + [30, 40, 80, 160, 320] if q else None)
    if cmd == "fig7":
        return ex.fig7(runs=runs, seed=a.seed, jobs=jobs, progress=prog,
                       lambdas=(0.1, 0.4, 1.0) if q else (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2),
                       c_values=tuple(range(1, 31)) if q else tuple(range(1, 61)))
    if cmd == "fig8":
        out = a.out
        if out:  # this run's cells only: appending mixed an earlier run's (another seed's, say) into the file
            (Path(out) / "fig8_cells.jsonl").unlink(missing_ok=True)

        def on_cell(cell):  # keep partial results of long runs
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                with open(Path(out) / "fig8_cells.jsonl", "a") as f:
                    f.write(json.dumps(json_safe(cell)) + "\n")

        return ex.fig8(runs=runs, seed=a.seed, jobs=jobs, progress=prog, on_cell=on_cell,
                       petals_cache_tokens=a.petals_cache_tokens, bprr_r=a.bprr_r,
                       servers=(10, 20) if q else (10, 20, 30, 40), etas=(0.2, 0.4) if q else (0.1, 0.2, 0.3, 0.4))
    if cmd == "overall":
        return ex.overall(num_servers=a.servers, eta=a.eta, arrival_rate=a.arrival_rate, runs=runs, seed=a.seed, jobs=jobs,
                          petals_cache_tokens=a.petals_cache_tokens, bprr_r=a.bprr_r, progress=prog)
    if cmd == "trace":
        return ex.trace_replay(trace_path=a.trace, requests=a.requests, seed=a.seed, service_scale=a.service_scale,
                               petals_cache_tokens=a.petals_cache_tokens,
                               runs=a.runs if a.runs is not None else (1 if q else 5), progress=prog)
    if cmd == "fairness":
        from petals_chain.sim import fairness as fair

        names = list(fair.EXPERIMENTS) if a.experiment == "all" else [a.experiment]
        if any(n not in fair.EXPERIMENTS for n in names):
            raise ValueError(f"fairness: --experiment must be one of {', '.join(fair.EXPERIMENTS)} or all")
        return {n: fair.EXPERIMENTS[n](quick=q, seed=a.seed, **({"trace": a.trace} if n == "heavy" else {}))
                for n in names}
    if cmd == "deadlines":
        from petals_chain.sim import deadlines as dl

        names = list(dl.EXPERIMENTS) if a.experiment == "all" else [a.experiment]
        if any(n not in dl.EXPERIMENTS for n in names):
            raise ValueError(f"deadlines: --experiment must be one of {', '.join(dl.EXPERIMENTS)} or all")
        return {n: dl.EXPERIMENTS[n](quick=q, seed=a.seed, **({"trace": a.trace} if n == "load" else {})) for n in names}
    if cmd == "multimodel":
        from petals_chain.sim import multimodel as mmsim

        names = list(mmsim.EXPERIMENTS) if a.experiment == "all" else [a.experiment]
        if any(n not in mmsim.EXPERIMENTS for n in names):
            raise ValueError(f"multimodel: --experiment must be one of {', '.join(mmsim.EXPERIMENTS)} or all")
        return {n: mmsim.EXPERIMENTS[n](quick=q, seed=a.seed) for n in names}
    if cmd == "planner-scale":
        return ex.planner_scale(a.servers, seed=a.seed, arrival_rate=a.planner_rate)
    raise ValueError(cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m petals_chain.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=(*FIGS, "overall", "trace", "planner-scale", "reproduce", "fairness", "deadlines",
                                        "multimodel"))
    p.add_argument("--experiment", choices=("heavy", "prefix", "distributed", "sweep", "bound", "all",
                                                "fig11a", "load", "herd", "chain", "db", "shift", "ablation"), default="all",
                   help="which experiment (default all): fairness heavy|prefix|distributed|sweep|bound, deadlines "
                        "fig11a|load|herd|chain, multimodel db|shift|ablation|sweep")
    p.add_argument("--runs", type=int, default=None, help="Monte Carlo runs (default 20, 3 with --quick; trace: 5 / 1)")
    p.add_argument("--jobs", type=int, default=None, help="jobs per simulation run (default 5000, 1000 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller grids and fewer runs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--out", type=str, default=None, help="directory for PNG plots and JSON results")
    p.add_argument("--servers", type=int, default=None, help="J (overall: default 20; planner-scale: default 1000)")
    p.add_argument("--eta", type=float, default=DEFAULT_ETA, help="fraction of fast servers")
    p.add_argument("--arrival-rate", type=float, default=DEFAULT_LAMBDA, help="lambda for overall (req/s)")
    p.add_argument("--planner-rate", type=float, default=None, help="arrival rate lambda (requests/s) for planner-scale (default 0.01*J)")
    p.add_argument("--trace", type=str, default=None,
                   help="Azure trace CSV for trace, deadlines --experiment load and fairness --experiment heavy "
                        "(default ../shared/data/... or $PETALS_CHAIN_DATA_DIR/..., else synthetic); an option a "
                        "sub-command does not read is refused")
    p.add_argument("--rtt-file", type=str, default=None,
                   help="RIPE Atlas CSV (default ../shared/data/... or $PETALS_CHAIN_DATA_DIR/..., else synthetic)")
    p.add_argument("--requests", type=int, default=1000, help="trace: replay the first N requests (0 = all)")
    p.add_argument("--service-scale", type=float, default=1.0,
                   help="trace: multiply every modelled service time (e.g. to match a measured mean service time)")
    p.add_argument("--petals-cache-tokens", type=int, default=4096,
                   help="PETALS baseline: attention cache per block in tokens (PETALS' default 4096; slots hold 2048)")
    p.add_argument("--bprr-r", type=int, default=7, help="BPRR baseline: CG-BP target concurrency R (default 7 = c)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _given(argv: Sequence[str] | None) -> set[str]:
    """The options on the command line (by ``dest``), defaults aside."""
    probe = build_parser()
    for x in probe._actions:  # (not set_defaults: its parser-level defaults land in the namespace)
        if x.option_strings:
            x.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv))) - {"command"}


def unused_option(command: str, experiment: str, given: set[str]) -> str | None:
    """An error for the first option in ``given`` that ``command`` (``--experiment experiment``) would ignore."""
    cmds = set(REPRODUCE) if command == "reproduce" else {command}
    for dest in sorted(given):
        users = USED_BY.get(dest)
        flag = "--" + dest.replace("_", "-")
        if users is not None and not cmds & set(users):
            return f"{flag} is not used by {command} (only by {', '.join(users)})"
        if dest == "trace" and command in TRACE_EXPERIMENT and experiment not in ("all", TRACE_EXPERIMENT[command]):
            return f"--trace is read only by {command} --experiment {TRACE_EXPERIMENT[command]} (or all)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    unused = unused_option(a.command, a.experiment, _given(argv))
    if unused:
        print(f"error: {unused}", file=sys.stderr)
        return 2
    for name in ("runs", "jobs", "servers", "requests"):
        v = getattr(a, name)
        if v is not None and v < (0 if name == "requests" else 1):
            print(f"error: --{name} must be positive", file=sys.stderr)
            return 2
    if a.seed < 0:  # numpy's seeding said only "expected non-negative integer"
        print("error: --seed must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= a.eta <= 1:
        print("error: --eta must be in [0, 1]", file=sys.stderr)
        return 2
    if not (a.arrival_rate > 0 and math.isfinite(a.arrival_rate)):
        print("error: --arrival-rate must be positive", file=sys.stderr)
        return 2
    if a.bprr_r < 1:
        print("error: --bprr-r must be >= 1", file=sys.stderr)
        return 2
    if a.petals_cache_tokens < 2048:
        print("error: --petals-cache-tokens must be >= 2048 (one full-length session)", file=sys.stderr)
        return 2
    if not (a.service_scale > 0 and math.isfinite(a.service_scale)):
        print("error: --service-scale must be positive", file=sys.stderr)
        return 2
    if a.servers is None:
        a.servers = 1000 if a.command == "planner-scale" else DEFAULT_J
    if a.rtt_file is not None:
        from petals_chain.sim import data as simdata

        try:
            anchors = simdata.get_anchors(a.rtt_file)
        except (OSError, simdata.DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        simdata.set_default_anchors(anchors)
    out = Path(a.out) if a.out else None
    if out:  # before the runs: an --out that is a file or not writable failed with a traceback after them
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"error: --out {a.out}: {e}", file=sys.stderr)
            return 2
        if not os.access(out, os.W_OK | os.X_OK):
            print(f"error: --out {a.out}: not writable", file=sys.stderr)
            return 2
    cmds = list(REPRODUCE) if a.command == "reproduce" else [a.command]
    results = {}
    for cmd in cmds:
        t0 = time.perf_counter()
        try:
            res = json_safe(run_command(cmd, a))
        except (OSError, ValueError) as e:
            print(f"error in {cmd}: {e}", file=sys.stderr)
            return 2
        if cmd != "planner-scale":
            res_meta = {"command": cmd, "seconds": time.perf_counter() - t0, "quick": a.quick, "seed": a.seed}
        else:
            res_meta = {}
        results[cmd] = res
        if out:
            try:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"{cmd}.json").write_text(json.dumps({**res_meta, "result": res}, indent=1))
                if cmd in PLOTS:
                    PLOTS[cmd](res, out)
            except OSError as e:  # removed or filled while the runs went on
                print(f"error writing {cmd}'s results to {a.out}: {e}", file=sys.stderr)
                return 2
        if not a.json:
            show(cmd, res)
            print(f"[{cmd}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    if a.json:
        print(json.dumps(results if a.command == "reproduce" else results[a.command]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

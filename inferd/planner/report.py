"""`inferd plan`: the plan from the parsed command line (its flags: inferd/cli/plan.py), its table and plots."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from ..config import TIERS
from ..engine.tier_shares import TierShares
from .plan import (
    DESCRIBED,
    HOUR,
    FleetRun,
    Target,
    by_hour,
    figures,
    format_seconds,
    hourly_need,
    parse_slo,
    read_traffic,
    run_autoscaler,
    run_fixed,
    run_hourly_minimum,
    tier_targets,
    worker_capacity,
)
from .sim import Req, StepModel, WorkerConfig


class PlanInputError(ValueError):
    """A flag or input file `inferd plan` cannot use (the message names it)."""


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        result, text = make_plan(args)
    except PlanInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.md").write_text(text)
    (out / "plan.json").write_text(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1,
                                              default=str))
    print(text)
    if not result["summary"]:
        print(f"wrote {out / 'plan.md'}, {out / 'plan.json'} (no plots: nothing is served)")
        return 0
    plot(result, out)
    print(f"wrote {out / 'plan.md'}, {out / 'plan.json'}, {out / 'load_and_workers.png'}, {out / 'latency.png'}")
    return 0


def make_plan(args: argparse.Namespace) -> tuple[dict, str]:
    """The plan (plan.json's content, and the simulated runs) and its Markdown, from the parsed command line;
    PlanInputError naming a flag or input that cannot be used."""
    from ..cluster.autoscaler import AutoscalerConfig

    try:
        targets = parse_slo(args.slo)
        traffic = read_traffic(args.traffic)
        model = StepModel.load(args.profile)
        if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1 or args.kv_tokens < 1:
            raise ValueError("--max-num-seqs, --max-num-batched-tokens and --kv-tokens must be >= 1")
        if args.workers is not None and args.workers < 1:
            raise ValueError("--workers must be >= 1")
        try:
            shares = TierShares.parse(args.tier_shares)
        except ValueError as e:
            raise ValueError(f"--tier-shares: {e}") from None
        day_tiers = traffic.tiers()
        per_tier = tier_targets(targets)
        if day_tiers and not any(per_tier[TIERS.index(t)] for t in day_tiers):
            raise ValueError(f"the SLO sets no target for the tiers of the traffic ({', '.join(day_tiers)})")
    except (OSError, ValueError, KeyError) as e:
        raise PlanInputError(str(e)) from None
    config = WorkerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.worker_queue_depth, args.kv_tokens,
                          shares)
    uniform = args.arrivals == "uniform"
    day_reqs = traffic.requests(args.seed, uniform)
    for r in day_reqs:
        r.refused = not r.fits(config.kv_tokens)  # what the simulation marks on arrival
    servable = [r for r in day_reqs if not r.refused]
    if not servable:
        # nothing a worker could serve (no traffic, or every request larger than the KV cache): a plan that says so,
        # with no fleet to simulate and no capacity to measure
        result = {"targets": [str(t) for t in targets], "tier_shares": str(shares), "tiers": day_tiers,
                  "hourly": traffic.hourly(), "need": [0] * 24,
                  "requests": len(day_reqs), **refusals(day_reqs), "summary": [],
                  "worker_capacity": args.worker_capacity, "cost_per_worker_hour": args.cost_per_worker_hour}
        return result, markdown_nothing_to_serve(result, args)
    # the day's mean lengths over the requests a worker can take (each fits the cache, so their mean does)
    mean_prompt = round(sum(r.prompt for r in servable) / len(servable))
    mean_output = min(round(sum(r.output for r in servable) / len(servable)), config.kv_tokens - mean_prompt)
    mix = [sum(r.tier == t for r in servable) / len(servable) for t in range(len(TIERS))]
    try:
        capacity = args.worker_capacity or worker_capacity(model, config, targets, mean_prompt, mean_output,
                                                           args.seed, mix=mix)
    except ValueError as e:  # the SLO sets nothing for the tiers a worker can serve
        raise PlanInputError(str(e)) from None
    try:
        scaler = AutoscalerConfig(worker_capacity=capacity, min_workers=args.min_workers,
                                  max_workers=args.max_workers, target_utilization=args.target_utilization,
                                  scale_down_cooldown_s=args.scale_down_cooldown, warm_schedule=args.warm_schedule,
                                  warm_lead_s=args.warm_lead)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    result = plan(model, config, traffic, targets, args.seed, uniform, scaler, args.worker_start, args.workers)
    result.update(worker_capacity=capacity, cost_per_worker_hour=args.cost_per_worker_hour, tier_shares=str(shares),
                  tiers=day_tiers)
    return result, markdown(result, args)


def plan(model, config, traffic, targets, seed, uniform, scaler, worker_start, workers=None) -> dict:
    need = hourly_need(model, config, traffic, targets, seed, uniform, scaler.max_workers)
    fixed_n = workers or max([n if n is not None else scaler.max_workers for n in need] + [1])
    day = datetime(2026, 1, 1)

    def fresh() -> list[Req]:
        return traffic.requests(seed, uniform)

    runs = [run_fixed(model, config, fresh(), fixed_n),
            run_autoscaler(model, config, fresh(), scaler, worker_start, day)]
    if scaler.warm_schedule:
        runs.append(run_autoscaler(model, config, fresh(), replace(scaler, warm_schedule=[]), worker_start, day,
                                   name="autoscaler, no warm schedule"))
    runs.append(run_hourly_minimum(model, config, fresh(), need, scaler.min_workers, scaler.max_workers))
    hourly = traffic.hourly()
    day = runs[0].requests
    return {"targets": [str(t) for t in targets], "hourly": hourly, "need": need, "fixed_workers": fixed_n,
            "requests": len(day), **refusals(day),
            "summary": [summary(r, targets) for r in runs], "per_hour": {r.name: per_hour(r, targets) for r in runs},
            "ramp": ramp(hourly, runs, targets), "runs": runs}


def refusals(reqs: list[Req]) -> dict:
    """The requests the engine refuses (larger than the KV cache), in all and per hour, and the largest of them."""
    refused = [r for r in reqs if r.refused]
    return {"refused": len(refused), "refused_per_hour": [len(h) for h in by_hour(refused)],
            "largest_refused_tokens": max((r.prompt + r.output for r in refused), default=None)}


def summary(run: FleetRun, targets) -> dict:
    """A fleet's day: hours meeting the SLO, the share within each target and the percentiles, in all and per tier
    (the tier's requests, its hours meeting its own targets, its DESCRIBED percentiles)."""
    hours = [figures(h, targets) for h in by_hour(run.requests) if any(not r.refused for r in h)]
    overall = figures(run.requests, targets, describe=True)
    tiers = overall.pop("tiers")
    for name, f in tiers.items():
        with_traffic = [h["tiers"][name] for h in hours if name in h["tiers"]]
        f["hours_meeting_slo"] = sum(h["met"] for h in with_traffic)
        f["hours_with_traffic"] = len(with_traffic)
    return {"fleet": run.name, "worker_hours": run.worker_hours, "hours_meeting_slo": sum(h["met"] for h in hours),
            "hours_with_traffic": len(hours), **{k: v for k, v in overall.items() if k.startswith("within_")},
            **{k: v for k, v in overall.items() if k not in ("requests", "met") and not k.startswith("within_")},
            "tiers": tiers}


def per_hour(run: FleetRun, targets) -> list[dict]:
    out = []
    for h, reqs in enumerate(by_hour(run.requests)):
        f = figures(reqs, targets)
        out.append({"hour": h, "workers": mean_workers(run.fleet_log, h * HOUR, (h + 1) * HOUR), **f})
    return out


def mean_workers(log: list[tuple[float, int]], start: float, end: float) -> float:
    """The fleet's time-weighted mean size over [start, end): log holds (time, size from then on)."""
    total = 0.0
    for i, (t, n) in enumerate(log):
        until = log[i + 1][0] if i + 1 < len(log) else float("inf")
        total += n * max(0.0, min(until, end) - max(t, start))
    return total / (end - start)


def ramp(hourly, runs: list[FleetRun], targets) -> dict | None:
    """The morning ramp: from the first hour whose token rate exceeds the day's mean back to the last quiet hour
    before it, up to the busiest hour. Each fleet's figures over those hours."""
    rates = [tok for _, _, tok in hourly]
    if not any(rates):
        return None
    mean = sum(rates) / 24
    peak = max(range(24), key=lambda h: rates[h])
    first = next((h for h in range(24) if rates[h] > mean), peak)
    start = max(0, first - 1)
    hours = range(start, max(peak, first) + 1)
    out = {"hours": [hours.start, hours.stop - 1]}
    for r in runs:
        reqs = [q for q in r.requests if int(q.t // HOUR) in hours]
        out[r.name] = figures(reqs, targets)
    return out


def target_value(f: dict, tg: Target) -> float | None:
    """A target's percentile in figures f: its tier's for a tier's own target, else over all tiers."""
    return f["tiers"].get(tg.tier, {}).get(tg.key) if tg.tier else f.get(tg.key)


def tiers_paragraph(result: dict) -> str:
    """The shares the simulation modelled, and the day's tiers."""
    tiers = result["tiers"]
    shares = result["tier_shares"]
    how = "strict priority" if shares == "strict" else f"capacity shares {shares}"
    if len(tiers) > 1:
        return f"Tiers: {', '.join(tiers)}, served with {how} (`--tier-shares`)."
    alone = tiers[0] if tiers else "standard"
    return f"Every request is of tier {alone} (modelled with {how}: one tier alone takes every seat)."


def markdown(result: dict, args) -> str:
    price = result["cost_per_worker_hour"]
    targets = parse_slo(",".join(result["targets"]))
    metrics = list(dict.fromkeys(tg.metric for tg in targets))
    several = len(result["tiers"]) > 1
    lines = [f"# Capacity plan: {Path(args.traffic).name}", "",
             f"SLO: {', '.join(result['targets'])} (an hour meets it when "
             + ("each tier's requests meet that tier's targets: its own and those without a tier). " if several else
                "its requests meet every target). ") + f"{tiers_paragraph(result)} "
             f"Worker model: {Path(args.profile).name}, max_num_seqs {args.max_num_seqs}, "
             f"max_num_batched_tokens {args.max_num_batched_tokens}, KV {args.kv_tokens} tokens. "
             f"Worker capacity for the autoscaler: {result['worker_capacity']:.0f} tokens/s "
             f"({'given' if args.worker_capacity else 'found: what one worker sustains within the SLO'}).", "",
             *refused_paragraph(result, args),
             "## The fleets over the day", "",
             "| fleet | worker-hours | cost | hours meeting the SLO | " +
             " | ".join(f"within {m} target" for m in metrics) + " |",
             "|---|---|---|---|" + "---|" * len(metrics)]
    for s in result["summary"]:
        within = [f"{100 * s.get('within_' + m, 1.0):.1f}%" for m in metrics]
        lines.append(f"| {s['fleet']} | {s['worker_hours']:.1f} | {s['worker_hours'] * price:.2f} | "
                     f"{s['hours_meeting_slo']}/{s['hours_with_traffic']} | " + " | ".join(within) + " |")
    by_name = {s["fleet"]: s for s in result["summary"]}
    fixed = result["summary"][0]
    auto = by_name.get("autoscaler")
    if auto is not None:
        saved = fixed["worker_hours"] - auto["worker_hours"]
        lines += ["", f"The autoscaler uses {abs(saved):.1f} {'fewer' if saved >= 0 else 'more'} worker-hours than "
                  f"the fixed fleet of {result['fixed_workers']} ({abs(saved) * price:.2f} at {price:g} per "
                  f"worker-hour, {abs(100 * saved / fixed['worker_hours']):.0f}% {'less' if saved >= 0 else 'more'})."]
    if several:
        lines += ["", *per_tier_lines(result, targets)]
    r = result["ramp"]
    if r is not None:
        lines += ["", f"## The morning ramp (hours {r['hours'][0]:02d}-{r['hours'][1]:02d})", "",
                  "| fleet | " + " | ".join(result["targets"]) + " | met |",
                  "|---|" + "---|" * (len(result["targets"]) + 1)]
        for name in [s["fleet"] for s in result["summary"]]:
            f = r[name]
            cells = " | ".join(format_seconds(target_value(f, tg)) for tg in targets)
            lines.append(f"| {name} | {cells} | {'yes' if f['met'] else 'no'} |")
    refused = result["refused_per_hour"] if result["refused"] else None
    lines += ["", "## Per hour", "",
              "| hour | req/s | tokens/s | workers needed | " + ("refused | " if refused else "") +
              " | ".join(f"{name}: workers, {result['targets'][0].split('=')[0]}, met"
                         for name in result["per_hour"]) + " |",
              "|---|---|---|---|" + ("---|" if refused else "") + "---|" * len(result["per_hour"])]
    for h, rps, tok in result["hourly"]:
        need = result["need"][h]
        cells = []
        for rows in result["per_hour"].values():
            row = rows[h]
            missed = [name for name, f in row["tiers"].items() if not f["met"]]
            met = "yes" if row["met"] else f"NO ({', '.join(missed)})" if several else "NO"
            cells.append(f"{row['workers']:.1f}, {format_seconds(target_value(row, targets[0]))}, {met}"
                         if row["requests"] else f"{row['workers']:.1f}, -, -")
        lines.append(f"| {h:02d} | {rps:.2f} | {tok:.0f} | {need if need is not None else '>max'} | " +
                     (f"{refused[h]} | " if refused else "") + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def per_tier_lines(result: dict, targets: list[Target]) -> list[str]:
    """Each fleet's day per tier: requests, hours meeting the tier's targets, its percentiles, the share within its
    targets."""
    own = dict(zip(TIERS, tier_targets(targets)))
    lines = ["## Per tier", "", "Each tier's targets: " + "; ".join(
        f"{name}: {', '.join(str(Target(t.metric, t.percentile, t.seconds)) for t in own[name]) or 'none'}"
        for name in result["tiers"]) + ".", "",
             "| fleet | tier | requests | hours meeting its SLO | " + " | ".join(k.replace("_", " ") for k in DESCRIBED)
             + " | within its targets |", "|---|---|---|---|" + "---|" * (len(DESCRIBED) + 1)]
    for s in result["summary"]:
        for name, f in s["tiers"].items():
            within = ", ".join(f"{m} {100 * f['within_' + m]:.1f}%"
                               for m in dict.fromkeys(t.metric for t in own[name])) or "-"
            lines.append(f"| {s['fleet']} | {name} | {f['requests']} | {f['hours_meeting_slo']}/"
                         f"{f['hours_with_traffic']} | " + " | ".join(format_seconds(f[k]) for k in DESCRIBED) +
                         f" | {within} |")
    return lines


def refused_paragraph(result: dict, args) -> list[str]:
    """Lines on the requests no worker can take (none: no lines)."""
    n = result["refused"]
    if not n:
        return []
    return [f"**{n} of the day's {result['requests']} requests ({100 * n / result['requests']:.1f}%) can never run**: "
            f"each one's prompt + output (up to {result['largest_refused_tokens']} tokens) is more than the KV cache "
            f"({args.kv_tokens} tokens), so the engine refuses it (a 400, whatever the fleet). They count in no "
            "latency figure. A larger --kv-tokens (more --kv-cache-bytes, or a larger GPU) serves them.",
            ""]


def markdown_nothing_to_serve(result: dict, args) -> str:
    """The plan of a day in which no worker has anything to serve."""
    why = ("The traffic has no requests" if not result["requests"] else
           f"Every one of the day's {result['requests']} requests is larger than the KV cache")
    floor = args.min_workers
    lines = [f"# Capacity plan: {Path(args.traffic).name}", "",
             f"{why}: no hour needs a worker, and there is no fleet to simulate and no latency to report "
             f"(SLO: {', '.join(result['targets'])}).", "", *refused_paragraph(result, args),
             f"An autoscaler keeps its floor: --min-workers {floor} ({floor * 24} worker-hours, "
             f"{floor * 24 * result['cost_per_worker_hour']:.2f} at {result['cost_per_worker_hour']:g} per worker-hour)"
             + (", and the warm schedule's floors." if args.warm_schedule else ".")]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[FleetRun] = result["runs"]
    hours = [h for h, _, _ in result["hourly"]]
    fig, (load, fleet) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    load.bar([h + 0.5 for h in hours], [tok for _, _, tok in result["hourly"]], width=0.9, color="#9db4e0")
    load.set_ylabel("tokens/s offered")
    load.set_title("Load and workers over the day")
    for r in runs:
        xs, ys = [], []
        for t, n in r.fleet_log:
            xs.append(t / HOUR)
            ys.append(n)
        xs.append(24.0)
        ys.append(ys[-1])
        fleet.step(xs, ys, where="post", label=r.name)
    fleet.plot([h + 0.5 for h in hours], [n if n is not None else float("nan") for n in result["need"]], "k.",
               label="needed (hour alone)")
    fleet.set_ylabel("workers")
    fleet.set_xlabel("hour of day")
    fleet.set_xlim(0, 24)
    fleet.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "load_and_workers.png", dpi=110)
    plt.close(fig)

    targets = result["targets"]
    fig, axes = plt.subplots(len(targets), 1, figsize=(11, 3.2 * len(targets)), sharex=True, squeeze=False)
    for ax, target in zip(axes[:, 0], targets):
        name, limit = target.split("=")
        tg = parse_slo(target)[0]
        metric, p = tg.metric, tg.percentile
        for r in runs:
            bins = [[] for _ in range(96)]
            for q in r.requests:
                if q.refused or (tg.tier is not None and TIERS[q.tier] != tg.tier):
                    continue
                v = getattr(q, metric)
                if v is not None:
                    bins[min(95, int(q.t // 900))].append(v)
            from .plan import percentile

            ax.plot([i / 4 + 0.125 for i in range(96)], [percentile(b, p) if b else float("nan") for b in bins],
                    label=r.name)
        ax.axhline(tg.seconds, color="k", ls="--", lw=0.8, label=f"SLO {limit}")
        ax.set_ylabel(f"{name} (s), per 15 min")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("hour of day")
    axes[-1, 0].set_xlim(0, 24)
    fig.suptitle("Latency over the day")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)

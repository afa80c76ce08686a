"""`agentserve bench tier-grid`: the residency issue's Claude Code grid with KV tiers, in the
simulator: ablations B (LRU), D (LRU + host/disk tiers), E (the agent policy), G (agent + tiers)
at capacities fixed relative to the LRU elbow of one session rate.

The workload is the first N sessions of the even-numbered Claude Code files (the reporting set),
Poisson arrivals at one session rate, one seed. Per cell, each replica's host tier holds
`host_x` times its device pool and its disk `disk_x` times (an H200 node: host DRAM and NVMe are
separate from HBM, so the tiers add memory rather than share it). Reported per cell: recomputed
tokens (eligible from the workload alone, the same for every ablation), tokens served from host
and from disk, session JCT p50 / p99, and the simulator's wall time.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentserve.config import ADMISSIONS

ABLATIONS = (("B", "lru", False), ("D", "lru", True), ("E", "agent", False), ("G", "agent", True))


def run(args) -> int:  # type: ignore[no-untyped-def]
    from agentserve.sim.fleet import SimConfig, simulate
    from agentserve.sim.plan import Arrival, compile_workload, session_starts
    from agentserve.sim.presets import load_cost_model
    from agentserve.workload.claude_code import read_claude_code
    from agentserve.workload.load import take_sessions

    files = sorted(p for p in Path(args.traces).glob("trace_*.json*") if int(p.name[6:10]) % 2 == 0)
    plan = compile_workload(take_sessions(read_claude_code(files), args.sessions), True, 1.0)
    cost = load_cost_model(args.cost_model)
    starts = session_starts(plan, Arrival.POISSON, args.rate, args.seed)
    floor = plan.max_request_tokens + 2
    rows = []
    for mult in (float(m) for m in args.mults.split(",")):
        cap = max(int(mult * args.elbow), floor)
        for name, policy, tiers in ABLATIONS:
            cfg = SimConfig(cap, policy, host_tokens=int(args.host_x * cap) if tiers else 0,
                            disk_tokens=int(args.disk_x * cap) if tiers else 0, admission=args.admission)
            res = simulate(plan, starts, cfg, cost)
            s = res.summary
            row = {"x_elbow": mult, "capacity": cap, "ablation": name, "recomputed": s["recomputed_tokens"],
                   "eligible": s["eligible_tokens"], "from_host": s["reused_host_tokens"],
                   "from_disk": s["reused_disk_tokens"], "jct_p50_s": s["jct_p50_s"], "jct_p99_s": s["jct_p99_s"],
                   "ttft_p99_s": s["ttft_p99_s"], "wall_s": res.wall_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| capacity | x elbow | ablation | recomputed | / B | from host | from disk | JCT p50 s | JCT p99 s | "
             "JCT p99 / B | sim wall s |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["capacity"]: r for r in rows if r["ablation"] == "B"}
    for r in rows:
        b = base.get(r["capacity"])
        rel = r["recomputed"] / b["recomputed"] if b and b["recomputed"] else float("nan")
        jrel = r["jct_p99_s"] / b["jct_p99_s"] if b else float("nan")
        lines.append(f"| {r['capacity'] / 1e6:.1f}M | {r['x_elbow']:.2f} | {r['ablation']} | "
                     f"{r['recomputed'] / 1e6:.2f}M | {rel:.3f}x | {r['from_host'] / 1e6:.2f}M | "
                     f"{r['from_disk'] / 1e6:.2f}M | {r['jct_p50_s']:.0f} | {r['jct_p99_s']:.0f} | {jrel:.3f}x | "
                     f"{r['wall_s']:.0f} |")
    return "\n".join(lines)


def add_args(p) -> None:  # type: ignore[no-untyped-def]
    p.add_argument("--traces", default="../shared/traces/weka-claude-code")
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--rate", type=float, default=1 / 150, help="sessions per second (Poisson)")
    p.add_argument("--elbow", type=float, default=8e6, help="LRU's elbow at that rate (docs/benchmarks.md)")
    p.add_argument("--mults", default="0.5,0.75,1,1.5")
    p.add_argument("--host-x", type=float, default=1.0, help="host tier, times the device pool")
    p.add_argument("--disk-x", type=float, default=8.0, help="disk tier, times the device pool")
    p.add_argument("--cost-model", default="h200-llama3-8b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission", default="auto", choices=list(ADMISSIONS),
                   help="as sim's (auto: protective under the agent order; tables before 2026-12-04: eager)")
    p.add_argument("--out", default=None, help="rows as JSON")

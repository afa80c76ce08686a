"""What a workload looks like: sizes, gaps, and the reuse an infinite prefix cache would get."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from agentserve.workload.model import InputType, Workload


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    sessions: int  # top-level
    agents: int  # sessions and sub-agents
    requests: int
    input_tokens: int
    output_tokens: int
    input_p50: float
    input_p90: float
    output_p50: float
    appended_p50: float  # prompt growth over the previous turn
    tool_gap_p50_s: float  # think time before a tool-result turn
    tool_gap_p90_s: float
    tool_gap_p99_s: float
    human_gap_p50_s: float  # before a text (human) turn after the first
    ideal_reuse: float  # prompt tokens in blocks seen earlier in the namespace / all prompt tokens
    skipped: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def describe(w: Workload) -> WorkloadStats:
    ins, outs, appended, tool_gaps, human_gaps = [], [], [], [], []
    agents = 0
    for s in w.all_sessions():
        agents += 1
        prev = None
        for t in s.turns:
            ins.append(t.prompt_tokens)
            outs.append(t.output_tokens)
            if prev is not None:
                appended.append(t.prompt_tokens - prev)
                if t.input_type is InputType.TOOL_RESULT:
                    tool_gaps.append(t.think_s)
                elif t.input_type is InputType.TEXT:
                    human_gaps.append(t.think_s)
            prev = t.prompt_tokens
    return WorkloadStats(
        len(w.sessions), agents, len(ins), sum(ins), sum(outs), quantile(ins, 0.5), quantile(ins, 0.9),
        quantile(outs, 0.5), quantile(appended, 0.5), quantile(tool_gaps, 0.5), quantile(tool_gaps, 0.9),
        quantile(tool_gaps, 0.99), quantile(human_gaps, 0.5), ideal_reuse(w), len(w.skipped))


def ideal_reuse(w: Workload) -> float:
    """Fraction of prompt tokens in full blocks whose (namespace, id) appeared in an earlier
    prompt, taking turns in trace order (start + offset); as the trace README measures it."""
    turns = []
    for i, top in enumerate(w.sessions):
        for s in top.walk():
            base = top.start_s or 0.0
            for t, hashes in zip(s.turns, s.block_hashes()):
                turns.append((base + t.offset_s, i, s.namespace, t.prompt_tokens, hashes))
    turns.sort(key=lambda x: (x[0], x[1]))
    seen: dict[int, set[int]] = {}
    hit = total = 0
    for _, _, ns, n, hashes in turns:
        known = seen.setdefault(ns, set())
        k = 0
        while k < len(hashes) and hashes[k] in known:
            k += 1
        hit += k * w.block_size
        total += n
        known.update(hashes[k:])
    return hit / total if total else 0.0

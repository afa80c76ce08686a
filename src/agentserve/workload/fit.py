"""Fit the synthetic generator's distributions to a trace (`agentserve sim --fit TRACE`)."""

from __future__ import annotations

from dataclasses import replace

from agentserve.workload.model import InputType, Workload
from agentserve.workload.synthetic import LogNormal, SyntheticConfig, ToolClass

# tool-gap bands (s) standing in for tool classes: the traces name no tools
BANDS: tuple[tuple[str, float, float], ...] = (("fast", 0.0, 20.0), ("medium", 20.0, 120.0),
                                               ("slow", 120.0, float("inf")))


def fit_synthetic(w: Workload) -> SyntheticConfig:
    tops = list(w.sessions)
    subs = [s for top in tops for s in top.walk() if s is not top]
    appended, outputs, tool_gaps, human_gaps = [], [], [], []
    n_turns = fanouts = 0
    for s in w.all_sessions():
        for j, t in enumerate(s.turns):
            n_turns += 1
            fanouts += bool(t.subagents)
            outputs.append(float(t.output_tokens))
            if j == 0:
                continue
            prev = s.turns[j - 1]
            appended.append(float(t.prompt_tokens - prev.prompt_tokens - prev.output_tokens))
            gaps = tool_gaps if t.input_type is InputType.TOOL_RESULT else human_gaps
            if t.tool_class is None:
                gaps.append(t.think_s)
    classes = []
    for name, lo, hi in BANDS:
        band = [g for g in tool_gaps if lo < g <= hi or (lo == 0 and g == 0)]
        classes.append(ToolClass(name, len(band) / max(1, len(tool_gaps)), LogNormal.fit(band)))
    total = sum(c.weight for c in classes) or 1.0
    classes = [replace(c, weight=c.weight / total) for c in classes]
    return SyntheticConfig(
        num_sessions=len(tops), block_size=w.block_size,
        turns=LogNormal.fit([float(len(s.turns)) for s in tops]),
        first_prompt=LogNormal.fit([float(s.turns[0].prompt_tokens) for s in tops]),
        appended=LogNormal.fit(appended), output=LogNormal.fit(outputs),
        human_turn_share=len(human_gaps) / max(1, len(human_gaps) + len(tool_gaps)),
        human_gap=LogNormal.fit(human_gaps), tool_classes=tuple(classes),
        subagent_share=fanouts / max(1, n_turns),
        fanout_mean=len(subs) / max(1, fanouts),
        subagent_turns=LogNormal.fit([float(len(s.turns)) for s in subs]) if subs else LogNormal(10, 0.6),
        subagent_first_prompt=LogNormal.fit([float(s.turns[0].prompt_tokens) for s in subs]) if subs
        else LogNormal(9500, 0.3))

"""Prefix-stability analysis of agent transcripts with a model's real chat template
(`agentserve analyze`; docs/analyze.md). Needs a tokenizer and a template only, never weights
or torch.

Data flows one way:
  transcript (parse, check)  →  render (template → text → token ids)
  →  analysis (per request: reusable, hybrid, break)  ←  breaks / causes / spans / volatile
  →  sharing (first requests of two sessions)  →  report (totals, advice, JSON)  →  table / html
"""

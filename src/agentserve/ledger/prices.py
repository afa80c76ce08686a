"""Price tables: what a token, an accelerator-second and a token-second of held KV cost.

A table is versioned YAML (`version: 1`). Token prices are per million tokens, split the way
providers bill cached prompts: fresh input, cached input (usually at a discount), output. A
self-hosted table prices accelerator time instead (per hour, charged on each attempt's share of
the engine's step time) and may price KV held while a trajectory is paused (per million
token-hours, per tier), so a task's cost includes the memory its residency kept. Presets mirror
common price shapes; their numbers are illustrative, not any provider's list price: copy one
with `agentserve report --prices-template` and set your own.

    version: 1
    name: my-prices
    currency: USD
    tokens: {fresh_input: 3.0, cached_input: 0.3, output: 15.0}   # per million tokens
    accelerator: {per_hour: 0.0}                                   # optional
    kv_held: {device: 0.0, host: 0.0, disk: 0.0}                   # per million token-hours
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentserve.ledger.rows import TIERS

VERSION = 1


class PriceError(ValueError):
    """A price table that cannot be used; the message names the file and field."""


@dataclass(frozen=True, slots=True)
class PriceTable:
    name: str
    currency: str = "USD"
    fresh_input: float = 0.0  # per million tokens
    cached_input: float = 0.0
    output: float = 0.0
    accelerator_per_hour: float = 0.0
    kv_held: dict[str, float] = field(default_factory=dict)  # tier -> per million token-hours
    version: int = VERSION

    def as_yaml(self) -> str:
        return yaml.safe_dump({
            "version": self.version, "name": self.name, "currency": self.currency,
            "tokens": {"fresh_input": self.fresh_input, "cached_input": self.cached_input,
                       "output": self.output},
            "accelerator": {"per_hour": self.accelerator_per_hour},
            "kv_held": {t: self.kv_held.get(t, 0.0) for t in TIERS}}, sort_keys=False)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "currency": self.currency, "version": self.version,
                "fresh_input_per_mtok": self.fresh_input, "cached_input_per_mtok": self.cached_input,
                "output_per_mtok": self.output, "accelerator_per_hour": self.accelerator_per_hour,
                "kv_held_per_mtok_hour": {t: self.kv_held.get(t, 0.0) for t in TIERS}}


PRESETS: dict[str, PriceTable] = {
    # a provider shape: cached input billed at half the fresh price
    "cached-half": PriceTable("cached-half", fresh_input=2.50, cached_input=1.25, output=10.00),
    # a provider shape: cached input at a tenth of the fresh price
    "cached-tenth": PriceTable("cached-tenth", fresh_input=1.25, cached_input=0.125, output=10.00),
    # a provider shape: writing the cache costs a premium (1.25x), reading it a tenth; every
    # fresh token here is written to the cache, so fresh input carries the premium
    "cache-write-premium": PriceTable("cache-write-premium", fresh_input=3.75, cached_input=0.30,
                                      output=15.00),
    # self-hosted: accelerator time, and KV held for paused trajectories by tier
    "self-hosted": PriceTable("self-hosted", accelerator_per_hour=2.00,
                              kv_held={"device": 0.50, "host": 0.05, "disk": 0.005}),
}
DEFAULT = "cached-tenth"


def load_prices(spec: str | Path | None) -> PriceTable:
    """A preset by name, or a YAML file; None gives the default preset."""
    if spec is None:
        return PRESETS[DEFAULT]
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]
    path = Path(spec)
    if not path.exists():
        raise PriceError(f"price table {str(spec)!r}: no such file and no such preset "
                         f"(presets: {', '.join(PRESETS)})")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise PriceError(f"{path}: not valid YAML: {exc}") from None
    return parse_prices(doc, str(path))


def parse_prices(doc: Any, where: str = "price table") -> PriceTable:
    if not isinstance(doc, dict):
        raise PriceError(f"{where}: expected a mapping with version, name, tokens, ... "
                         f"(got {type(doc).__name__})")
    version = doc.get("version")
    if isinstance(version, bool) or version != VERSION:  # True == 1 in Python
        raise PriceError(f"{where}: field 'version' must be {VERSION} (got {version!r})")
    unknown = set(doc) - {"version", "name", "currency", "tokens", "accelerator", "kv_held"}
    if unknown:
        raise PriceError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    name = doc.get("name", Path(where).stem)
    currency = doc.get("currency", "USD")
    if not isinstance(name, str) or not isinstance(currency, str):
        raise PriceError(f"{where}: fields 'name' and 'currency' must be strings")
    tokens = _section(doc, "tokens", ("fresh_input", "cached_input", "output"), where, required=True)
    acc = _section(doc, "accelerator", ("per_hour",), where, required=False)
    kv = _section(doc, "kv_held", TIERS, where, required=False)
    if not any(tokens.values()) and not acc.get("per_hour"):
        raise PriceError(f"{where}: every token price and the accelerator price are 0: nothing would cost anything")
    return PriceTable(name, currency, tokens["fresh_input"], tokens["cached_input"], tokens["output"],
                      acc.get("per_hour", 0.0), kv)


def _section(doc: dict[str, Any], key: str, names: tuple[str, ...], where: str, required: bool
             ) -> dict[str, float]:
    sec = doc.get(key)
    if sec is None:
        if required:
            raise PriceError(f"{where}: field {key!r} is missing (it needs {', '.join(names)})")
        return {}
    if not isinstance(sec, dict):
        raise PriceError(f"{where}: field {key!r} must be a mapping of {', '.join(names)}")
    unknown = set(sec) - set(names)
    if unknown:
        raise PriceError(f"{where}: unknown field(s) {', '.join(f'{key}.{u}' for u in sorted(map(str, unknown)))}"
                         f" (expected {', '.join(names)})")
    out: dict[str, float] = {}
    for n in names:
        if n not in sec:
            if required:
                raise PriceError(f"{where}: field '{key}.{n}' is missing")
            continue
        v = sec[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PriceError(f"{where}: field '{key}.{n}' must be a number (got {v!r})")
        if v < 0:
            raise PriceError(f"{where}: field '{key}.{n}' must be >= 0 (got {v})")
        out[n] = float(v)
    return out

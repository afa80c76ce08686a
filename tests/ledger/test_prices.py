"""Price tables: every preset loads and round-trips through its YAML template; a table with a
missing, negative or non-numeric price, an unknown field, the wrong version or text that is not
YAML is a PriceError naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentserve.ledger.prices import (
    DEFAULT,
    PRESETS,
    PriceError,
    PriceTable,
    load_prices,
    parse_prices,
)

GOOD = """\
version: 1
name: mine
currency: EUR
tokens: {fresh_input: 3.0, cached_input: 0.3, output: 15}
accelerator: {per_hour: 1.5}
kv_held: {device: 0.5, host: 0.05}
"""


def table(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "prices.yaml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_loads_and_its_template_reads_back(name: str) -> None:
    t = load_prices(name)
    assert t is PRESETS[name] and t.name == name and t.version == 1
    back = parse_prices(yaml.safe_load(t.as_yaml()), f"{name}.yaml")
    assert back.as_dict() == t.as_dict()


def test_preset_numbers() -> None:
    assert load_prices(None) is PRESETS[DEFAULT] is PRESETS["cached-tenth"]
    tenth = PRESETS["cached-tenth"]
    assert (tenth.fresh_input, tenth.cached_input, tenth.output) == (1.25, 0.125, 10.0)
    hosted = PRESETS["self-hosted"]
    assert (hosted.fresh_input, hosted.cached_input, hosted.output) == (0.0, 0.0, 0.0)
    assert hosted.accelerator_per_hour == 2.0
    assert hosted.kv_held == {"device": 0.5, "host": 0.05, "disk": 0.005}


def test_a_good_file(tmp_path: Path) -> None:
    t = load_prices(table(tmp_path, GOOD))
    assert t == PriceTable("mine", "EUR", 3.0, 0.3, 15.0, 1.5, {"device": 0.5, "host": 0.05})
    assert isinstance(t.output, float)


def test_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    text = "version: 1\ntokens: {fresh_input: 1, cached_input: 0, output: 2}\n"
    t = load_prices(table(tmp_path, text))
    assert (t.name, t.currency, t.accelerator_per_hour, t.kv_held) == ("prices", "USD", 0.0, {})


@pytest.mark.parametrize(("text", "field"), [
    (GOOD.replace(", output: 15", ""), "'tokens.output' is missing"),
    (GOOD.replace("tokens: {fresh_input: 3.0, cached_input: 0.3, output: 15}\n", ""),
     "'tokens' is missing"),
    (GOOD.replace("fresh_input: 3.0", "fresh_input: -3.0"), "'tokens.fresh_input' must be >= 0"),
    (GOOD.replace("per_hour: 1.5", "per_hour: -1"), "'accelerator.per_hour' must be >= 0"),
    (GOOD.replace("cached_input: 0.3", "cached_input: abc"), "'tokens.cached_input' must be a number"),
    (GOOD.replace("cached_input: 0.3", "cached_input: '0.3'"),
     "'tokens.cached_input' must be a number"),
    (GOOD.replace("output: 15", "output: true"), "'tokens.output' must be a number"),
    (GOOD.replace("output: 15", "output: .nan"), "'tokens.output' must be a number"),
    (GOOD.replace("output: 15", "output: .inf"), "'tokens.output' must be a number"),
    (GOOD.replace("output: 15", "output: null"), "'tokens.output' must be a number"),
    (GOOD.replace("device: 0.5", "device: [0.5]"), "'kv_held.device' must be a number"),
    (GOOD.replace("host: 0.05", "gpu: 0.05"), "unknown field(s) kv_held.gpu"),
    (GOOD.replace("output: 15", "output: 15, cache_write: 4"), "unknown field(s) tokens.cache_write"),
    (GOOD + "discount: 0.1\n", "unknown field(s) discount"),
    (GOOD + "7: seven\n", "unknown field(s) 7"),
    (GOOD.replace("tokens: {fresh_input: 3.0, cached_input: 0.3, output: 15}", "tokens: 3"),
     "field 'tokens' must be a mapping"),
    (GOOD.replace("version: 1", "version: 2"), "field 'version' must be 1 (got 2)"),
    (GOOD.replace("version: 1", "version: true"), "field 'version' must be 1 (got True)"),
    (GOOD.replace("version: 1\n", ""), "field 'version' must be 1 (got None)"),
    (GOOD.replace("name: mine", "name: 5"), "'name' and 'currency' must be strings"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("", "expected a mapping"),
    ("version: 1\ntokens: {fresh_input: 0, cached_input: 0, output: 0}\n", "every token price"),
])
def test_bad_table_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    p = table(tmp_path, text)
    with pytest.raises(PriceError) as exc:
        load_prices(p)
    assert str(exc.value).startswith(f"{p}: ")
    assert field in str(exc.value)


def test_not_yaml(tmp_path: Path) -> None:
    p = table(tmp_path, "tokens: {fresh_input: 3.0\nversion: [1\n")
    with pytest.raises(PriceError, match="not valid YAML"):
        load_prices(p)
    raw = tmp_path / "binary.yaml"
    raw.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PriceError, match="not valid YAML"):
        load_prices(raw)


def test_no_such_file_or_preset_lists_the_presets(tmp_path: Path) -> None:
    with pytest.raises(PriceError) as exc:
        load_prices(str(tmp_path / "missing.yaml"))
    assert "no such file and no such preset" in str(exc.value)
    for name in PRESETS:
        assert name in str(exc.value)

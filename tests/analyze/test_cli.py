"""`agentserve analyze` end to end: table, JSON, HTML, --compare, --template-kwargs, and bad
input reported with its place and a non-zero exit after reporting what could be analyzed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentserve.cli import main
from tests.analyze.scenarios import TOOLS, USER, base_messages, system, three_requests

ROW_KEYS = {
    "session",
    "request",
    "where",
    "prompt_tokens",
    "reusable_tokens",
    "prefill_tokens",
    "generated_tokens",
    "hybrid_reusable_tokens",
    "hybrid_prefill_tokens",
    "break",
}
BREAK_KEYS = {
    "position",
    "message_index",
    "role",
    "cause",
    "detail",
    "old",
    "new",
    "recoverable_tokens",
}


def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def drifting(tmp_path: Path) -> Path:
    """Three requests; the third has a new timestamp in its system prompt."""
    requests = three_requests(base_messages(), third_system=system("10:00:42"))
    return _write_jsonl(tmp_path / "drifting.jsonl", requests)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["analyze", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_json_rows_totals_and_advice(
    drifting: Path, qwen3_style_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _run(capsys, str(drifting), "--tokenizer", str(qwen3_style_dir), "--json")
    assert (status, err) == (0, "")
    report = json.loads(out)
    rows = report["rows"]
    assert [set(r) for r in rows] == [ROW_KEYS] * 3
    assert [r["break"] is None for r in rows] == [True, True, False]
    assert set(rows[2]["break"]) == BREAK_KEYS
    assert rows[2]["break"]["cause"] == "volatile_text"
    totals = report["totals"]
    assert (
        totals["prompt_tokens"]
        == totals["no_cache_prefill_tokens"]
        == sum(r["prompt_tokens"] for r in rows)
    )
    assert totals["prefill_tokens"] == sum(r["prefill_tokens"] for r in rows)
    assert totals["hybrid_prefill_tokens"] == sum(r["hybrid_prefill_tokens"] for r in rows)
    (advice,) = report["advice"]
    assert advice["cause"] == "volatile_text"
    assert advice["tokens_saved"] == rows[2]["break"]["recoverable_tokens"] > 0


def test_table_and_html(
    drifting: Path, qwen3_style_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    status, out, _ = _run(
        capsys, str(drifting), "--tokenizer", str(qwen3_style_dir), "--html", str(page)
    )
    assert status == 0
    for words in (
        "volatile_text",
        "timestamp '10:00:00' → '10:00:42'",
        "Totals",
        "prefilled by a hybrid model",
        "Advice",
        "Volatile content last",
    ):
        assert words in out
    html = page.read_text()
    assert html.count("class='bar'") == 6  # prefix cache and hybrid bar per request
    assert "<script" not in html and "http" not in html
    assert "<|" not in html and "timestamp &#x27;10:00:00&#x27;" in html  # text is escaped


def test_bundled_model_by_name(
    drifting: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, str(drifting), "--model", "smollm2-135m", "--json")
    assert status == 0
    assert json.loads(out)["rows"][2]["break"]["cause"] == "volatile_text"


def test_compare_two_sessions(
    tmp_path: Path, qwen3_style_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def session(time: str, task: str) -> dict[str, object]:
        return {"tools": TOOLS, "messages": [system(time), {"role": "user", "content": task}]}

    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(session("10:00:00", "Fix the test.")))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(session("09:30:00", "Write docs.")))
    status, out, _ = _run(
        capsys, str(ours), "--tokenizer", str(qwen3_style_dir), "--json", "--compare", str(other)
    )
    (sharing,) = json.loads(out)["sharing"]
    assert status == 0
    assert 0 < sharing["shared_tokens"] < sharing["shared_tokens_volatile_last"]


def test_template_kwargs_reach_the_template(
    drifting: Path, qwen3_style_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def first_prompt(*extra: str) -> int:
        _, out, _ = _run(
            capsys, str(drifting), "--tokenizer", str(qwen3_style_dir), "--json", *extra
        )
        return json.loads(out)["rows"][0]["prompt_tokens"]

    assert first_prompt("--template-kwargs", '{"enable_thinking": false}') > first_prompt()
    status, _, err = _run(
        capsys, str(drifting), "--tokenizer", str(qwen3_style_dir), "--template-kwargs", "{oops"
    )
    assert status == 1 and "--template-kwargs" in err


def test_malformed_line_reports_the_line_and_the_requests_before(
    drifting: Path, qwen3_style_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    drifting.write_text(drifting.read_text() + '{"messages": [}\n')
    status, out, err = _run(capsys, str(drifting), "--tokenizer", str(qwen3_style_dir), "--json")
    assert status == 1
    assert f"{drifting}:4:" in err and "malformed JSON" in err
    assert len(json.loads(out)["rows"]) == 3


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"role": "narrator", "content": "..."}, "unknown role 'narrator'"),
        (
            {"role": "tool", "content": "orphan"},
            "tool result with no preceding assistant tool call",
        ),
    ],
)
def test_bad_messages_are_named_with_their_line(
    tmp_path: Path,
    qwen3_style_dir: Path,
    capsys: pytest.CaptureFixture[str],
    bad: dict[str, str],
    words: str,
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [USER]}, {"messages": [USER, bad]}])
    status, out, err = _run(capsys, str(path), "--tokenizer", str(qwen3_style_dir), "--json")
    assert status == 1
    assert f"{path}:2: message 1" in err and words in err
    assert len(json.loads(out)["rows"]) == 1


def test_tokenizer_without_chat_template(
    drifting: Path, no_template_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _run(capsys, str(drifting), "--tokenizer", str(no_template_dir))
    assert status == 1 and out == ""
    assert str(no_template_dir) in err and "no chat template" in err


def test_template_that_raises_reports_the_request(
    drifting: Path, raising_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _run(capsys, str(drifting), "--tokenizer", str(raising_dir), "--json")
    assert status == 1
    assert f"{drifting}:2, request 2: chat template raised" in err
    assert "tool messages are not supported" in err
    assert len(json.loads(out)["rows"]) == 1  # the first request renders; then it stops


def test_unreadable_session_prints_only_the_problem(
    tmp_path: Path, qwen3_style_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "messages": [\n    {"role": "user", "content": "hi"},\n  ]\n}\n')
    status, out, err = _run(capsys, str(path), "--tokenizer", str(qwen3_style_dir))
    assert (status, out) == (1, "")
    assert f"{path}:4:3: malformed JSON" in err

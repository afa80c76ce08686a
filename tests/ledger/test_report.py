"""`agentserve report`: the page's embedded numbers are `summarize()`'s, bad input is reported
(skipped lines, unknown prices, empty ledgers), strings from the ledger stay inert, and several
ledgers are compared side by side. The browser and scale tests are in test_report_browser.py;
both use `make_row` and `synthetic_ledger` from here."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from agentserve.cli import main
from agentserve.ledger.cost import summarize
from agentserve.ledger.html import ROW_COLUMNS, TRAJ_COLUMNS, embed_json
from agentserve.ledger.prices import PRESETS, load_prices
from agentserve.ledger.rows import Decision, Miss, Outcome, Row

XSS = "</script><img src=x onerror=alert(1)>"


def make_row(trajectory_id: str | None = "t1", turn: int = 1, attempt: int = 1, *,
             prompt: int = 1000, device: int = 0, host: int = 0, disk: int = 0,
             generated: int = 50, recomputed: int = 0, eligible: int = 0, arrival_s: float = 0.0,
             e2e_s: float = 1.0, parent: str | None = None, session: str | None = "s1",
             tenant: str = "", miss: Miss | None = None, request_id: str | None = None,
             finish_reason: str = "stop", decision: Decision | None = None,
             error: str | None = None) -> Row:
    """A row with the fields a test cares about; times and the rest filled consistently."""
    return Row(request_id=request_id or f"req-{trajectory_id}-{turn}-{attempt}",
               trajectory_id=trajectory_id, session_id=session, parent_trajectory_id=parent,
               tenant=tenant, turn=turn, attempt=attempt, route="sim", arrival_s=arrival_s,
               queue_s=0.0, prefill_s=e2e_s / 4, decode_s=e2e_s / 2, ttft_s=e2e_s / 2,
               e2e_s=e2e_s, busy_s=e2e_s / 2, prompt_tokens=prompt, reused_device=device,
               reused_host=host, reused_disk=disk, generated_tokens=generated,
               recomputed_tokens=recomputed, preemptions=int(recomputed > 0),
               eligible_tokens=eligible, finish_reason=finish_reason, error=error,
               decision=decision, miss=miss)


def write_ledger(path: Path, records: Iterable[Row | Outcome], extra_lines: Iterable[str] = ()
                 ) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.as_dict()) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


_MISSES = [
    Miss("cold", 0, 0),
    Miss("evicted", 3, 48, cause="capacity", policy="lru", evicted_s=1.0),
    Miss("evicted", 2, 32, cause="preemption"),
    Miss("diverged", 5, 83, message_index=4, role="tool", old="ls -la", new="ls -l"),
    Miss("identity", 0, 0),
    Miss("partial_block", 9, 144),
]


def synthetic_ledger(num_trajectories: int, turns: int, seed: int = 0,
                     prefix: str = "traj") -> list[Row | Outcome]:
    """Trajectories of growing prompts (every 10th a sub-agent of the one before), each turn's
    prompt mostly reused from device, host or disk, a miss on most, retries now and then, and
    an outcome for every top-level trajectory. Deterministic for a seed."""
    rng = random.Random(seed)
    out: list[Row | Outcome] = []
    for n in range(num_trajectories):
        tid = f"{prefix}-{n:05d}"
        parent = f"{prefix}-{n - 1:05d}" if n % 10 == 9 else None
        start = rng.uniform(0, 3600)
        prompt, t = rng.randint(500, 4000), start
        for turn in range(1, turns + 1):
            attempts = 2 if rng.random() < 0.02 else 1
            for attempt in range(1, attempts + 1):
                reused = 0 if turn == 1 else int(prompt * rng.uniform(0.5, 0.99))
                dev = int(reused * rng.uniform(0.5, 1.0))
                host = int((reused - dev) * rng.uniform(0, 1))
                miss = None if rng.random() < 0.2 else rng.choice(_MISSES)
                out.append(make_row(tid, turn, attempt, prompt=prompt, device=dev, host=host,
                                    disk=reused - dev - host, generated=rng.randint(10, 400),
                                    recomputed=rng.choice((0, 0, 0, 64)), eligible=reused,
                                    arrival_s=t, e2e_s=rng.uniform(0.2, 5.0), parent=parent,
                                    session=f"sess-{n // 3}", miss=miss))
                t += rng.uniform(1, 30)
            prompt += rng.randint(100, 3000)
        if parent is None:
            out.append(Outcome(tid, "", rng.random() < 0.7, t))
    return out


def report(tmp_path: Path, ledgers: list[Path], *extra: str, out: str = "out") -> int:
    return main(["report", *map(str, ledgers), "--out", str(tmp_path / out), *extra])


def page_data(index: Path) -> dict:
    text = index.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S)
    assert m is not None
    return json.loads(m[1])


def test_embedded_summary_is_summarize(tmp_path: Path) -> None:
    records = synthetic_ledger(12, 4, seed=1)
    path = write_ledger(tmp_path / "run.jsonl", records)
    assert report(tmp_path, [path], "--prices", "cached-half") == 0
    data = page_data(tmp_path / "out" / "index.html")
    rows = [r for r in records if isinstance(r, Row)]
    outcomes = [r for r in records if isinstance(r, Outcome)]
    summary = summarize(rows, outcomes, load_prices("cached-half"))
    (run,) = data["runs"]
    assert run["summary"] == json.loads(json.dumps(summary.as_dict()))
    assert run["rows"] == len(rows) and run["label"] == "run.jsonl"
    assert data["currency"] == "USD" and data["prices"]["name"] == "cached-half"
    assert summary.successes + summary.failures == 11  # 12 trajectories, one a sub-agent
    # per trajectory: the columns carry each summary's own and with-sub-agents totals
    traj = data["traj"]
    assert set(traj) == set(TRAJ_COLUMNS) and set(data["rows"]) == set(ROW_COLUMNS)
    assert len(traj["id"]) == len(summary.trajectories)
    for i, t in enumerate(summary.trajectories.values()):
        assert traj["id"][i] == t.id and traj["rows"][i] == len(t.rows)
        assert traj["prompt"][i] == t.own.prompt and traj["fresh"][i] == t.own.fresh
        assert traj["device"][i] == t.own.reused["device"]
        assert traj["all_cost"][i] == pytest.approx(t.with_children.cost)
        assert traj["outcome"][i] == t.outcome
        parent = traj["parent"][i]
        assert (parent is None) == (t.parent is None)
        if parent is not None:
            assert traj["id"][parent] == t.parent[1]
        # a trajectory's attempts are its contiguous rows, in arrival order
        r0 = traj["row0"][i]
        got = data["rows"]["request_id"][r0:r0 + len(t.rows)]
        assert got == [r.request_id for r in t.rows]
    jcts = [t.jct_s for t in summary.roots]
    assert run["jct_p50_s"] == pytest.approx(float(np.percentile(jcts, 50)))
    assert run["jct_p99_s"] == pytest.approx(float(np.percentile(jcts, 99)))
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["runs"] == data["runs"]


def test_row_cost_is_embedded(tmp_path: Path) -> None:
    """Each row's `cost` is row_cost(row, the run's prices).total, worked out here by hand from
    the presets' per-million prices: U fresh, H cached and O output tokens, and (self-hosted)
    the attempt's busy_s, which make_row sets to e2e_s / 2, at the accelerator's hourly price."""
    rows = [make_row("a", 1, prompt=1000, generated=50),  # U 1000, H 0
            make_row("a", 2, arrival_s=5, prompt=2000, device=1200, host=300, disk=100,
                     generated=400, e2e_s=3.6),  # U 400, H 1600
            make_row("b", 1, arrival_s=2, prompt=800, host=800, generated=0, e2e_s=0.0),  # H 800
            make_row("b", 1, 2, arrival_s=3, prompt=800, device=200, generated=7, recomputed=64,
                     e2e_s=7.2)]  # U 600, H 200; recomputed tokens are not billed as input
    path = write_ledger(tmp_path / "run.jsonl", rows)
    tokens = [(1000, 0, 50), (400, 1600, 400), (0, 800, 0), (600, 200, 7)]  # (U, H, O)
    busy_s = [0.5, 1.8, 0.0, 3.6]
    half = PRESETS["cached-half"]
    assert (half.fresh_input, half.cached_input, half.output) == (2.50, 1.25, 10.00)
    hosted = PRESETS["self-hosted"]
    assert (hosted.fresh_input, hosted.cached_input, hosted.output) == (0.0, 0.0, 0.0)
    assert hosted.accelerator_per_hour == 2.00
    expected = {
        "cached-half": [(u * 2.50 + h * 1.25 + o * 10.00) / 1e6 for u, h, o in tokens],
        "self-hosted": [b / 3600 * 2.00 for b in busy_s]}
    assert expected["cached-half"][1] == pytest.approx(0.001 + 0.002 + 0.004)
    for preset, costs in expected.items():
        assert report(tmp_path, [path], "--prices", preset, out=preset) == 0
        data = page_data(tmp_path / preset / "index.html")
        assert data["prices"]["name"] == preset
        r, traj = data["rows"], data["traj"]
        assert len(r["cost"]) == len(rows)
        got = dict(zip(r["request_id"], r["cost"], strict=True))  # the page orders by trajectory
        assert [got[row.request_id] for row in rows] == pytest.approx(costs, rel=1e-6, abs=1e-9)
        for i in range(len(traj["id"])):  # a trajectory's own cost is the sum of its rows'
            r0, n = traj["row0"][i], traj["rows"][i]
            assert sum(r["cost"][r0:r0 + n]) == pytest.approx(traj["cost"][i], abs=1e-8)


def test_writes_plots_and_top_waterfalls(tmp_path: Path) -> None:
    path = write_ledger(tmp_path / "run.jsonl", synthetic_ledger(8, 3))
    out = tmp_path / "out"
    out.mkdir()
    (out / "waterfall-9.png").write_bytes(b"stale")
    assert report(tmp_path, [path], "--waterfalls", "3") == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["index.html", "misses.png", "reuse-over-time.png", "reuse.png",
                     "summary.json", "waterfall-1.png", "waterfall-2.png", "waterfall-3.png"]
    for name in names:
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = page_data(out / "index.html")
    traj = data["traj"]
    tokens = [traj["prompt"][i] + traj["generated"][i] for i in range(len(traj["id"]))]
    top = sorted(range(len(tokens)), key=lambda i: -tokens[i])[:3]
    assert [w["traj"] for w in data["waterfalls"]] == top
    assert all(data["images"][k].startswith("data:image/png;base64,")
               for k in ("reuse", "reuse_over_time", "misses"))


def test_miss_fields_reach_the_page(tmp_path: Path) -> None:
    rows = [make_row("a", 1, miss=Miss("cold", 0, 0)),
            make_row("a", 2, arrival_s=5, device=600,
                     miss=Miss("evicted", 4, 64, cause="capacity")),
            make_row("a", 3, arrival_s=9, host=700, miss=Miss("diverged", 5, 83, message_index=4,
                                                              role="tool", old="x<y", new="x>y"))]
    path = write_ledger(tmp_path / "run.jsonl", rows)
    assert report(tmp_path, [path]) == 0
    data = page_data(tmp_path / "out" / "index.html")
    s, r = data["strings"], data["rows"]
    assert [s[k] for k in r["miss"]] == ["cold", "evicted", "diverged"]
    assert s[r["cause"][1]] == "capacity" and r["cause"][0] is None
    assert r["token"][2] == 83 and r["message"][2] == 4 and r["exact"][2] == 1
    assert data["text"]["2"] == {"old": "x<y", "new": "x>y"}
    assert data["runs"][0]["summary"]["misses"] == {"cold": 1, "evicted:capacity": 1, "diverged": 1}


def test_bad_lines_are_reported_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    path = write_ledger(tmp_path / "run.jsonl", [make_row("a"), make_row("b")],
                        ["not json", json.dumps({"v": 1, "kind": "attempt"})])
    assert report(tmp_path, [path]) == 0
    err = capsys.readouterr().err
    assert f"{path}:3: not JSON" in err and f"{path}:4: field" in err
    data = page_data(tmp_path / "out" / "index.html")
    (run,) = data["runs"]
    assert run["num_problems"] == 2 and run["rows"] == 2
    assert run["problems"][0].startswith(f"{path}:3: not JSON")
    assert (tmp_path / "out" / "problems.txt").read_text().count("\n") == 2


def test_bad_prices_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_ledger(tmp_path / "run.jsonl", [make_row()])
    assert report(tmp_path, [path], "--prices", "no-such-preset") == 2
    err = capsys.readouterr().err
    assert "--prices" in err and "no-such-preset" in err and "cached-half" in err
    bad = tmp_path / "prices.yaml"
    bad.write_text("version: 1\ntokens: {fresh_input: 1, cached_input: -1, output: 2}\n")
    assert report(tmp_path, [path], "--prices", str(bad)) == 2
    assert "tokens.cached_input" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_valid_rows_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("garbage\n")
    assert report(tmp_path, [path]) == 2
    err = capsys.readouterr().err
    assert "no valid ledger rows" in err and f"{path}:1: not JSON" in err
    assert report(tmp_path, [tmp_path / "missing.jsonl"]) == 2
    assert "no ledger at" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_ledger(tmp_path / "run.jsonl", [make_row()])
    assert main(["report", str(path)]) == 2
    assert "--out" in capsys.readouterr().err
    assert report(tmp_path, [path], "--label", "a", "--label", "b") == 2
    assert "one per LEDGER" in capsys.readouterr().err


def test_prices_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--prices-template", "cached-half"]) == 0
    assert "fresh_input: 2.5" in capsys.readouterr().out


def test_xss_trajectory_id_is_inert(tmp_path: Path) -> None:
    rows = [make_row(XSS, 1, session=XSS, miss=Miss("diverged", 1, 20, old=XSS, new="<!--")),
            make_row("ok", 1, parent=XSS, arrival_s=1)]
    path = write_ledger(tmp_path / "run.jsonl", rows)
    assert report(tmp_path, [path], "--title", "<b>{{DATA}}</b>", "--label", XSS) == 0
    text = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    # the only markup is the page's own: one data element, one script, no image, no comment
    assert text.count("<script") == 2 and text.count("</script>") == 2
    assert "<img" not in text and "<!--" not in text and "<b>" not in text
    assert "<title>&lt;b&gt;{{DATA}}&lt;/b&gt;</title>" in text
    data = page_data(tmp_path / "out" / "index.html")
    assert data["traj"]["id"][0] == XSS and data["runs"][0]["label"] == XSS
    assert data["text"]["0"]["old"] == XSS and data["title"] == "<b>{{DATA}}</b>"


def test_embed_json_escapes() -> None:
    text = embed_json({"a": "</script>&\u2028<!--", "b": "\ud800"})
    assert not set(text) & set("<>&\u2028") and text.isascii()
    assert json.loads(text) == {"a": "</script>&\u2028<!--", "b": "\ud800"}


def test_runs_side_by_side(tmp_path: Path) -> None:
    (tmp_path / "live").mkdir()
    (tmp_path / "sim").mkdir()
    live = write_ledger(tmp_path / "live" / "ledger.jsonl", synthetic_ledger(5, 3, 1, "live"))
    sim = write_ledger(tmp_path / "sim" / "ledger.jsonl", synthetic_ledger(7, 3, 2, "sim"))
    assert report(tmp_path, [live, sim]) == 0
    data = page_data(tmp_path / "out" / "index.html")
    assert [r["label"] for r in data["runs"]] == [str(live), str(sim)]  # same file names
    assert data["traj"]["run"] == [0] * 5 + [1] * 7
    assert all(i.startswith("live") for i in data["traj"]["id"][:5])
    assert report(tmp_path, [live, sim], "--label", "live", "--label", "sim") == 0
    data = page_data(tmp_path / "out" / "index.html")
    assert [r["label"] for r in data["runs"]] == ["live", "sim"]
    assert data["title"] == "agentserve report: live vs sim"


def test_report_never_imports_torch(tmp_path: Path) -> None:
    path = write_ledger(tmp_path / "run.jsonl", synthetic_ledger(2, 2))
    code = ("import sys; from agentserve.cli import main; "
            f"rc = main(['report', {str(path)!r}, '--out', {str(tmp_path / 'o')!r}]); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr

"""Host and disk KV tiers through the real server on SmolLM2: a turn pushed out of a small pool
comes back from host, a restarted server serves it from disk, usage and /metrics say which tier,
and the greedy text equals the same turn recomputed on a server without tiers."""

from __future__ import annotations

import shutil

import pytest

from agentserve.api import LLM
from agentserve.config import TierConfig
from tests.server.conftest import runner_for

MODEL = "smollm2-135m"
KEY = bytes(range(32))
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 12  # ~150 tokens


def chat(question: str, history: list[dict] | None = None) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "system", "content": SYSTEM}, *(history or []),
                         {"role": "user", "content": question}]}


def small(tiers: TierConfig | None) -> LLM:
    # 48 blocks of 16 = 768 tokens: three other conversations push a finished one out
    return LLM(MODEL, dtype="float32", num_kv_blocks=48, max_model_len=768, tiers=tiers)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


def tiers(disk_dir, host_gib: float = 0.25) -> TierConfig:
    return TierConfig(host_bytes=int(host_gib * 2**30), disk_dir=disk_dir, disk_bytes=1 << 30, key=KEY)


async def turn_then_fillers(client, fillers: int, usages: list | None = None):
    """The first turn, `fillers` unrelated conversations, and the body of the next turn
    (their usages appended to `usages`)."""
    first = chat("Name a color.")
    reply = (await client.post("/v1/chat/completions", json=first)).json()
    seen = [reply["usage"]]
    for i in range(fillers):
        r = await client.post("/v1/chat/completions", json={**chat(f"Count to {i + 3}."),
                                                           "messages": [{"role": "user", "content": f"filler {i} " * 120}]})
        assert r.status_code == 200
        seen.append(r.json()["usage"])
    if usages is not None:
        usages.extend(seen)
    history = [{"role": "user", "content": "Name a color."},
               {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}]
    return chat("Name another one.", history)


@pytest.fixture(scope="module")
def recomputed():
    """The next turn's text on a server with no tiers, where it is recomputed."""
    async def go(client, state):
        body = await turn_then_fillers(client, fillers=3)
        r = (await client.post("/v1/chat/completions", json=body)).json()
        assert r["usage"]["agentserve"]["reused_tokens_by_tier"]["host"] == 0
        return body, r["choices"][0]["message"]["content"]
    return runner_for(small(None))(go)


@pytest.fixture(scope="module")
def first_server(disk_dir, recomputed):
    """The conversation on a server with tiers, which leaves its blocks on disk when it stops."""
    llm = small(tiers(disk_dir))

    async def go(client, state):
        usages: list = []
        body = await turn_then_fillers(client, fillers=3, usages=usages)
        assert body == recomputed[0]
        r = (await client.post("/v1/chat/completions", json=body)).json()
        usages.append(r["usage"])
        return r, (await client.get("/metrics")).text, usages
    out = runner_for(llm)(go)
    llm.close()
    return out


def ledger_total(metrics: str, tier: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(f'agentserve:prompt_tokens_cached_total{{tier="{tier}"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_a_turn_pushed_out_of_the_pool_comes_back_from_host(first_server, recomputed):
    r, metrics, usages = first_server
    for tier in ("device", "host", "disk"):  # the ledger (every attempt) equals the responses exactly
        assert ledger_total(metrics, tier) == sum(u["agentserve"]["reused_tokens_by_tier"][tier] for u in usages)
    by_tier = r["usage"]["agentserve"]["reused_tokens_by_tier"]
    assert by_tier["host"] >= 128, by_tier  # the system prompt and the first turn, at least
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(by_tier.values())
    assert r["choices"][0]["message"]["content"] == recomputed[1]
    assert 'agentserve_kv_tier_blocks_total{op="restored"}' in metrics
    assert 'agentserve_kv_tier_used_bytes{tier="disk"}' in metrics


def test_a_restarted_server_serves_the_turn_from_disk(disk_dir, first_server, recomputed):
    body, text_ref = recomputed
    llm = small(tiers(disk_dir))  # a new process's worth of state: empty pool and host tier

    async def go(client, state):
        r = (await client.post("/v1/chat/completions", json=body)).json()
        by_tier = r["usage"]["agentserve"]["reused_tokens_by_tier"]
        assert by_tier["disk"] >= 128 and by_tier["device"] == 0, by_tier
        assert r["choices"][0]["message"]["content"] == text_ref
        metrics = (await client.get("/metrics")).text
        assert ledger_total(metrics, "disk") == by_tier["disk"]  # a fresh server: this row alone
    runner_for(llm)(go)
    llm.close()


def test_another_key_serves_nothing_from_those_files(disk_dir, first_server, recomputed, tmp_path):
    body, text_ref = recomputed
    copy = tmp_path / "kv"
    shutil.copytree(disk_dir, copy)  # the other tests' files stay as they are
    other = TierConfig(disk_dir=copy, disk_bytes=1 << 30, key=bytes(32))
    llm = small(other)

    async def go(client, state):
        r = (await client.post("/v1/chat/completions", json=body)).json()
        assert r["usage"]["agentserve"]["reused_tokens_by_tier"]["disk"] == 0
        assert r["choices"][0]["message"]["content"] == text_ref
        assert llm.tiers.disk.stats().num_verify_failures >= 1  # read, refused, deleted
    runner_for(llm)(go)
    llm.close()

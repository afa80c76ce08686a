"""Cross-session sharing: two unrelated sessions' first prompts, as they are and with the
volatile values that split them moved to the end."""

from __future__ import annotations

import json

from agentserve.analyze.prefix import common_prefix
from agentserve.analyze.render import HFChatTokenizer, Renderer
from agentserve.analyze.sharing import compare_sessions, move_sentence
from agentserve.analyze.transcript import parse_transcript
from tests.analyze.scenarios import TOOLS, system


def _session(time: str, task: str) -> dict[str, object]:
    return {"tools": TOOLS, "messages": [system(time), {"role": "user", "content": task}]}


def test_two_sessions_share_up_to_the_timestamp_and_more_once_it_moves(
    any_template: tuple[str, Renderer],
) -> None:
    _, renderer = any_template
    first, second = _session("10:00:00", "Fix the failing test."), _session("09:45:17", "Add docs.")
    transcript = parse_transcript(json.dumps({"sessions": [first, second]}), "two.json")
    sharing = compare_sessions(renderer, *transcript.sessions)

    text_a = renderer.text(first["messages"], TOOLS, generation=True)
    text_b = renderer.text(second["messages"], TOOLS, generation=True)
    ids_a = renderer.rendering(first["messages"], TOOLS, generation=True).token_ids
    assert sharing.shared_tokens == common_prefix(
        ids_a, renderer.rendering(second["messages"], TOOLS, generation=True).token_ids
    )
    assert text_a[: common_prefix(text_a, text_b)].endswith("2025-01-02 ")  # the time differs
    assert sharing.moved == ("10:00:00 → 09:45:17",)
    # With the time line last, everything before the two tasks is shared.
    stable = {"role": "system", "content": "You are a coding agent. "}
    before_task = renderer.rendering(
        [stable, {"role": "user", "content": "x"}], TOOLS, generation=True
    )
    assert sharing.shared_tokens < sharing.shared_tokens_volatile_last
    assert sharing.shared_tokens_volatile_last >= common_prefix(before_task.token_ids, ids_a) - 2
    assert sharing.first_prompt_tokens == len(ids_a)


def test_sessions_without_volatile_values_move_nothing(qwen25: HFChatTokenizer) -> None:
    same = [_session("10:00:00", "Fix it."), _session("10:00:00", "Document it.")]
    sessions = parse_transcript(json.dumps(same), "two.json").sessions
    sharing = compare_sessions(Renderer(qwen25), *sessions)
    assert sharing.moved == ()
    assert sharing.shared_tokens == sharing.shared_tokens_volatile_last > 0


def test_move_sentence_takes_the_sentence_or_line_to_the_end() -> None:
    messages = [
        {"role": "system", "content": "A. Time: 10:00 UTC. B.\nC"},
        {"role": "user", "content": "Task."},
    ]
    moved = move_sentence(messages, "10:00")
    assert moved == [
        {"role": "system", "content": "A. B.\nC"},
        {"role": "user", "content": "Task.\nTime: 10:00 UTC."},
    ]
    assert messages[0]["content"] == "A. Time: 10:00 UTC. B.\nC"  # the input is not changed
    line = move_sentence([{"role": "user", "content": "x\nnow 10:00\ny"}], "10:00")
    assert line == [{"role": "user", "content": "x\ny\nnow 10:00"}]
    assert move_sentence(messages, "11:00") is None

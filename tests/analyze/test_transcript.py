"""Reading transcripts: sessions cut into requests, JSONL requests, request logs, and bad input
reported with its place."""

from __future__ import annotations

import json

from agentserve.analyze.messages import server_messages
from agentserve.analyze.transcript import detect_format, parse_transcript

SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "List the files."}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}},
        {"id": "b", "type": "function", "function": {"name": "ls", "arguments": '{"path": "src"}'}},
    ],
}
RESULT_A = {"role": "tool", "tool_call_id": "a", "content": "README.md"}
RESULT_B = {"role": "tool", "tool_call_id": "b", "content": "main.py"}
ANSWER = {"role": "assistant", "content": "Two files."}


def _lines(*records: object) -> str:
    return "\n".join(json.dumps(r) for r in records) + "\n"


def test_session_is_cut_at_each_reply_and_parallel_results_make_one_request() -> None:
    session = {"messages": [SYSTEM, USER, CALL, RESULT_A, RESULT_B, ANSWER]}
    transcript = parse_transcript(json.dumps(session), "s.json")
    assert transcript.problems == ()
    (only,) = transcript.sessions
    first, second = only.requests
    assert first.messages == (SYSTEM, USER) and first.reply == CALL
    assert second.messages == (SYSTEM, USER, CALL, RESULT_A, RESULT_B)
    assert second.reply == ANSWER
    assert [r.index for r in only.requests] == [1, 2]


def test_session_ending_with_a_user_message_has_a_last_request_without_reply() -> None:
    more = {"role": "user", "content": "And tests?"}
    transcript = parse_transcript(json.dumps({"messages": [USER, ANSWER, more]}), "s.json")
    last = transcript.sessions[0].requests[-1]
    assert last.messages == (USER, ANSWER, more) and last.reply is None


def test_sessions_list_gives_named_sessions() -> None:
    text = json.dumps(
        {"sessions": [{"name": "a", "messages": [USER, ANSWER]}, {"messages": [USER, ANSWER]}]}
    )
    transcript = parse_transcript(text, "s.json")
    assert [s.name for s in transcript.sessions] == ["a", "session 2"]


def test_jsonl_reply_comes_from_response_or_from_the_next_request() -> None:
    text = _lines(
        {"messages": [SYSTEM, USER], "response": {"choices": [{"message": CALL}]}},
        {"messages": [SYSTEM, USER, CALL, RESULT_A, RESULT_B]},
        {"messages": [SYSTEM, USER, CALL, RESULT_A, RESULT_B, ANSWER, USER]},
    )
    assert detect_format(text) == "requests"
    first, second, third = parse_transcript(text, "r.jsonl").sessions[0].requests
    assert first.reply == CALL
    assert second.reply == ANSWER  # inferred from the next line
    assert third.reply is None
    assert (first.where, third.where) == ("r.jsonl:1", "r.jsonl:3")


def test_request_log_entries_grouped_by_session() -> None:
    def entry(session: str) -> dict[str, object]:
        return {
            "request": {"model": "m", "messages": [USER], "session_id": session},
            "response": {"choices": [{"message": ANSWER}]},
        }

    transcript = parse_transcript(_lines(entry("x"), entry("y"), entry("x")), "log.jsonl")
    assert [(s.name, len(s.requests)) for s in transcript.sessions] == [("x", 2), ("y", 1)]
    assert transcript.sessions[0].requests[0].reply == ANSWER


def test_malformed_json_names_the_line_and_keeps_what_came_before() -> None:
    text = _lines({"messages": [USER]}, {"messages": [USER]}) + '{"messages": [\n'
    transcript = parse_transcript(text, "r.jsonl")
    assert len(transcript.sessions[0].requests) == 2
    (problem,) = transcript.problems
    assert problem.where.startswith("r.jsonl:3:") and "malformed JSON" in problem.text


def test_malformed_session_document_names_line_and_column() -> None:
    transcript = parse_transcript('{\n  "messages": [\n    {"role": "user",}\n  ]\n}', "s.json")
    assert transcript.sessions == ()
    assert str(transcript.problems[0]).startswith("s.json:3:")


def test_unknown_role_is_reported_and_earlier_requests_kept() -> None:
    bad = {"role": "robot", "content": "beep"}
    transcript = parse_transcript(json.dumps({"messages": [USER, ANSWER, bad, ANSWER]}), "s.json")
    assert len(transcript.sessions[0].requests) == 1
    assert "unknown role 'robot'" in str(transcript.problems[0])
    assert "message 2" in str(transcript.problems[0])


def test_tool_message_without_a_call_is_reported() -> None:
    transcript = parse_transcript(
        _lines({"messages": [USER]}, {"messages": [USER, RESULT_A]}), "r.jsonl"
    )
    (problem,) = transcript.problems
    assert problem.where == "r.jsonl:2"
    assert "tool result with no preceding assistant tool call" in problem.text
    assert len(transcript.sessions[0].requests) == 1


def test_tool_call_id_must_match_a_call() -> None:
    stray = {"role": "tool", "tool_call_id": "zzz", "content": "?"}
    transcript = parse_transcript(json.dumps({"messages": [USER, CALL, stray]}), "s.json")
    assert "'zzz' matches no preceding tool call" in str(transcript.problems[0])


def test_server_messages_parse_arguments_and_flatten_content() -> None:
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    call, user = server_messages([CALL, parts])
    assert call["content"] == ""
    assert call["tool_calls"][0]["function"]["arguments"] == {"path": "."}
    assert user["content"] == "a\nb"
    assert CALL["tool_calls"][0]["function"]["arguments"] == '{"path": "."}'  # input untouched


def test_session_without_requests_and_bad_reply_are_reported() -> None:
    only_system = parse_transcript(json.dumps({"messages": [ANSWER]}), "s.json")
    assert only_system.sessions == ()
    assert "no request" in str(only_system.problems[0])
    bad_reply = {"messages": [USER], "response": {"content": "x", "tool_calls": "nope"}}
    transcript = parse_transcript(_lines({"messages": [USER]}, bad_reply), "r.jsonl")
    assert "tool_calls must be a list" in str(transcript.problems[0])
    assert transcript.problems[0].where == "r.jsonl:2"

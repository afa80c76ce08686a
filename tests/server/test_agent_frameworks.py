"""Real agent frameworks run a two-tool loop against the real server on Qwen2.5-Coder-0.5B.

The server is a subprocess on a loopback port (loaded once for the module); decoding is greedy,
over the bf16 weights and KV computed in fp32 (`--compute-dtype float32`): bf16 arithmetic
rounds differently on each CPU's path (AVX512-BF16 kernels, AMX through torch's SDPA), and the
0.5B model's greedy wording moved with it (on an Intel CPU with AMX and on an AMD Zen 3, bf16:
"This is the temperature in Paris in Fahrenheit.", without the value); in fp32 it is the same on
every CPU this ran on.
The tools are Python functions the frameworks call; each run must call both with the right
arguments and end with a text answer built from their results, not with call JSON. The first
tests pin what the model writes at each step of that loop through the plain `openai` client:
several calls in one reply, the repeat of a call it just had answered, and the loop's end."""

from __future__ import annotations

import asyncio
import json
import warnings
from dataclasses import dataclass, field

import httpx
import jsonschema
import openai
import pytest

from agentserve.bench.served import served

from agentserve.server.tool_parsers import extract, get_parser

pytestmark = pytest.mark.slow
M = "qwen2.5-coder-0.5b"
QUESTION = "What is the temperature in Paris in Fahrenheit?"


def function(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


WEATHER = function("get_weather", "Current temperature in a city, in Celsius.", {"city": {"type": "string"}})
TO_F = function("celsius_to_fahrenheit", "Convert a temperature from Celsius to Fahrenheit.",
                {"celsius": {"type": "number"}})
TOOLS = [WEATHER, TO_F]


@dataclass
class Tools:
    """The two tools as plain functions, recording how they were called."""

    calls: list[tuple[str, dict]] = field(default_factory=list)

    def get_weather(self, city: str) -> str:
        """Current temperature in a city, in Celsius."""
        self.calls.append(("get_weather", {"city": city}))
        return json.dumps({"city": city, "celsius": 21})

    def celsius_to_fahrenheit(self, celsius: float) -> str:
        """Convert a temperature from Celsius to Fahrenheit."""
        self.calls.append(("celsius_to_fahrenheit", {"celsius": celsius}))
        return json.dumps({"celsius": celsius, "fahrenheit": round(celsius * 9 / 5 + 32, 1)})

    def check(self, turns: Turns) -> None:
        """Both tools ran, with the arguments the question implies (a repeat is allowed), in a
        few model turns (printed: pytest shows it with -s, and on failure)."""
        print(f"{len(turns.bodies)} model turns, tool calls: {self.calls}")
        assert len(turns.bodies) <= 4
        names = {n for n, _ in self.calls}
        assert names == {"get_weather", "celsius_to_fahrenheit"}, self.calls
        for name, args in self.calls:
            assert args == ({"city": "Paris"} if name == "get_weather" else {"celsius": 21}), self.calls


@dataclass
class Turns:
    """The chat requests a framework sent (an httpx request hook: responses stream untouched)."""

    bodies: list[dict] = field(default_factory=list)

    def record(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    async def arecord(self, request: httpx.Request) -> None:
        self.record(request)


def check_answer(answer: object, value: str | None = None) -> None:
    """A text answer after the tool results: no parser finds a call in it, nor does it hold call
    JSON a parser might have missed (the server's part: the loop ends in an answer). The
    frameworks' runs do not assert the model's wording (the tools' arguments they do); `value` is
    asserted where a test gives it (the loop rule's fixed turns)."""
    assert isinstance(answer, str) and answer.strip(), answer
    offered = {t["function"]["name"]: t["function"] for t in TOOLS}
    assert extract(get_parser("auto"), answer, offered).calls == ()
    assert '"name"' not in answer, answer
    assert value is None or value in answer, answer


@pytest.fixture(scope="module")
def server():
    with served(["--model", M, "--max-model-len", "4096", "--compute-dtype", "float32"]) as s:
        yield s.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def after(*steps: tuple[str, dict, str]) -> list[dict]:
    """The conversation after these calls (name, arguments, result), one assistant turn each."""
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    for i, (name, args, result) in enumerate(steps):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": result}]
    return messages


PARIS = ("get_weather", {"city": "Paris"}, json.dumps({"city": "Paris", "celsius": 21}))
CONVERTED = ("celsius_to_fahrenheit", {"celsius": 21}, json.dumps({"celsius": 21, "fahrenheit": 69.8}))


def chat(client: openai.OpenAI, messages: list[dict], stream: bool = False, keep: bool = False, **kw: object):
    """(content, calls as (name, arguments), the server's record of dropped calls), one-shot or
    streamed; keep sends repeated_tool_calls "keep"."""
    kw |= {"model": M, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 100,
           "extra_body": {"repeated_tool_calls": "keep"} if keep else None}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.model_extra.get("agentserve")
    content, streamed, record = "", {}, None
    for ch in client.chat.completions.create(**kw, stream=True):
        if ch.choices:
            content += ch.choices[0].delta.content or ""
            for d in ch.choices[0].delta.tool_calls or []:
                streamed[d.index] = (d.function.name, json.loads(d.function.arguments))
            record = ch.choices[0].model_extra.get("agentserve") or record
    return content or None, [streamed[i] for i in sorted(streamed)], record


def test_two_calls_in_one_reply_become_two_tool_calls(client):
    # After the weather result the model writes the call it just made again, then the next one.
    messages = after(PARIS)
    both = [PARIS[:2], CONVERTED[:2]]
    assert chat(client, messages, keep=True) == (None, both, None)
    assert chat(client, messages, stream=True, keep=True) == (None, both, None)
    assert chat(client, messages, keep=True, parallel_tool_calls=False) == (None, both[:1], None)
    # By default the repeat is dropped: the reply asks only for what is new, and says what it dropped.
    record = {"dropped_repeated_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
              "answered_without_tools": False}
    assert chat(client, messages, parallel_tool_calls=False) == (None, both[1:], record)


OSLO = (("get_weather", {"city": "Oslo"}, json.dumps({"city": "Oslo", "celsius": 4})),
        ("celsius_to_fahrenheit", {"celsius": 4}, json.dumps({"celsius": 4, "fahrenheit": 39.2})))


@pytest.mark.parametrize("steps, value", [((PARIS, CONVERTED), "69.8"), (OSLO, "39.2")], ids=["paris", "oslo"])
def test_a_reply_asking_only_for_answered_calls_ends_the_loop(client, steps, value):
    messages = after(*steps)
    if value == "39.2":
        messages[0]["content"] = QUESTION.replace("Paris", "Oslo")
    content, calls, record = chat(client, messages)
    assert calls == [] and record["answered_without_tools"] and record["dropped_repeated_calls"]
    # The echo was cut once it cycled (rule 3): in Oslo's case it ran to max_tokens, five calls
    # long, and left the answer no room (an empty reply).
    dropped = [(d["name"], json.loads(d["arguments"])) for d in record["dropped_repeated_calls"]]
    assert len(dropped) == len(set(map(json.dumps, dropped))) + 1, dropped
    check_answer(content, value)
    assert chat(client, messages, stream=True) == (content, calls, record)


def test_required_allows_several_calls_each_valid(client):
    messages = [{"role": "user", "content": "What is the temperature in Paris and in Oslo?"}]
    _, calls, _ = chat(client, messages, tool_choice="required")
    assert len(calls) >= 2, calls
    for name, args in calls:
        jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])
    _, one, _ = chat(client, messages, tool_choice="required", parallel_tool_calls=False)
    assert one == calls[:1]


def openai_agent(server: str, tools: Tools, turns: Turns):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing outside this machine is reachable
    http = httpx.AsyncClient(event_hooks={"request": [turns.arecord]}, timeout=300)
    model = OpenAIChatCompletionsModel(model=M, openai_client=openai.AsyncOpenAI(
        base_url=server + "/v1", api_key="unused", max_retries=0, http_client=http))
    return Agent(name="assistant", instructions=None, model=model,  # no system message: as the others send
                 tools=[function_tool(tools.get_weather), function_tool(tools.celsius_to_fahrenheit)],
                 model_settings=ModelSettings(temperature=0, max_tokens=200))


def test_openai_agents_one_shot(server):
    from agents import Runner

    tools, turns = Tools(), Turns()
    result = asyncio.run(Runner.run(openai_agent(server, tools, turns), QUESTION, max_turns=6))
    tools.check(turns)
    check_answer(result.final_output)
    assert not any(b.get("stream") for b in turns.bodies)


def test_openai_agents_streamed(server):
    from agents import Runner
    from openai.types.responses import ResponseTextDeltaEvent

    tools, turns = Tools(), Turns()

    async def run() -> tuple[list[str], str]:
        result = Runner.run_streamed(openai_agent(server, tools, turns), QUESTION, max_turns=6)
        deltas = []
        async for event in result.stream_events():
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
                deltas.append(event.data.delta)
        return deltas, result.final_output

    deltas, final = asyncio.run(run())
    tools.check(turns)
    check_answer(final)
    assert len(deltas) > 1 and "".join(deltas) == final  # the answer came in pieces, and only the answer
    assert all(b.get("stream") for b in turns.bodies)


def test_langgraph_streamed(server):
    from langchain_core.messages import AIMessage, AIMessageChunk
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent's move to langchain.agents (not installed)
        from langgraph.prebuilt import create_react_agent

    tools, turns = Tools(), Turns()
    http = httpx.Client(event_hooks={"request": [turns.record]}, timeout=300)
    llm = ChatOpenAI(model=M, base_url=server + "/v1", api_key="unused", temperature=0, max_tokens=200,
                     streaming=True, max_retries=0, http_client=http)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_react_agent(llm, [tool(tools.get_weather), tool(tools.celsius_to_fahrenheit)])
    pieces: dict[str, list[str]] = {}  # text chunks by message id
    state: dict = {}
    for mode, data in agent.stream({"messages": [("user", QUESTION)]}, stream_mode=["messages", "values"],
                                   config={"recursion_limit": 10}):
        if mode == "messages" and isinstance(data[0], AIMessageChunk) and data[0].text:
            pieces.setdefault(data[0].id, []).append(data[0].text)
        elif mode == "values":
            state = data
    final = state["messages"][-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    tools.check(turns)
    check_answer(final.content)
    assert len(pieces[final.id]) > 1 and "".join(pieces[final.id]) == final.content  # it came in pieces
    assert all(b.get("stream") for b in turns.bodies)

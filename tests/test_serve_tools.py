"""Tool calling through the server: a qwen3 fixture given a Hermes-style chat template that renders
`tools` and earlier tool calls; `<tool_call>{json}</tool_call>` output parsed into `tool_calls`
(the random-weight model never writes one by itself, so the end-to-end calls are forced with
tool_choice, which constrains the output through llguidance), whole and streamed."""

from __future__ import annotations

import json
import shutil

import pytest

from kvcore.serve.prompting import chat_ids
from kvcore.serve.protocol import Message
from kvcore.serve.server import EXTRA_MODULES
from kvcore.serve.tools import ToolStream, parse

jsonschema = pytest.importorskip("jsonschema")  # the dev extra (absent on the device image: the module skips)

TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "<tools>{% for t in tools %}{{ t['function'] | tojson }}{% endfor %}</tools>\n{%- endif %}"
    "{%- for m in messages %}{% if m['role'] == 'system' and tools %}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}\n"
    "{% elif m.get('tool_calls') %}<|assistant|>{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {  # small: the fixture's 512-token vocabulary spells JSON out
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                                      "unit": {"enum": ["C", "F"]}},
                                      "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_call_blocks_parse_and_stream():
    text = 'Let me look. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "g"}</tool_call>'
    content, calls = parse(text)
    assert content == "Let me look." and [c["function"] for c in calls] == [
        {"name": "f", "arguments": '{"x": 1}'}, {"name": "g", "arguments": "{}"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse("no calls here") == ("no calls here", [])
    s = ToolStream()
    sent = "".join(s.feed(ch) for ch in text)  # a character at a time: a possible '<tool_call>' is held back
    rest, streamed = s.end()
    assert sent == "Let me look. " and rest == "" and [c["function"] for c in streamed] == [
        c["function"] for c in calls]
    s = ToolStream()
    assert "".join(s.feed(ch) for ch in "a <tool box> b <tool") + s.end()[0] == "a <tool box> b <tool"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    for name in (*EXTRA_MODULES, "openai", "llguidance"):
        pytest.importorskip(name)
    from kvcore.serve import ServeConfig, start_server

    folder = tmp_path_factory.mktemp("tools") / "qwen3-tools"
    shutil.copytree(tiny_models("qwen3"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    h = start_server(ServeConfig(model=str(folder), port=0, batch_size=4, prefill_chunk=64))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_tools_are_rendered_by_the_chat_template(server, client):
    tok = server.served.tokenizer
    text = tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '"name": "weather"' in text and text.endswith("<|assistant|>")
    want = list(tok.encode(text, add_special_tokens=False))
    assert chat_ids(tok, [Message(**m) for m in ASK], [WEATHER]) == want
    r = client.chat.completions.create(model=server.served.name, messages=ASK, tools=[WEATHER], max_tokens=3,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(want)
    none = client.chat.completions.create(model=server.served.name, messages=ASK, tools=[WEATHER],
                                          tool_choice="none", max_tokens=3, temperature=0)
    assert none.usage.prompt_tokens == len(chat_ids(tok, [Message(**m) for m in ASK]))  # "none": no tools shown


def test_a_forced_call_is_parsed_into_tool_calls(server, client):
    name = server.served.name
    for kw in ({"temperature": 0}, {"temperature": 1.2, "seed": 3}):
        r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "weather"}}, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=80, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    tool = {"weather": WEATHER, "time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # streamed: the same call, sent once the block is complete
    chunks = list(client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, TIME], stream=True,
                                                 tool_choice="required", max_tokens=80, temperature=0))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (streamed,) = [t for d in deltas for t in (d.tool_calls or [])]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert "".join(d.content or "" for d in deltas) == "" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_a_call_and_its_result_renders(server, client):
    tok = server.served.tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}]
    r = client.chat.completions.create(model=server.served.name, messages=turns, tools=[WEATHER], max_tokens=3,
                                       temperature=0)
    as_object = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}, turns[2]]
    text = tok.apply_chat_template(as_object, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Paris"}' in text  # the arguments rendered as an object, not a string
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, extra, param):
    from serve_helpers import post

    status, err = post(server.url, {"model": server.served.name, "messages": ASK, "max_tokens": 2, **extra})
    assert status == 400 and err["error"]["param"] == param, err


@pytest.mark.parametrize("params,why", [
    ({"type": "object", "properties": {"x": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}, "look-around"),
])
def test_a_forced_tool_whose_schema_does_not_compile_is_a_400_naming_tools(server, params, why):
    from serve_helpers import post

    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    status, err = post(server.url, {"model": server.served.name, "messages": ASK, "max_tokens": 2, "tools": [tool],
                                    "tool_choice": "required"})
    msg = err["error"]["message"]
    assert status == 400 and err["error"]["param"] == "tools" and why in msg, err
    assert msg.startswith("'tools': ") and "--grammar" not in msg and "start:" not in msg  # no grammar echoed
    status, err = post(server.url, {"model": server.served.name, "messages": ASK, "max_tokens": 2,
                                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": params}}})
    assert status == 400 and err["error"]["param"] == "response_format.json_schema.schema", err
    assert "--json-schema" not in err["error"]["message"]
    assert post(server.url, {"model": server.served.name, "messages": ASK, "max_tokens": 2})[0] == 200  # serves on


def test_a_forced_call_follows_local_refs_of_its_schema(server, client):
    """Parameters with $defs (as pydantic writes them): their "#/..." refs resolve within that
    function's parameters, not the combined schema around them."""
    place = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
             "additionalProperties": False, "$defs": {"City": {"enum": ["Paris", "Rome"]}}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": place}}, TIME]
    for choice in ("required", {"type": "function", "function": {"name": "go"}}):
        r = client.chat.completions.create(model=server.served.name, messages=ASK, tools=tools, tool_choice=choice,
                                           max_tokens=80, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        if call.function.name == "go":
            jsonschema.validate(json.loads(call.function.arguments), place)

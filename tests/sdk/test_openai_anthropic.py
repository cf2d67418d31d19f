"""The official Python SDKs, unmodified, against a real `rmlx serve` on loopback.

Run: scripts/sdk-venv && RMLX_BIN=target/debug/rmlx .venv-sdk/bin/python -m pytest tests/sdk
(cargo test runs it through crates/rmlx-cli/tests/sdk.rs when .venv-sdk exists).
The tiny fixture has random weights: texts are gibberish but deterministic at temperature 0.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen3-tiny"
KEY = "sdk-test-key"


def serve(*extra):
    """A real `rmlx serve` on the tiny fixture; yields its base URL, then stops it."""
    binary = os.environ.get("RMLX_BIN", str(ROOT / "target" / "debug" / "rmlx"))
    empty_hub = ROOT / "target" / "sdk-empty-hub"
    empty_hub.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [binary, "serve", "--model", str(ROOT / "tests/fixtures/qwen3-tiny"), "--port", "0",
         "--api-key", KEY, "--hf-cache", str(empty_hub), *extra],
        stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
    )
    try:
        line = server.stdout.readline()  # "rmlx serve: listening on http://127.0.0.1:PORT"
        assert "listening on http://" in line, f"server did not start: {line!r}"
        yield line.strip().rsplit(" ", 1)[-1]
    finally:
        server.terminate()  # SIGTERM: graceful shutdown
        assert server.wait(timeout=30) == 0, "the server did not exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def base_url():
    yield from serve()


@pytest.fixture(scope="module")
def one_row_url():
    """One batch row, keep-alives every 0.2 s: a second request waits in the queue."""
    yield from serve("--max-batch", "1", "--heartbeat", "0.2")


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


def test_models_list(oai):
    models = oai.models.list()
    assert MODEL in [m.id for m in models.data]
    assert oai.models.retrieve(MODEL).id == MODEL


def test_chat_stream_equals_non_stream_and_usage(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    # The prefix cache may reuse an earlier request's prompt; never the whole prompt.
    assert 0 <= whole.usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens

    pieces, usage = [], None
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == text
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_legacy_completions(oai):
    whole = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.usage.completion_tokens <= 8


def test_chat_tool_history_round_trips(oai):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4, temperature=0)
    plain = oai.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens


def test_messages_stream_equals_non_stream_and_usage(claude):
    # anthropic 2.x has no typed `temperature` any more; the server still honours the field.
    kwargs = dict(model=MODEL, max_tokens=12, extra_body={"temperature": 0}, system="You are terse.",
                  messages=[{"role": "user", "content": "Name three colours."}])
    whole = claude.messages.create(**kwargs)
    text = "".join(block.text for block in whole.content if block.type == "text")
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert whole.usage.output_tokens <= 12
    with claude.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == whole.stop_reason


def test_count_tokens_equals_prompt_tokens(claude):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", tools=tools, messages=messages)
    used = claude.messages.create(model=MODEL, system="Be brief.", tools=tools, messages=messages,
                                  max_tokens=2, extra_body={"temperature": 0})
    assert counted.input_tokens == used.usage.input_tokens


def test_unknown_model_is_not_found(oai, claude):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_bad_key_is_authentication_error(base_url):
    bad_oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_oai.models.list()
    bad_claude = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_context_overflow_is_bad_request(oai, claude):
    long = "word " * 3000  # the fixture's context is 2048 tokens
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=2)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": long}])


def test_n_above_one_and_remote_images_are_bad_requests(oai):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="remote image URLs"):
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])


# Fixture-tokenizer ids of '"' and '}': the random model rarely closes a string on its own, so a
# bias makes finishing likely. Validity is the grammar's doing (the engine tests show the same
# bias without response_format gives no JSON).
CLOSE_BIAS = {"1": 10, "92": 10}


def test_json_object_parses_even_from_the_random_model(oai):
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=400,
        temperature=0, response_format={"type": "json_object"}, logit_bias=CLOSE_BIAS)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_json_schema_is_enforced(oai):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A digit, please."}], max_tokens=400,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "digit", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert 1 <= value["n"] <= 9


# A forced call: the random model never writes one itself, so these show the constraint at work.
FORECAST = {"type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["unit", "days"], "additionalProperties": False}


def assert_forecast_arguments(arguments):
    assert set(arguments) == {"unit", "days"}, arguments
    assert arguments["unit"] in ("celsius", "fahrenheit")
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7


def test_forced_tool_call_round_trips_openai(oai):
    tools = [{"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast",
                                               "parameters": FORECAST}}]
    messages = [{"role": "user", "content": "Forecast for Paris?"}]
    reply = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=400, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_forecast"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_forecast"
    assert_forecast_arguments(json.loads(call.function.arguments))

    # Streamed, the SDK assembles the same call from the deltas.
    name, arguments, finish = None, "", None
    for chunk in oai.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, max_tokens=400, temperature=0,
            tool_choice="required", stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            name = delta_call.function.name or name
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, finish) == ("get_forecast", "tool_calls")
    assert_forecast_arguments(json.loads(arguments))

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8,
                                         temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens > 0
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_forced_tool_use_round_trips_anthropic(claude):
    tools = [{"name": "get_forecast", "description": "Weather forecast", "input_schema": FORECAST}]
    messages = [{"role": "user", "content": "Forecast for Paris?"}]
    kwargs = dict(model=MODEL, max_tokens=400, extra_body={"temperature": 0}, tools=tools)
    reply = claude.messages.create(messages=messages, tool_choice={"type": "tool", "name": "get_forecast"},
                                   **kwargs)
    assert reply.stop_reason == "tool_use"
    [block] = reply.content
    assert (block.type, block.name) == ("tool_use", "get_forecast")
    assert_forecast_arguments(block.input)

    with claude.messages.stream(messages=messages, tool_choice={"type": "any"}, **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_forecast"
    assert_forecast_arguments(streamed.input)

    messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                               "content": "sunny, 21 C"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, tools=tools,
                                    messages=messages)
    assert answer.role == "assistant" and answer.stop_reason in ("max_tokens", "end_turn")
    assert answer.usage.output_tokens > 0 and answer.usage.input_tokens > reply.usage.input_tokens


# The Responses API (what Codex speaks): whole, streamed through the SDK's own accumulator, and a
# forced call carried to the next turn by `previous_response_id`.
def test_responses_create_and_stream_agree(oai):
    # A schema ends the random model's answer (the SDK's stream helper wants response.completed;
    # an answer cut by max_output_tokens ends in response.incomplete, as OpenAI's does).
    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
              "required": ["colour"], "additionalProperties": False}
    kwargs = dict(model=MODEL, instructions="You are terse.", input="Pick a colour.",
                  max_output_tokens=400, temperature=0,
                  text={"format": {"type": "json_schema", "name": "colour", "schema": colour, "strict": True}})
    whole = oai.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed"
    text = whole.output_text
    assert json.loads(text)["colour"] in ("red", "green")
    assert whole.output[0].type == "message"
    usage = whole.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0

    with oai.responses.stream(**kwargs) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == text
    assert final.output_text == text
    assert final.usage.output_tokens == usage.output_tokens
    assert final.usage.input_tokens == usage.input_tokens

    # Cut short: the raw stream ends in response.incomplete.
    kwargs.update(max_output_tokens=2)
    kwargs.pop("text")
    events = list(oai.responses.create(stream=True, **kwargs))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_forced_function_call_round_trips(oai):
    tools = [{"type": "function", "name": "get_forecast", "description": "Weather forecast",
              "parameters": FORECAST, "strict": True},
             {"type": "web_search"}]  # a built-in tool the server cannot run: dropped
    kwargs = dict(model=MODEL, input="Forecast for Paris?", tools=tools, max_output_tokens=400,
                  temperature=0)
    reply = oai.responses.create(tool_choice={"type": "function", "name": "get_forecast"}, **kwargs)
    assert reply.status == "completed"
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_forecast" and call.call_id.startswith("call_")
    assert_forecast_arguments(json.loads(call.arguments))

    with oai.responses.stream(tool_choice="required", **kwargs) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert streamed.name == "get_forecast" and streamed.arguments == arguments
    assert_forecast_arguments(json.loads(arguments))

    answer = oai.responses.create(
        model=MODEL, previous_response_id=reply.id, tools=tools, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert answer.output_text is not None and answer.usage.output_tokens > 0
    assert answer.usage.input_tokens > reply.usage.input_tokens

    with pytest.raises(openai.BadRequestError) as raised:
        oai.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi",
                             max_output_tokens=2)
    assert raised.value.code == "previous_response_not_found"


def test_responses_over_the_context(oai):
    long = "word " * 3000  # the fixture's context is 2048 tokens
    with pytest.raises(openai.BadRequestError) as raised:
        oai.responses.create(model=MODEL, input=long, max_output_tokens=2)
    assert raised.value.code == "context_length_exceeded"
    events = list(oai.responses.create(model=MODEL, input=long, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "context_length_exceeded"


# The fixture's EOS ids (`<|endoftext|>`, `<|im_end|>`), banned so a long answer runs its length.
NO_EOS = {"991": -100, "993": -100}


def test_queued_streams_outlast_the_clients_timeouts(one_row_url):
    """A stream queued behind a long answer (one batch row) gets its headers and keep-alives
    while it waits: each SDK's one-second read timeout never fires, and the answer arrives."""
    runner = openai.OpenAI(base_url=f"{one_row_url}/v1", api_key=KEY, max_retries=0)
    quick_oai = openai.OpenAI(base_url=f"{one_row_url}/v1", api_key=KEY, max_retries=0, timeout=1.0)
    quick_claude = anthropic.Anthropic(base_url=one_row_url, api_key=KEY, max_retries=0, timeout=1.0)

    def behind_a_long_answer(ask):
        first, ended = threading.Event(), threading.Event()

        def run():
            stream = runner.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1900,
                                                    temperature=0, logit_bias=NO_EOS, stream=True)
            for _ in stream:
                first.set()
            ended.set()

        thread = threading.Thread(target=run)
        thread.start()
        assert first.wait(60), "the long answer never started"
        asked = time.monotonic()
        text = ask()
        waited = time.monotonic() - asked
        thread.join()
        # It waited past the client's timeout, for the long answer to end.
        assert ended.is_set() and waited > 1.0, waited
        return text

    def openai_stream():
        stream = quick_oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                   temperature=0, logit_bias=NO_EOS, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def anthropic_stream():
        with quick_claude.messages.stream(model=MODEL, messages=MESSAGES[1:], max_tokens=4) as stream:
            return stream.get_final_message()

    text = behind_a_long_answer(openai_stream)
    whole = quick_oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                              temperature=0, logit_bias=NO_EOS)
    assert text == whole.choices[0].message.content
    message = behind_a_long_answer(anthropic_stream)
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.input_tokens > 0

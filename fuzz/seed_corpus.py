#!/usr/bin/env python3
"""Writes the seed inputs of every fuzz target into fuzz/corpus/<target>/ (libFuzzer then adds
what it finds beside them). Each seed is a well-formed example of what the server really
parses, so the fuzzer starts from inside every format instead of from random bytes.

Usage: python3 fuzz/seed_corpus.py   (Pillow, from .venv-ref, makes the image seeds)
"""
import base64
import hashlib
import io
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent
FIXTURES = ROOT.parent / "tests" / "fixtures"


def write(target, data):
    if isinstance(data, str):
        data = data.encode()
    folder = ROOT / "corpus" / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ("seed-" + hashlib.sha1(data).hexdigest()[:16])).write_bytes(data)


def png_bytes():
    return (FIXTURES / "vision-images" / "gradient_64x48.png").read_bytes()


def requests():
    image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}}
    bodies = [
        {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Hi"}]},
        {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                                 {"type": "image_url", "image_url": {"url": image}}]}],
         "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
        {"model": "m", "messages": [{"role": "user", "content": "weather?"},
                                    {"role": "assistant", "content": None, "tool_calls": [
                                        {"id": "call_1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
         "tools": [weather], "tool_choice": "required"},
        {"model": "m", "messages": [{"role": "user", "content": "json"}], "tools": [weather],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"model": "m", "messages": [{"role": "user", "content": "json"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
         "logprobs": True, "top_logprobs": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
         "presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.1, "seed": 7,
         "logit_bias": {"42": -100}, "stop": ["\n", "END"], "n": 1},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "enable_thinking": False,
         "chat_template_kwargs": {"enable_thinking": True, "custom": [1, 2]}, "max_completion_tokens": 3},
        {"model": "m", "prompt": "Once upon a time", "max_tokens": 5, "logprobs": 2, "echo": False},
        {"model": "m", "prompt": [1, 2, 3, 151643], "stop": "x"},
        {"model": "m", "prompt": ["one", "two"]},
        {"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "sys"}],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                                "data": base64.b64encode(png_bytes()).decode()}}]},
                      {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                         "input": {"city": "Oslo"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                          {"type": "text", "text": "rain"}]}]},
                      {"role": "assistant", "content": "Partial prefill"}],
         "tools": [{"name": "get_weather", "description": "w", "input_schema": weather["function"]["parameters"]}],
         "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 100},
         "stop_sequences": ["\n\n"], "temperature": 0, "top_k": 5, "stream": True},
        {"model": "m", "messages": [{"role": "user", "content": "count me"}], "system": "plain system"},
    ]
    for body in bodies:
        write("request_json", json.dumps(body))


def templates():
    conversations = [
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "A", "reasoning_content": "thought"},
                      {"role": "user", "content": "Q2"}], "enable_thinking": True},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}]},
        {"messages": [{"role": "user", "content": "w?"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                      {"role": "tool", "content": "sunny"}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}], "enable_thinking": False},
    ]
    for which in range(4):
        for conversation in conversations:
            write("chat_template", bytes([which]) + json.dumps(conversation).encode())


def images():
    for name in ("gradient_64x48.png", "noise_80x100.png"):
        write("image_decode", (FIXTURES / "vision-images" / name).read_bytes())
    from PIL import Image

    picture = Image.open(io.BytesIO(png_bytes())).convert("RGB").resize((16, 12))
    for fmt in ("JPEG", "GIF", "WEBP", "BMP", "TIFF"):
        out = io.BytesIO()
        picture.save(out, format=fmt)
        write("image_decode", out.getvalue())
    small = io.BytesIO()
    picture.save(small, format="PNG")
    write("image_decode", "data:image/png;base64," + base64.b64encode(small.getvalue()).decode())
    write("image_decode", base64.b64encode(small.getvalue()).decode())
    write("image_decode", "/etc/passwd")


def safetensors():
    def file(entries, data):
        header = json.dumps(entries).encode()
        return struct.pack("<Q", len(header)) + header + data

    write("safetensors_header", file({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16)))
    write("safetensors_header", file({"__metadata__": {"format": "mlx"},
                                      "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
                                      "b": {"dtype": "U32", "shape": [1, 2], "data_offsets": [6, 14]}}, bytes(14)))
    write("safetensors_header", file({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}, bytes(4)))
    write("safetensors_header", file({"w": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}, bytes(8)))
    write("safetensors_header", struct.pack("<Q", 1 << 40) + b"{}")


def sse():
    for text in ["hello", "two\nlines", "carriage\rreturn\r\n", "data: not an event\n\nevent: x", "",
                 "unicode \u00e9\u4e2d\U0001f600", "\u2028\u2029 separators", "{\"json\": [1, 2]}"]:
        write("sse_event", text)


def tool_calls():
    texts = [
        "plain answer",
        "<think>reasoning</think>\n\nanswer",
        "reasoning only</think>answer",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "before <tool_call>{\"name\": \"x\"</tool_call> after",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\ntrue\n</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=unknown>\n<parameter=a>1</parameter>\n</function>\n</tool_call>",
        "<think>a<tool_call>b</think><tool_call>{\"name\":\"get_weather\",\"arguments\":{}}",
        "<thi<tool_ <tool_call",
    ]
    for text in texts:
        for flags in (0, 1, 2, 3, 6, 7):
            write("tool_calls", bytes([flags, len(text) % 16]) + text.encode())


if __name__ == "__main__":
    requests()
    templates()
    images()
    safetensors()
    sse()
    tool_calls()
    for folder in sorted((ROOT / "corpus").iterdir()):
        print(f"{folder.name}: {len(list(folder.iterdir()))} inputs")

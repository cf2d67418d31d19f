"""Mixed traffic against a real `rmlx serve`, speculative decoding on as it is served by default.

For the tiny Qwen3 (prompt lookup drafts), the Qwen3.6-35B-A3B release fixture (Gated DeltaNet,
MoE, its MTP head drafts, vision) and the tiny Gemma 4 (sliding windows, vision), four clients send
100 seeded random requests each, at once, across /v1/chat/completions, /v1/messages and
/v1/completions, combining what agents and SDKs send: grammars (json_schema, json_object, forced
tool calls), greedy and sampled decoding with filters and penalties, log-probs, stop strings,
streaming, logit bias, prompts whose words repeat (so prompt lookup drafts, and a grammar may
refuse the draft), pictures of two sizes where the model sees (so prompts with images prefill
together or alone), and clients that hang up after the first streamed chunk. Every request is
answered 200; a constrained answer that ended on its own parses and fits its schema; the server
is alive after and exits cleanly. Such a mix once killed the server: a sampled row whose first
draft the grammar refused reached MLX's scan with an empty axis (SIGFPE).

Run: cargo test -p rmlx-cli --test contract (it runs tests/api; needs .venv-sdk).
"""

import base64
import json
import random
import threading
import urllib.error
import urllib.request

import jsonschema_rs

import pytest

from test_contract import LOCAL, ROOT, start_server, stop_server

CLIENTS, REQUESTS = 4, 100
WORDS = "the cat sat on the mat and the dog ran to the cat then the cat sat again on the mat".split()
SCHEMAS = [
    {"enum": ["cat", "dog", "axolotl"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
     "required": ["a"], "additionalProperties": False},
    {},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
]
TOOLS = [
    {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"y": {"type": "string"}}}}},
]


PICTURES = [base64.b64encode((ROOT / "tests/fixtures/vision-images" / name).read_bytes()).decode()
            for name in ("gradient_64x48.png", "gradient_64x48_mirror.png", "noise_80x100.png")]


class Client:
    def __init__(self, seed, model, sees):
        self.rng, self.model, self.sees = random.Random(seed), model, sees

    def picture(self):
        """A picture for half the prompts where the model sees (two of one size, one other)."""
        return self.rng.choice(PICTURES) if self.sees and self.rng.random() < 0.5 else None

    def text(self):
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 40)))

    def sampling(self, body):
        rng = self.rng
        if rng.random() < 0.6:
            body["temperature"] = rng.choice([0, 0.3, 1.0, 1.7])
        if rng.random() < 0.3:
            body["top_p"] = rng.choice([0.01, 0.5, 0.95, 1])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([0, 1, 2, 50])
        return body

    def chat(self):
        rng = self.rng
        messages = [{"role": "user", "content": self.text()}]
        if rng.random() < 0.4:
            messages += [{"role": "assistant", "content": self.text()}, {"role": "user", "content": self.text()}]
        picture = self.picture()
        if picture:
            messages[-1]["content"] = [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + picture}},
                {"type": "text", "text": messages[-1]["content"]}]
        body = self.sampling({"model": self.model, "messages": messages, "max_tokens": rng.randint(1, 24),
                              "enable_thinking": rng.random() < 0.3})
        if rng.random() < 0.2:
            body["min_p"] = rng.choice([0, 0.1, 0.9])
        if rng.random() < 0.2:
            body["seed"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            body.update(presence_penalty=rng.choice([0.5, 2]), frequency_penalty=rng.choice([0, 1.5]))
        if rng.random() < 0.2:
            body["repetition_penalty"] = 1.3
        kind = rng.random()
        if kind < 0.65:
            body["max_tokens"] = rng.randint(16, 64)  # room for a constrained answer to finish
        if kind < 0.35:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": rng.choice(SCHEMAS), "strict": rng.random() < 0.5}}
        elif kind < 0.45:
            body["response_format"] = {"type": "json_object"}
        elif kind < 0.65:
            body["tools"] = TOOLS
            body["tool_choice"] = rng.choice(["auto", "required", {"type": "function", "function": {"name": "get"}}])
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        if rng.random() < 0.2:
            body["stop"] = rng.choice(["cat", ["the", "mat"], "\n"])
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.1:
            body["logit_bias"] = {str(rng.randint(0, 100)): rng.choice([-100, 5, 100])}
        return "/v1/chat/completions", body

    def messages(self):
        rng = self.rng
        content = self.text()
        picture = self.picture()
        if picture:
            content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}},
                       {"type": "text", "text": content}]
        body = self.sampling({"model": self.model, "max_tokens": rng.randint(1, 24),
                              "messages": [{"role": "user", "content": content}]})
        if rng.random() < 0.4:
            body["tools"] = [{"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}
                             for tool in TOOLS]
            body["tool_choice"] = rng.choice([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get"}])
        if rng.random() < 0.3:
            body["stream"] = True
        return "/v1/messages", body

    def completions(self):
        rng = self.rng
        body = self.sampling({"model": self.model, "prompt": self.text(), "max_tokens": rng.randint(1, 24)})
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.3:
            body["stream"] = True
        return "/v1/completions", body

    def next_request(self):
        return self.rng.choice([self.chat, self.chat, self.chat, self.messages, self.completions])()


def check_answer(path, body, answer):
    """What a finished constrained answer must be; unconstrained or cut answers say nothing.
    Returns whether it checked something."""
    if path == "/v1/chat/completions":
        choice = answer["choices"][0]
        if body.get("stop") is not None:
            return False  # a stop string may cut a constrained answer anywhere
        content = choice["message"].get("content") or ""
        format_ = body.get("response_format")
        if format_ and choice["finish_reason"] == "stop":
            value = json.loads(content)
            if format_["type"] == "json_object":
                assert isinstance(value, dict), content
            else:
                schema = format_["json_schema"]["schema"]
                assert jsonschema_rs.validator_for(schema).is_valid(value), (schema, content)
            return True
        forced = body.get("tool_choice") not in (None, "auto")
        if forced and choice["finish_reason"] != "length":
            calls = choice["message"]["tool_calls"]
            assert len(calls) == 1, answer
            assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict), calls
            if isinstance(body["tool_choice"], dict):
                assert calls[0]["function"]["name"] == "get", calls
            return True
    elif path == "/v1/messages":
        forced = body.get("tool_choice", {}).get("type") in ("any", "tool")
        if forced and answer["stop_reason"] != "max_tokens":
            uses = [block for block in answer["content"] if block["type"] == "tool_use"]
            assert len(uses) == 1 and isinstance(uses[0]["input"], dict), answer
            return True
    return False


# Each model's folder and its clients' requests (Gemma 4 fewer: the suite's time).
FOLDERS = {LOCAL: (None, REQUESTS), "qwen3.6-35b-a3b": ("tests/fixtures/releases/qwen3.6-35b-a3b", REQUESTS),
           "gemma4-tiny": ("tests/fixtures/gemma4-tiny", 50)}


@pytest.mark.parametrize("model", list(FOLDERS))
def test_mixed_traffic_is_answered_and_constrained(tmp_path, model):
    folder, count = FOLDERS[model]
    folder = folder and ROOT / folder
    sees = bool(folder) and (folder / "preprocessor_config.json").exists()
    process, url = start_server(tmp_path, max_ctx=2048, also=[folder] if folder else [])
    failures, checked, grouped, lock = [], [0], [0], threading.Lock()

    def client(seed):
        requests = Client(seed, model, sees)
        for _ in range(count):
            path, body = requests.next_request()
            request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})
            # A client that hangs up after the first streamed chunk (its row is cancelled).
            hang_up = body.get("stream") and requests.rng.random() < 0.15
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    raw = response.readline() if hang_up else response.read()
                if hang_up:
                    continue
                answer = None if body.get("stream") else json.loads(raw)
                if answer and check_answer(path, body, answer):
                    with lock:
                        checked[0] += 1
                if answer and (answer.get("timings") or {}).get("images_prefilled_with", 0) >= 2:
                    with lock:
                        grouped[0] += 1
            except urllib.error.HTTPError as error:
                problem = f"HTTP {error.code}: {error.read()[:300]!r}"
            except Exception as error:  # noqa: BLE001 (a dead server, a failed check: all reported)
                problem = f"{type(error).__name__}: {error}"
            else:
                continue
            with lock:
                failures.append(f"{path} {json.dumps(body)[:400]}\n  -> {problem}")
            if process.poll() is not None:
                return

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, f"{len(failures)} of {CLIENTS * count} requests failed:\n" + "\n".join(failures[:10])
        print(f"mixed traffic on {model}: {CLIENTS * count} requests answered, {checked[0]} constrained answers "
              f"checked, {grouped[0]} answers whose picture prefilled beside another's")
        assert checked[0] >= 10, "too few constrained answers finished to check the grammars"
    finally:
        stop_server(process)

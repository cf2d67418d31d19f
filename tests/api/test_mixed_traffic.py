"""Mixed traffic against a real `rmlx serve`, speculative decoding on as it is served by default.

For the tiny Qwen3 (prompt lookup drafts) and the Qwen3.6-35B-A3B release fixture (Gated DeltaNet,
MoE, its MTP head drafts), four clients send 100 seeded random requests each, at once, across /v1/chat/completions,
/v1/messages and /v1/completions, combining what agents and SDKs send: grammars (json_schema,
json_object, forced tool calls), greedy and sampled decoding with filters and penalties,
log-probs, stop strings, streaming, logit bias, and prompts whose words repeat (so prompt lookup
drafts, and a grammar may refuse the draft). Every request is answered 200; a constrained answer
that ended on its own parses and fits its schema; the server is alive after and exits cleanly.
Such a mix once killed the server: a sampled row whose first draft the grammar refused reached
MLX's scan with an empty axis (SIGFPE).

Run: cargo test -p rmlx-cli --test contract (it runs tests/api; needs .venv-sdk).
"""

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


class Client:
    def __init__(self, seed, model):
        self.rng, self.model = random.Random(seed), model

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
        body = self.sampling({"model": self.model, "max_tokens": rng.randint(1, 24),
                              "messages": [{"role": "user", "content": self.text()}]})
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


@pytest.mark.parametrize("model", [LOCAL, "qwen3.6-35b-a3b"])
def test_mixed_traffic_is_answered_and_constrained(tmp_path, model):
    also = [ROOT / "tests/fixtures/releases" / model] if model != LOCAL else []
    process, url = start_server(tmp_path, max_ctx=2048, also=also)
    failures, checked, lock = [], [0], threading.Lock()

    def client(seed):
        requests = Client(seed, model)
        for _ in range(REQUESTS):
            path, body = requests.next_request()
            request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    raw = response.read()
                if not body.get("stream") and check_answer(path, body, json.loads(raw)):
                    with lock:
                        checked[0] += 1
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
        assert not failures, f"{len(failures)} of {CLIENTS * REQUESTS} requests failed:\n" + "\n".join(failures[:10])
        print(f"mixed traffic on {model}: {CLIENTS * REQUESTS} requests answered, {checked[0]} constrained answers checked")
        assert checked[0] >= 10, "too few constrained answers finished to check the grammars"
    finally:
        stop_server(process)

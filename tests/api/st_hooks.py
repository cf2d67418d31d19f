"""schemathesis hooks for tests/api.

1. Generated bodies name a model the server has, and downloads a repository the imitation hub
   serves. The document cannot list the served models (they are the user's folders), so a
   generated `model` would almost always be an unknown id and every case would stop at the 404.
   Only a `model` (or `repo`) that is already a valid id is replaced, so a case stays as valid
   or as invalid as it was generated (schemathesis revalidates a case a hook changed). The 404
   path for unknown models has its own tests (crates/rmlx-server/tests). This runs before each
   call (`before_call`), in every phase: a `map_case` hook would also do it, but slows
   schemathesis' fuzzing several times over.
2. Most `previous_response_id`s are dropped (one in four is kept): any string is schema-valid,
   but only a stored response's id continues one, so nearly every Responses case would stop at
   the listed `previous_response_not_found` refusal.
3. Answers are capped at 8 tokens: a token limit of at least 1 that is absent or larger becomes
   8 (still valid), so the run tests the contract rather than spending its time generating.
4. Hypothesis runs without its `target` phase (a profile loaded here, which schemathesis
   applies): schemathesis targets each operation's success rate, and Hypothesis 6.170's optimiser
   then crashed on some seeds (`IndexError` in `Optimiser.hill_climb`, an internal error of the
   fuzzer, not a finding) while spending its time re-drawing cases already sent.
5. The refusals docs/SERVER.md lists as ones a schema cannot state ("Refusals the document
   cannot state") are the only failures dropped: a schema-valid request answered 400 with one
   of those exact errors, on a route that gives it. Every other failure fails the run.
"""

import os
import re
from pathlib import Path

import hypothesis
import schemathesis
import yaml

hypothesis.settings.register_profile(
    "rmlx-contract",
    phases=[phase for phase in hypothesis.Phase if phase is not hypothesis.Phase.target],
)
hypothesis.settings.load_profile("rmlx-contract")

MODELS = ["qwen3-tiny", "local/qwen3-tiny"]
REPO = "test/qwen3-tiny"
CAP = 8

_SCHEMAS = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs/openapi.yaml").read_text())[
    "components"]["schemas"]
MODEL_ID = re.compile(_SCHEMAS["ModelId"]["pattern"])
REPO_ID = re.compile(_SCHEMAS["StartDownload"]["properties"]["repo"]["pattern"])

# The token limit each generation route reads first.
TOKEN_FIELDS = {
    "/v1/chat/completions": ["max_completion_tokens", "max_tokens"],
    "/v1/completions": ["max_tokens"],
    "/v1/messages": ["max_tokens"],
    "/v1/responses": ["max_output_tokens"],
}


def _is_count(value):
    return (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        isinstance(value, float) and value >= 1 and value.is_integer())


def cap_tokens(path, body):
    fields = TOKEN_FIELDS.get(path)
    if not fields:
        return
    present = [field for field in fields if field in body and body[field] is not None]
    if not present:
        # Chat reads max_completion_tokens before max_tokens; either absent field is the default.
        body[fields[-1]] = CAP
        return
    for field in present:
        if _is_count(body[field]) and body[field] > CAP:
            body[field] = CAP


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not isinstance(body, dict):
        return
    model = body.get("model")
    if isinstance(model, str) and MODEL_ID.match(model):
        body["model"] = MODELS[len(model) % len(MODELS)]
    # Half the download requests name the hub's repository, so jobs exist for the stateful
    # links to follow; the others keep their generated repo (a failed job, or a 400).
    repo = body.get("repo")
    if isinstance(repo, str) and REPO_ID.match(repo) and len(repo) % 2 == 0:
        body["repo"] = REPO
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and len(previous) % 4 != 1:
        del body["previous_response_id"]
    cap_tokens(case.path, body)


GENERATION = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
PROMPTS = GENERATION | {"/v1/messages/count_tokens"}
CHATS = PROMPTS - {"/v1/completions"}
CALLS = {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}

# (routes, error code or None, message pattern): docs/SERVER.md's table of the refusals the
# document cannot state, each as narrow as its message allows.
REFUSALS = [
    # Bytes that are not an image (or one too large): only decoding tells.
    (CHATS, None, r"bad image: (image is empty|image is \d+ bytes, over|image is \d+x\d+, over"
                  r"|not a supported image|unreadable )"),
    # A model without a vision tower: the document does not know which model is which.
    (CHATS, None, r"(model `[^`]+`|this model \([^)]*\)) has no vision: "),
    # A prompt over the context: it depends on the tokenizer, the template and --max-ctx.
    (GENERATION, "context_length_exceeded", r"this request has \d+ prompt tokens but the model's"),
    ({"/v1/messages"}, None, r"prompt is too long: \d+ tokens > \d+ maximum"),
    # A token id (logit_bias key, completions prompt) past the model's vocabulary.
    (GENERATION, None, r"(logit_bias )?token id \S+ is outside the vocabulary"),
    # A previous_response_id that is not stored.
    ({"/v1/responses"}, "previous_response_not_found", r"Previous response with id "),
    # tool_choice naming a tool that is not in tools, or forcing a call with none to call.
    (CALLS, None, r"`tool_choice` (names |requires a call but no `tools` are given)"),
    # A conversation the model's chat template refuses, or with no turn to answer.
    (CHATS, None, r"chat template render error|the conversation (has no turn before the "
                  r"assistant's prefill|is empty: )"),
    # A JSON Schema the constrained decoder cannot compile.
    ({"/v1/chat/completions", "/v1/responses"}, None,
     r"the response format's JSON schema does not compile: "),
    # A custom tool's grammar the constrained decoder cannot compile.
    ({"/v1/responses"}, None, r"the grammar of custom tool `[^`]+` does not compile: "),
]


def listed_refusal(case, response):
    """The message of the listed refusal `response` is, or None."""
    if response is None or response.status_code != 400:
        return None
    try:
        error = response.json()["error"]
    except Exception:
        return None
    message, code = error.get("message", ""), error.get("code")
    for routes, expected_code, pattern in REFUSALS:
        if case.path in routes and case.method.upper() == "POST" and re.match(pattern, message) \
                and (expected_code is None or code == expected_code):
            return message
    return None


@schemathesis.hook
def filter_failure(context, failure, case, response):
    # Only "schema-valid request rejected" with a listed refusal is dropped (and noted in
    # $RMLX_ST_DROPPED for the test's summary).
    message = listed_refusal(case, response) if failure.code == "ST202" else None
    if message is None:
        return True
    if os.environ.get("RMLX_ST_DROPPED"):
        with open(os.environ["RMLX_ST_DROPPED"], "a") as out:
            out.write(f"{case.method} {case.path}\t{message[:60]}\n")
    return False

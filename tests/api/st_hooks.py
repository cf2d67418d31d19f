"""schemathesis hooks for tests/api: generated bodies name a model the server has, and
downloads a repository the imitation hub serves.

The document cannot list the served models (they are the user's folders), so a generated
`model` would almost always be an unknown id and every case would stop at the 404. Only a
`model` that is already a string is replaced, so a case stays as valid or as invalid as it was
generated. The 404 path for unknown models has its own tests (crates/rmlx-server/tests).
"""

import schemathesis

MODELS = ["qwen3-tiny", "local/qwen3-tiny"]
REPO = "test/qwen3-tiny"


@schemathesis.hook
def map_body(context, body):
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = MODELS[len(body["model"]) % len(MODELS)]
        # Half the download requests name the hub's repository, so jobs exist for the
        # stateful links to follow; the others keep their generated repo (400 or a failed job).
        if isinstance(body.get("repo"), str) and len(body["repo"]) % 2 == 0:
            body["repo"] = REPO
    return body

"""The OpenAPI contract (docs/openapi.yaml) against a real `rmlx serve` on loopback.

1. The served /openapi.json is the committed document.
2. Every documented method and path reaches its handler (no 404 or 405), and a method the
   document does not list for a path is answered 405.
3. schemathesis (pinned in scripts/sdk-venv) runs every check against every operation with
   three fixed seeds, stateful links included (tests/api/schemathesis.toml and st_hooks.py say
   what is configured and why): the coverage phase (the same cases whatever the seed) with the
   first, the fuzzing and stateful phases with each. It finds nothing but the refusals
   docs/SERVER.md lists as ones a schema cannot state, and a failure names its cases.

The server runs on temporary copies of the tiny fixture (stateful runs delete models) with
downloads from the imitation hub crates/rmlx-cli/tests/contract.rs starts (RMLX_TEST_HUB).
Run: cargo test -p rmlx-cli --test contract (needs .venv-sdk: scripts/sdk-venv).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FIXTURE_REPO = "test/qwen3-tiny"  # what the imitation hub serves
SERVED = "qwen3-tiny"  # the --model fixture
LOCAL = "local/qwen3-tiny"  # the copy in --models-dir (deletable)


def start_server(tmp: Path, max_ctx: int = 256, also: tuple = ()):
    """`rmlx serve` on the fixture and its deletable copy (`also`: more model folders)."""
    models = tmp / "models"
    shutil.copytree(ROOT / "tests/fixtures/qwen3-tiny", models / LOCAL)
    empty_cache = tmp / "hf-cache"
    empty_cache.mkdir()
    binary = os.environ.get("RMLX_BIN", str(ROOT / "target/debug/rmlx"))
    server = subprocess.Popen(
        [binary, "serve", "--model", str(ROOT / "tests/fixtures/qwen3-tiny"), "--models-dir",
         str(models), "--hf-cache", str(empty_cache), "--hub-url", os.environ["RMLX_TEST_HUB"],
         "--port", "0", "--no-ui", "--max-ctx", str(max_ctx),
         # Every documented route answers, the disk cache's too.
         "--prefix-disk-dir", str(tmp / "disk-cache"), "--prefix-disk-gb", "1",
         *[arg for folder in also for arg in ("--model", str(folder))]],
        stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
    )
    line = server.stdout.readline()  # "rmlx serve: listening on http://127.0.0.1:PORT"
    assert "listening on http://" in line, f"server did not start: {line!r}"
    return server, line.strip().rsplit(" ", 1)[-1]


def stop_server(process):
    """SIGTERM, then a clean exit; a server that had already died says by which signal."""
    died = process.poll()
    process.terminate()
    code = process.wait(timeout=60)
    if died is not None:
        cause = signal.Signals(-died).name if died < 0 else f"exit status {died}"
        pytest.fail(f"the server died during the test ({cause}); schemathesis' output above "
                    "lists the requests it sent last")
    assert code == 0, f"the server did not exit cleanly on SIGTERM (status {code})"


@pytest.fixture
def server(tmp_path):
    process, url = start_server(tmp_path)
    try:
        yield url
    finally:
        stop_server(process)


def call(url, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def committed():
    return yaml.safe_load((ROOT / "docs/openapi.yaml").read_text())


def test_served_document_is_the_committed_one(server):
    status, body, headers = call(server, "GET", "/openapi.json")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body) == committed(), \
        "docs/openapi.yaml is stale: cargo run -p rmlx-cli -- openapi > docs/openapi.yaml"


# A request each documented operation can take; a new route fails the test until it has one.
BODIES = {
    ("post", "/v1/chat/completions"):
        {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ("post", "/v1/completions"): {"model": SERVED, "prompt": "Hi", "max_tokens": 2},
    ("post", "/v1/responses"): {"model": SERVED, "input": "Hi", "max_output_tokens": 2},
    ("post", "/v1/messages"):
        {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ("post", "/v1/messages/count_tokens"):
        {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}]},
    ("post", "/admin/downloads"): {"repo": FIXTURE_REPO},
}
METHODS = ["get", "post", "put", "patch", "delete"]


def test_every_documented_operation_is_routed(server):
    paths = committed()["paths"]
    status, body, _ = call(server, "POST", "/admin/downloads", {"repo": FIXTURE_REPO})
    assert status == 202, body
    job = json.loads(body)["id"]
    ids = {"/v1/models/": urllib.parse.quote(SERVED, safe=""), "/admin/downloads/": job}
    operations = sorted((path, method) for path, item in paths.items() for method in item
                        if method in METHODS)
    # Deletes go last: the other routes of the model and the job need them.
    operations.sort(key=lambda op: op[1] == "delete")
    seen = []
    for path, method in operations:
        concrete = path
        for prefix, value in ids.items():
            if path.startswith(prefix):
                concrete = path.replace("{id}", value)
        if (path, method) == ("/v1/models/{id}", "delete"):
            concrete = "/v1/models/" + urllib.parse.quote(LOCAL, safe="")
        body = BODIES.get((method, path))
        if method == "post" and "{id}" not in path:
            assert body is not None, f"no request body for POST {path}: add one to BODIES"
        status, answer, _ = call(server, method.upper(), concrete, body)
        seen.append(f"{method.upper()} {concrete} -> {status}")
        assert status not in (404, 405) and status < 500, f"{seen[-1]}: {answer[:300]!r}"
        # Pause and resume may find the job done (409): routed, not missing.
        if path.startswith("/admin/downloads/{id}/"):
            assert status in (200, 409), seen[-1]
        else:
            assert status in (200, 202), f"{seen[-1]}: {answer[:300]!r}"
    print("\n".join(seen))
    # What a path does not document is refused as such, not as a missing route.
    for path, item in paths.items():
        concrete = path.replace("{id}", urllib.parse.quote(SERVED, safe="") if "models" in path
                                else job)
        for method in METHODS:
            if method in item:
                continue
            status, answer, headers = call(server, method.upper(), concrete)
            assert status == 405, f"{method.upper()} {concrete} -> {status}: {answer[:200]!r}"
            allowed = {m.strip().lower() for m in headers.get("allow", "").split(",") if m.strip()}
            assert allowed >= {m for m in item if m in METHODS}, (concrete, headers)


# Three fixed seeds; the coverage phase derives its cases from the document alone, so it runs
# once, with the first.
SEEDS = [20261205, 20260126, 7]


def failures_of(output):
    """The failing cases schemathesis printed (each with its curl reproduction)."""
    match = re.search(r"=+ FAILURES =+\n(.*?)\n=+ (WARNINGS|SUMMARY) =+", output, re.S)
    return match.group(1).strip() if match else output[-6000:]


@pytest.mark.parametrize("seed", SEEDS)
def test_schemathesis_finds_nothing(tmp_path, seed):
    process, url = start_server(tmp_path)
    report, dropped = tmp_path / "junit.xml", tmp_path / "dropped.txt"
    phases = "examples,coverage,fuzzing,stateful" if seed == SEEDS[0] else "fuzzing,stateful"
    try:
        started = time.monotonic()
        result = subprocess.run(
            [str(Path(sys.executable).parent / "schemathesis"),
             "--config-file", str(HERE / "schemathesis.toml"),
             "run", f"{url}/openapi.json", "--seed", str(seed), "--phases", phases,
             "--report", "junit", "--report-junit-path", str(report)],
            cwd=HERE, env={**os.environ, "SCHEMATHESIS_HOOKS": "st_hooks",
                           "PYTHONPATH": str(HERE), "NO_COLOR": "1",
                           "RMLX_ST_DROPPED": str(dropped)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
        )
        # The listed refusals st_hooks.py let pass, by route and message.
        kinds = Counter(dropped.read_text().splitlines() if dropped.exists() else [])
        print("listed refusals dropped:", dict(kinds) or "none")
        cases = re.search(r"(\d+) generated", result.stdout)
        print(result.stdout[-3000:])
        print(f"schemathesis seed {seed} ({phases}): {cases.group(1) if cases else '?'} cases, "
              f"{time.monotonic() - started:.0f} s")
        assert result.returncode == 0, (
            f"schemathesis (seed {seed}, phases {phases}) found failures:\n\n"
            + failures_of(result.stdout))
    finally:
        stop_server(process)

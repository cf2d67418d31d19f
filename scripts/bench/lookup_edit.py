#!/usr/bin/env python3
"""Prompt lookup on agents' copy-heavy answers: `rmlx serve --speculative off | lookup | auto`
on the scripted Qwen3.6-35B-A3B-structured fixture (tests/fixtures/agents/, issue 30's CPU bench).

Each request is one of the fixture's golden `*-result` turns: a coding agent's conversation
(a 30k-character or a one-sentence system prompt, the tool call, the tool's result holding a
nonce) whose greedy answer copies the nonce out of the result, as an edit copies code: `Let me
answer.</think>The file says: qxbegin <the nonce> qxend.` Prompt lookup drafts what it has seen
before: the reasoning line from the call turn, the nonce from the tool result.
The three servers run side by side on 127.0.0.1 (prefix caches off, so every request is
prefilled anew); each is warmed up on every case first; then each run sends every case to each
server in turn, the order rotating per run. The answers must be equal across modes. Per mode:
the server's own decode tok/s (tokens after the first over the time since the first) and the
request's total time, medians with min-max, and the ratio to `off` per request.

Usage: lookup_edit.py --rmlx BIN [--runs 10] [--cases short|long|all] [--json-out PATH]
"""

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from concurrency import Server, free_port  # noqa: E402

FIXTURE = HERE.parent.parent / "tests/fixtures/agents/qwen3.6-35b-a3b-scripted"
MODES = ["off", "lookup", "auto"]


def complete(server, prompt_ids):
    body = {"model": FIXTURE.name, "prompt": prompt_ids, "max_tokens": 96, "temperature": 0}
    request = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rmlx", required=True)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--cases", default="short", help="short (one-sentence system prompt), long (30k characters) or all")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    golden = json.loads((FIXTURE / "golden.json").read_text())
    cases = [case for case in golden["cases"] if case["name"].endswith("-result")
             and (args.cases == "all" or case["name"].startswith(args.cases))]
    log_dir = Path("/tmp/rmlx-lookup-bench")
    log_dir.mkdir(exist_ok=True)
    servers = {}
    for mode in MODES:
        port = free_port()
        command = [args.rmlx, "serve", "--model", str(FIXTURE), "--port", str(port), "--speculative", mode,
                   "--prefix-cache-mb", "0", "--prefix-snapshot-mb", "0", "--prefix-disk-gb", "0", "--no-ui"]
        servers[mode] = Server(mode, command, port, log_dir / f"{mode}.log")
    try:
        for mode, server in servers.items():
            for case in cases:
                complete(server, case["prompt_ids"])
        rows = {mode: [] for mode in MODES}
        for run in range(args.runs):
            for case in cases:
                order = MODES[run % 3:] + MODES[:run % 3]
                replies = {mode: complete(servers[mode], case["prompt_ids"]) for mode in order}
                texts = {mode: reply["choices"][0]["text"] for mode, reply in replies.items()}
                if len(set(texts.values())) != 1:
                    raise SystemExit(f"answers differ on {case['name']}: {texts}")
                for mode, reply in replies.items():
                    timings = reply["timings"]
                    rows[mode].append({"case": case["name"], "tokens": reply["usage"]["completion_tokens"],
                                       "decode_tps": timings["decode_tps"], "total_ms": timings["total_ms"],
                                       "drafted": timings["draft_tokens"], "kept": timings["accepted_tokens"]})
    finally:
        for server in servers.values():
            server.close()

    def summary(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    result = {"cases": [case["name"] for case in cases], "runs": args.runs, "modes": {}}
    for mode in MODES:
        own = rows[mode]
        result["modes"][mode] = {
            "decode_tps": summary([r["decode_tps"] for r in own]),
            "total_ms": summary([r["total_ms"] for r in own]),
            "decode_ratio_to_off": summary([r["decode_tps"] / o["decode_tps"] for r, o in zip(own, rows["off"])]),
            "total_ratio_off_over_mode": summary([o["total_ms"] / r["total_ms"] for r, o in zip(own, rows["off"])]),
            "tokens_per_answer": summary([r["tokens"] for r in own]),
            "drafted": sum(r["drafted"] for r in own),
            "kept": sum(r["kept"] for r in own),
        }
    print(json.dumps(result, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Turn 2 of a conversation after `rmlx serve` restarted: read back from the disk prefix cache
vs prefilled cold (issue 29's benchmark).

Each run draws a fresh conversation (seeded random words, a first user message of --words words,
then turn 1's answer and a short question), so no run can hit another's files:
1. server A (disk cache in a fresh folder) answers turn 1 (--turn1-tokens tokens), and waits
   until its writer has put every file on disk (/metrics/cache `disk_cache.files` steady);
2. A stops (SIGTERM) and server B starts on the same folder: turn 2's TTFT is "from disk", with
   the bytes read and the reader's time (`disk_cache.read_bytes`, `read_ms`: the read rate);
3. server C, disk cache off, answers the same turn 2: "cold" (a whole prefill).
With --drop-caches (root) the page cache is dropped before each of B and C start, so B reads
the files from the device, not from memory (the `dropped` field says whether it worked).
Every server is warmed up before its timed request at the same prompt length with another
conversation (B and C both answer a warm-up turn 2 of their own first; B's comes off the disk
too, so its read path is warm). Runs alternate which of B and C goes first. TTFT is the
server's own (the `timings.ttft_ms` of the answer: from the request reaching the engine to the
first token; both include the reads). Medians with min-max over runs; the ratio is cold/disk.

Usage: disk_restart.py --model DIR --rmlx BIN [--words 6000] [--runs 3] [--json-out PATH]
                       [--rmlx-args "..."] [--log-dir DIR]
"""

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import WORDS  # noqa: E402
from concurrency import Server, free_port  # noqa: E402


def post(server, path, body):
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as error:
        raise SystemExit(f"{server.name} {path}: {error.code} {error.read().decode(errors='replace')}")


def get(server, path):
    with urllib.request.urlopen(server.base + path, timeout=60) as r:
        return json.loads(r.read())


def conversation(seed, n_words):
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return [{"role": "user", "content": f"Conversation {seed}. {text}"}]


def chat(server, model, messages, max_tokens, what=""):
    sent = time.perf_counter()
    reply = post(server, "/v1/chat/completions",
                 {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    # Progress on stderr: a long prefill on a new machine compiles kernels for minutes.
    usage = reply["usage"]
    print(f"  {server.name} {what}: {usage['prompt_tokens']} prompt tokens "
          f"({usage['prompt_tokens_details']['cached_tokens']} cached) in {time.perf_counter() - sent:.1f} s",
          file=sys.stderr, flush=True)
    return reply


def turn2(messages, answer):
    return messages + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": "Thanks. And what comes next?"}]


def wait_for_writer(server):
    """Until the disk cache's file count has not changed for a second."""
    last, steady_since = None, time.time()
    while True:
        files = get(server, "/metrics/cache")["disk_cache"]["files"]
        if files != last:
            last, steady_since = files, time.time()
        elif time.time() - steady_since > 1.0 and files > 0:
            return files
        time.sleep(0.1)


def drop_page_cache():
    """Writes dirty pages and drops the page cache (root only); whether it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def start(args, name, disk, log_dir, disk_on=True):
    extra = shlex.split(args.rmlx_args)
    flags = ["--prefix-disk-dir", str(disk)] if disk_on else ["--prefix-disk-gb", "0"]
    port = free_port()
    command = [args.rmlx, "serve", "--model", args.model, "--port", str(port), *flags, *extra]
    return Server(name, command, port, Path(log_dir) / f"{name}.log")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rmlx", required=True)
    ap.add_argument("--words", type=int, default=6000, help="words of the first user message")
    ap.add_argument("--turn1-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rmlx-args", default="")
    ap.add_argument("--json-out")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before B and C (root)")
    ap.add_argument("--log-dir", help="keep the servers' logs here (default: a scratch folder)")
    args = ap.parse_args()
    model = Path(args.model).name
    rows = []
    with tempfile.TemporaryDirectory(prefix="rmlx-disk-bench-") as scratch:
        logs = args.log_dir or scratch
        Path(logs).mkdir(parents=True, exist_ok=True)
        for run in range(args.runs):
            disk = Path(scratch) / f"cache-{run}"
            warm_seed, seed = 1000 + 2 * run, 1001 + 2 * run
            # 1. Turn 1 of the measured conversation and of the warm-up one.
            server = start(args, f"a{run}", disk, logs)
            firsts = {}
            for s in (warm_seed, seed):
                messages = conversation(s, args.words)
                reply = chat(server, model, messages, args.turn1_tokens, f"turn 1 of {s}")
                firsts[s] = (messages, reply["choices"][0]["message"]["content"] or "")
            files = wait_for_writer(server)
            written = get(server, "/metrics/cache")["disk_cache"]["written_bytes"]
            server.close()
            order = ("disk", "cold") if run % 2 == 0 else ("cold", "disk")
            row = {"run": run, "files": files, "written_bytes": written}
            for kind in order:
                if args.drop_caches:
                    row["dropped"] = drop_page_cache()
                server = start(args, f"{kind}{run}", disk, logs, disk_on=kind == "disk")
                warm = turn2(*firsts[warm_seed])
                chat(server, model, warm, 1, "warm-up turn 2")
                before = get(server, "/metrics/cache")["disk_cache"] if kind == "disk" else None
                reply = chat(server, model, turn2(*firsts[seed]), 1, "measured turn 2")
                after = get(server, "/metrics/cache")["disk_cache"] if kind == "disk" else None
                server.close()
                usage = reply["usage"]
                row[kind] = {"ttft_ms": reply["timings"]["ttft_ms"], "prompt_tokens": usage["prompt_tokens"],
                             "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
                if kind == "disk":
                    read = after["read_bytes"] - before["read_bytes"]
                    read_ms = after["read_ms"] - before["read_ms"]
                    row[kind].update(read_bytes=read, read_ms=read_ms,
                                     read_gb_s=read / max(read_ms, 1e-9) / 1e6)
            print(json.dumps(row), flush=True)
            rows.append(row)

    def summary(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    result = {
        "model": args.model, "words": args.words, "runs": rows,
        "prompt_tokens": rows[0]["disk"]["prompt_tokens"],
        "cached_tokens": summary([r["disk"]["cached_tokens"] for r in rows]),
        "ttft_disk_ms": summary([r["disk"]["ttft_ms"] for r in rows]),
        "ttft_cold_ms": summary([r["cold"]["ttft_ms"] for r in rows]),
        "ratio_cold_over_disk": summary([r["cold"]["ttft_ms"] / r["disk"]["ttft_ms"] for r in rows]),
        "read_gb_s": summary([r["disk"]["read_gb_s"] for r in rows]),
        "read_mb": summary([r["disk"]["read_bytes"] / 1e6 for r in rows]),
        "written_mb_per_conversation": summary([r["written_bytes"] / 2e6 for r in rows]),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

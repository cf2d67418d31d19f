#!/usr/bin/env python3
"""Concurrent streams through `rmlx serve` and through mlx-lm's server on one checkpoint.

Both servers run on 127.0.0.1 on the same MLX backend and get the same requests: streaming
`/v1/completions`, greedy, `max_tokens` tokens each (EOS kept out with the same logit bias on
both), N requests sent at once. Each run draws fresh prompts (seeded random words, a different
seed per run, stream and N), so neither server's prompt cache can serve a timed run. Both are
warmed up at every measured N first; runs are interleaved (the order alternates each run).

Per N and server: aggregate tok/s = all streams' tokens / (first request sent .. last stream
done); per-stream tok/s = (tokens - 1) / (first token .. last token) of each stream; TTFT =
request sent .. first text chunk, p50 and p95 over all streams of all runs. Medians over runs
with min-max. Every stream must end with finish_reason "length" after exactly max_tokens.

Usage: concurrency.py --model DIR --rmlx BIN [--streams 1,4,8] [--runs 5] [--max-tokens 128]
                      [--prompt-words 48] [--rmlx-args "--max-batch 8"] [--json-out PATH]
"""

import argparse
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import WORDS, eos_ids, stop_server  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, command, port, log_path):
        self.name, self.port = name, port
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    r.read()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"{name} did not come up (see {log_path})")
                time.sleep(0.3)

    def close(self):
        stop_server(self.proc, self.log)


def stream_one(server, model, prompt, max_tokens, bias, out):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "logit_bias": {str(k): v for k, v in bias.items()}}
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    stamps, finish, text, batched = [], None, "", None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            batched = (chunk.get("timings") or {}).get("batched_with", batched)
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text += choice["text"]
                finish = choice.get("finish_reason") or finish
    out.append({"sent": sent, "stamps": stamps, "finish": finish, "text": text, "batched_with": batched})


def at_once(target, calls):
    """Runs `target(*args)` for every args of `calls` in threads started together; the wall
    seconds from the first start to the last end."""
    threads = [threading.Thread(target=target, args=args) for args in calls]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def burst(server, model, prompts, max_tokens, bias):
    results = []
    wall = at_once(stream_one, [(server, model, p, max_tokens, bias, results) for p in prompts])
    if len(results) != len(prompts):
        raise SystemExit(f"{server.name}: {len(prompts) - len(results)} streams failed (see its log)")
    for r in results:
        if r["finish"] != "length" or not r["stamps"]:
            raise SystemExit(f"{server.name}: a stream ended with {r['finish']!r} after {len(r['stamps'])} chunks")
    tokens = max_tokens * len(prompts)
    ttfts = [(r["stamps"][0] - r["sent"]) * 1000 for r in results]
    per_stream = [(max_tokens - 1) / (r["stamps"][-1] - r["stamps"][0]) for r in results if len(r["stamps"]) > 1]
    # rmlx reports how many requests decoded together (`timings.batched_with`); mlx-lm does not.
    widest = max((r["batched_with"] or 0) for r in results)
    return {"aggregate_tps": tokens / wall, "wall_s": wall, "ttft_ms": ttfts,
            "per_stream_tps": per_stream, "batched_with": widest or None}


def prompts_for(seed, count, words):
    out = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        out.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    return out


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rmlx", required=True)
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--rmlx-args", default="", help="extra `rmlx serve` arguments")
    parser.add_argument("--mlx-lm-args", default="", help="extra `mlx_lm.server` arguments")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    streams = [int(n) for n in args.streams.split(",")]
    bias = {i: -1e9 for i in eos_ids(args.model)}

    rport, mport = free_port(), free_port()
    # No disk prefix cache: the seeded prompts repeat from one invocation to the next.
    rmlx = Server("rmlx", [args.rmlx, "serve", "--model", args.model, "--port", str(rport),
                           "--prefix-disk-gb", "0", *shlex.split(args.rmlx_args)], rport,
                  "/tmp/bench-concurrency-rmlx.log")
    try:
        mlx_lm = Server("mlx_lm", [sys.executable, "-m", "mlx_lm.server", "--model", args.model,
                                   "--port", str(mport), *shlex.split(args.mlx_lm_args)],
                        mport, "/tmp/bench-concurrency-mlx-lm.log")
    except SystemExit:
        rmlx.close()
        raise
    servers = [rmlx, mlx_lm]
    # rmlx names a model by its folder; mlx-lm's server maps "default_model" to its --model.
    models = {"rmlx": Path(args.model).name, "mlx_lm": "default_model"}
    results = {s.name: {n: [] for n in streams} for s in servers}
    try:
        for n in streams:
            for s in servers:
                t0 = time.perf_counter()
                burst(s, models[s.name], prompts_for(900 + n, n, args.prompt_words), args.max_tokens, bias)
                print(f"warm-up {s.name} x{n}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for run in range(args.runs):
            for n in streams:
                prompts = prompts_for(10_000 + run * 100 + n, n, args.prompt_words)
                order = servers if run % 2 == 0 else servers[::-1]
                for s in order:
                    r = burst(s, models[s.name], prompts, args.max_tokens, bias)
                    results[s.name][n].append(r)
                    print(f"run {run + 1} x{n} {s.name}: {r['aggregate_tps']:.1f} tok/s, "
                          f"TTFT p50 {statistics.median(r['ttft_ms']):.0f} ms"
                          + (f", batched {r['batched_with']}" if r["batched_with"] else ""), file=sys.stderr)
    finally:
        for s in servers:
            s.close()

    def spread(values):
        return f"{min(values):.1f}-{max(values):.1f}"

    print(f"model {args.model}  max_tokens {args.max_tokens}  prompt ~{args.prompt_words} words  runs {args.runs} "
          f"(medians; min-max)")
    print(f"{'streams':>7s} {'rmlx tok/s':>22s} {'mlx-lm tok/s':>22s} {'ratio':>6s} {'rmlx vs 1 stream':>17s} "
          f"{'rmlx TTFT p50/p95 ms':>21s} {'mlx-lm TTFT p50/p95':>20s} {'per-stream rmlx/mlx-lm':>23s}")
    table = []
    for n in streams:
        row = {"streams": n}
        for s in servers:
            runs = results[s.name][n]
            agg = [r["aggregate_tps"] for r in runs]
            ttft = [t for r in runs for t in r["ttft_ms"]]
            per = [t for r in runs for t in r["per_stream_tps"]]
            row[s.name] = {"aggregate_tps": statistics.median(agg), "aggregate_spread": [min(agg), max(agg)],
                           "ttft_p50_ms": pct(ttft, 0.5), "ttft_p95_ms": pct(ttft, 0.95),
                           "per_stream_tps": statistics.median(per) if per else 0.0, "runs": runs}
        one = statistics.median(r["aggregate_tps"] for r in results["rmlx"][streams[0]])
        r_, m_ = row["rmlx"], row["mlx_lm"]
        print(f"{n:7d} {r_['aggregate_tps']:9.1f} ({spread([x['aggregate_tps'] for x in r_['runs']]):>11s}) "
              f"{m_['aggregate_tps']:9.1f} ({spread([x['aggregate_tps'] for x in m_['runs']]):>11s}) "
              f"{r_['aggregate_tps'] / m_['aggregate_tps']:5.2f}x {r_['aggregate_tps'] / one:16.2f}x "
              f"{r_['ttft_p50_ms']:10.0f}/{r_['ttft_p95_ms']:<10.0f} {m_['ttft_p50_ms']:9.0f}/{m_['ttft_p95_ms']:<10.0f} "
              f"{r_['per_stream_tps']:11.1f}/{m_['per_stream_tps']:<11.1f}")
        table.append(row)
    print(f"(ratio > 1 means rmlx is faster; 'vs 1 stream' divides by rmlx's x{streams[0]} aggregate)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                                   "runs": args.runs, "table": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()

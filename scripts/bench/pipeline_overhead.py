#!/usr/bin/env python3
"""What a two-rank pipeline costs against one process (issue 33 e): `rmlx generate` of the same
prompt as one process and as two ranks over the ring on loopback (one machine, so this is the
overhead of the pipeline's messages and of each rank waiting for the other, not a speed-up).

Runs alternate between the two, each a fresh process (or pair), greedy, EOS ignored, and read
the engine's own timings from `--json` (TTFT from request start to the first token, decode tok/s
between the first and the last). Every run uses another prompt (no cache is involved: each
process serves one request). Prints medians with min-max and the ratios.

Usage: pipeline_overhead.py --rmlx BIN --model DIR [--runs 5] [--tokens 128] [--words 200]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("river stone cloud lantern harbor meadow copper thistle orbit candle falcon "
         "glacier ember quartz willow summit").split()


def prompt(run, words):
    return " ".join(WORDS[(run * 7 + i * 3) % len(WORDS)] for i in range(words))


def free_ports():
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise SystemExit("no two consecutive free ports")


def generate(args, text, extra=()):
    return [args.rmlx, "generate", "--model", args.model, "--prompt", text, "--max-tokens",
            str(args.tokens), "--temperature", "0", "--ignore-eos", "--speculative", "off", "--json",
            *extra]


def one_process(args, text):
    out = subprocess.run(generate(args, text), capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def two_ranks(args, text):
    port = free_ports()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"backend": "ring", "port": port, "hosts": [{"ip": "127.0.0.1"}, {"ip": "127.0.0.1"}]}, f)
        hostfile = f.name
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    try:
        follower = subprocess.Popen(generate(args, text, ["--distributed", hostfile, "--rank", "1"]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        leader = subprocess.run(generate(args, text, ["--distributed", hostfile, "--rank", "0"]),
                                capture_output=True, text=True, timeout=600, env=env)
        follower.wait(timeout=60)
        if leader.returncode != 0:
            raise SystemExit(f"rank 0 failed: {leader.stderr}")
        return json.loads(leader.stdout)
    finally:
        os.unlink(hostfile)


def spread(values):
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rmlx", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    # Warm-up of both (MLX's compiled kernels, the page cache), not timed.
    one_process(args, prompt(999, args.words))
    two_ranks(args, prompt(998, args.words))
    results = {"one": [], "two": []}
    for run in range(args.runs):
        text = prompt(run, args.words)
        order = [("one", one_process), ("two", two_ranks)]
        for name, call in (order if run % 2 == 0 else order[::-1]):
            out = call(args, text)
            results[name].append({"ttft_ms": out["timings"]["ttft_ms"], "decode_tps": out["timings"]["decode_tps"],
                                  "prompt_tokens": out["prompt_tokens"], "token_ids": out["token_ids"]})
        same = results["one"][-1]["token_ids"] == results["two"][-1]["token_ids"]
        print(f"run {run + 1}: " + "  ".join(
            f"{k} ttft {v[-1]['ttft_ms']:.1f} ms decode {v[-1]['decode_tps']:.1f} tok/s" for k, v in results.items())
            + ("" if same else "  (ANSWERS DIFFER)"), file=sys.stderr)
    print(f"model {args.model}, prompt {results['one'][0]['prompt_tokens']} tokens, {args.tokens} generated, "
          f"{args.runs} runs (median, min-max)")
    for key, label in (("ttft_ms", "TTFT ms"), ("decode_tps", "decode tok/s")):
        one = [r[key] for r in results["one"]]
        two = [r[key] for r in results["two"]]
        print(f"{label:14s} one process {spread(one):>24s}   two ranks {spread(two):>24s}   "
              f"two / one {statistics.median(two) / statistics.median(one):.3f}")
    one_ms = 1000 / statistics.median([r["decode_tps"] for r in results["one"]])
    two_ms = 1000 / statistics.median([r["decode_tps"] for r in results["two"]])
    print(f"per-token overhead of the pipeline: {two_ms - one_ms:.2f} ms ({one_ms:.2f} -> {two_ms:.2f} ms a token)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

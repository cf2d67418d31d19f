#!/usr/bin/env python3
"""First use of a freshly started `rmlx serve` (issue 32 a): how long a user waits after loading.

Each run starts a new server process with an empty MLX kernel cache (MLX keeps the kernels it
compiles at run time under $TMPDIR/mlx, so every run gets its own fresh TMPDIR unless
--keep-kernels), then, one after another:
  1. the first request (1 stream, one token, timed by the client): load start -> its first
     token, which includes the server's start (to /health), the model's load and the warm-up
     (`--warm-up on`, the default), each reported apart (/v1/models), and what is left;
  2. a second single request (the one-stream aggregate, warm at width 1);
  3. the first burst of N concurrent requests after load;
  4. a second burst of N (fresh prompts): the warm burst.
Every request is streaming `/v1/completions` (greedy unless --temperature), `max_tokens` tokens, EOS kept out, fresh
prompts (no prompt cache can serve them; the disk cache is off). Medians over runs, min-max.

Usage: first_use.py --model DIR --rmlx BIN [--streams 8] [--runs 3] [--max-tokens 128]
                    [--prompt-words 200] [--temperature T] [--rmlx-args "..."] [--keep-kernels] [--json-out PATH]
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import eos_ids  # noqa: E402
from concurrency import Server, at_once, free_port, prompts_for  # noqa: E402


def stream_one(server, model, prompt, max_tokens, bias, temperature, out):
    """One streaming request; the server's own `timings` (TTFT) from its last chunk, so a model
    whose tokens decode to no text (the bench checkpoints' tiny vocabularies) is timed too."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "logit_bias": {str(k): v for k, v in bias.items()}}
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    finish, timings = None, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
    out.append({"finish": finish, "timings": timings})


def burst(server, model, prompts, max_tokens, bias, temperature=0.0):
    results = []
    wall = at_once(stream_one, [(server, model, p, max_tokens, bias, temperature, results)
                                for p in prompts])
    if len(results) != len(prompts) or any(r["finish"] != "length" or not r["timings"] for r in results):
        raise SystemExit(f"rmlx: a stream failed or ended early: {results}")
    return {"aggregate_tps": max_tokens * len(prompts) / wall, "wall_s": wall,
            "ttft_ms": [r["timings"]["ttft_ms"] for r in results]}


def one_run(args, run, bias):
    env_tmp = None if args.keep_kernels else tempfile.mkdtemp(prefix="rmlx-first-use-")
    port = free_port()
    command = [args.rmlx, "serve", "--model", args.model, "--port", str(port), "--prefix-disk-gb", "0",
               *shlex.split(args.rmlx_args)]
    saved = os.environ.get("TMPDIR")
    if env_tmp:
        os.environ["TMPDIR"] = env_tmp  # the server inherits it: MLX's kernel cache starts empty
    start = time.perf_counter()
    try:
        server = Server("rmlx", command, port, f"/tmp/bench-first-use-rmlx-{run}.log")
    finally:
        if env_tmp:
            if saved is None:
                os.environ.pop("TMPDIR")
            else:
                os.environ["TMPDIR"] = saved
    loaded = time.perf_counter()
    model = Path(args.model).name
    seed = 20_000 + run * 1000
    try:
        # One token, timed by the client: its wait behind the warm-up (the server's TTFT
        # starts at admission) counts.
        asked = time.perf_counter()
        first = burst(server, model, prompts_for(seed, 1, args.prompt_words), 1, bias)
        first_token_s = asked - start + first["wall_s"]
        one = burst(server, model, prompts_for(seed + 1, 1, args.prompt_words), args.max_tokens, bias,
                    args.temperature)
        cold = burst(server, model, prompts_for(seed + 2, args.streams, args.prompt_words), args.max_tokens,
                     bias, args.temperature)
        warm = burst(server, model, prompts_for(seed + 3, args.streams, args.prompt_words), args.max_tokens,
                     bias, args.temperature)
        # The server's warm-up after loading (`--warm-up on`, the default): the first request
        # waited for it; null with --warm-up off.
        listed = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60).read())
        entry = next((m for m in listed["data"] if m["id"] == model), {})
        warm_up_s, model_load_s = entry.get("warm_up_seconds"), entry.get("load_seconds")
    finally:
        server.close()
    kernels = None
    if env_tmp:
        kernels = sum(len(files) for _, _, files in os.walk(Path(env_tmp) / "mlx"))
    # What the first request waited beyond the server's start, the model's load and the warm-up
    # (issue 32's target: at most 2x a warm request's TTFT).
    beyond = None
    if warm_up_s is not None and model_load_s is not None:
        beyond = first_token_s - (loaded - start) - model_load_s - warm_up_s
    result = {"load_s": loaded - start, "first_token_s": first_token_s, "warm_up_s": warm_up_s,
              "model_load_s": model_load_s, "first_token_beyond_s": beyond,
              "first_request_ttft_ms": first["ttft_ms"][0], "one_stream_ttft_ms": one["ttft_ms"][0],
              "one_stream_tps": one["aggregate_tps"],
              "first_burst_tps": cold["aggregate_tps"], "warm_burst_tps": warm["aggregate_tps"],
              "first_burst_ttft_p50_ms": statistics.median(cold["ttft_ms"]),
              "warm_burst_ttft_p50_ms": statistics.median(warm["ttft_ms"]), "kernel_cache_files": kernels}
    print(f"run {run + 1}: load {result['load_s']:.2f} s, first token {first_token_s:.2f} s (warm-up {warm_up_s} s), one stream "
          f"{one['aggregate_tps']:.0f} tok/s, first burst x{args.streams} {cold['aggregate_tps']:.0f}, warm "
          f"{warm['aggregate_tps']:.0f}, kernel cache files {kernels}", file=sys.stderr)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rmlx", required=True)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the timed streams' temperature (agents sample at 1; the first request stays greedy)")
    parser.add_argument("--rmlx-args", default="", help="extra `rmlx serve` arguments")
    parser.add_argument("--keep-kernels", action="store_true",
                        help="share this process's TMPDIR (MLX's kernel cache may already be warm)")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    bias = {i: -1e9 for i in eos_ids(args.model)}
    runs = [one_run(args, r, bias) for r in range(args.runs)]

    def cell(key, fmt="{:.2f}"):
        values = [r[key] for r in runs]
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    ratios = {"first_burst_vs_one": [r["first_burst_tps"] / r["one_stream_tps"] for r in runs],
              "warm_burst_vs_one": [r["warm_burst_tps"] / r["one_stream_tps"] for r in runs]}
    for r, fb, wb in zip(runs, ratios["first_burst_vs_one"], ratios["warm_burst_vs_one"]):
        r["first_burst_vs_one"], r["warm_burst_vs_one"] = fb, wb
    print(f"model {args.model}  max_tokens {args.max_tokens}  prompt ~{args.prompt_words} words  "
          f"{args.streams} streams  runs {args.runs} (medians; min-max)")
    print(f"  load (start -> /health)         {cell('load_s')} s")
    print(f"  load start -> first token       {cell('first_token_s')} s")
    if all(r["model_load_s"] is not None for r in runs):
        print(f"  of which the model's load       {cell('model_load_s')} s")
    if all(r["warm_up_s"] is not None for r in runs):
        print(f"  of which the warm-up            {cell('warm_up_s')} s")
    if all(r["first_token_beyond_s"] is not None for r in runs):
        print(f"  the rest (target <= 2x warm TTFT) {cell('first_token_beyond_s', '{:.3f}')} s")
    print(f"  a warm request's TTFT           {cell('one_stream_ttft_ms', '{:.0f}')} ms")
    print(f"  one stream                      {cell('one_stream_tps', '{:.0f}')} tok/s")
    print(f"  first burst x{args.streams:<3d}               {cell('first_burst_tps', '{:.0f}')} tok/s, "
          f"{cell('first_burst_vs_one')}x one stream, TTFT p50 {cell('first_burst_ttft_p50_ms', '{:.0f}')} ms")
    print(f"  warm burst x{args.streams:<3d}                {cell('warm_burst_tps', '{:.0f}')} tok/s, "
          f"{cell('warm_burst_vs_one')}x one stream, TTFT p50 {cell('warm_burst_ttft_p50_ms', '{:.0f}')} ms")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": args.model, "streams": args.streams,
                                                   "max_tokens": args.max_tokens, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

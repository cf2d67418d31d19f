#!/usr/bin/env python3
"""A burst of chats with pictures through two `rmlx serve` builds (A/B) on one vision checkpoint.

N requests are sent at once to `/v1/chat/completions`, each a user turn holding one picture
and a few words: non-streaming, greedy, `max_tokens` 1 (what is measured is the wait for the
first token: the vision tower, the placement of its features and the prompt's prefill). Every
run draws fresh pictures (seeded random pixels, a different seed per run and stream, all
SIZE x SIZE, so their image blocks have one length) and fresh words, so no prefix cache can
serve a timed run. Both servers are warmed up with one burst at the measured N and size first;
timed runs alternate the order of the two servers.

Per build: the burst's wall time (first request sent .. last answer), TTFT per request (the
server's `timings.ttft_ms`: queue, vision tower and prefill) p50 / p95 over every request of
every run, and how many prompts' image blocks went through one forward
(`timings.images_prefilled_with`, absent in builds before it). Medians over runs with min-max.

Usage: image_burst.py --model DIR --a BIN --b BIN [--streams 4] [--size 256] [--runs 5]
                      [--words 24] [--openblas LIB] [--json-out PATH]
"""

import argparse
import base64
import io
import json
import os
import random
import statistics
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import WORDS  # noqa: E402
from concurrency import Server, at_once, free_port, pct  # noqa: E402

try:
    from PIL import Image
except ImportError:  # pragma: no cover - the reference venv has Pillow (mlx-vlm needs it)
    raise SystemExit("image_burst.py needs Pillow: run it with .venv-ref/bin/python")


def picture(seed, size):
    rng = random.Random(seed)
    pixels = bytes(rng.getrandbits(8) for _ in range(size * size * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (size, size), pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ask(server, body, out):
    req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        answer = json.load(r)
    out.append(answer)


def burst(server, model, seed, streams, size, words):
    bodies = []
    for i in range(streams):
        rng = random.Random(seed * 1000 + i)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        bodies.append({
            "model": model, "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": picture(seed * 1000 + i, size)}},
                {"type": "text", "text": text}]}],
        })
    answers = []
    wall = at_once(ask, [(server, body, answers) for body in bodies])
    if len(answers) != streams:
        raise SystemExit(f"{server.name}: {streams - len(answers)} requests failed (see its log)")
    timings = [a.get("timings") or {} for a in answers]
    return {"wall_s": wall, "ttft_ms": [t.get("ttft_ms", 0.0) for t in timings],
            "images_together": max((t.get("images_prefilled_with") or 0) for t in timings) or None,
            "prompt_tokens": [a["usage"]["prompt_tokens"] for a in answers]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--a", required=True, help="rmlx binary A (before)")
    parser.add_argument("--b", required=True, help="rmlx binary B (after)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--words", type=int, default=24)
    parser.add_argument("--openblas", help="BLAS library both servers preload (LD_PRELOAD): the "
                        "CPU wheel's reference BLAS makes fp32 GEMMs ~20x slower")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if args.openblas:
        os.environ["LD_PRELOAD"] = args.openblas

    servers = []
    for name, binary in (("A", args.a), ("B", args.b)):
        port = free_port()
        command = [binary, "serve", "--model", args.model, "--port", str(port), "--prefix-disk-gb", "0"]
        servers.append(Server(name, command, port, f"/tmp/image_burst_{name}.log"))
    results = {s.name: [] for s in servers}
    model = Path(args.model).name  # rmlx names a model by its folder
    try:
        for server in servers:
            burst(server, model, 999_999, args.streams, args.size, args.words)  # warm-up at the shape
        for run in range(args.runs):
            order = servers if run % 2 == 0 else servers[::-1]
            for server in order:
                results[server.name].append(burst(server, model, run + 1, args.streams, args.size, args.words))
    finally:
        for server in servers:
            server.close()

    summary = {}
    for name, runs in results.items():
        walls = [r["wall_s"] for r in runs]
        ttfts = [t for r in runs for t in r["ttft_ms"]]
        summary[name] = {
            "wall_s": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
            "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p95_ms": pct(ttfts, 0.95),
            "images_together": max((r["images_together"] or 0) for r in runs) or None,
            "prompt_tokens": runs[0]["prompt_tokens"],
        }
        s = summary[name]
        print(f"{name}: burst of {args.streams} pictures {args.size}px: wall {s['wall_s']:.3f} s "
              f"({s['wall_min']:.3f}-{s['wall_max']:.3f}), TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
              f"p95 {s['ttft_p95_ms']:.0f} ms, image blocks together: {s['images_together']}, "
              f"prompt tokens {s['prompt_tokens']}")
    print(f"B / A wall: {summary['B']['wall_s'] / summary['A']['wall_s']:.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "summary": summary,
                                                   "runs": results}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Issue 32 (b): what `rmlx serve` holds after one long prompt, against what MLX says it needs.

Starts `rmlx serve` (no disk cache, no UI) on the model, sends one chat request of `--words`
words (about 6 tokens each on the Qwen vocabulary), waits until the server is idle, and reads:
the process's device memory (nvidia-smi's compute apps) where there is an NVIDIA GPU, its
resident memory otherwise, and MLX's active / peak / cache bytes and the prefix cache's bytes
from /metrics/cache. The target: held <= 1.25 x (MLX peak + prefix cache). Prints one JSON line.

    python3 scripts/bench/memory_after_prompt.py --rmlx target/release/rmlx --model DIR --words 5500
"""

import argparse
import json
import subprocess
import sys
import time
import urllib.request


def http_json(url, body=None, timeout=3600):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def device_bytes(pid):
    """The process's memory on NVIDIA GPUs (None without nvidia-smi)."""
    try:
        out = subprocess.check_output(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for line in out.strip().splitlines():
        owner, used = [part.strip() for part in line.split(",")]
        if owner == str(pid):
            total += int(used) * 1024 * 1024
    return total


def resident_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rmlx", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--words", type=int, default=5500)
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()

    log = open(args.log, "w") if args.log else subprocess.DEVNULL
    server = subprocess.Popen(
        [args.rmlx, "serve", "--model", args.model, "--port", str(args.port), "--no-ui",
         "--prefix-disk-gb", "0"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                models = http_json(f"{base}/v1/models")
                break
            except OSError:
                time.sleep(0.5)
        else:
            sys.exit("the server did not start")
        model_id = models["data"][0]["id"]
        # The server warms the model up after loading it (`--warm-up on`): measure after that.
        for _ in range(1200):
            if models["data"][0].get("warm_up_seconds") is not None:
                break
            time.sleep(0.5)
            models = http_json(f"{base}/v1/models")

        def ask(words):
            text = " ".join(f"word{i % 997} line" for i in range(words))
            return http_json(f"{base}/v1/chat/completions", {
                "model": model_id, "max_tokens": 8,
                "messages": [{"role": "user", "content": text}],
            })

        def settled():
            for _ in range(200):
                metrics = http_json(f"{base}/metrics/cache")
                if metrics["in_flight"] == 0 and metrics["queue_depth"] == 0:
                    break
                time.sleep(0.1)
            time.sleep(1.0)
            metrics = http_json(f"{base}/metrics/cache")
            return {
                "device_bytes": device_bytes(server.pid),
                "resident_bytes": resident_bytes(server.pid),
                "mlx_active_bytes": metrics["active_memory_bytes"],
                "mlx_peak_bytes": metrics["peak_memory_bytes"],
                "mlx_cache_bytes": metrics["cache_memory_bytes"],
                "prefix_cache_bytes": metrics["prefix_cache_bytes"],
            }

        ask(8)
        before = settled()
        started = time.time()
        reply = ask(args.words)
        seconds = time.time() - started
        after = settled()
        held = after["device_bytes"] if after["device_bytes"] else after["resident_bytes"]
        bound = 1.25 * (after["mlx_peak_bytes"] + after["prefix_cache_bytes"])
        print(json.dumps({
            "prompt_tokens": reply["usage"]["prompt_tokens"],
            "seconds": round(seconds, 2),
            "before": before,
            "after": after,
            "held_over_bound": round(held / bound, 3),
        }))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Image prefill: rmlx vs mlx-vlm on one Qwen3-VL checkpoint, same MLX backend.

For each image size a deterministic RGB image is synthesized (.bench/images/bench_<N>.png).
Every run is a fresh process on both sides, one after the other (rmlx, then mlx-vlm), with
the same prompt, the same image file, greedy decoding, one new token and the same prefill
chunk size:

  rmlx     `rmlx generate --model M --image P --prompt Q --max-tokens 1 --temperature 0
            --prefill-chunk C --json`; TTFT = its timings.ttft_ms.
  mlx-vlm  this script's --worker: mlx_vlm.load, apply_chat_template(num_images=1),
            stream_generate(image=[P], max_tokens=1, temperature=0, prefill_step_size=C);
            TTFT = prompt_tokens / prompt_tps (stream_generate's own prompt time).

Both TTFTs cover the same span: from the start of generation, with the image already decoded,
resized and patchified and the prompt tokenized, to the first token on the host; i.e. the
vision tower, the placement of its features and the prefill of every prompt token.
"prefill tok/s" = prompt tokens / TTFT. "wall s" is the whole process (load, Python imports,
image preprocessing included) for information.

Peak memory: rmlx's JSON has none, so both sides are measured from outside, the same way:
  - max RSS of the process (wait4() rusage: the number `/usr/bin/time -v` prints);
  - on a GPU, also the process's device memory, the max of NVML samples every ~5 ms (NVML does
    not count CUDA managed memory: MLX arrays made on the CPU stream, e.g. weights loaded there);
  - mlx-vlm's own mx.get_peak_memory() (MLX allocator peak) is shown beside, for reference.

The load average (/proc/loadavg) is read before each run and reported.
Usage: images.py --model DIR --rmlx BIN [--sizes 512,1024] [--runs 3] [--prefill-chunk 2048]
                 [--openblas LIB] [--mlx-lib-dir DIR] [--json-out FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Describe this image in detail."


# --------------------------------------------------------------------------
# Image
# --------------------------------------------------------------------------
def make_image(size, out_dir, variant=0):
    """A deterministic size x size RGB PNG: gradients, rings and seeded noise blocks. Variants
    differ in their noise blocks (warm runs use a new image each time, so no cache can help)."""
    import numpy as np
    from PIL import Image

    path = Path(out_dir) / (f"bench_{size}.png" if variant == 0 else f"bench_{size}_v{variant}.png")
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    r = np.sqrt((x - 0.5) ** 2 + (y - 0.5) ** 2)
    rng = np.random.default_rng(size if variant == 0 else [size, variant])
    blocks = rng.integers(0, 256, size=(size // 32 + 1, size // 32 + 1, 3)).repeat(32, 0).repeat(32, 1)[:size, :size]
    img = np.stack([255 * x, 255 * y, 127.5 * (1 + np.sin(40 * r))], axis=-1)
    img = 0.7 * img + 0.3 * blocks
    Image.fromarray(img.clip(0, 255).astype(np.uint8), mode="RGB").save(path, format="PNG")
    return path


# --------------------------------------------------------------------------
# mlx-vlm worker (runs in its own process)
# --------------------------------------------------------------------------
def worker(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.perf_counter()
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    t_import = time.perf_counter()
    model, processor = load(args.model)
    t_load = time.perf_counter()
    prompt = apply_chat_template(processor, model.config, args.prompt, num_images=1)
    first = None
    for res in stream_generate(
        model, processor, prompt, image=[args.image], max_tokens=1, temperature=0.0,
        prefill_step_size=args.prefill_chunk,
    ):
        if first is None:
            first = res
            t_first = time.perf_counter()
    print(json.dumps({
        "ttft_ms": first.prompt_tokens / first.prompt_tps * 1000.0,
        "call_to_first_token_ms": (t_first - t_load) * 1000.0,
        "prompt_tokens": first.prompt_tokens,
        "token": int(first.token) if first.token is not None else None,
        "mlx_peak_gb": mx.get_peak_memory() / 1e9,
        "import_s": t_import - t_start,
        "load_s": t_load - t_import,
        "device": str(mx.default_device()),
        "mlx_vlm": mlx_vlm.__version__,
        "mlx": mx.__version__,
    }))


def worker_warm(args):
    """One process, one load; then, per image path read from stdin (one a line), time from the
    call (image file load, preprocessing, tokenization included) to the first token and print
    one JSON line. Prints {"ready": true} once loaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import mlx.core as mx
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(args.model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        image = line.strip()
        if not image:
            break
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        prompt = apply_chat_template(processor, model.config, args.prompt, num_images=1)
        for res in stream_generate(model, processor, prompt, image=[image], max_tokens=1, temperature=0.0,
                                   prefill_step_size=args.prefill_chunk):
            t1 = time.perf_counter()
            break
        print(json.dumps({"request_ms": (t1 - t0) * 1000.0, "ttft_ms": res.prompt_tokens / res.prompt_tps * 1000.0,
                          "prompt_tokens": res.prompt_tokens, "token": res.token, "mlx_peak_gb": mx.get_peak_memory() / 1e9}),
              flush=True)


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------
class GpuSampler:
    """Max device memory of one process from NVML samples every ~5 ms: the process's own
    usedGpuMemory, or, where NVML lists no processes (some VMs), the rise of the device's used
    memory over its level before the start. None without NVML or a GPU."""

    def __init__(self, pid):
        self.pid, self.peak, self.peak_dev, self._stop = pid, None, None, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.base = sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)
        except Exception:
            self.nvml = None
            return
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            used = 0
            for h in self.handles:
                try:
                    used += self.nvml.nvmlDeviceGetMemoryInfo(h).used
                    procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
                except Exception:
                    continue
                for p in procs:
                    if p.pid == self.pid and p.usedGpuMemory is not None:
                        self.peak = max(self.peak or 0, p.usedGpuMemory)
            self.peak_dev = max(self.peak_dev or 0, used - self.base)
            time.sleep(0.005)

    def stop(self):
        if self.nvml is None:
            return None
        self._stop.set()
        self.thread.join()
        return self.peak if self.peak is not None else self.peak_dev


def loadavg():
    return float(Path("/proc/loadavg").read_text().split()[0])


def timed(cmd, env):
    """Run cmd; return (stdout, wall s, max RSS bytes, GPU peak bytes or None)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        gpu = GpuSampler(p.pid)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        gpu_peak = gpu.stop()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{stderr[-4000:]}")
    return stdout, wall, usage.ru_maxrss * 1024, gpu_peak


def run_rmlx(args, image, env):
    cmd = [args.rmlx, "generate", "--model", args.model, "--image", str(image), "--prompt", args.prompt,
           "--max-tokens", "1", "--temperature", "0", "--prefill-chunk", str(args.prefill_chunk), "--json"]
    load = loadavg()
    stdout, wall, rss, gpu = timed(cmd, env)
    j = json.loads(stdout)
    t = j["timings"]
    return {"ttft_ms": t["ttft_ms"], "prompt_tokens": j["prompt_tokens"], "token": j["token_ids"][0],
            "wall_s": wall, "rss_gb": rss / 1e9, "gpu_gb": gpu / 1e9 if gpu else None, "load": load}


def run_vlm(args, image, env):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--image", str(image),
           "--prompt", args.prompt, "--prefill-chunk", str(args.prefill_chunk)]
    load = loadavg()
    stdout, wall, rss, gpu = timed(cmd, env)
    j = json.loads(stdout.strip().splitlines()[-1])
    j.update({"wall_s": wall, "rss_gb": rss / 1e9, "gpu_gb": gpu / 1e9 if gpu else None, "load": load})
    return j


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["cold", "warm", "both"], default="both",
                    help="cold: a fresh process per run (rmlx generate); warm: one loaded process per "
                         "engine (rmlx serve over HTTP, mlx-vlm in-process), a new image per request")
    ap.add_argument("--warmups", type=int, default=2, help="warm mode: discarded requests first")
    ap.add_argument("--image", help=argparse.SUPPRESS)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rmlx")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="both sides (mlx-vlm's default)")
    ap.add_argument("--openblas", help="LD_PRELOAD this BLAS into both sides (CPU backend)")
    ap.add_argument("--mlx-lib-dir", help="RMLX_MLX_LIB_DIR for rmlx")
    ap.add_argument("--image-dir", default=str(ROOT / ".bench" / "images"))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.worker:
        return worker_warm(args) if args.warm else worker(args)
    if not args.rmlx:
        ap.error("--rmlx is required")

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.openblas:
        env["LD_PRELOAD"] = args.openblas
    rmlx_env = dict(env)
    if args.mlx_lib_dir:
        rmlx_env["RMLX_MLX_LIB_DIR"] = args.mlx_lib_dir

    report = {"model": args.model, "prompt": args.prompt, "prefill_chunk": args.prefill_chunk, "runs": args.runs,
              "openblas": args.openblas, "sizes": {}}
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.mode in ("cold", "both"):
        for size in sizes:
            report["sizes"][size] = cold(args, size, env, rmlx_env)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.mode in ("warm", "both"):
        report["warm"] = warm(args, sizes, env, rmlx_env)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")


def cold(args, size, env, rmlx_env):
    image = make_image(size, args.image_dir)
    print(f"== cold {size}x{size} ({image}); warm-up (discarded), load {loadavg():.2f}", file=sys.stderr)
    w_r = run_rmlx(args, image, rmlx_env)
    w_v = run_vlm(args, image, env)
    print(f"   warm-up: rmlx {w_r['ttft_ms']:.0f} ms, mlx-vlm {w_v['ttft_ms']:.0f} ms", file=sys.stderr)
    rows = {"rmlx": [], "mlx_vlm": []}
    for run in range(args.runs):
        rows["rmlx"].append(run_rmlx(args, image, rmlx_env))
        rows["mlx_vlm"].append(run_vlm(args, image, env))
        r, v = rows["rmlx"][-1], rows["mlx_vlm"][-1]
        print(f"   run {run + 1}: rmlx {r['ttft_ms']:.0f} ms rss {r['rss_gb']:.2f} GB (load {r['load']:.2f}) | "
              f"mlx-vlm {v['ttft_ms']:.0f} ms rss {v['rss_gb']:.2f} GB mlx-peak {v['mlx_peak_gb']:.2f} GB "
              f"(load {v['load']:.2f})", file=sys.stderr)
    r0, v0 = rows["rmlx"][0], rows["mlx_vlm"][0]
    agree = {"prompt_tokens": r0["prompt_tokens"] == v0["prompt_tokens"],
             "greedy_token": all(r["token"] == v["token"] for r, v in zip(rows["rmlx"], rows["mlx_vlm"]))}
    print_size(size, rows, agree)
    return {"runs": rows, "agree": agree, "device": v0["device"],
            "versions": {"mlx": v0["mlx"], "mlx_vlm": v0["mlx_vlm"]}}


def post_chat(port, model_name, image, prompt):
    import base64
    import urllib.request

    data = base64.b64encode(Path(image).read_bytes()).decode()
    body = json.dumps({"model": model_name, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
        {"type": "text", "text": prompt}]}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        j = json.loads(r.read())
    return (time.perf_counter() - t0) * 1000.0, j


def warm(args, sizes, env, rmlx_env):
    """One loaded process per engine, both loaded at once; per size `warmups` discarded requests,
    then `runs` timed ones, alternating rmlx / mlx-vlm, each with a new image. Timed the same way
    on both sides: request start (image file in hand) to the first token: rmlx through
    `rmlx serve` (HTTP POST, max_tokens 1), mlx-vlm in-process (stream_generate from the image
    path). Each engine's own TTFT is kept too."""
    n = args.warmups + args.runs
    images = {size: [make_image(size, args.image_dir, 100 + k) for k in range(n)] for size in sizes}
    print(f"== warm: sizes {sizes}, {args.warmups} warm-up + {args.runs} timed requests each, alternating, "
          f"load {loadavg():.2f}", file=sys.stderr)
    out = {"rmlx": {}, "mlx_vlm": {}}
    with tempfile.TemporaryFile() as se, tempfile.TemporaryFile() as we:
        server = subprocess.Popen([args.rmlx, "serve", "--model", args.model, "--port", "0"],
                                  stdout=subprocess.PIPE, stderr=se, env=rmlx_env)
        vlm = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--warm", "--model",
                                args.model, "--prompt", args.prompt, "--prefill-chunk", str(args.prefill_chunk)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=we, env=env, text=True)
        try:
            line = server.stdout.readline().decode()  # "rmlx serve: listening on http://127.0.0.1:PORT"
            port = int(line.strip().rsplit(":", 1)[1])
            threading.Thread(target=server.stdout.read, daemon=True).start()  # keep the pipe drained
            while True:
                ready = vlm.stdout.readline()
                if not ready:
                    we.seek(0)
                    raise SystemExit(f"mlx-vlm worker died:\n{we.read().decode()[-4000:]}")
                if ready.startswith("{"):
                    break
            name = Path(args.model).name
            for size in sizes:
                out["rmlx"][size], out["mlx_vlm"][size] = [], []
                for k, image in enumerate(images[size]):
                    load = loadavg()
                    ms, j = post_chat(port, name, image, args.prompt)
                    vlm.stdin.write(f"{image}\n")
                    vlm.stdin.flush()
                    v = json.loads(vlm.stdout.readline())
                    if k >= args.warmups:
                        out["rmlx"][size].append({"request_ms": ms, "ttft_ms": j["timings"]["ttft_ms"],
                                                  "prompt_tokens": j["usage"]["prompt_tokens"], "load": load})
                        v["load"] = loadavg()
                        out["mlx_vlm"][size].append(v)
                R, V = out["rmlx"][size], out["mlx_vlm"][size]
                print(f"   {size}: rmlx request ms {[round(r['request_ms']) for r in R]} (own ttft "
                      f"{[round(r['ttft_ms']) for r in R]}) | mlx-vlm {[round(r['request_ms']) for r in V]}",
                      file=sys.stderr)
        finally:
            server.terminate()
            server.wait()
            try:
                vlm.stdin.close()
            except Exception:
                pass
            vlm.wait()
    for size in sizes:
        R, V = out["rmlx"][size], out["mlx_vlm"][size]
        loads = [r["load"] for r in R + V]
        print(f"\nwarm {size}x{size}: prompt {R[0]['prompt_tokens']} tokens (mlx-vlm {V[0]['prompt_tokens']}), "
              f"{len(R)} requests each, alternating, medians, load {min(loads):.2f}-{max(loads):.2f}")
        print(f"{'':34s}{'rmlx':>10s}{'mlx-vlm':>10s}{'ratio':>8s}")
        a, b = med(R, "request_ms"), med(V, "request_ms")
        print(f"{'request -> first token ms':34s}{a:10.1f}{b:10.1f}{b / a:7.2f}x")
        print(f"{'  prompt tok/s over that':34s}{R[0]['prompt_tokens'] / a * 1000:10.1f}"
              f"{V[0]['prompt_tokens'] / b * 1000:10.1f}{b / a:7.2f}x")
        print(f"{'engine TTFT ms (own clocks)':34s}{med(R, 'ttft_ms'):10.1f}{med(V, 'ttft_ms'):10.1f}")
        print(f"{'mlx-vlm mx.get_peak_memory GB':34s}{'':10s}{med(V, 'mlx_peak_gb'):10.2f}")
    return out


def med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def print_size(size, rows, agree):
    R, V = rows["rmlx"], rows["mlx_vlm"]
    n = R[0]["prompt_tokens"]
    print(f"\n{size}x{size}: prompt {n} tokens (mlx-vlm {V[0]['prompt_tokens']}), greedy token "
          f"{'agrees' if agree['greedy_token'] else 'DIFFERS'} (rmlx {R[0]['token']}, mlx-vlm {V[0]['token']}), "
          f"{len(R)} runs, medians, load {min(r['load'] for r in R + V):.2f}-{max(r['load'] for r in R + V):.2f}")
    print(f"{'':26s}{'rmlx':>10s}{'mlx-vlm':>10s}{'ratio':>8s}")

    def line(label, a, b, higher_better, fmt="{:10.1f}"):
        if a is None or b is None:
            return
        ratio = (a / b) if higher_better else (b / a)
        print(f"{label:26s}{fmt.format(a)}{fmt.format(b)}{ratio:7.2f}x")

    line("TTFT ms", med(R, "ttft_ms"), med(V, "ttft_ms"), False)
    line("prefill tok/s", n / med(R, "ttft_ms") * 1000, V[0]["prompt_tokens"] / med(V, "ttft_ms") * 1000, True)
    line("max RSS GB", med(R, "rss_gb"), med(V, "rss_gb"), False, "{:10.2f}")
    line("GPU memory GB (NVML)", med(R, "gpu_gb"), med(V, "gpu_gb"), False, "{:10.2f}")
    print(f"{'mlx-vlm mx.get_peak_memory':26s}{'':>10s}{med(V, 'mlx_peak_gb'):10.2f}")
    line("process wall s", med(R, "wall_s"), med(V, "wall_s"), False, "{:10.2f}")
    print("(ratio > 1 means rmlx is faster / smaller)")


if __name__ == "__main__":
    main()

"""Where do weights loaded by mx.load(stream=cpu) (what mlx-rs's load_safetensors does) live on
the CUDA backend, and what do they cost the first prefill-sized matmuls? Against mx.load on the
GPU stream, and CPU-loaded weights copied once on the GPU stream. One case per process:
    WHICH=make python3 load_stream_check.py     # writes /tmp/w.safetensors (36 x [9728, 2560] bf16)
    WHICH=cpu|gpu|copy python3 load_stream_check.py
Prints host RSS and the process's NVML device memory after loading and after each pass.
(docs/PERFORMANCE.md, Image prefill, H200; run through scripts/bench/h200/run.sh stage-b ...)
"""
import os, time
import mlx.core as mx
try:
    import pynvml; pynvml.nvmlInit(); H = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception:
    H = None

def gpu_mb():
    if H is None: return -1
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(H):
        if p.pid == os.getpid(): return p.usedGpuMemory / 2**20
    return 0

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) / 1024

path = "/tmp/w.safetensors"
if not os.path.exists(path):
    ws = {f"w{i}": mx.random.normal((9728, 2560)).astype(mx.bfloat16) for i in range(36)}
    mx.eval(ws); mx.save_safetensors(path, ws); del ws
    raise SystemExit(0)
mx.clear_cache()
x = mx.random.normal((272, 2560)).astype(mx.bfloat16)
mx.eval(x)

def bench(name, ws):
    mx.eval(list(ws.values()))
    print(f"{name}: after load  rss {rss_mb():8.0f} MB  gpu {gpu_mb():8.0f} MB", flush=True)
    nbytes = sum(w.nbytes for w in ws.values())
    for it in range(4):
        t = time.perf_counter()
        outs = [x @ w.T for w in ws.values()]
        mx.eval(outs)
        dt = time.perf_counter() - t
        print(f"{name}: pass {it}: 36 matmuls (272x2560 @ 2560x9728, {nbytes/1e9:.1f} GB of weights): {dt*1000:.1f} ms "
              f"({nbytes/dt/1e9:.0f} GB/s)  rss {rss_mb():.0f} MB gpu {gpu_mb():.0f} MB", flush=True)

which = os.environ.get("WHICH", "cpu")
if which == "cpu":
    bench("mx.load(stream=mx.cpu)", mx.load(path, stream=mx.cpu))
elif which == "gpu":
    bench("mx.load(default stream: gpu)", mx.load(path))
else:
    ws = mx.load(path, stream=mx.cpu); mx.eval(list(ws.values()))
    bench("mx.load(stream=mx.cpu) then w * 1 on the gpu", {k: mx.multiply(v, 1, stream=mx.gpu) for k, v in ws.items()})

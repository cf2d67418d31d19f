#!/usr/bin/env python3
"""rmlx vs a reference engine on one checkpoint, same MLX backend, interleaved runs.

Both sides get the same random prompt ids, greedy decoding, no EOS stop. Timings are taken the
same way on both: TTFT = start of the call to the first token on the host; prefill tok/s =
prompt tokens / TTFT; decode tok/s = (tokens - 1) / (last token time - first token time).

References (--reference):
  mlx-lm   (default) mlx-lm 0.32.2's `generate_step`; rmlx through `rmlx bench` (one process
           per run). Both warm up at the measured shape on the seed-999 ids and time run r on
           fresh ids (seed 1000 + r, the same for both; `rmlx bench --seed`), so nothing is
           served from a prefix cache; who goes first alternates each run.
  mlx-vlm  mlx-vlm 0.7.6's own `generate_step` on the language model (text only, no pixel
           values; the qwen3_5 / qwen3_5_moe family). rmlx runs behind one `rmlx serve` and gets
           the same ids through /v1/completions; both engines are warmed up once at the measured
           shape (full prompt, full generation) and every run draws fresh prompt ids (seed
           1000 + run, the same ids for both engines), so no prefix cache can serve a run (rmlx
           reports `cached_tokens`; it must be 0). EOS is kept out with the same logit bias on
           both sides (-1e9 on every EOS id): the server has no ignore-eos switch. mlx-vlm's GDN
           prefill on CPU/CUDA is its chunked scan (`gated_delta_chunked`); --mlx-vlm-gdn
           sequential (or chunked,sequential: both, interleaved) patches in its per-token
           `gated_delta_ops` instead, which is what rmlx computes.

rmlx via serve: TTFT, prefill and decode come from the engine's own `timings` in the response
(request start on the engine thread to the first token, and the gaps between tokens); the
HTTP round trip is reported next to them.

--chat-turns N (serve only): N two-turn conversations through /v1/chat/completions (the second
turn resends the first and extends it), each followed by a control request with the second
turn's length and nothing cached (another system prompt): TTFT and
usage.prompt_tokens_details.cached_tokens of each.

Usage: bench.py --model DIR --rmlx BIN [--reference mlx-lm|mlx-vlm] [--prompt-tokens 512]
                [--gen-tokens 64] [--runs 3] [--device cpu|gpu] [--json-out PATH]
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402

HERE = Path(__file__).resolve().parent


def prompt_ids(count, vocab, seed=0):
    # Same LCG as `rmlx bench` (which always starts from state 0), so both engines can see
    # identical prompts.
    state = seed
    out = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((state >> 33) % vocab)
    return out


def stamps_to_metrics(start, stamps, n_prompt):
    ttft = stamps[0] - start
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ttft_ms": ttft * 1000, "prefill_tps": n_prompt / ttft, "decode_tps": decode, "tokens": len(stamps)}


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------
class MlxLm:
    name = "mlx_lm"

    def __init__(self, model_dir, prefill_chunk):
        # mlx_lm.generate makes its generation stream on the default device when first
        # imported: before the fixture module, whose import pins the CPU.
        from mlx_lm.generate import generate_step

        sys.path.insert(0, str(HERE.parent / "fixtures"))
        device = mx.default_device()
        from make_releases import patch_gather_qmm

        mx.set_default_device(device)
        from mlx_lm import load
        from mlx_lm.sample_utils import make_sampler

        # mlx-lm 0.32.2 cannot run a quantized MoE on MLX 0.32.2 as shipped (global_scale=None
        # reaches gather_qmm); the fixture script's one-line fix lets the 4-bit MoE run.
        patch_gather_qmm()
        self.model, _ = load(model_dir)
        self.vocab = self.model.args.vocab_size
        from mlx_lm.sample_utils import make_logits_processors

        self.generate_step, self.sampler = generate_step, make_sampler(temp=0.0)
        self.processors = make_logits_processors
        self.prefill_chunk = prefill_chunk

    def run(self, ids, gen_tokens, logit_bias=None):
        # The same EOS bias as the rmlx server side gets (serve mode), through mlx-lm's own
        # logits processor.
        processors = self.processors(logit_bias=logit_bias) if logit_bias else None
        # MLX's peak over this run, weights included (as `rmlx bench` reports its own).
        mx.clear_cache()
        mx.reset_peak_memory()
        start = time.perf_counter()
        stamps = []
        for token, _ in self.generate_step(mx.array(ids), self.model, max_tokens=gen_tokens, sampler=self.sampler,
                                           logits_processors=processors, prefill_step_size=self.prefill_chunk):
            stamps.append(time.perf_counter())
        metrics = stamps_to_metrics(start, stamps, len(ids))
        metrics["peak_memory_bytes"] = mx.get_peak_memory()
        return metrics


class MlxVlm:
    """mlx-vlm's generate_step on the language model, text only; `gdn` picks its CPU/CUDA
    Gated DeltaNet prefill: its own chunked scan or its sequential per-token ops."""

    def __init__(self, model, gdn, prefill_chunk):
        from mlx_vlm.generate import generate_step
        from mlx_vlm.models.qwen3_5 import gated_delta as gd

        self.model, self.gdn, self.gd = model, gdn, gd
        self.chunked = gd.gated_delta_chunked
        self.name = "mlx_vlm" if gdn == "chunked" else "mlx_vlm_seq"
        self.generate_step, self.prefill_chunk = generate_step, prefill_chunk

    def run(self, ids, gen_tokens, logit_bias=None):
        gd = self.gd
        if self.gdn == "sequential":
            gd.gated_delta_chunked = lambda q, k, v, g, beta, state, mask=None, C=64: gd.gated_delta_ops(
                q, k, v, g, beta, state, mask)
        try:
            start = time.perf_counter()
            stamps = []
            for token, _ in self.generate_step(mx.array([ids]), self.model, None, None, max_tokens=gen_tokens,
                                               sampler=lambda lp: mx.argmax(lp, axis=-1), logit_bias=logit_bias,
                                               prefill_step_size=self.prefill_chunk):
                stamps.append(time.perf_counter())
        finally:
            gd.gated_delta_chunked = self.chunked
        return stamps_to_metrics(start, stamps, len(ids))


# ---------------------------------------------------------------------------------------------
# rmlx
# ---------------------------------------------------------------------------------------------
def run_rmlx_bench(binary, model_dir, prompt_tokens, gen_tokens, prefill_chunk, seed):
    out = subprocess.run(
        [binary, "bench", "--model", model_dir, "--prompt-tokens", str(prompt_tokens),
         "--gen-tokens", str(gen_tokens), "--prefill-chunk", str(prefill_chunk), "--runs", "1",
         "--seed", str(seed), "--json"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RmlxServer:
    name = "rmlx"

    def __init__(self, binary, model_dir, log_path, extra_args=()):
        self.port = free_port()
        self.log = open(log_path, "w")
        # No disk prefix cache: it outlives the process, and bench.py's seeded prompts repeat from
        # one invocation to the next (another arm's server would read their prefixes back).
        self.proc = subprocess.Popen([binary, "serve", "--model", model_dir, "--port", str(self.port),
                                      "--prefix-disk-gb", "0", *extra_args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=5) as r:
                    models = json.load(r)["data"]
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"rmlx serve did not come up (see {log_path})")
                time.sleep(0.2)
        self.model = models[0]["id"]

    def post(self, route, body):
        req = urllib.request.Request(self.base + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.load(r)
        return out, (time.perf_counter() - start) * 1000

    def run(self, ids, gen_tokens, logit_bias=None):
        body = {"model": self.model, "prompt": ids, "max_tokens": gen_tokens, "temperature": 0.0}
        if logit_bias:
            body["logit_bias"] = {str(k): v for k, v in logit_bias.items()}
        out, wall = self.post("/v1/completions", body)
        t, usage = out["timings"], out["usage"]
        if usage["completion_tokens"] != gen_tokens:
            raise SystemExit(f"rmlx stopped after {usage['completion_tokens']} of {gen_tokens} tokens: {out}")
        return {"ttft_ms": t["ttft_ms"], "prefill_tps": t["prefill_tps"], "decode_tps": t["decode_tps"],
                "tokens": usage["completion_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "prompt_tokens": usage["prompt_tokens"], "http_ms": wall, "total_ms": t["total_ms"]}

    def chat(self, messages, max_tokens, logit_bias=None):
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        if logit_bias:
            body["logit_bias"] = {str(k): v for k, v in logit_bias.items()}
        out, wall = self.post("/v1/chat/completions", body)
        msg = out["choices"][0]["message"]
        usage = out["usage"]
        return {"ttft_ms": out["timings"]["ttft_ms"], "http_ms": wall, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "reply": (msg.get("content") or "") or (msg.get("reasoning_content") or "")}

    def close(self):
        stop_server(self.proc, self.log)


def stop_server(proc, log):
    """SIGTERM (both servers finish what runs and exit), SIGKILL after 30 s; close its log."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


# ---------------------------------------------------------------------------------------------
# Checkpoint facts
# ---------------------------------------------------------------------------------------------
def read_json(path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def eos_ids(model_dir):
    cfg = read_json(Path(model_dir) / "config.json")
    gen = read_json(Path(model_dir) / "generation_config.json")
    tok = read_json(Path(model_dir) / "tokenizer.json")
    ids = set()
    for block in (cfg, cfg.get("text_config", {}), gen):
        value = block.get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    for added in tok.get("added_tokens", []):
        if added["content"] in ("<|im_end|>", "<|endoftext|>"):
            ids.add(added["id"])
    return sorted(ids)


def plain_vocab(model_dir, vocab):
    """Prompt ids are drawn below the first added (special) token: no image/vision/chat markers."""
    tok = read_json(Path(model_dir) / "tokenizer.json")
    added = [t["id"] for t in tok.get("added_tokens", [])]
    return min([vocab, *added])


WORDS = ("the of and to in is was for on that with as by at from his her an it were which are this be or had "
         "not but have their one all they been has more its also who first new after two time city during year "
         "river music world state known school other between team early history north film house part system "
         "small water light garden station market bridge valley story number letter island paper winter summer "
         "morning evening mountain forest engine signal circuit harbor library window kitchen journey").split()


def words(n, rng):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_turns(server, conversations, user_words, max_tokens, logit_bias):
    out = []
    for c in range(conversations):
        rng = random.Random(5000 + c)
        system = f"You are assistant number {c}. " + words(24, rng)
        user1 = words(user_words, rng)
        user2 = "Now answer this follow-up question: " + words(24, rng)
        m1 = [{"role": "system", "content": system}, {"role": "user", "content": user1}]
        t1 = server.chat(m1, max_tokens, logit_bias)
        m2 = m1 + [{"role": "assistant", "content": t1["reply"]}, {"role": "user", "content": user2}]
        t2 = server.chat(m2, max_tokens, logit_bias)
        # The same conversation under another system prompt of about the same length: nothing of it
        # is cached, so it is turn 2's cost without the prefix cache.
        control_system = f"You are assistant number {c + 100}. " + words(24, random.Random(9000 + c))
        t3 = server.chat([{"role": "system", "content": control_system}] + m2[1:], max_tokens, logit_bias)
        row = {"turn1": t1, "turn2": t2, "control": t3}
        for k in row.values():
            k.pop("reply", None)
        out.append(row)
        print(f"chat {c + 1}: turn 1 {t1}\n        turn 2 {t2}\n        uncached turn-2 control {t3}", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------
def spread(values):
    return f"{min(values):.4g}-{max(values):.4g}" if len(values) > 1 else ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rmlx", required=True)
    parser.add_argument("--reference", choices=["mlx-lm", "mlx-vlm"], default="mlx-lm")
    parser.add_argument("--rmlx-via", choices=["bench", "serve"],
                        help="rmlx bench per run (default with mlx-lm) or one rmlx serve (default with mlx-vlm)")
    parser.add_argument("--mlx-vlm-gdn", default="chunked",
                        help="mlx-vlm's GDN prefill: chunked (the library's own on CPU/CUDA), sequential, or both "
                             "(chunked,sequential)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--chat-turns", type=int, default=0, help="two-turn conversations (rmlx serve)")
    parser.add_argument("--chat-words", type=int, default=400, help="words in each conversation's first user message")
    parser.add_argument("--chat-max-tokens", type=int, default=8)
    parser.add_argument("--json-out")
    parser.add_argument("--server-log", default="/tmp/rmlx-bench-serve.log")
    args = parser.parse_args()
    via = args.rmlx_via or ("bench" if args.reference == "mlx-lm" else "serve")

    mx.set_default_device(getattr(mx, args.device))
    t0 = time.perf_counter()
    if args.reference == "mlx-lm":
        references = [MlxLm(args.model, args.prefill_chunk)]
        vocab = references[0].vocab
    else:
        from mlx_vlm.utils import load_model

        model = load_model(Path(args.model))
        cfg = read_json(Path(args.model) / "config.json")
        vocab = cfg.get("text_config", cfg)["vocab_size"]
        references = [MlxVlm(model, gdn, args.prefill_chunk) for gdn in args.mlx_vlm_gdn.split(",")]
    print(f"reference loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    engines = references
    server = None
    if via == "serve":
        limit = plain_vocab(args.model, vocab)
        bias = {i: -1e9 for i in eos_ids(args.model)}
        t0 = time.perf_counter()
        server = RmlxServer(args.rmlx, args.model, args.server_log)
        print(f"rmlx serve up in {time.perf_counter() - t0:.1f} s (model {server.model}); prompt ids < {limit}, "
              f"EOS ids biased: {sorted(bias)}", file=sys.stderr)
        engines = [server] + references
        # Warm-up at the measured shape, fresh ids, every engine.
        warm = prompt_ids(args.prompt_tokens, limit, seed=999)
        for engine in engines:
            t0 = time.perf_counter()
            engine.run(warm, args.gen_tokens, bias)
            print(f"warm-up {engine.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    else:
        limit, bias = vocab, None
        # Warm-up at the measured shape on the ids `rmlx bench --seed 1000+r` warms up on.
        references[0].run(prompt_ids(args.prompt_tokens, vocab, seed=999), args.gen_tokens)

    results = {"rmlx": []} if via == "bench" else {}
    results.update({e.name: [] for e in engines})
    try:
        for run in range(args.runs):
            if via == "serve":
                ids = prompt_ids(args.prompt_tokens, limit, seed=1000 + run)
                order = engines if run % 2 == 0 else engines[::-1]  # alternate who goes first
                for engine in order:
                    results[engine.name].append(engine.run(ids, args.gen_tokens, bias))
            else:
                ids = prompt_ids(args.prompt_tokens, vocab, seed=1000 + run)
                ours = lambda: results["rmlx"].append(run_rmlx_bench(  # noqa: E731
                    args.rmlx, args.model, args.prompt_tokens, args.gen_tokens, args.prefill_chunk, 1000 + run))
                theirs = lambda: results[references[0].name].append(  # noqa: E731
                    references[0].run(ids, args.gen_tokens))
                for side in ([ours, theirs] if run % 2 == 0 else [theirs, ours]):
                    side()
            print(f"run {run + 1}: " + "  ".join(f"{k} {v[-1]}" for k, v in results.items()), file=sys.stderr)
        chats = chat_turns(server, args.chat_turns, args.chat_words, args.chat_max_tokens, bias) \
            if server and args.chat_turns else []
    finally:
        if server:
            server.close()

    def med(engine, key):
        return statistics.median(r[key] for r in results[engine])

    names = list(results)
    ref = names[1]
    print(f"model {args.model}  device {args.device}  prompt {args.prompt_tokens}  gen {args.gen_tokens}  "
          f"runs {args.runs} (medians; min-max)  rmlx via {via}")
    header = f"{'':14s}" + "".join(f"{n:>26s}" for n in names) + f"{'ratio vs ' + ref:>18s}"
    print(header)
    for key, label, higher_better in [("prefill_tps", "prefill tok/s", True),
                                      ("decode_tps", "decode tok/s", True),
                                      ("ttft_ms", "TTFT ms", False)]:
        cells = ""
        for n in names:
            vals = [r[key] for r in results[n]]
            cells += f"{statistics.median(vals):10.1f} ({spread(vals):>13s})"
        ours, theirs = med("rmlx", key), med(ref, key)
        ratio = ours / theirs if higher_better else theirs / ours
        print(f"{label:14s}{cells}{ratio:17.2f}x")
    if all("peak_memory_bytes" in r for n in names for r in results[n]):
        cells = "".join(f"{med(n, 'peak_memory_bytes') / 1e9:10.2f} {'':14s}" for n in names)
        ratio = med(ref, "peak_memory_bytes") / med("rmlx", "peak_memory_bytes")
        print(f"{'MLX peak GB':14s}{cells}{ratio:17.2f}x")
    print("(ratio > 1 means rmlx is faster, or holds less at its peak)")
    if via == "serve":
        print(f"rmlx cached_tokens per run: {[r['cached_tokens'] for r in results['rmlx']]}")
    for c, row in enumerate(chats):
        print(f"chat {c + 1}: " + "  ".join(
            f"{k}: prompt {v['prompt_tokens']} cached {v['cached_tokens']} ttft {v['ttft_ms']:.1f} ms "
            f"(http {v['http_ms']:.1f} ms)" for k, v in row.items()))
    if chats:
        for k in ("turn1", "turn2", "control"):
            print(f"chat {k}: median TTFT {statistics.median(r[k]['ttft_ms'] for r in chats):.1f} ms, "
                  f"median cached {statistics.median(r[k]['cached_tokens'] for r in chats)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"model": args.model, "device": args.device, "prompt_tokens": args.prompt_tokens,
             "gen_tokens": args.gen_tokens, "runs": args.runs, "rmlx_via": via, "reference": args.reference,
             "results": results, "chats": chats}, indent=1) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A random-weight 4-bit `qwen3_5_moe` checkpoint with the real Qwen3.6-35B-A3B layer shapes,
made on the GPU machine (scripts/bench/h200/run.sh qwen3_5), for decode and prefix-cache TTFT.

config.json is Qwen/Qwen3.6-35B-A3B's (tests/fixtures/real-configs/), every key kept; changed:
- text `num_hidden_layers` 8 (of 40) and `layer_types` its first 8 ([linear x 3, full] x 2);
  every layer shape is the release's: hidden 2048, 256 experts of 512, top-8, shared expert
  512, GDN 16 key / 32 value heads of 128, attention 16 / 2 heads of 256 (partial rotary 0.25),
  vocab 248320, untied lm_head;
- a small vision tower (depth 2, hidden 64; out_hidden_size 2048): the model type needs one,
  these benchmarks are text only;
- the special-token ids, renumbered into the tokenizer used: the release fixture's
  (tests/fixtures/releases/qwen3.6-35b-a3b-4bit: the Qwen3-VL fixture vocabulary, ~1000 tokens,
  with Qwen3.6's chat_template.jinja). Ids past the tokenizer exist in the model (as the real
  model's padded rows do) and decode to nothing.
Weights: random (mx.random, seeded), bf16, then mlx_vlm's 4-bit recipe as `mlx_vlm.convert`
applies it to qwen3_5_moe: affine 4-bit g64 everywhere, 8-bit g64 `mlp.gate` and
`mlp.shared_expert_gate` (the model's quant_predicate), A_log fp32 (cast_predicate), vision
unquantized. mlx layout (language_model.model.*), as mlx-community ships.

`--mtp`: also the release's multi-token-prediction head (`mtp.*`, mlx layout: norms already
shifted), in model-mtp.safetensors: its decoder layer a copy of the first full-attention
layer's tensors (quantized as they are, with their per-path quantization entries), `fc` random
bf16, norms 1. Random: it drafts nothing right unless answers are forced (see
crates/rmlx-cli/src/bench_spec.rs, --draft-head).

`--release Qwen__Qwen3.6-27B --bits 16`: the dense 27B's layer shapes instead (hidden 5120, MLP
17408, GDN 16 key / 48 value heads of 128, attention 24 / 4 heads of 256), bf16 as released, its
release fixture's tokenizer (tests/fixtures/releases/qwen3.6-27b).

Usage: python3 scripts/bench/h200/make_qwen3_5_bench_model.py --out DIR [--device gpu]
       [--layers 8] [--experts 256] [--vocab 248320]   (smaller values: a quick local check)
       [--release Qwen__Qwen3.6-27B] [--bits 4|16] [--mtp]
"""

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
REAL = ROOT / "tests" / "fixtures" / "real-configs" / "Qwen__Qwen3.6-35B-A3B"
FIXTURE = ROOT / "tests" / "fixtures" / "releases" / "qwen3.6-35b-a3b-4bit"
# Other releases this script builds, and the release fixture whose tokenizer each takes.
FIXTURES = {"Qwen__Qwen3.6-35B-A3B": "qwen3.6-35b-a3b-4bit", "Qwen__Qwen3.6-27B": "qwen3.6-27b"}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json"]
TOP_IDS = ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"]
TEXT_IDS = ["bos_token_id", "eos_token_id", "pad_token_id"]
VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
SEED = 20261242
NAME = "qwen3.6-35b-a3b-shape-8l-4bit"


def config(layers, experts, vocab):
    cfg = json.loads((REAL / "config.json").read_text())
    fixture = json.loads((FIXTURE / "config.json").read_text())
    text = cfg["text_config"]
    assert layers % text["full_attention_interval"] == 0
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    if "num_experts" in text:
        text["num_experts"] = experts
    text["vocab_size"] = vocab
    for key in TOP_IDS:
        cfg[key] = fixture[key]
    for key in TEXT_IDS:
        text[key] = fixture["text_config"][key]
    cfg["vision_config"].update(VISION, out_hidden_size=text["hidden_size"])
    return cfg


def randomize(model, seed):
    """Every parameter random, bf16 (A_log fp32), one at a time; the rules of the release
    fixtures (make_releases.qwen3_5_rules, untied): clear router margins, decays ~0.1..0.98."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    for i, (name, p) in enumerate(params):
        shape = p.shape
        leaf = name.split(".")[-1]
        parent = name.split(".")[-2] if "." in name else ""
        if name.endswith("A_log"):
            w = mx.log(mx.random.uniform(1.0, 16.0, shape, key=keys[i]))
            model.update(tree_unflatten([(name, w.astype(mx.float32))]))
            mx.eval(w)
            continue
        z = mx.random.normal(shape, key=keys[i])
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        if name.endswith("dt_bias"):
            w = -2.0 + 0.3 * z
        elif leaf == "bias":
            w = 0.1 * z
        elif len(shape) == 1 or "norm" in parent:
            w = 1.0 + 0.1 * z
        elif name.endswith("embed_tokens.weight"):
            w = 0.6 * z
        elif name.endswith("lm_head.weight"):
            w = 0.5 * z
        elif name.endswith("pos_embed.weight"):
            w = 0.5 * z
        elif name.endswith("mlp.gate.weight"):
            w = (8.0 / math.sqrt(shape[-1])) * z
        elif ".switch_mlp." in name:
            w = (1.5 / math.sqrt(shape[-1])) * z
        else:
            w = (1.5 / math.sqrt(fan_in)) * z
        w = w.astype(mx.bfloat16)
        mx.eval(w)
        model.update(tree_unflatten([(name, w)]))
    mx.eval(model.parameters())
    return sum(math.prod(p.shape) for _, p in params)


def add_mtp(folder, model, cfg, mx):
    """The `mtp.*` head (see the module doc) in model-mtp.safetensors, indexed if the weights are."""
    from mlx.utils import tree_flatten

    text = cfg["text_config"]
    full = text["layer_types"].index("full_attention")
    prefix = f"language_model.model.layers.{full}."
    params = dict(tree_flatten(model.parameters()))
    head = {"mtp.layers.0." + k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
    hidden = text["hidden_size"]
    mx.random.seed(SEED + 1)
    head["mtp.fc.weight"] = (mx.random.normal((hidden, 2 * hidden)) / math.sqrt(2 * hidden)).astype(mx.bfloat16)
    for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]:
        head[f"mtp.{norm}.weight"] = mx.ones((hidden,), dtype=mx.bfloat16)
    mx.save_safetensors(str(folder / "model-mtp.safetensors"), head, metadata={"format": "mlx"})
    for block in ("quantization", "quantization_config"):
        entries = cfg.get(block)
        if isinstance(entries, dict):
            for key in [k for k in entries if k.startswith(prefix)]:
                entries["mtp.layers.0." + key[len(prefix):]] = entries[key]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "model-mtp.safetensors" for name in head})
        index.write_text(json.dumps(data, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="parent folder of the checkpoint")
    ap.add_argument("--device", choices=["cpu", "gpu", "default"], default="default")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--name", default=None, help=f"default {NAME}, or the release's shape and bits")
    ap.add_argument("--release", default="Qwen__Qwen3.6-35B-A3B", choices=sorted(FIXTURES))
    ap.add_argument("--bits", type=int, choices=[4, 16], default=4)
    ap.add_argument("--mtp", action="store_true", help="also a random mtp.* head")
    args = ap.parse_args()
    global REAL, FIXTURE
    REAL = REAL.parent / args.release
    FIXTURE = FIXTURE.parent / FIXTURES[args.release]
    if args.name is None:
        short = args.release.split("__")[1].lower()
        args.name = NAME if args.release == "Qwen__Qwen3.6-35B-A3B" and args.bits == 4 else \
            f"{short}-shape-{args.layers}l-{'bf16' if args.bits == 16 else '4bit'}"
        if args.mtp:
            args.name += "-mtp"

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.quant_utils import quantize_model
    from mlx_vlm.utils import get_model_and_args, save_weights, skip_multimodal_module

    if args.device != "default":
        mx.set_default_device(getattr(mx, args.device))
    out = Path(args.out) / args.name
    if (out / "config.json").exists():
        print(f"{out} exists; kept", file=sys.stderr)
        print(out)
        return
    t0 = time.time()
    cfg = config(args.layers, args.experts, args.vocab)
    arch, _ = get_model_and_args(cfg)
    model = arch.Model(arch.ModelConfig.from_dict(copy.deepcopy(cfg)))
    n = randomize(model, SEED)
    own = model.quant_predicate

    def predicate(p, m):
        if skip_multimodal_module(p):
            return False
        return own(p, m) if own is not None else True

    if args.bits == 4:
        model, quantized = quantize_model(model, copy.deepcopy(cfg), 64, 4, mode="affine",
                                          quant_predicate=predicate)
        mx.eval(model.parameters())
        cfg["quantization"] = quantized["quantization"]
        cfg["quantization_config"] = quantized["quantization"]
    cfg = dict(sorted(cfg.items()))
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_weights(tmp, model)
    if args.mtp:
        add_mtp(tmp, model, cfg, mx)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURE / name, tmp / name)
    tmp.rename(out)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(f"{out}: {n / 1e9:.3f} B parameters, {nbytes / 2**30:.2f} GiB as saved, {time.time() - t0:.1f} s",
          file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()

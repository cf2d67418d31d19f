#!/usr/bin/env python3
"""Random Qwen3 checkpoints of a benchmark size (mlx-lm's `benchmark` shape: hidden 1024,
8 layers) with the fixture tokenizer, in fp32 and affine 4-bit (bf16 scales), under .bench/,
and a Qwen3-30B-A3B-shaped MoE (`qwen3_moe`, top-8 routing, the real config's keys) scaled to
this machine: 32 experts of width 256 instead of 128 of 768, in fp32 and in mlx-lm's 4-bit
recipe (8-bit router), and a Qwen3.6-35B-A3B-shaped `qwen3_5_moe` (hybrid Gated DeltaNet +
gated attention, routed + shared experts) scaled the same way, in fp32 and in mlx-vlm's 4-bit
recipe, mlx layout (what mlx-community ships; both engines load it). Reuses the fixture
generators' builders so both share one definition of each checkpoint.

Usage: make_bench_model.py [dense] [moe] [qwen3_5]   (no argument: all three sets)
"""

import copy
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))

import make_qwen3 as fx  # noqa: E402
import make_releases as releases  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.convert import convert  # noqa: E402

OUT = ROOT / ".bench"
SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 3072,
    "max_window_layers": 8,
    "max_position_embeddings": 40960,
}


def main():
    sets = sys.argv[1:] or ["dense", "moe", "qwen3_5"]
    unknown = set(sets) - {"dense", "moe", "qwen3_5"}
    if unknown:
        raise SystemExit(f"unknown set(s) {sorted(unknown)}: dense, moe, qwen3_5")
    tok = fx.build_tokenizer()
    tok_files, ids = fx.tokenizer_files(tok)
    vocab = ((tok.get_vocab_size() + 63) // 64) * 64
    if "dense" in sets:
        make_dense(tok_files, ids, vocab)
    if "moe" in sets:
        make_moe(tok_files, ids, vocab)
    if "qwen3_5" in sets:
        make_qwen3_5()


def make_dense(tok_files, ids, vocab):
    config = fx.model_config(vocab, ids, tie=True)
    config.update(SHAPE)
    fp32 = OUT / "qwen3-bench-fp32"
    q4 = OUT / "qwen3-bench-4bit"
    if not fp32.exists():
        model = fx.random_model(config, seed=7, scales=fx.TIED_SCALES)
        fx.write_checkpoint(fp32, model, config, tok_files, fx.generation_config(ids))
    if not q4.exists():
        convert(str(fp32), str(q4), quantize=True, q_bits=4, q_group_size=64, q_mode="affine", dtype="bfloat16")
    print(fp32, q4)


MOE_SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 3072,
    "max_window_layers": 8,
    "num_experts": 32,
    "moe_intermediate_size": 256,
}


def make_moe(tok_files, ids, vocab):
    real = releases.real_config("Qwen__Qwen3-30B-A3B")
    config = dict(real)
    config.update(MOE_SHAPE)
    config.update(vocab_size=vocab, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    fp32 = OUT / "qwen3-moe-bench-fp32"
    q4 = OUT / "qwen3-moe-bench-4bit"
    if not fp32.exists():
        model = releases.build_model(config, seed=8, scales=fx.UNTIED_SCALES)
        weights = dict(tree_flatten(model.parameters()))
        releases.write_release(fp32, weights, config, tok_files, fx.generation_config(ids))
    if not q4.exists():
        convert(str(fp32), str(q4), quantize=True, q_bits=4, q_group_size=64, q_mode="affine", dtype="bfloat16")
        (q4 / "README.md").unlink(missing_ok=True)
    print(fp32, q4)


# Qwen/Qwen3.6-35B-A3B's text config scaled to a 2-core CPU: every key of the release, only
# dims changed. Kept as released: head_dim 256 with partial_rotary_factor 0.25 (64 rotary dims,
# mrope_section [11, 11, 10]), 2 KV heads, Dk = Dv = 128, the 2:1 value:key GDN head ratio,
# top-8 routing, the [linear x 3, full] period (2 periods), untied lm_head. Query heads 8 (of
# 16), so GQA is 4:1 here (8:1 released).
QWEN3_5_SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "num_experts": 32,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
}
# A small vision tower (the model type requires one; text-only benchmarks never run it).
QWEN3_5_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
QWEN3_5_SEED = 20261241


def qwen3_5_bench_config(real, vocab_size, id_map, shape, vision):
    """The real qwen3_5_moe config.json with the text dims of `shape` and the vision dims of
    `vision` (same keys, same order); special-token ids renumbered into the tokenizer's."""
    cfg = copy.deepcopy(real)
    text = cfg["text_config"]
    layers = shape["num_hidden_layers"]
    assert text["full_attention_interval"] == 4 and layers % 4 == 0
    assert (text["linear_num_value_heads"] // text["linear_num_key_heads"]
            == shape["linear_num_value_heads"] // shape["linear_num_key_heads"]), "GDN head ratio as released"
    new = dict(shape, layer_types=text["layer_types"][:layers], vocab_size=vocab_size)
    for key, value in new.items():
        assert key in text, key
        text[key] = value
    vis = cfg["vision_config"]
    assert vis["deepstack_visual_indexes"] == []
    for key, value in dict(vision, out_hidden_size=text["hidden_size"]).items():
        assert key in vis, key
        vis[key] = value
    for block in (cfg, text):
        for key in releases.TOKEN_ID_KEYS:
            if key in block:
                block[key] = releases.renumber(block[key], id_map)
    return cfg


def qwen3_5_quantize_like_mlx_vlm(model, plain):
    """mlx_vlm.convert(quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16") as the
    fixture script's "mlx-derived" release does it: bf16 except A_log (cast_predicate), the
    vision tower skipped, qwen3_5_moe's quant_predicate (8-bit g64 mlp.gate and
    mlp.shared_expert_gate); returns the `quantization` block for config.json."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_vlm.quant_utils import quantize_model as vlm_quantize_model
    from mlx_vlm.utils import skip_multimodal_module

    cast = model.cast_predicate
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    own = model.quant_predicate

    def predicate(p, m):
        if skip_multimodal_module(p):
            return False
        return own(p, m) if own is not None else True

    model, quantized = vlm_quantize_model(model, copy.deepcopy(plain), 64, 4, mode="affine", quant_predicate=predicate)
    mx.eval(model.parameters())
    return quantized["quantization"]


def make_qwen3_5():
    import make_vision as mv
    from mlx_vlm.utils import get_model_and_args

    fp32 = OUT / "qwen3_5-moe-bench-fp32"
    q4 = OUT / "qwen3_5-moe-bench-4bit"
    if fp32.exists() and q4.exists():
        print(fp32, q4)
        return
    release = "Qwen__Qwen3.6-35B-A3B"
    real_dir = releases.REAL / release
    template = (real_dir / "chat_template.jinja").read_text(encoding="utf-8")
    mv.check_template(template, releases.QWEN3_5_TEMPLATE_SHA256["Qwen3.6"], f"{release} chat_template.jinja")
    tok, tok_files, ids = releases.qwen3_5_tokenizer(template)
    vocab_size = ((tok.get_vocab_size() + 63) // 64) * 64
    id_map = releases.qwen3_5_token_map(ids)
    real = releases.real_config(release)
    cfg = qwen3_5_bench_config(real, vocab_size, id_map, QWEN3_5_SHAPE, QWEN3_5_VISION)
    arch, _ = get_model_and_args(cfg)
    model = arch.Model(arch.ModelConfig.from_dict(copy.deepcopy(cfg)))
    mv.randomize(model, QWEN3_5_SEED, releases.qwen3_5_rules(tied=False))
    gen_real = releases.real_generation_config(release)
    gen = releases.shrink_generation(gen_real, id_map) if gen_real else None

    def write(path, weights, config):
        partial = path.with_name(path.name + ".partial")
        releases.write_release(partial, weights, config, tok_files, gen)
        for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
            source = real_dir / name
            if not source.exists():
                source = releases.REAL / "Qwen__Qwen3.5-0.8B" / name  # byte-identical across releases
            shutil.copy(source, partial / name)
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)

    if not fp32.exists():
        write(fp32, dict(tree_flatten(model.parameters())), cfg)
    if not q4.exists():
        block = qwen3_5_quantize_like_mlx_vlm(model, cfg)
        qcfg = dict(cfg, quantization=block, quantization_config=block)
        write(q4, dict(tree_flatten(model.parameters())), dict(sorted(qcfg.items())))
    text = cfg["text_config"]
    print(fp32, q4)
    print(f"  qwen3_5_moe bench: hidden {text['hidden_size']}, layers {text['num_hidden_layers']}, heads "
          f"{text['num_attention_heads']}/{text['num_key_value_heads']} of {text['head_dim']}, GDN "
          f"{text['linear_num_key_heads']}k/{text['linear_num_value_heads']}v of {text['linear_key_head_dim']}, "
          f"experts {text['num_experts']} of {text['moe_intermediate_size']} top-{text['num_experts_per_tok']}, "
          f"shared {text['shared_expert_intermediate_size']}, vocab {vocab_size}; "
          f"fp32 {(fp32 / 'model.safetensors').stat().st_size / 1e6:.0f} MB, "
          f"4-bit {(q4 / 'model.safetensors').stat().st_size / 1e6:.0f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()

//! Quantized embedding lookup takes the packed rows, then dequantizes only them: equal to
//! dequantize-everything-then-take in every mode and scale dtype, with peak memory that grows
//! with the sequence, not with its square (the rMLX 0.2.4 identity-matmul bug).

use mlx_rs::{random, Array, Dtype};
use rmlx_engine::{
    nn::{Embedding, QuantWeights},
    quant::{self, QuantMode, QuantSpec},
};

/// MLX's peak-memory counter is process-wide: tests in this file take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn quantized_table(vocab: i32, dim: i32, dtype: Dtype, spec: QuantSpec) -> (Embedding, Array) {
    let key = random::key(7).unwrap();
    let table = random::normal::<f32>(&[vocab, dim], None, None, &key)
        .unwrap()
        .as_dtype(dtype)
        .unwrap();
    let q = quant::quantize(&table, spec).unwrap();
    let dense = quant::dequantize(&q.weight, &q.scales, q.biases.as_ref(), spec).unwrap();
    let embedding = Embedding::Quantized {
        packed: QuantWeights {
            weight: q.weight,
            scales: q.scales,
            biases: q.biases,
            spec,
        },
    };
    (embedding, dense)
}

fn ids(count: i32, vocab: i32) -> Array {
    let values: Vec<i32> = (0..count).map(|i| (i * 7919 + 13) % vocab).collect();
    Array::from_slice(&values, &[1, count])
}

#[test]
fn take_then_dequantize_equals_dequantize_then_take() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    let cases = [
        (
            QuantSpec::new(QuantMode::Affine, 64, 4).unwrap(),
            Dtype::Float32,
        ),
        (
            QuantSpec::new(QuantMode::Affine, 64, 4).unwrap(),
            Dtype::Bfloat16,
        ),
        (
            QuantSpec::new(QuantMode::Affine, 32, 8).unwrap(),
            Dtype::Float16,
        ),
        (QuantSpec::defaults(QuantMode::Mxfp4), Dtype::Bfloat16),
        (QuantSpec::defaults(QuantMode::Mxfp8), Dtype::Bfloat16),
        (QuantSpec::defaults(QuantMode::Nvfp4), Dtype::Float32),
    ];
    for (spec, dtype) in cases {
        let (embedding, dense) = quantized_table(512, 128, dtype, spec);
        let ids = ids(300, 512);
        let looked_up = embedding.forward(&ids).unwrap();
        let reference = dense.take_axis(&ids, 0).unwrap();
        assert_eq!(looked_up.shape(), &[1, 300, 128]);
        assert_eq!(looked_up.dtype(), reference.dtype(), "{spec:?} {dtype:?}");
        let equal = mlx_rs::ops::array_eq(&looked_up, &reference, None).unwrap();
        assert!(
            equal.item_exact::<bool>(),
            "{spec:?} with {dtype:?} scales differs"
        );
    }
}

fn peak_memory() -> usize {
    let mut bytes = 0;
    // SAFETY: plain memory counters of the loaded MLX.
    unsafe { mlx_sys::mlx_get_peak_memory(&mut bytes) };
    bytes
}

/// Peak bytes MLX allocates to look up `seq` ids.
fn lookup_peak(embedding: &Embedding, seq: i32) -> usize {
    let ids = ids(seq, 4096);
    ids.eval().unwrap();
    // SAFETY: resets MLX's process-wide peak counter; SERIAL keeps other tests out.
    unsafe { mlx_sys::mlx_reset_peak_memory() };
    let before = peak_memory();
    let out = embedding.forward(&ids).unwrap();
    out.eval().unwrap();
    peak_memory().saturating_sub(before)
}

#[test]
fn lookup_memory_is_linear_in_sequence_length() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    let (embedding, _) = quantized_table(
        4096,
        256,
        Dtype::Bfloat16,
        QuantSpec::defaults(QuantMode::Affine),
    );
    let small = lookup_peak(&embedding, 4096);
    let large = lookup_peak(&embedding, 16384);
    let identity_bytes = 16384usize.pow(2) * 4;
    assert!(small > 0, "MLX reported no memory use");
    // 4x the ids costs about 4x the memory (a quadratic lookup would cost 16x).
    let growth = large as f64 / small as f64;
    assert!(
        growth < 5.0,
        "peak grew {growth:.1}x for 4x the ids ({small} -> {large} bytes)"
    );
    assert!(
        large < identity_bytes / 10,
        "lookup peaked at {large} bytes; a seq x seq f32 identity alone is {identity_bytes}"
    );
}

/// The quantized tables the fixtures ship, loaded as the models load them: Qwen3-VL's 4-bit
/// `embed_tokens`, Gemma 4's mxfp4 `embed_tokens` and its per-layer table, and the 4-bit
/// tables of the Qwen3 release fixtures (dense and MoE).
fn checkpoint_tables() -> Vec<(String, Embedding, i32)> {
    let fixtures =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut tables = Vec::new();
    for (dir, name, vocab, dim) in [
        (
            "qwen3-vl-tiny-4bit",
            "language_model.model.embed_tokens",
            1024,
            64,
        ),
        (
            "gemma4-tiny-mxfp4",
            "language_model.model.embed_tokens",
            1024,
            64,
        ),
        (
            "gemma4-tiny-mxfp4",
            "language_model.model.embed_tokens_per_layer",
            1024,
            96,
        ),
        (
            "releases/qwen3-30b-a3b-4bit",
            "model.embed_tokens",
            1024,
            64,
        ),
        (
            "releases/qwen3-4b-instruct-2507-4bit",
            "model.embed_tokens",
            1024,
            64,
        ),
    ] {
        let path = fixtures.join(dir);
        let config = rmlx_engine::config::ConfigFile::read(&path).unwrap();
        let mut store = rmlx_engine::weights::WeightStore::open(&path).unwrap();
        let quant = config.base.quantization.as_ref();
        let table = Embedding::load(&mut store, quant, name, vocab, dim).unwrap();
        assert!(matches!(table, Embedding::Quantized { .. }), "{dir} {name}");
        tables.push((format!("{dir} {name}"), table, vocab));
    }
    tables
}

#[test]
fn vision_checkpoint_tables_look_up_on_device_like_dequantize_then_take() {
    let _turn = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    for (name, table, vocab) in checkpoint_tables() {
        let Embedding::Quantized { packed } = &table else {
            unreachable!()
        };
        let dense = quant::dequantize(
            &packed.weight,
            &packed.scales,
            packed.biases.as_ref(),
            packed.spec,
        )
        .unwrap();
        let ids = ids(700, vocab);
        let looked_up = table.forward(&ids).unwrap();
        let reference = dense.take_axis(&ids, 0).unwrap();
        let equal = mlx_rs::ops::array_eq(&looked_up, &reference, None).unwrap();
        assert!(equal.item_exact::<bool>(), "{name} differs");
        // A 16384-token prompt (a 2560² image and more) costs O(seq) memory, far below the
        // seq × seq identity the 0.2.4 lookup multiplied by.
        let long = ids_in(16384, vocab);
        unsafe { mlx_sys::mlx_reset_peak_memory() };
        let before = peak_memory();
        table.forward(&long).unwrap().eval().unwrap();
        let peak = peak_memory().saturating_sub(before);
        let identity_bytes = 16384usize.pow(2) * 4;
        assert!(
            peak < identity_bytes / 20,
            "{name}: lookup peaked at {peak} bytes (identity: {identity_bytes})"
        );
    }
}

fn ids_in(count: i32, vocab: i32) -> Array {
    let array = ids(count, vocab);
    array.eval().unwrap();
    array
}

//! The MLX platform from Rust: dtype round trips, and each fast/quantized op against a plain-op
//! reference computed in the same test. Reference: MLX's python tests (test_fast.py,
//! test_quantized.py) for the formulas.

use half::{bf16, f16};
use mlx_rs::{
    fast,
    fast::ScaledDotProductAttentionMask,
    ops::{self, indexing::IndexOp},
    random, Array, Dtype,
};
use rmlx_engine::quant::{self, QuantMode, QuantSpec};

fn randn(shape: &[i32], seed: u64) -> Array {
    let key = random::key(seed).unwrap();
    random::normal::<f32>(shape, None, None, &key).unwrap()
}

fn to_f32(array: &Array) -> Vec<f32> {
    let array = array.as_dtype(Dtype::Float32).unwrap();
    array.eval().unwrap();
    array.to_vec_exact::<f32>().unwrap()
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape(), "shapes differ");
    to_f32(a)
        .iter()
        .zip(to_f32(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn f32_bf16_f16_round_trip() {
    let values: Vec<f32> = vec![0.0, 1.0, -2.5, 3.140625, 1e-3, -65504.0, 0.333_333_34];
    let array = Array::from_slice(&values, &[values.len() as i32]);
    array.eval().unwrap();
    assert_eq!(array.as_slice::<f32>(), values.as_slice());

    let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
    let array = Array::from_slice(&halves, &[halves.len() as i32]);
    assert_eq!(array.dtype(), Dtype::Float16);
    array.eval().unwrap();
    assert_eq!(array.as_slice::<f16>(), halves.as_slice());

    let brains: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    let array = Array::from_slice(&brains, &[brains.len() as i32]);
    assert_eq!(array.dtype(), Dtype::Bfloat16);
    array.eval().unwrap();
    assert_eq!(array.as_slice::<bf16>(), brains.as_slice());
    // Scalars go through mlx_array_item_{float16,bfloat16}, the accessors x86-64 needed a shim for.
    assert_eq!(array.index(2).item_exact::<bf16>(), bf16::from_f32(-2.5));
    let halves_array = Array::from_slice(&halves, &[halves.len() as i32]);
    assert_eq!(
        halves_array.index(3).item_exact::<f16>(),
        f16::from_f32(3.140625)
    );

    // Conversions on device agree with the host conversions.
    let converted = Array::from_slice(&values, &[values.len() as i32])
        .as_dtype(Dtype::Bfloat16)
        .unwrap();
    converted.eval().unwrap();
    assert_eq!(converted.as_slice::<bf16>(), brains.as_slice());
}

#[test]
fn matmul_matches_broadcast_multiply_sum() {
    let a = randn(&[5, 7], 1);
    let b = randn(&[7, 3], 2);
    let fused = ops::matmul(&a, &b).unwrap();
    let plain = ops::sum_axis(
        ops::multiply(
            ops::expand_dims(&a, 2).unwrap(),
            ops::expand_dims(&b, 0).unwrap(),
        )
        .unwrap(),
        1,
        None,
    )
    .unwrap();
    assert!(max_abs_diff(&fused, &plain) < 1e-5);
}

/// softmax(q k^T * scale + mask) v, with grouped KV heads repeated to the query heads.
fn plain_attention(q: &Array, k: &Array, v: &Array, scale: f32, causal: bool) -> Array {
    let repeats = q.shape()[1] / k.shape()[1];
    let k = ops::repeat_axis::<f32>(k.clone(), repeats, 1).unwrap();
    let v = ops::repeat_axis::<f32>(v.clone(), repeats, 1).unwrap();
    let mut scores = ops::multiply(
        ops::matmul(q, ops::swap_axes(&k, -1, -2).unwrap()).unwrap(),
        Array::from_f32(scale),
    )
    .unwrap();
    if causal {
        let (l, s) = (q.shape()[2], k.shape()[2]);
        let rows = ops::expand_dims(ops::arange::<_, i32>(s - l, s, None).unwrap(), 1).unwrap();
        let cols = ops::expand_dims(ops::arange::<_, i32>(0, s, None).unwrap(), 0).unwrap();
        let allowed = ops::ge(&rows, &cols).unwrap();
        scores = ops::select(&allowed, &scores, Array::from_f32(f32::NEG_INFINITY)).unwrap();
    }
    let weights = ops::softmax_axis(&scores, -1, None).unwrap();
    ops::matmul(&weights, &v).unwrap()
}

#[test]
fn sdpa_matches_plain_attention_with_grouped_heads() {
    let (batch, q_heads, kv_heads, len, dim) = (1, 4, 2, 9, 16);
    let q = randn(&[batch, q_heads, len, dim], 3);
    let k = randn(&[batch, kv_heads, len, dim], 4);
    let v = randn(&[batch, kv_heads, len, dim], 5);
    let scale = 1.0 / (dim as f32).sqrt();
    for causal in [false, true] {
        let mask = causal.then_some(ScaledDotProductAttentionMask::Causal);
        let fused = fast::scaled_dot_product_attention(&q, &k, &v, scale, mask, None).unwrap();
        let plain = plain_attention(&q, &k, &v, scale, causal);
        let diff = max_abs_diff(&fused, &plain);
        assert!(diff < 1e-5, "causal={causal}: max diff {diff}");
    }
    // One query against a longer cache (the decode shape): causal means "see everything before".
    let q1 = randn(&[batch, q_heads, 1, dim], 6);
    let fused = fast::scaled_dot_product_attention(
        &q1,
        &k,
        &v,
        scale,
        ScaledDotProductAttentionMask::Causal,
        None,
    )
    .unwrap();
    assert!(max_abs_diff(&fused, &plain_attention(&q1, &k, &v, scale, true)) < 1e-5);
}

#[test]
fn rms_norm_matches_plain_formula() {
    let x = randn(&[3, 10, 64], 7);
    let weight = ops::add(randn(&[64], 8), Array::from_f32(1.0)).unwrap();
    let eps = 1e-6;
    let fused = fast::rms_norm(&x, Some(&weight), eps).unwrap();
    let mean_square = ops::mean_axis(ops::square(&x).unwrap(), -1, true).unwrap();
    let inverse = ops::rsqrt(ops::add(&mean_square, Array::from_f32(eps)).unwrap()).unwrap();
    let plain = ops::multiply(ops::multiply(&x, &inverse).unwrap(), &weight).unwrap();
    assert!(max_abs_diff(&fused, &plain) < 1e-5);
}

/// Non-traditional RoPE as in Qwen/Llama: rotate the two halves by (offset + t) * base^(-2i/d),
/// computed on the host.
fn plain_rope(x: &[f32], shape: [usize; 3], dims: usize, base: f32, offset: usize) -> Vec<f32> {
    let [heads, len, head_dim] = shape;
    let half = dims / 2;
    let mut out = x.to_vec();
    for h in 0..heads {
        for t in 0..len {
            let row = (h * len + t) * head_dim;
            for i in 0..half {
                let theta = base.powf(-2.0 * i as f32 / dims as f32);
                let angle = (offset + t) as f32 * theta;
                let (x1, x2) = (x[row + i], x[row + i + half]);
                out[row + i] = x1 * angle.cos() - x2 * angle.sin();
                out[row + i + half] = x1 * angle.sin() + x2 * angle.cos();
            }
        }
    }
    out
}

#[test]
fn rope_matches_plain_rotation() {
    let (heads, len, head_dim) = (2, 6, 16);
    let x = randn(&[1, heads, len, head_dim], 9);
    let host = to_f32(&x);
    for (dims, offset) in [(16, 0), (16, 5), (8, 3)] {
        let fused = fast::rope(&x, dims, false, 10000.0, 1.0, offset, None).unwrap();
        let plain = plain_rope(
            &host,
            [heads as usize, len as usize, head_dim as usize],
            dims as usize,
            10000.0,
            offset as usize,
        );
        let diff = to_f32(&fused)
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-4, "dims {dims} offset {offset}: max diff {diff}");
    }
}

#[test]
fn affine_quantized_matmul_matches_dequantized_matmul() {
    let w = randn(&[128, 256], 10);
    let x = randn(&[3, 256], 11);
    for bits in [4, 8] {
        let spec = QuantSpec::new(QuantMode::Affine, 64, bits).unwrap();
        let q = quant::quantize(&w, spec).unwrap();
        assert_eq!(q.weight.dtype(), Dtype::Uint32);
        assert_eq!(q.weight.shape(), &[128, 256 * bits / 32]);
        assert_eq!(q.scales.shape(), &[128, 4]);
        let biases = q.biases.as_ref().expect("affine has biases");
        let fused =
            quant::quantized_matmul(&x, &q.weight, &q.scales, Some(biases), true, spec).unwrap();
        let dense = quant::dequantize(&q.weight, &q.scales, Some(biases), spec).unwrap();
        let plain = ops::matmul(&x, ops::transpose(&dense).unwrap()).unwrap();
        let diff = max_abs_diff(&fused, &plain);
        assert!(diff < 1e-3, "{bits}-bit: max diff {diff}");
        // And the quantization itself is close to the original weights.
        let error = max_abs_diff(&dense, &w);
        assert!(
            error < if bits == 4 { 0.5 } else { 0.05 },
            "{bits}-bit error {error}"
        );
    }
    // mlx-rs's own affine path (which hard-codes the mode) agrees with ours bit for bit.
    let (mw, ms, mb) = ops::quantize(&w, 64, 4).unwrap();
    let ours = quant::quantize(&w, QuantSpec::defaults(QuantMode::Affine)).unwrap();
    assert_eq!(max_abs_diff(&mw, &ours.weight), 0.0);
    assert_eq!(max_abs_diff(&ms, &ours.scales), 0.0);
    assert_eq!(max_abs_diff(&mb, ours.biases.as_ref().unwrap()), 0.0);
}

#[test]
fn fp_modes_round_trip_through_mlx_c() {
    let w = randn(&[64, 128], 12);
    for mode in [QuantMode::Mxfp4, QuantMode::Mxfp8, QuantMode::Nvfp4] {
        let spec = QuantSpec::defaults(mode);
        let q = quant::quantize(&w, spec).unwrap();
        assert!(q.biases.is_none(), "{mode:?} has no biases");
        assert_eq!(q.weight.shape(), &[64, 128 * spec.bits / 32]);
        assert_eq!(q.scales.shape(), &[64, 128 / spec.group_size]);
        let dense = quant::dequantize(&q.weight, &q.scales, None, spec).unwrap();
        assert_eq!(dense.shape(), w.shape());
        // fp4 keeps about one significant bit per group-scaled value; fp8 about three.
        let rel = max_abs_diff(&dense, &w) / to_f32(&w).iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let bound = if mode == QuantMode::Mxfp8 { 0.1 } else { 0.35 };
        assert!(rel < bound, "{mode:?}: relative error {rel}");
        // Dequantized values are exactly representable: quantizing them again changes nothing.
        let again = quant::quantize(&dense, spec).unwrap();
        let redone = quant::dequantize(&again.weight, &again.scales, None, spec).unwrap();
        assert_eq!(
            max_abs_diff(&redone, &dense),
            0.0,
            "{mode:?} is not idempotent"
        );
        // The quantized matmul in the same mode equals the dense matmul of the dequantized weight.
        let x = randn(&[2, 128], 13);
        let fused = quant::quantized_matmul(&x, &q.weight, &q.scales, None, true, spec).unwrap();
        let plain = ops::matmul(&x, ops::transpose(&dense).unwrap()).unwrap();
        assert!(max_abs_diff(&fused, &plain) < 1e-3, "{mode:?} matmul");
    }
}

#[test]
fn bad_quantization_requests_are_typed_errors() {
    assert_eq!(
        "int3".parse::<QuantMode>(),
        Err(quant::QuantError::UnknownMode("int3".into()))
    );
    assert!(matches!(
        QuantSpec::new(QuantMode::Mxfp4, 64, 4),
        Err(quant::QuantError::BadGeometry { .. })
    ));
    let w = randn(&[8, 64], 14);
    let spec = QuantSpec::defaults(QuantMode::Mxfp4);
    let q = quant::quantize(&w, spec).unwrap();
    let stray = Array::from_f32(0.0);
    assert!(matches!(
        quant::dequantize(&q.weight, &q.scales, Some(&stray), spec),
        Err(quant::QuantError::Biases { .. })
    ));
}

//! The gated delta rule as one Metal kernel per layer and chunk (macOS): each SIMD-group of 32
//! threads owns one value row of one head's state, every thread `Dk / 32` of its float32
//! columns; per token the two dot products over Dk are `simd_sum`s. The ops form
//! ([`super::gated_delta::sequential_ops`]) is its reference: at first use the kernel runs on a
//! small random input against it, and on any mismatch (or when it cannot be built) the engine
//! logs why and keeps the ops form. Reference: mlx-vlm `models/qwen3_5/gated_delta.py` and
//! mlx-lm `models/gated_delta.py` (`gated_delta_step` through `mx.fast.metal_kernel`); the
//! kernel here is written from the recurrence, through mlx-c's `mlx_fast_metal_kernel`.

use std::ffi::CString;

use mlx_rs::{Array, Dtype, Stream};

use crate::error::{EngineError, Result};

/// The kernel body; MLX wraps it in a `[[kernel]]` with the inputs, outputs and template
/// arguments (InT, Dk, Dv, Hk, Hv) bound by name.
const SOURCE: &str = r#"
    const uint head = thread_position_in_grid.z;          // b * Hv + value head
    const uint b = head / Hv;
    const uint hv = head % Hv;
    const uint hk = hv / (Hv / Hk);
    const uint row = thread_position_in_grid.y;           // value row of the state
    const uint lane = thread_position_in_threadgroup.x;   // 0..31
    constexpr int per_lane = Dk / 32;
    const int steps = T[0];

    device const InT* q_t = q + (b * steps * Hk + hk) * Dk;
    device const InT* k_t = k + (b * steps * Hk + hk) * Dk;
    device const InT* v_t = v + (b * steps * Hv + hv) * Dv;
    device InT* y_t = y + (b * steps * Hv + hv) * Dv;
    device const float* g_t = g + b * steps * Hv;
    device const InT* beta_t = beta + b * steps * Hv;

    float s[per_lane];
    const uint base = (head * Dv + row) * Dk + lane * per_lane;
    for (int i = 0; i < per_lane; ++i) {
        s[i] = state_in[base + i];
    }
    for (int t = 0; t < steps; ++t) {
        const float decay = g_t[hv];
        float remembered = 0.0f;
        for (int i = 0; i < per_lane; ++i) {
            s[i] *= decay;
            remembered += s[i] * static_cast<float>(k_t[lane * per_lane + i]);
        }
        remembered = simd_sum(remembered);
        const float delta =
            (static_cast<float>(v_t[row]) - remembered) * static_cast<float>(beta_t[hv]);
        float out = 0.0f;
        for (int i = 0; i < per_lane; ++i) {
            s[i] += static_cast<float>(k_t[lane * per_lane + i]) * delta;
            out += s[i] * static_cast<float>(q_t[lane * per_lane + i]);
        }
        out = simd_sum(out);
        if (lane == 0) {
            y_t[row] = static_cast<InT>(out);
        }
        q_t += Hk * Dk;
        k_t += Hk * Dk;
        v_t += Hv * Dv;
        y_t += Hv * Dv;
        g_t += Hv;
        beta_t += Hv;
    }
    for (int i = 0; i < per_lane; ++i) {
        state_out[base + i] = s[i];
    }
"#;

/// A compiled `gated_delta_step` kernel (mlx caches the Metal library by name and template).
pub struct GatedDeltaKernel {
    handle: mlx_sys::mlx_fast_metal_kernel,
}

impl Drop for GatedDeltaKernel {
    fn drop(&mut self) {
        // SAFETY: the handle came from mlx_fast_metal_kernel_new and is freed once.
        unsafe { mlx_sys::mlx_fast_metal_kernel_free(self.handle) };
    }
}

fn names(list: &[&str]) -> (Vec<CString>, mlx_sys::mlx_vector_string) {
    let owned: Vec<CString> = list
        .iter()
        .map(|name| CString::new(*name).expect("no NUL in kernel names"))
        .collect();
    let pointers: Vec<*const std::os::raw::c_char> = owned.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: the pointers live in `owned` for the call; mlx copies the strings.
    let vector =
        unsafe { mlx_sys::mlx_vector_string_new_data(pointers.as_ptr() as _, pointers.len()) };
    (owned, vector)
}

fn check(status: i32, what: &str) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(EngineError::Mlx(format!(
            "gated_delta_step kernel: {what} failed"
        )))
    }
}

impl GatedDeltaKernel {
    pub fn new() -> Result<Self> {
        let (_inputs, input_names) = names(&["q", "k", "v", "g", "beta", "state_in", "T"]);
        let (_outputs, output_names) = names(&["y", "state_out"]);
        let name = CString::new("rmlx_gated_delta_step").expect("static name");
        let source = CString::new(SOURCE).expect("static source");
        let header = CString::new("").expect("static header");
        // SAFETY: every argument is live for the call; mlx copies what it keeps.
        let handle = unsafe {
            let handle = mlx_sys::mlx_fast_metal_kernel_new(
                name.as_ptr(),
                input_names,
                output_names,
                source.as_ptr(),
                header.as_ptr(),
                true,
                false,
            );
            mlx_sys::mlx_vector_string_free(input_names);
            mlx_sys::mlx_vector_string_free(output_names);
            handle
        };
        if handle.ctx.is_null() {
            return Err(EngineError::Mlx(
                "gated_delta_step kernel could not be created".into(),
            ));
        }
        Ok(Self { handle })
    }

    /// Same contract as `gated_delta_ops`: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g (float32)
    /// and beta `[B, T, Hv]`, state `[B, Hv, Dv, Dk]` float32 → (y, state after the chunk).
    pub fn apply(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        g: &Array,
        beta: &Array,
        state: &Array,
    ) -> Result<(Array, Array)> {
        let (batch, steps, key_heads, key_dim) =
            (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
        let (value_heads, value_dim) = (v.shape()[2], v.shape()[3]);
        if key_dim % 32 != 0 {
            return Err(EngineError::Mlx(format!(
                "gated_delta_step kernel needs a key head size divisible by 32, got {key_dim}"
            )));
        }
        let input_dtype = q.dtype();
        let beta = beta.as_dtype(input_dtype)?;
        let g = g.as_dtype(Dtype::Float32)?;
        let steps_array = Array::from_slice(&[steps], &[1]);
        let inputs = [q, k, v, &g, &beta, state, &steps_array];
        let stream = Stream::thread_local_or_default();
        // SAFETY: every handle is live for the calls; the outputs become owned Arrays.
        unsafe {
            let config = mlx_sys::mlx_fast_metal_kernel_config_new();
            let y_shape = [batch, steps, value_heads, value_dim];
            let state_shape = state.shape().to_vec();
            let template_ints = [
                ("Dk", key_dim),
                ("Dv", value_dim),
                ("Hk", key_heads),
                ("Hv", value_heads),
            ];
            let mut status = mlx_sys::mlx_fast_metal_kernel_config_add_output_arg(
                config,
                y_shape.as_ptr(),
                4,
                input_dtype as mlx_sys::mlx_dtype,
            );
            status |= mlx_sys::mlx_fast_metal_kernel_config_add_output_arg(
                config,
                state_shape.as_ptr(),
                state_shape.len(),
                Dtype::Float32 as mlx_sys::mlx_dtype,
            );
            status |= mlx_sys::mlx_fast_metal_kernel_config_set_grid(
                config,
                32,
                value_dim,
                batch * value_heads,
            );
            status |= mlx_sys::mlx_fast_metal_kernel_config_set_thread_group(config, 32, 4, 1);
            let in_t = CString::new("InT").expect("static");
            status |= mlx_sys::mlx_fast_metal_kernel_config_add_template_arg_dtype(
                config,
                in_t.as_ptr(),
                input_dtype as mlx_sys::mlx_dtype,
            );
            for (name, value) in template_ints {
                let name = CString::new(name).expect("static");
                status |= mlx_sys::mlx_fast_metal_kernel_config_add_template_arg_int(
                    config,
                    name.as_ptr(),
                    value,
                );
            }
            let pointers: Vec<mlx_sys::mlx_array> =
                inputs.iter().map(|array| array.as_ptr()).collect();
            let input_vector =
                mlx_sys::mlx_vector_array_new_data(pointers.as_ptr(), pointers.len());
            let mut outputs = mlx_sys::mlx_vector_array_new();
            if status == 0 {
                status = mlx_sys::mlx_fast_metal_kernel_apply(
                    &mut outputs,
                    self.handle,
                    input_vector,
                    config,
                    stream.as_ptr(),
                );
            }
            mlx_sys::mlx_vector_array_free(input_vector);
            mlx_sys::mlx_fast_metal_kernel_config_free(config);
            let arrays = crate::quant::take_vector(outputs);
            check(status, "apply")?;
            let mut arrays = arrays.into_iter();
            match (arrays.next(), arrays.next()) {
                (Some(y), Some(state)) => Ok((y, state)),
                _ => Err(EngineError::Mlx(
                    "gated_delta_step kernel returned no outputs".into(),
                )),
            }
        }
    }

    /// Runs the kernel and the ops form on a small random input (two value heads per key
    /// head, 5 tokens, Dk 64, Dv 16); Ok when they agree within float32 rounding.
    pub fn self_check(&self) -> Result<()> {
        use mlx_rs::ops;
        let [q, k, v, g, beta, state] = super::gated_delta::sample_inputs(5, 64, 16)?;
        let (y, out) = self.apply(&q, &k, &v, &g, &beta, &state)?;
        let (y_ops, out_ops) = super::gated_delta::sequential_ops(&q, &k, &v, &g, &beta, &state)?;
        let worst = |a: &Array, b: &Array| -> Result<f32> {
            let diff = ops::abs(ops::subtract(a, b)?)?.max(None)?;
            diff.eval()?;
            diff.try_item_cast::<f32>()
                .map_err(|error| EngineError::Mlx(error.to_string()))
        };
        let (dy, ds) = (worst(&y, &y_ops)?, worst(&out, &out_ops)?);
        if dy.is_finite() && ds.is_finite() && dy < 1e-4 && ds < 1e-4 {
            Ok(())
        } else {
            Err(EngineError::Mlx(format!(
                "gated_delta_step kernel disagrees with the ops form (y by {dy}, state by {ds})"
            )))
        }
    }
}

thread_local! {
    /// Built and checked once per thread (the engine thread), None when unusable.
    static KERNEL: Option<GatedDeltaKernel> = {
        match GatedDeltaKernel::new().and_then(|kernel| kernel.self_check().map(|()| kernel)) {
            Ok(kernel) => Some(kernel),
            Err(error) => {
                eprintln!("rmlx: {error}; Gated DeltaNet layers use the MLX ops form");
                None
            }
        }
    };
}

/// The kernel's result when it is usable for this input, None to use the ops form.
pub fn try_apply(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Option<Result<(Array, Array)>> {
    if q.shape()[3] % 32 != 0 {
        return None;
    }
    KERNEL.with(|kernel| {
        kernel
            .as_ref()
            .map(|kernel| kernel.apply(q, k, v, g, beta, state))
    })
}

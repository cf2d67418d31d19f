//! Quantization in every mode MLX supports (affine, mxfp4, mxfp8, nvfp4). mlx-rs 0.33 passes the
//! affine mode only, so these call mlx-c directly with the mode string.
//! Reference: MLX `mlx/ops.cpp` (quantize/dequantize/quantized_matmul), mlx-lm `utils.py`.

use std::ffi::CString;

use mlx_rs::{Array, Stream};

/// A quantization mode as mlx-community checkpoints write it in `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Mxfp8,
    Nvfp4,
}

/// Errors from quantized ops; a bad mode or geometry is caught before MLX sees it.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error("unknown quantization mode `{0}` (supported: affine, mxfp4, mxfp8, nvfp4)")]
    UnknownMode(String),
    #[error("{mode} quantization needs group_size {want_group} and bits {want_bits}, got group_size {group_size} and bits {bits}")]
    BadGeometry {
        mode: &'static str,
        group_size: i32,
        bits: i32,
        want_group: String,
        want_bits: String,
    },
    #[error("{mode} quantization needs biases: {detail}")]
    Biases { mode: &'static str, detail: String },
    #[error("MLX rejected {op} ({mode}, group_size {group_size}, bits {bits})")]
    Mlx {
        op: &'static str,
        mode: &'static str,
        group_size: i32,
        bits: i32,
    },
}

impl std::str::FromStr for QuantMode {
    type Err = QuantError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "affine" => Ok(Self::Affine),
            "mxfp4" => Ok(Self::Mxfp4),
            "mxfp8" => Ok(Self::Mxfp8),
            "nvfp4" => Ok(Self::Nvfp4),
            other => Err(QuantError::UnknownMode(other.to_string())),
        }
    }
}

impl QuantMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Affine => "affine",
            Self::Mxfp4 => "mxfp4",
            Self::Mxfp8 => "mxfp8",
            Self::Nvfp4 => "nvfp4",
        }
    }

    /// MLX's defaults per mode: (group_size, bits).
    pub fn default_geometry(self) -> (i32, i32) {
        match self {
            Self::Affine => (64, 4),
            Self::Mxfp4 => (32, 4),
            Self::Mxfp8 => (32, 8),
            Self::Nvfp4 => (16, 4),
        }
    }

    /// The fp modes store one shared scale per group and no bias.
    pub fn has_biases(self) -> bool {
        self == Self::Affine
    }
}

/// A mode with its group size and bit width, checked against what MLX accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    pub mode: QuantMode,
    pub group_size: i32,
    pub bits: i32,
}

impl QuantSpec {
    pub fn new(mode: QuantMode, group_size: i32, bits: i32) -> Result<Self, QuantError> {
        let valid = match mode {
            QuantMode::Affine => [32, 64, 128].contains(&group_size) && (2..=8).contains(&bits),
            _ => (group_size, bits) == mode.default_geometry(),
        };
        if !valid {
            let (want_group, want_bits) = match mode {
                QuantMode::Affine => ("32, 64 or 128".to_string(), "2 to 8".to_string()),
                _ => {
                    let (group, bits) = mode.default_geometry();
                    (group.to_string(), bits.to_string())
                }
            };
            return Err(QuantError::BadGeometry {
                mode: mode.as_str(),
                group_size,
                bits,
                want_group,
                want_bits,
            });
        }
        Ok(Self {
            mode,
            group_size,
            bits,
        })
    }

    pub fn defaults(mode: QuantMode) -> Self {
        let (group_size, bits) = mode.default_geometry();
        Self {
            mode,
            group_size,
            bits,
        }
    }

    fn mlx_error(self, op: &'static str) -> QuantError {
        QuantError::Mlx {
            op,
            mode: self.mode.as_str(),
            group_size: self.group_size,
            bits: self.bits,
        }
    }

    fn check_biases(self, biases: Option<&Array>) -> Result<(), QuantError> {
        match (self.mode.has_biases(), biases.is_some()) {
            (true, false) => Err(QuantError::Biases {
                mode: self.mode.as_str(),
                detail: "affine weights come with .biases".into(),
            }),
            (false, true) => Err(QuantError::Biases {
                mode: self.mode.as_str(),
                detail: "fp modes have no .biases".into(),
            }),
            _ => Ok(()),
        }
    }

    fn c_mode(self) -> CString {
        CString::new(self.mode.as_str()).expect("mode names have no NUL")
    }
}

/// A quantized weight as stored in checkpoints: packed `weight`, `scales`, and `biases` (affine).
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
}

fn optional_int(value: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int {
        value,
        has_value: true,
    }
}

fn no_dtype() -> mlx_sys::mlx_optional_dtype {
    mlx_sys::mlx_optional_dtype {
        value: mlx_sys::mlx_dtype__MLX_FLOAT32,
        has_value: false,
    }
}

/// An empty mlx_array standing for a null optional argument, freed when dropped.
fn null_array() -> Array {
    // SAFETY: mlx_array_new returns an owned empty handle.
    unsafe { Array::from_ptr(mlx_sys::mlx_array_new()) }
}

/// Quantizes `w` (last axis grouped) in `spec`'s mode.
pub fn quantize(w: &Array, spec: QuantSpec) -> Result<Quantized, QuantError> {
    let stream = Stream::thread_local_or_default();
    let mode = spec.c_mode();
    let global_scale = null_array();
    // SAFETY: every handle is live for the call; the result vector is read and freed here.
    unsafe {
        let mut out = mlx_sys::mlx_vector_array_new();
        let status = mlx_sys::mlx_quantize(
            &mut out,
            w.as_ptr(),
            optional_int(spec.group_size),
            optional_int(spec.bits),
            mode.as_ptr(),
            global_scale.as_ptr(),
            stream.as_ptr(),
        );
        let parts = take_vector(out);
        if status != 0 || parts.len() < 2 {
            return Err(spec.mlx_error("quantize"));
        }
        let mut parts = parts.into_iter();
        Ok(Quantized {
            weight: parts.next().unwrap(),
            scales: parts.next().unwrap(),
            biases: parts.next(),
        })
    }
}

/// Dequantizes packed weights back to floats (the scales' dtype).
pub fn dequantize(
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
) -> Result<Array, QuantError> {
    spec.check_biases(biases)?;
    let stream = Stream::thread_local_or_default();
    let mode = spec.c_mode();
    let null = null_array();
    let global_scale = null_array();
    // SAFETY: every handle is live for the call; `out` becomes an owned Array.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_dequantize(
            &mut out,
            weight.as_ptr(),
            scales.as_ptr(),
            biases.unwrap_or(&null).as_ptr(),
            optional_int(spec.group_size),
            optional_int(spec.bits),
            mode.as_ptr(),
            global_scale.as_ptr(),
            no_dtype(),
            stream.as_ptr(),
        );
        let out = Array::from_ptr(out);
        if status != 0 {
            return Err(spec.mlx_error("dequantize"));
        }
        Ok(out)
    }
}

/// `x @ dequantize(w).T` (transpose = true, the Linear layout) without materialising `w`.
pub fn quantized_matmul(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    spec: QuantSpec,
) -> Result<Array, QuantError> {
    spec.check_biases(biases)?;
    let stream = Stream::thread_local_or_default();
    let mode = spec.c_mode();
    let null = null_array();
    // SAFETY: every handle is live for the call; `out` becomes an owned Array.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_quantized_matmul(
            &mut out,
            x.as_ptr(),
            weight.as_ptr(),
            scales.as_ptr(),
            biases.unwrap_or(&null).as_ptr(),
            transpose,
            optional_int(spec.group_size),
            optional_int(spec.bits),
            mode.as_ptr(),
            stream.as_ptr(),
        );
        let out = Array::from_ptr(out);
        if status != 0 {
            return Err(spec.mlx_error("quantized_matmul"));
        }
        // MLX 0.32.2's CPU kernel divides by the row count: zero rows would be a SIGFPE that
        // ends the process at evaluation. The (lazy) product only lends its shape and dtype.
        if out.size() == 0 {
            return mlx_rs::ops::zeros_dtype(out.shape(), out.dtype())
                .map_err(|_| spec.mlx_error("quantized_matmul"));
        }
        Ok(out)
    }
}

/// Experts' matmul `x @ dequantize(w[rhs_indices]).T` (mlx `gather_qmm`): only the chosen
/// experts' packed rows are read. `sorted` says the indices ascend (the prefill path).
pub fn gather_qmm(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    rhs_indices: &Array,
    sorted: bool,
    spec: QuantSpec,
) -> Result<Array, QuantError> {
    spec.check_biases(biases)?;
    let stream = Stream::thread_local_or_default();
    let mode = spec.c_mode();
    let null = null_array();
    let no_lhs = null_array();
    // SAFETY: every handle is live for the call; `out` becomes an owned Array.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_gather_qmm(
            &mut out,
            x.as_ptr(),
            weight.as_ptr(),
            scales.as_ptr(),
            biases.unwrap_or(&null).as_ptr(),
            no_lhs.as_ptr(),
            rhs_indices.as_ptr(),
            true,
            optional_int(spec.group_size),
            optional_int(spec.bits),
            mode.as_ptr(),
            sorted,
            stream.as_ptr(),
        );
        let out = Array::from_ptr(out);
        if status != 0 {
            return Err(spec.mlx_error("gather_qmm"));
        }
        Ok(out)
    }
}

/// Experts' matmul `x @ b[rhs_indices]` for dense stacked weights (mlx `gather_mm`; mlx-rs 0.33
/// has no binding).
pub fn gather_mm(
    x: &Array,
    b: &Array,
    rhs_indices: &Array,
    sorted: bool,
) -> Result<Array, mlx_rs::error::Exception> {
    let stream = Stream::thread_local_or_default();
    let no_lhs = null_array();
    // SAFETY: every handle is live for the call; `out` becomes an owned Array.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_gather_mm(
            &mut out,
            x.as_ptr(),
            b.as_ptr(),
            no_lhs.as_ptr(),
            rhs_indices.as_ptr(),
            sorted,
            stream.as_ptr(),
        );
        let out = Array::from_ptr(out);
        if status != 0 {
            return Err(mlx_rs::error::Exception::custom("MLX rejected gather_mm"));
        }
        Ok(out)
    }
}

/// Moves the arrays out of an mlx_vector_array and frees it.
pub(crate) unsafe fn take_vector(vector: mlx_sys::mlx_vector_array) -> Vec<Array> {
    let len = mlx_sys::mlx_vector_array_size(vector);
    let mut arrays = Vec::with_capacity(len);
    for index in 0..len {
        let mut item = mlx_sys::mlx_array_new();
        mlx_sys::mlx_vector_array_get(&mut item, vector, index);
        arrays.push(Array::from_ptr(item));
    }
    mlx_sys::mlx_vector_array_free(vector);
    arrays
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No rows in, no rows out, without evaluating MLX's kernel (whose division by the row
    /// count would end the test process with a SIGFPE).
    #[test]
    fn a_quantized_matmul_of_no_rows_is_empty() {
        let spec = QuantSpec::defaults(QuantMode::Affine);
        let w = mlx_rs::random::normal::<f32>(&[96, 128], None, None, None).unwrap();
        let q = quantize(&w, spec).unwrap();
        for rows in [&[0, 128][..], &[1, 0, 128]] {
            let x = mlx_rs::ops::zeros::<f32>(rows).unwrap();
            let out =
                quantized_matmul(&x, &q.weight, &q.scales, q.biases.as_ref(), true, spec).unwrap();
            out.eval().unwrap();
            assert_eq!(out.shape()[out.ndim() - 1], 96);
            assert_eq!(out.size(), 0);
        }
        // The same call with a row computes.
        let x = mlx_rs::ops::ones::<f32>(&[1, 128]).unwrap();
        let out =
            quantized_matmul(&x, &q.weight, &q.scales, q.biases.as_ref(), true, spec).unwrap();
        assert_eq!(out.shape(), &[1, 96]);
    }
}

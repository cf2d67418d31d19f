//! One error type for the engine: every variant says what failed and where (file, tensor,
//! token counts), so front doors can map it to a clear message or HTTP status.

use std::path::PathBuf;

use crate::quant::QuantError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: invalid config: {message}")]
    Config { path: PathBuf, message: String },
    #[error("unsupported model_type `{0}` (supported: {supported})", supported = crate::models::SUPPORTED_MODEL_TYPES.join(", "))]
    UnknownModelType(String),
    #[error("{file}: tensor `{tensor}`: {message}")]
    Tensor {
        file: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{file}: {message}")]
    WeightsFile { file: PathBuf, message: String },
    #[error("missing tensor `{tensor}` (not in any of: {files})")]
    MissingTensor { tensor: String, files: String },
    #[error("{} unexpected tensor(s) no layer uses, e.g. `{}` in {}", .tensors.len(), .tensors[0].0, .tensors[0].1.display())]
    UnusedTensors { tensors: Vec<(String, PathBuf)> },
    #[error("{} needs about {:.1} GB but only {:.1} GB of memory is available", .model.display(), *.needed as f64 / 1e9, *.available as f64 / 1e9)]
    ModelTooLarge {
        model: PathBuf,
        needed: u64,
        available: u64,
    },
    #[error("prompt has {prompt_tokens} tokens but the context holds {max_ctx}")]
    ContextOverflow {
        prompt_tokens: usize,
        max_ctx: usize,
    },
    #[error("the prompt has {tokens} image tokens but the vision tower gave {features} features")]
    ImageTokenMismatch { tokens: usize, features: usize },
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error(transparent)]
    Sample(#[from] crate::sample::SampleError),
    #[error("MLX: {0}")]
    Mlx(String),
    /// A buffer this request needed could not be allocated (host memory, or MLX's allocator
    /// on any device); only this request fails, and the next one starts afresh.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A bug: code on the engine thread panicked while serving this request. The thread
    /// carries on with the next one.
    #[error("internal error in the engine: {0}")]
    Internal(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("the engine is busy: {0} requests queued")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    EngineStopped,
    /// A pipeline across ranks failed (a peer lost, a message this rank cannot read).
    #[error("distributed: {0}")]
    Distributed(String),
}

impl From<mlx_rs::error::Exception> for EngineError {
    fn from(error: mlx_rs::error::Exception) -> Self {
        let what = error.what();
        if is_allocation_failure(what) {
            Self::OutOfMemory(format!("MLX: {what}"))
        } else {
            Self::Mlx(what.to_string())
        }
    }
}

/// Whether an MLX message reports a failed allocation: Metal's allocator throws
/// `[malloc] Unable to allocate N bytes.`, `[metal::malloc] Attempting to allocate N bytes which
/// is greater than the maximum allowed buffer size ...` or `[metal::malloc] Resource limit (N)
/// exceeded.` (mlx `backend/metal/allocator.cpp`); C++ containers inside MLX throw
/// `std::bad_alloc`. (MLX 0.32's CPU allocator reports nothing: it hands out a null buffer.)
pub fn is_allocation_failure(message: &str) -> bool {
    message.contains("Unable to allocate")
        || message.contains("Attempting to allocate")
        || message.contains("Resource limit")
        || message.contains("bad_alloc")
}

/// Reserves room for `additional` more values in `buffer`, or `OutOfMemory` naming `what`:
/// the big per-request buffers (image rows) must never abort the process the way a failed
/// `Vec` growth does.
pub fn try_grow<T>(buffer: &mut Vec<T>, additional: usize, what: &str) -> Result<()> {
    buffer.try_reserve_exact(additional).map_err(|_| {
        EngineError::OutOfMemory(format!(
            "cannot allocate {:.1} MB for {what}",
            (additional * std::mem::size_of::<T>()) as f64 / 1e6
        ))
    })
}

impl EngineError {
    /// A stable name for metrics and API error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::Config { .. } | Self::UnknownModelType(_) => "model_config",
            Self::Tensor { .. }
            | Self::WeightsFile { .. }
            | Self::MissingTensor { .. }
            | Self::UnusedTensors { .. } => "model_weights",
            Self::ContextOverflow { .. } => "context_length_exceeded",
            Self::ImageTokenMismatch { .. } => "image_token_mismatch",
            Self::ModelTooLarge { .. } => "model_too_large",
            Self::Quant(_) => "quantization",
            Self::Chat(_) => "chat_template",
            Self::Sample(_) => "invalid_sampling",
            Self::Mlx(_) => "mlx",
            Self::OutOfMemory(_) => "out_of_memory",
            Self::Internal(_) => "internal",
            Self::InvalidRequest(_) => "invalid_request",
            Self::QueueFull(_) => "queue_full",
            Self::EngineStopped => "engine_stopped",
            Self::Distributed(_) => "distributed",
        }
    }

    /// This error again, for each request of a batch that failed together. Errors whose
    /// source cannot be copied (I/O, JSON, MLX exceptions inside others) keep their message.
    pub fn for_each_request(&self) -> Self {
        match self {
            Self::Mlx(message) => Self::Mlx(message.clone()),
            Self::OutOfMemory(message) => Self::OutOfMemory(message.clone()),
            Self::Internal(message) => Self::Internal(message.clone()),
            Self::Distributed(message) => Self::Distributed(message.clone()),
            Self::InvalidRequest(message) => Self::InvalidRequest(message.clone()),
            Self::ContextOverflow {
                prompt_tokens,
                max_ctx,
            } => Self::ContextOverflow {
                prompt_tokens: *prompt_tokens,
                max_ctx: *max_ctx,
            },
            Self::ImageTokenMismatch { tokens, features } => Self::ImageTokenMismatch {
                tokens: *tokens,
                features: *features,
            },
            Self::QueueFull(bound) => Self::QueueFull(*bound),
            Self::EngineStopped => Self::EngineStopped,
            // A request's own sampling parameters: still its fault, not the engine's.
            Self::Sample(crate::sample::SampleError::InvalidParam { .. })
            | Self::Sample(crate::sample::SampleError::TokenOutOfRange { .. }) => {
                Self::InvalidRequest(self.to_string())
            }
            other => Self::Mlx(other.to_string()),
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_failures_are_told_apart_from_other_mlx_errors() {
        for message in [
            "[malloc] Unable to allocate 1073741824 bytes.",
            "[metal::malloc] Attempting to allocate 99999999999 bytes which is greater than the \
             maximum allowed buffer size of 77309411328 bytes.",
            "[metal::malloc] Resource limit (499000) exceeded.",
            "std::bad_alloc",
        ] {
            assert!(is_allocation_failure(message), "{message}");
        }
        for message in [
            "[matmul] Last dimension of first input with shape (2,3) must match second to last \
             dimension of second input with shape (4,5).",
            "[load_safetensors] Failed to open file model.safetensors",
        ] {
            assert!(!is_allocation_failure(message), "{message}");
        }
        let mut rows = vec![0f32; 4];
        let error = try_grow(&mut rows, usize::MAX / 8, "image rows").unwrap_err();
        assert_eq!(error.kind(), "out_of_memory");
        assert!(error.to_string().contains("image rows"), "{error}");
        assert_eq!(rows.len(), 4);
    }
}

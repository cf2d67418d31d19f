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
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("the engine is busy: {0} requests queued")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    EngineStopped,
}

impl From<mlx_rs::error::Exception> for EngineError {
    fn from(error: mlx_rs::error::Exception) -> Self {
        Self::Mlx(error.what().to_string())
    }
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
            Self::InvalidRequest(_) => "invalid_request",
            Self::QueueFull(_) => "queue_full",
            Self::EngineStopped => "engine_stopped",
        }
    }

    /// This error again, for each request of a batch that failed together. Errors whose
    /// source cannot be copied (I/O, JSON, MLX exceptions inside others) keep their message.
    pub fn for_each_request(&self) -> Self {
        match self {
            Self::Mlx(message) => Self::Mlx(message.clone()),
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
            other => Self::Mlx(other.to_string()),
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

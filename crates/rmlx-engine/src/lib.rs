//! rMLX's engine: pure compute on MLX, no HTTP. Front doors (CLI, server, app) call into it.

pub mod attention;
pub mod cache;
pub mod cache_mirror;
pub mod chat;
pub mod config;
pub mod constrain;
pub mod disk_cache;
pub mod distributed;
pub mod engine;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod models;
pub mod multimodal;
pub mod nn;
pub mod prefix_cache;
pub mod profile;
pub mod quant;
pub mod runtime;
pub mod sample;
pub mod speculative;
pub mod vision;
pub mod weights;

pub use error::{EngineError, Result};

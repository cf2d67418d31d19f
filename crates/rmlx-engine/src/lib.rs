//! rMLX's engine: pure compute on MLX, no HTTP. Front doors (CLI, server, app) call into it.

pub mod quant;
pub mod runtime;

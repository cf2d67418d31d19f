//! Images in: decoding with limits (this module), then per-family preprocessing.

pub mod image;
pub mod preprocess;

pub use image::{decode_image, decode_image_source, ImageError, ImageLimits, SourcePolicy};

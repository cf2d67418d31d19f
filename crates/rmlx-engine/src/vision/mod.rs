//! Images in: decoding with limits (this module), then per-family preprocessing.

pub mod image;
pub mod preprocess;

/// Decoded RGB8 pixels, as front doors hand images to the engine.
pub use ::image::RgbImage;
pub use image::{
    decode_image, decode_image_source, ImageError, ImageLimits, SourcePolicy, JPEG_BASE64,
    LENIENT_BASE64,
};

//! Image bytes to RGB pixels, safely: the format is sniffed from the bytes, dimensions are
//! checked from the header before any pixel is decoded (decompression bombs), JPEG EXIF
//! orientation is applied, GIFs give their first frame. Reference: the `image` crate's
//! `ImageReader` + `Limits`; HF `image_utils.load_image` (data-URIs, base64, RGB conversion).

use std::io::Cursor;

use base64::Engine as _;
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, RgbImage};

/// Where an image may come from. File paths are for the CLI only; servers never read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourcePolicy {
    /// Data-URIs and bare base64 only (what API requests may send).
    InlineOnly,
    /// Also local file paths (the CLI's `--image`).
    AllowFiles,
}

/// Bounds checked before decoding. The defaults admit a 2560×2560 photo with room to spare
/// and refuse a small file that claims a gigapixel canvas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    pub max_bytes: usize,
    pub max_side: u32,
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_bytes: 64 << 20,
            max_side: 16384,
            max_pixels: 64 << 20,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ImageError {
    #[error("image is empty")]
    Empty,
    #[error("image is {bytes} bytes, over the {max} byte limit")]
    TooManyBytes { bytes: usize, max: usize },
    #[error(
        "image is {width}x{height}, over the limit ({max_side} px a side, {max_pixels} px in all)"
    )]
    TooLarge {
        width: u32,
        height: u32,
        max_side: u32,
        max_pixels: u64,
    },
    #[error("not a supported image (PNG, JPEG, WebP, GIF, BMP or TIFF)")]
    UnknownFormat,
    #[error("unreadable {format} image: {message}")]
    Corrupt { format: String, message: String },
    #[error("bad data URI or base64: {0}")]
    BadEncoding(String),
    /// The host refused the memory to decode it (the process goes on; see [`reserve`]).
    #[error("out of memory: cannot allocate {:.1} MB to decode the image", *.bytes as f64 / 1e6)]
    OutOfMemory { bytes: usize },
    #[error("remote image URLs are not fetched; send the image inline as a data URI")]
    RemoteUrl,
    #[error("file paths are not accepted here; send the image inline as a data URI")]
    FilePath,
    #[error("cannot read {path}: {message}")]
    File { path: String, message: String },
}

const SUPPORTED: [ImageFormat; 6] = [
    ImageFormat::Png,
    ImageFormat::Jpeg,
    ImageFormat::WebP,
    ImageFormat::Gif,
    ImageFormat::Bmp,
    ImageFormat::Tiff,
];

/// Decodes image bytes to RGB8 with EXIF orientation applied.
pub fn decode_image(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes {
            bytes: bytes.len(),
            max: limits.max_bytes,
        });
    }
    let format = image::guess_format(bytes)
        .ok()
        .filter(|format| SUPPORTED.contains(format))
        .ok_or(ImageError::UnknownFormat)?;
    let corrupt = |error: image::ImageError| ImageError::Corrupt {
        format: format!("{format:?}").to_uppercase(),
        message: error.to_string(),
    };
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    // The decoder also enforces these while allocating, as a second line of defence.
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_image_width = Some(limits.max_side);
    decoder_limits.max_image_height = Some(limits.max_side);
    decoder_limits.max_alloc = Some(limits.max_pixels * 4 + (16 << 20));
    reader.limits(decoder_limits);
    let mut decoder = reader.into_decoder().map_err(|error| match error {
        image::ImageError::Limits(_) => too_large_from_header(bytes, format, limits),
        other => corrupt(other),
    })?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        return Err(ImageError::Empty);
    }
    if width > limits.max_side
        || height > limits.max_side
        || u64::from(width) * u64::from(height) > limits.max_pixels
    {
        return Err(ImageError::TooLarge {
            width,
            height,
            max_side: limits.max_side,
            max_pixels: limits.max_pixels,
        });
    }
    let orientation = decoder.orientation().ok();
    // The decoder's buffer, its RGB copy (none when it is RGB already) and a rotated copy: asked
    // for up front, as the decoder's own allocations cannot fail without aborting the process.
    let rgb = u64::from(width) * u64::from(height) * 3;
    let converted = if decoder.color_type() == image::ColorType::Rgb8 {
        0
    } else {
        rgb
    };
    let rotated = if orientation.is_some_and(|o| o != image::metadata::Orientation::NoTransforms) {
        rgb
    } else {
        0
    };
    probe_memory(decoder.total_bytes() + converted + rotated)?;
    let mut image = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    if let Some(orientation) = orientation {
        image.apply_orientation(orientation);
    }
    Ok(image.into_rgb8())
}

/// Room for `additional` more bytes in `buffer`, or `OutOfMemory`: an image's buffers are tens
/// of MB, and a refused `Vec` growth would abort the whole server.
fn reserve(buffer: &mut Vec<u8>, additional: usize) -> Result<(), ImageError> {
    buffer
        .try_reserve_exact(additional)
        .map_err(|_| ImageError::OutOfMemory { bytes: additional })
}

/// Whether `bytes` can be had now, asked for and given back: for allocations inside the `image`
/// crate, which cannot fail softly. (One thread decodes one image; another thread may still
/// take the memory in between, so this narrows the window rather than closing it.)
fn probe_memory(bytes: u64) -> Result<(), ImageError> {
    let bytes =
        usize::try_from(bytes).map_err(|_| ImageError::OutOfMemory { bytes: usize::MAX })?;
    reserve(&mut Vec::new(), bytes)
}

/// When the decoder refuses on its own limits, report the header's size if we can read it.
fn too_large_from_header(bytes: &[u8], format: ImageFormat, limits: &ImageLimits) -> ImageError {
    // Reading the header allocates nothing, so no limits are needed for it.
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.no_limits();
    let (width, height) = reader.into_dimensions().unwrap_or((u32::MAX, u32::MAX));
    ImageError::TooLarge {
        width,
        height,
        max_side: limits.max_side,
        max_pixels: limits.max_pixels,
    }
}

/// Decodes an image given as a data-URI, bare base64, or (when allowed) a file path.
pub fn decode_image_source(
    source: &str,
    policy: SourcePolicy,
    limits: &ImageLimits,
) -> Result<RgbImage, ImageError> {
    let source = source.trim();
    let lower = source.get(..8).unwrap_or(source).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(ImageError::RemoteUrl);
    }
    if let Some(rest) = source.strip_prefix("data:") {
        let (header, payload) = rest
            .split_once(',')
            .ok_or_else(|| ImageError::BadEncoding("data URI without a comma".into()))?;
        if !header.ends_with(";base64") {
            return Err(ImageError::BadEncoding("data URI is not base64".into()));
        }
        return decode_image(&decode_base64(payload, limits)?, limits);
    }
    if policy == SourcePolicy::AllowFiles && std::path::Path::new(source).is_file() {
        let bytes = std::fs::read(source).map_err(|error| ImageError::File {
            path: source.to_string(),
            message: error.to_string(),
        })?;
        return decode_image(&bytes, limits);
    }
    if looks_like_path(source) {
        return Err(match policy {
            SourcePolicy::InlineOnly => ImageError::FilePath,
            SourcePolicy::AllowFiles => ImageError::File {
                path: source.to_string(),
                message: "no such file".into(),
            },
        });
    }
    decode_image(&decode_base64(source, limits)?, limits)
}

/// Bare base64 of a JPEG: its first bytes `FF D8 FF` encode as `/9j/`, which would otherwise
/// read as an absolute path.
pub const JPEG_BASE64: &str = "/9j/";

/// Standard base64, padded or not (clients send both, and line-wrapped text, whose ASCII
/// whitespace is skipped before decoding).
pub const LENIENT_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

fn looks_like_path(source: &str) -> bool {
    (source.starts_with('/') && !source.starts_with(JPEG_BASE64))
        || source.starts_with("./")
        || source.starts_with("file:")
        || source.starts_with('~')
}

fn decode_base64(payload: &str, limits: &ImageLimits) -> Result<Vec<u8>, ImageError> {
    // Refuse before allocating: base64 is 4 characters per 3 bytes.
    let approximate = payload.len() / 4 * 3;
    if approximate > limits.max_bytes {
        return Err(ImageError::TooManyBytes {
            bytes: approximate,
            max: limits.max_bytes,
        });
    }
    let mut compact = Vec::new();
    reserve(&mut compact, payload.len())?;
    compact.extend(payload.bytes().filter(|c| !c.is_ascii_whitespace()));
    let mut decoded = Vec::new();
    reserve(&mut decoded, base64::decoded_len_estimate(compact.len()))?;
    LENIENT_BASE64
        .decode_vec(&compact, &mut decoded)
        .map_err(|error| ImageError::BadEncoding(error.to_string()))?;
    Ok(decoded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, Rgb};

    /// A 4x3 image whose corners are distinguishable, so orientation is visible.
    fn sample() -> RgbImage {
        RgbImage::from_fn(4, 3, |x, y| Rgb([(x * 60) as u8, (y * 100) as u8, 7]))
    }

    fn encode(image: &RgbImage, format: ImageFormat) -> Vec<u8> {
        let mut bytes = Vec::new();
        DynamicImage::ImageRgb8(image.clone())
            .write_to(&mut Cursor::new(&mut bytes), format)
            .unwrap();
        bytes
    }

    #[test]
    fn lossless_formats_round_trip() {
        let image = sample();
        for format in [
            ImageFormat::Png,
            ImageFormat::Bmp,
            ImageFormat::Tiff,
            ImageFormat::WebP,
        ] {
            let decoded = decode_image(&encode(&image, format), &ImageLimits::default()).unwrap();
            assert_eq!(decoded, image, "{format:?}");
        }
        // GIF is paletted: exact for these few colours.
        let decoded =
            decode_image(&encode(&image, ImageFormat::Gif), &ImageLimits::default()).unwrap();
        assert_eq!(decoded.dimensions(), (4, 3));
        let jpeg =
            decode_image(&encode(&image, ImageFormat::Jpeg), &ImageLimits::default()).unwrap();
        assert_eq!(jpeg.dimensions(), (4, 3));
    }

    /// A JPEG with an EXIF APP1 segment carrying `orientation` (tag 0x0112).
    fn jpeg_with_orientation(image: &RgbImage, orientation: u16) -> Vec<u8> {
        let jpeg = encode(image, ImageFormat::Jpeg);
        let mut tiff = b"II*\0\x08\0\0\0".to_vec();
        tiff.extend_from_slice(&1u16.to_le_bytes()); // one IFD entry
        tiff.extend_from_slice(&0x0112u16.to_le_bytes());
        tiff.extend_from_slice(&3u16.to_le_bytes()); // SHORT
        tiff.extend_from_slice(&1u32.to_le_bytes());
        tiff.extend_from_slice(&orientation.to_le_bytes());
        tiff.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // value padding, next IFD = 0
        let mut app1 = b"Exif\0\0".to_vec();
        app1.extend_from_slice(&tiff);
        let mut out = jpeg[..2].to_vec(); // SOI
        out.extend_from_slice(&[0xff, 0xe1]);
        out.extend_from_slice(&((app1.len() + 2) as u16).to_be_bytes());
        out.extend_from_slice(&app1);
        out.extend_from_slice(&jpeg[2..]);
        out
    }

    #[test]
    fn jpeg_exif_orientation_is_applied() {
        let wide = RgbImage::from_fn(40, 20, |x, _| Rgb([if x < 20 { 250 } else { 5 }, 0, 0]));
        let limits = ImageLimits::default();
        let upright = decode_image(&jpeg_with_orientation(&wide, 1), &limits).unwrap();
        assert_eq!(upright.dimensions(), (40, 20));
        // 6 = rotate 90° clockwise: the bright left half ends up on top.
        let rotated = decode_image(&jpeg_with_orientation(&wide, 6), &limits).unwrap();
        assert_eq!(rotated.dimensions(), (20, 40));
        assert!(
            rotated.get_pixel(10, 5)[0] > 200,
            "{:?}",
            rotated.get_pixel(10, 5)
        );
        assert!(
            rotated.get_pixel(10, 35)[0] < 50,
            "{:?}",
            rotated.get_pixel(10, 35)
        );
    }

    #[test]
    fn data_uris_base64_and_sources() {
        let png = encode(&sample(), ImageFormat::Png);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
        let limits = ImageLimits::default();
        let uri = format!("data:image/png;base64,{b64}");
        assert_eq!(
            decode_image_source(&uri, SourcePolicy::InlineOnly, &limits).unwrap(),
            sample()
        );
        assert_eq!(
            decode_image_source(&b64, SourcePolicy::InlineOnly, &limits).unwrap(),
            sample()
        );
        // Unpadded and line-wrapped base64 is accepted, as browsers and SDKs send both.
        let wrapped: String = b64
            .trim_end_matches('=')
            .chars()
            .collect::<Vec<_>>()
            .chunks(60)
            .map(|c| c.iter().collect::<String>() + "\n")
            .collect();
        assert_eq!(
            decode_image_source(&wrapped, SourcePolicy::InlineOnly, &limits).unwrap(),
            sample()
        );
        assert_eq!(
            decode_image_source(
                "https://example.com/cat.png",
                SourcePolicy::InlineOnly,
                &limits
            ),
            Err(ImageError::RemoteUrl)
        );
        assert_eq!(
            decode_image_source("/etc/passwd", SourcePolicy::InlineOnly, &limits),
            Err(ImageError::FilePath)
        );
        // Bare base64 of a JPEG starts with `/`: it is the picture, not a path.
        let jpeg =
            base64::engine::general_purpose::STANDARD.encode(encode(&sample(), ImageFormat::Jpeg));
        assert!(jpeg.starts_with("/9j/"));
        let decoded = decode_image_source(&jpeg, SourcePolicy::InlineOnly, &limits).unwrap();
        assert_eq!(decoded.dimensions(), sample().dimensions());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.png");
        std::fs::write(&path, &png).unwrap();
        let path = path.to_str().unwrap();
        assert_eq!(
            decode_image_source(path, SourcePolicy::AllowFiles, &limits).unwrap(),
            sample()
        );
        assert_eq!(
            decode_image_source(path, SourcePolicy::InlineOnly, &limits),
            Err(ImageError::FilePath)
        );
    }

    #[test]
    fn bad_input_is_typed() {
        let limits = ImageLimits::default();
        assert_eq!(decode_image(b"", &limits), Err(ImageError::Empty));
        assert_eq!(
            decode_image(b"hello world, not an image", &limits),
            Err(ImageError::UnknownFormat)
        );
        let png = encode(&sample(), ImageFormat::Png);
        assert!(matches!(
            decode_image(&png[..png.len() / 2], &limits),
            Err(ImageError::Corrupt { .. })
        ));
        assert!(matches!(
            decode_image_source(
                "data:image/png;base64,@@@",
                SourcePolicy::InlineOnly,
                &limits
            ),
            Err(ImageError::BadEncoding(_))
        ));
        let tight = ImageLimits {
            max_bytes: 10,
            ..limits
        };
        assert!(matches!(
            decode_image(&png, &tight),
            Err(ImageError::TooManyBytes { .. })
        ));
    }

    #[test]
    fn decompression_bombs_are_refused_from_the_header() {
        // A real PNG header claiming 100000 x 100000 pixels, with no pixel data behind it.
        let mut bytes = Vec::new();
        let mut header = Vec::new();
        header.extend_from_slice(b"\x89PNG\r\n\x1a\n");
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&100_000u32.to_be_bytes());
        ihdr.extend_from_slice(&100_000u32.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        header.extend_from_slice(&(ihdr.len() as u32).to_be_bytes());
        let mut chunk = b"IHDR".to_vec();
        chunk.extend_from_slice(&ihdr);
        let crc = crc32(&chunk);
        header.extend_from_slice(&chunk);
        header.extend_from_slice(&crc.to_be_bytes());
        // A first IDAT (the decoder reads headers up to it) and the end marker.
        for (kind, data) in [
            (&b"IDAT"[..], &[0x78u8, 0x9c, 0x03, 0x00][..]),
            (&b"IEND"[..], &[][..]),
        ] {
            header.extend_from_slice(&(data.len() as u32).to_be_bytes());
            let mut chunk = kind.to_vec();
            chunk.extend_from_slice(data);
            header.extend_from_slice(&chunk);
            header.extend_from_slice(&crc32(&chunk).to_be_bytes());
        }
        bytes.extend_from_slice(&header);
        let error = decode_image(&bytes, &ImageLimits::default()).unwrap_err();
        assert!(
            matches!(
                error,
                ImageError::TooLarge {
                    width: 100_000,
                    height: 100_000,
                    ..
                }
            ),
            "{error}"
        );
        // A 2560x2560 image is within the default limits.
        let big = RgbImage::new(2560, 2560);
        let mut png = Vec::new();
        image::codecs::png::PngEncoder::new(&mut png)
            .write_image(big.as_raw(), 2560, 2560, image::ExtendedColorType::Rgb8)
            .unwrap();
        assert_eq!(
            decode_image(&png, &ImageLimits::default())
                .unwrap()
                .dimensions(),
            (2560, 2560)
        );
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut crc = 0xffff_ffffu32;
        for &byte in data {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xedb8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
}

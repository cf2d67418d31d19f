//! Qwen3-VL image preprocessing: smart resize to multiples of patch × merge within pixel bounds,
//! PIL bicubic, rescale and normalise in f32, then patches in merge-block order with the single
//! frame repeated along the temporal axis.
//! Reference: mlx-vlm 0.7.6 `models/qwen3_vl/processing_qwen3_vl.py` (`Qwen3VLImageProcessor`,
//! `_smart_resize_image`, `_qwen_vl_image_kwargs`), itself a port of transformers'
//! `qwen2_vl/image_processing_qwen2_vl.py::smart_resize`.

use std::path::Path;

use image::RgbImage;
use serde::Deserialize;
use serde_json::Value;

use super::{buffer, read_json, reserve, resize_bicubic, PreprocessError};

/// The image half of `preprocessor_config.json` (merged with `processor_config.json`'s
/// `image_processor`, as mlx-vlm does). Defaults are mlx-vlm's when a key is absent.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessorConfig {
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub rescale_factor: f64,
    pub do_rescale: bool,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for PreprocessorConfig {
    fn default() -> Self {
        Self {
            patch_size: 16,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 14 * 14 * 4 * 1280,
            rescale_factor: 1.0 / 255.0,
            do_rescale: true,
            do_normalize: true,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        }
    }
}

/// What the JSON may say; every key optional.
#[derive(Deserialize, Default)]
struct RawConfig {
    patch_size: Option<usize>,
    merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    size: Option<RawSize>,
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
    rescale_factor: Option<f64>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
}

/// Qwen2/3-VL reuse HF's `size` keys for pixel counts: `shortest_edge` is min_pixels and
/// `longest_edge` max_pixels (not edge lengths).
#[derive(Deserialize, Default)]
struct RawSize {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
}

impl PreprocessorConfig {
    /// From one JSON object (a `preprocessor_config.json`, or an `image_processor` block).
    /// Explicit `min_pixels` / `max_pixels` win over `size`, as in mlx-vlm.
    pub fn from_value(v: &Value) -> Result<Self, PreprocessError> {
        let raw: RawConfig = serde_json::from_value(v.clone())
            .map_err(|e| PreprocessError::Config(e.to_string()))?;
        let d = Self::default();
        let size = raw.size.unwrap_or_default();
        let cfg = Self {
            patch_size: raw.patch_size.unwrap_or(d.patch_size),
            merge_size: raw.merge_size.unwrap_or(d.merge_size),
            temporal_patch_size: raw.temporal_patch_size.unwrap_or(d.temporal_patch_size),
            min_pixels: raw
                .min_pixels
                .or(size.shortest_edge)
                .unwrap_or(d.min_pixels),
            max_pixels: raw.max_pixels.or(size.longest_edge).unwrap_or(d.max_pixels),
            rescale_factor: raw.rescale_factor.unwrap_or(d.rescale_factor),
            do_rescale: raw.do_rescale.unwrap_or(d.do_rescale),
            do_normalize: raw.do_normalize.unwrap_or(d.do_normalize),
            image_mean: raw.image_mean.unwrap_or(d.image_mean),
            image_std: raw.image_std.unwrap_or(d.image_std),
        };
        if cfg.patch_size == 0 || cfg.merge_size == 0 || cfg.temporal_patch_size == 0 {
            return Err(PreprocessError::Config(
                "patch_size, merge_size and temporal_patch_size must be positive".into(),
            ));
        }
        Ok(cfg)
    }

    /// From a checkpoint directory: `preprocessor_config.json`, then `processor_config.json`'s
    /// `image_processor` keys on top (mlx-vlm's `_qwen_vl_image_kwargs`); defaults if neither.
    pub fn load(dir: &Path) -> Result<Self, PreprocessError> {
        let mut merged = read_json(&dir.join("preprocessor_config.json"))?
            .unwrap_or_else(|| Value::Object(Default::default()));
        if let Some(Value::Object(ip)) = read_json(&dir.join("processor_config.json"))?
            .and_then(|mut p| p.get_mut("image_processor").map(Value::take))
        {
            if let Value::Object(m) = &mut merged {
                m.extend(ip);
            }
        }
        Self::from_value(&merged)
    }

    /// Side lengths are multiples of this: one merged token covers `factor × factor` pixels.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// `(height, width)` after resizing, exactly as the reference computes it.
    pub fn resized_size(
        &self,
        height: usize,
        width: usize,
    ) -> Result<(usize, usize), PreprocessError> {
        smart_resize(
            height,
            width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )
    }

    /// Image tokens an image of this size becomes, without touching pixels (for context checks
    /// before any vision work).
    pub fn num_image_tokens(&self, height: usize, width: usize) -> Result<usize, PreprocessError> {
        let (h, w) = self.resized_size(height, width)?;
        Ok((h / self.patch_size) * (w / self.patch_size) / (self.merge_size * self.merge_size))
    }

    /// Resize, rescale, normalise and patchify one image.
    pub fn preprocess(&self, img: &RgbImage) -> Result<QwenImage, PreprocessError> {
        let (h, w) = self.resized_size(img.height() as usize, img.width() as usize)?;
        let resized;
        let img = if (h, w) == (img.height() as usize, img.width() as usize) {
            img
        } else {
            resized = resize_bicubic(img, w as u32, h as u32)?;
            &resized
        };
        let chw = self.normalise(img)?;
        let (ps, ms, tps) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (gh, gw) = (h / ps, w / ps);
        let row_len = 3 * tps * ps * ps;
        let mut out = Vec::new();
        reserve(&mut out, gh * gw * row_len, "the image's patches")?;
        // Patch order (bh, bw, mh, mw): the 2×2 patches a merged token pools are adjacent rows.
        for bh in 0..gh / ms {
            for bw in 0..gw / ms {
                for mh in 0..ms {
                    for mw in 0..ms {
                        let (y0, x0) = ((bh * ms + mh) * ps, (bw * ms + mw) * ps);
                        // Row layout [C][T][ph][pw]; a still image is its own T frames.
                        for c in 0..3 {
                            let plane = &chw[c * h * w..][..h * w];
                            for _ in 0..tps {
                                for y in y0..y0 + ps {
                                    out.extend_from_slice(&plane[y * w + x0..][..ps]);
                                }
                            }
                        }
                    }
                }
            }
        }
        let grid_thw = [1, gh, gw];
        Ok(QwenImage {
            pixel_values: out,
            grid_thw,
            num_tokens: gh * gw / (ms * ms),
            row_len,
        })
    }

    /// uint8 HWC to f32 CHW with numpy's float32 arithmetic: `x * f32(rescale)`, then
    /// `(x - mean) / std`, each op rounded to f32 (the goldens hash these bytes).
    fn normalise(&self, img: &RgbImage) -> Result<Vec<f32>, PreprocessError> {
        let (h, w) = (img.height() as usize, img.width() as usize);
        let scale = self.rescale_factor as f32;
        let mut chw = buffer(3 * h * w, 0f32, "the normalised image")?;
        for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
            for c in 0..3 {
                let mut x = f32::from(px[c]);
                if self.do_rescale {
                    x *= scale;
                }
                if self.do_normalize {
                    x = (x - self.image_mean[c]) / self.image_std[c];
                }
                chw[c * h * w + i] = x;
            }
        }
        Ok(chw)
    }
}

/// One preprocessed image, ready to upload.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenImage {
    /// `[grid_t * grid_h * grid_w, row_len]` row-major.
    pub pixel_values: Vec<f32>,
    /// `[t, h, w]` in patches; t is 1 for a still image.
    pub grid_thw: [usize; 3],
    /// Image placeholder tokens in the prompt: `t * h * w / merge²`.
    pub num_tokens: usize,
    /// Values per patch: `3 * temporal_patch_size * patch_size²` (1536 for Qwen3-VL).
    pub row_len: usize,
}

impl QwenImage {
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }
}

/// Transformers' `smart_resize` for images: round each side to a multiple of `factor`, then
/// scale both by the same factor into `[min_pixels, max_pixels]`, flooring when shrinking and
/// ceiling when growing. Python's `round` is half-to-even, hence `round_ties_even`.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize), PreprocessError> {
    if height == 0 || width == 0 {
        return Err(PreprocessError::EmptyImage);
    }
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let ratio = hf.max(wf) / hf.min(wf);
    if ratio > 200.0 {
        return Err(PreprocessError::AspectRatio { width, height });
    }
    let mut h_bar = (hf / ff).round_ties_even() as usize * factor;
    let mut w_bar = (wf / ff).round_ties_even() as usize * factor;
    let area = (height as u64 * width as u64) as f64;
    if (h_bar * w_bar) as u64 > max_pixels {
        let beta = (area / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as usize * factor);
        w_bar = factor.max((wf / beta / ff).floor() as usize * factor);
    } else if ((h_bar * w_bar) as u64) < min_pixels {
        let beta = (min_pixels as f64 / area).sqrt();
        h_bar = (hf * beta / ff).ceil() as usize * factor;
        w_bar = (wf * beta / ff).ceil() as usize * factor;
    }
    if h_bar == 0 || w_bar == 0 {
        // Only reachable with min_pixels 0 and a side under factor / 2; PIL would refuse too.
        return Err(PreprocessError::EmptyImage);
    }
    Ok((h_bar, w_bar))
}

#[cfg(test)]
mod tests {
    use super::super::{fixtures_dir, sha256_f32le};
    use super::*;

    fn tiny_config() -> PreprocessorConfig {
        PreprocessorConfig::load(&fixtures_dir().join("qwen3-vl-tiny")).unwrap()
    }

    #[test]
    fn config_reads_size_as_pixel_bounds() {
        let cfg = tiny_config();
        assert_eq!(
            (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size),
            (16, 2, 2)
        );
        assert_eq!((cfg.min_pixels, cfg.max_pixels), (65536, 16777216));
        assert_eq!((cfg.image_mean, cfg.image_std), ([0.5; 3], [0.5; 3]));
        // The converted checkpoint carries the same values as min/max_pixels in processor_config.
        assert_eq!(
            PreprocessorConfig::load(&fixtures_dir().join("qwen3-vl-tiny-4bit")).unwrap(),
            cfg
        );
    }

    /// Every Qwen3-VL golden image, decoded from the original PNG and run through our whole
    /// pipeline (our resize included), hashes to mlx-vlm's pixel_values.
    #[test]
    fn pixel_values_equal_the_goldens() {
        let cfg = tiny_config();
        for dir in ["qwen3-vl-tiny", "qwen3-vl-tiny-4bit"] {
            let golden: Value = serde_json::from_str(
                &std::fs::read_to_string(fixtures_dir().join(dir).join("golden.json")).unwrap(),
            )
            .unwrap();
            let images = golden["preprocessed_images"].as_object().unwrap();
            assert_eq!(images.len(), 3);
            for (name, rec) in images {
                let img = image::open(fixtures_dir().join(rec["file"].as_str().unwrap()))
                    .unwrap()
                    .to_rgb8();
                let got = cfg.preprocess(&img).unwrap();
                let want_grid: Vec<usize> =
                    serde_json::from_value(rec["grid_thw"].clone()).unwrap();
                assert_eq!(got.grid_thw.to_vec(), want_grid, "{name}");
                assert_eq!(
                    got.num_tokens,
                    rec["num_image_tokens"].as_u64().unwrap() as usize,
                    "{name}"
                );
                let shape: Vec<usize> =
                    serde_json::from_value(rec["pixel_values"]["shape"].clone()).unwrap();
                assert_eq!(shape, vec![got.num_patches(), got.row_len], "{name}");
                assert_eq!(
                    sha256_f32le(&got.pixel_values),
                    rec["pixel_values"]["sha256_f32le"].as_str().unwrap(),
                    "{dir}/{name}"
                );
            }
        }
    }

    /// A downscale end to end: `Qwen3VLImageProcessor(min_pixels=4096, max_pixels=128*128)` of
    /// `resample/noise_300x200.png` in `.venv-ref` (300x200 -> 128x96), hash of its pixel_values.
    #[test]
    fn downscaled_noise_equals_mlx_vlm() {
        let cfg = PreprocessorConfig {
            min_pixels: 4096,
            max_pixels: 128 * 128,
            ..PreprocessorConfig::default()
        };
        let img = image::open(fixtures_dir().join("vision-images/resample/noise_300x200.png"))
            .unwrap()
            .to_rgb8();
        let got = cfg.preprocess(&img).unwrap();
        assert_eq!(got.grid_thw, [1, 6, 8]);
        assert_eq!(
            sha256_f32le(&got.pixel_values),
            "f96dc122fefaa99c6fc8aee72591dd367e37347fd03b4c46b0c36c3e5e056699"
        );
    }

    /// The real Qwen3-VL ceiling keeps a 2560² image at full size: 160×160 patches, 6400 tokens
    /// after the 2×2 merge (rMLX 0.2.4 capped this and lost detail).
    #[test]
    fn large_image_gives_6400_tokens() {
        let cfg = tiny_config();
        assert_eq!(cfg.resized_size(2560, 2560).unwrap(), (2560, 2560));
        assert_eq!(cfg.num_image_tokens(2560, 2560).unwrap(), 6400);
        let img = RgbImage::from_fn(2560, 2560, |x, y| {
            image::Rgb([(x % 251) as u8, (y % 241) as u8, ((x + y) % 239) as u8])
        });
        let got = cfg.preprocess(&img).unwrap();
        assert_eq!(got.grid_thw, [1, 160, 160]);
        assert_eq!(got.num_tokens, 6400);
        assert_eq!(got.pixel_values.len(), 25600 * 1536);
    }

    /// Values worked through by hand against the Python formula (banker's rounding included).
    #[test]
    fn smart_resize_matches_the_reference() {
        let (min, max) = (65536, 16777216);
        assert_eq!(smart_resize(48, 64, 32, min, max).unwrap(), (224, 320));
        assert_eq!(smart_resize(100, 80, 32, min, max).unwrap(), (288, 256));
        // 80 / 32 = 2.5 rounds to 2 (half to even), 48 / 32 = 1.5 to 2.
        assert_eq!(smart_resize(80, 48, 32, 0, u64::MAX).unwrap(), (64, 64));
        // Over the ceiling: floor after scaling by sqrt(area / max).
        assert_eq!(
            smart_resize(4000, 3000, 32, min, 1003520).unwrap(),
            (1152, 864)
        );
        assert!(matches!(
            smart_resize(10, 2010, 32, min, max),
            Err(PreprocessError::AspectRatio { .. })
        ));
        assert_eq!(smart_resize(10, 2000, 32, min, max).unwrap(), (32, 3648));
        assert!(matches!(
            smart_resize(0, 10, 32, min, max),
            Err(PreprocessError::EmptyImage)
        ));
    }
}

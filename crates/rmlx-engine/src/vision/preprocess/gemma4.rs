//! Gemma 4 image preprocessing: an aspect-preserving resize to the largest size whose patch count
//! fits the soft-token budget (sides multiples of pooling × patch), PIL bicubic, rescale to
//! [0, 1] in f32, channels first. Patchify and the `2 * (x - 0.5)` shift happen in the vision
//! tower, not here, exactly as in the reference.
//! Reference: mlx-vlm 0.7.6 `models/gemma4/processing_gemma4.py` (`Gemma4ImageProcessor`,
//! `aspect_ratio_preserving_resize`, `Gemma4Processor.from_pretrained`) and `gemma4/vision.py`
//! (`_patch_positions_single`); the budget list from transformers 5 `image_processing_gemma4.py`.

use std::path::Path;

use image::RgbImage;
use serde::Deserialize;
use serde_json::Value;

use super::{buffer, read_json, reserve, resize_bicubic, PreprocessError};

/// Soft-token budgets Gemma 4 was trained with; anything else is refused (transformers does too).
pub const SUPPORTED_SOFT_TOKENS: [usize; 5] = [70, 140, 280, 560, 1120];

/// Gemma 4's image processor settings (`processor_config.json` → `image_processor`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4ImageConfig {
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
    /// Default budget when a request does not choose one (280 in the real checkpoints).
    pub max_soft_tokens: usize,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for Gemma4ImageConfig {
    fn default() -> Self {
        Self {
            patch_size: 16,
            pooling_kernel_size: 3,
            max_soft_tokens: 280,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: false,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        }
    }
}

#[derive(Deserialize, Default)]
struct RawConfig {
    patch_size: Option<usize>,
    pooling_kernel_size: Option<usize>,
    max_soft_tokens: Option<usize>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
}

impl Gemma4ImageConfig {
    /// From an `image_processor` object (or a flat preprocessor config); absent keys take the
    /// reference defaults. The budget is validated here so a bad checkpoint fails at load.
    pub fn from_value(v: &Value) -> Result<Self, PreprocessError> {
        let raw: RawConfig = serde_json::from_value(v.clone())
            .map_err(|e| PreprocessError::Config(e.to_string()))?;
        let d = Self::default();
        let cfg = Self {
            patch_size: raw.patch_size.unwrap_or(d.patch_size),
            pooling_kernel_size: raw.pooling_kernel_size.unwrap_or(d.pooling_kernel_size),
            max_soft_tokens: raw.max_soft_tokens.unwrap_or(d.max_soft_tokens),
            do_resize: raw.do_resize.unwrap_or(d.do_resize),
            do_rescale: raw.do_rescale.unwrap_or(d.do_rescale),
            rescale_factor: raw.rescale_factor.unwrap_or(d.rescale_factor),
            do_normalize: raw.do_normalize.unwrap_or(d.do_normalize),
            image_mean: raw.image_mean.unwrap_or(d.image_mean),
            image_std: raw.image_std.unwrap_or(d.image_std),
        };
        if cfg.patch_size == 0 || cfg.pooling_kernel_size == 0 {
            return Err(PreprocessError::Config(
                "patch_size and pooling_kernel_size must be positive".into(),
            ));
        }
        validate_budget(cfg.max_soft_tokens)?;
        Ok(cfg)
    }

    /// From a checkpoint directory: `processor_config.json`, else `preprocessor_config.json`
    /// (mlx-vlm's order); its `image_processor` block, or the file itself when flat.
    /// mlx-vlm ignores a flat file that names `image_processor_type`; we read it like
    /// transformers does.
    pub fn load(dir: &Path) -> Result<Self, PreprocessError> {
        let cfg = match read_json(&dir.join("processor_config.json"))? {
            Some(v) => Some(v),
            None => read_json(&dir.join("preprocessor_config.json"))?,
        };
        match cfg {
            Some(v) => match v.get("image_processor") {
                Some(ip @ Value::Object(_)) => Self::from_value(ip),
                _ => Self::from_value(&v),
            },
            None => Ok(Self::default()),
        }
    }

    /// `(height, width)` the reference resizes to for a given budget.
    pub fn resized_size(
        &self,
        height: usize,
        width: usize,
        max_soft_tokens: usize,
    ) -> Result<(usize, usize), PreprocessError> {
        if height == 0 || width == 0 {
            return Err(PreprocessError::EmptyImage);
        }
        if !self.do_resize {
            return Ok((height, width));
        }
        let (ps, k) = (self.patch_size, self.pooling_kernel_size);
        let max_patches = max_soft_tokens * k * k;
        let target_px = (max_patches * ps * ps) as f64;
        let factor = (target_px / (height as u64 * width as u64) as f64).sqrt();
        let side = k * ps;
        let mut th = (factor * height as f64 / side as f64).floor() as usize * side;
        let mut tw = (factor * width as f64 / side as f64).floor() as usize * side;
        if th == 0 && tw == 0 {
            return Err(PreprocessError::EmptyImage);
        }
        // A very thin image: one pooled row (or column), the long side as far as the ratio goes.
        let max_side = (max_patches / (k * k)) * side;
        if th == 0 {
            th = side;
            tw = ((width as f64 / height as f64).floor() as usize * side).min(max_side);
        } else if tw == 0 {
            tw = side;
            th = ((height as f64 / width as f64).floor() as usize * side).min(max_side);
        }
        Ok((th, tw))
    }

    /// Soft tokens an image of this size becomes, without touching pixels.
    pub fn num_soft_tokens(
        &self,
        height: usize,
        width: usize,
        max_soft_tokens: Option<usize>,
    ) -> Result<usize, PreprocessError> {
        let budget = self.budget(max_soft_tokens)?;
        let (h, w) = self.resized_size(height, width, budget)?;
        Ok(self.soft_tokens_for(h, w))
    }

    /// Resize, rescale (and normalise if configured) one image. `max_soft_tokens` overrides the
    /// configured budget for this request; it must be one of [`SUPPORTED_SOFT_TOKENS`].
    pub fn preprocess(
        &self,
        img: &RgbImage,
        max_soft_tokens: Option<usize>,
    ) -> Result<GemmaImage, PreprocessError> {
        let budget = self.budget(max_soft_tokens)?;
        let (h, w) = self.resized_size(img.height() as usize, img.width() as usize, budget)?;
        let resized;
        let img = if (h, w) == (img.height() as usize, img.width() as usize) {
            img
        } else {
            resized = resize_bicubic(img, w as u32, h as u32)?;
            &resized
        };
        let scale = self.rescale_factor as f32;
        let mut chw = buffer(3 * h * w, 0f32, "the normalised image")?;
        // numpy float32 arithmetic, op by op: `x * f32(rescale)`, then `(x - mean) / std`.
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
        let ps = self.patch_size;
        Ok(GemmaImage {
            pixel_values: chw,
            height: h,
            width: w,
            patch_grid_hw: [h / ps, w / ps],
            num_soft_tokens: self.soft_tokens_for(h, w),
        })
    }

    fn budget(&self, max_soft_tokens: Option<usize>) -> Result<usize, PreprocessError> {
        let b = max_soft_tokens.unwrap_or(self.max_soft_tokens);
        validate_budget(b)?;
        Ok(b)
    }

    fn soft_tokens_for(&self, h: usize, w: usize) -> usize {
        let ps = self.patch_size;
        (h / ps) * (w / ps) / (self.pooling_kernel_size * self.pooling_kernel_size)
    }
}

fn validate_budget(b: usize) -> Result<(), PreprocessError> {
    if SUPPORTED_SOFT_TOKENS.contains(&b) {
        Ok(())
    } else {
        Err(PreprocessError::SoftTokenBudget(b))
    }
}

/// One preprocessed image, ready to upload as `[1, 3, height, width]`.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaImage {
    /// `[3, height, width]` row-major, values in [0, 1] (the model applies `2 * (x - 0.5)`).
    pub pixel_values: Vec<f32>,
    pub height: usize,
    pub width: usize,
    /// Patches down and across: `[height / patch, width / patch]`.
    pub patch_grid_hw: [usize; 2],
    /// `<|image|>` tokens the image expands to: patches / pooling².
    pub num_soft_tokens: usize,
}

impl GemmaImage {
    /// `(x, y)` of each patch in the order the vision tower patchifies (row by row), for its
    /// 2-D position embeddings; padding up to the tower's `max_patches` is the model's job.
    pub fn patch_positions(&self) -> Vec<[i32; 2]> {
        let [gh, gw] = self.patch_grid_hw;
        (0..gh)
            .flat_map(|y| (0..gw).map(move |x| [x as i32, y as i32]))
            .collect()
    }

    /// `[patches, patch * patch * 3]` rows in the tower's patchify order: patches row by row,
    /// each row `[y][x][channel]` (mlx-vlm's `transpose(0, 2, 4, 3, 5, 1)`), appended to
    /// `rows`; fails only when the host cannot give the room.
    pub fn patch_rows(&self, patch: usize, rows: &mut Vec<f32>) -> Result<(), PreprocessError> {
        let [gh, gw] = self.patch_grid_hw;
        let plane = self.height * self.width;
        reserve(rows, 3 * plane, "the image's patches")?;
        for py in 0..gh {
            for px in 0..gw {
                for y in 0..patch {
                    let row = (py * patch + y) * self.width + px * patch;
                    for x in 0..patch {
                        for c in 0..3 {
                            rows.push(self.pixel_values[c * plane + row + x]);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{fixtures_dir, sha256_f32le};
    use super::*;

    /// Every Gemma 4 golden image (max_soft_tokens 70 in the fixture), through our whole
    /// pipeline from the original PNG, hashes to mlx-vlm's pixel_values.
    #[test]
    fn pixel_values_equal_the_goldens() {
        for dir in ["gemma4-tiny", "gemma4-tiny-mxfp4"] {
            let cfg = Gemma4ImageConfig::load(&fixtures_dir().join(dir)).unwrap();
            assert_eq!(cfg.max_soft_tokens, 70, "{dir}");
            assert!(!cfg.do_normalize);
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
                let got = cfg.preprocess(&img, None).unwrap();
                let want_grid: Vec<usize> =
                    serde_json::from_value(rec["patch_grid_hw"].clone()).unwrap();
                assert_eq!(got.patch_grid_hw.to_vec(), want_grid, "{name}");
                assert_eq!(
                    got.num_soft_tokens,
                    rec["num_soft_tokens"].as_u64().unwrap() as usize,
                    "{name}"
                );
                let shape: Vec<usize> =
                    serde_json::from_value(rec["pixel_values"]["shape"].clone()).unwrap();
                assert_eq!(shape, vec![3, got.height, got.width], "{name}");
                assert_eq!(
                    sha256_f32le(&got.pixel_values),
                    rec["pixel_values"]["sha256_f32le"].as_str().unwrap(),
                    "{dir}/{name}"
                );
            }
        }
    }

    /// `(w, h)` → `(W, H, soft tokens)` per budget, from mlx-vlm's `aspect_ratio_preserving_resize`
    /// (printed with `.venv-ref`), thin-image fallbacks included.
    #[test]
    fn resize_sizes_match_the_reference_for_every_budget() {
        let cfg = Gemma4ImageConfig::default();
        type Row = ((usize, usize), [(usize, usize, usize); 5]);
        let cases: &[Row] = &[
            (
                (64, 48),
                [
                    (432, 336, 63),
                    (624, 480, 130),
                    (912, 672, 266),
                    (1296, 960, 540),
                    (1824, 1344, 1064),
                ],
            ),
            (
                (2560, 2560),
                [
                    (384, 384, 64),
                    (528, 528, 121),
                    (768, 768, 256),
                    (1104, 1104, 529),
                    (1584, 1584, 1089),
                ],
            ),
            (
                (1920, 1080),
                [
                    (528, 288, 66),
                    (720, 384, 120),
                    (1056, 576, 264),
                    (1488, 816, 527),
                    (2112, 1200, 1100),
                ],
            ),
            (
                (20, 1000),
                [
                    (48, 2832, 59),
                    (48, 3984, 83),
                    (96, 5664, 236),
                    (144, 8016, 501),
                    (192, 11328, 944),
                ],
            ),
            (
                (333, 777),
                [
                    (240, 576, 60),
                    (336, 864, 126),
                    (480, 1200, 250),
                    (720, 1728, 540),
                    (1008, 2448, 1071),
                ],
            ),
        ];
        for &((w, h), want) in cases {
            for (b, (ww, wh, n)) in SUPPORTED_SOFT_TOKENS.iter().zip(want) {
                assert_eq!(
                    cfg.resized_size(h, w, *b).unwrap(),
                    (wh, ww),
                    "{w}x{h} @ {b}"
                );
                assert_eq!(
                    cfg.num_soft_tokens(h, w, Some(*b)).unwrap(),
                    n,
                    "{w}x{h} @ {b}"
                );
            }
        }
        // Height rounds to zero pooled rows: one row, width from the ratio, capped.
        assert_eq!(cfg.resized_size(5, 3000, 70).unwrap(), (48, 3360));
        assert_eq!(cfg.resized_size(5, 3000, 280).unwrap(), (48, 13440));
        assert_eq!(cfg.resized_size(4000, 7, 1120).unwrap(), (38400, 48));
        assert_eq!(cfg.resized_size(1, 1, 280).unwrap(), (768, 768));
    }

    /// A per-request budget end to end: `Gemma4ImageProcessor(max_soft_tokens=140)` of
    /// `resample/noise_300x200.png` in `.venv-ref` (-> 672x432, 126 soft tokens), pixel hash.
    #[test]
    fn override_budget_noise_equals_mlx_vlm() {
        let cfg = Gemma4ImageConfig::load(&fixtures_dir().join("gemma4-tiny")).unwrap();
        let img = image::open(fixtures_dir().join("vision-images/resample/noise_300x200.png"))
            .unwrap()
            .to_rgb8();
        let got = cfg.preprocess(&img, Some(140)).unwrap();
        assert_eq!(
            (got.width, got.height, got.num_soft_tokens),
            (672, 432, 126)
        );
        assert_eq!(
            sha256_f32le(&got.pixel_values),
            "78c1c783de3107b1d26dd784882d1768fb62719ed605e9f89db90657fb078224"
        );
    }

    #[test]
    fn budget_override_is_validated() {
        let cfg = Gemma4ImageConfig::load(&fixtures_dir().join("gemma4-tiny")).unwrap();
        let img = image::open(fixtures_dir().join("vision-images/gradient_64x48.png"))
            .unwrap()
            .to_rgb8();
        let big = cfg.preprocess(&img, Some(280)).unwrap();
        assert_eq!(
            (big.width, big.height, big.num_soft_tokens),
            (912, 672, 266)
        );
        assert_eq!(big.pixel_values.len(), 3 * 912 * 672);
        assert!(matches!(
            cfg.preprocess(&img, Some(100)),
            Err(PreprocessError::SoftTokenBudget(100))
        ));
        assert!(matches!(
            Gemma4ImageConfig::from_value(&serde_json::json!({"max_soft_tokens": 300})),
            Err(PreprocessError::SoftTokenBudget(300))
        ));
        assert_eq!(
            Gemma4ImageConfig::from_value(&serde_json::json!({}))
                .unwrap()
                .max_soft_tokens,
            280
        );
    }

    #[test]
    fn patch_positions_are_x_then_y_row_by_row() {
        let g = GemmaImage {
            pixel_values: vec![],
            height: 32,
            width: 48,
            patch_grid_hw: [2, 3],
            num_soft_tokens: 0,
        };
        assert_eq!(
            g.patch_positions(),
            vec![[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
        );
    }
}

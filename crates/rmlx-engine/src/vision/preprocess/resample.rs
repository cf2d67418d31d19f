//! PIL-compatible bicubic resize of RGB8 images. Both families' reference processors resize with
//! `PIL.Image.resize((w, h), Image.BICUBIC)` on uint8 RGB, and the vision towers see those exact
//! levels, so we follow Pillow's integer pipeline rather than a generic bicubic.
//! Reference: Pillow 13 `src/libImaging/Resample.c` (`precompute_coeffs`,
//! `normalize_coeffs_8bpc`, `ImagingResampleHorizontal_8bpc` / `Vertical_8bpc`, `ImagingResampleInner`).

use image::RgbImage;

use super::{buffer, PreprocessError};

/// Fixed-point bits of the uint8 path: 8 bits of result plus 2 of headroom (negative lobes can
/// push a sum below 0 or above 255) in an `i32`.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Keys' cubic with a = -0.5, support 2 (Pillow's `bicubic_filter`).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One axis's taps: output `i` reads `count[i]` inputs from `first[i]` with fixed-point weights
/// `weights[i * ksize..][..count[i]]`.
struct Taps {
    ksize: usize,
    first: Vec<usize>,
    count: Vec<usize>,
    weights: Vec<i32>,
}

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for the whole-image box. When shrinking,
/// the kernel is stretched by the reduction factor (antialiasing); weights are normalised to sum
/// to one in f64, then rounded half away from zero to 22-bit fixed point.
fn taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let ss = 1.0 / filterscale;
    let one = f64::from(1u32 << PRECISION_BITS);
    let mut t = Taps {
        ksize,
        first: Vec::with_capacity(out_size),
        count: Vec::with_capacity(out_size),
        weights: vec![0; out_size * ksize],
    };
    let mut w = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        // `(int)` in C truncates toward zero; the clamps then bound both ends.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
        let n = (xmax - xmin).max(0) as usize;
        let mut ww = 0.0;
        for (x, wx) in w.iter_mut().enumerate().take(n) {
            *wx = bicubic(((x as i64 + xmin) as f64 - center + 0.5) * ss);
            ww += *wx;
        }
        let row = &mut t.weights[xx * ksize..][..n];
        for (k, &wx) in row.iter_mut().zip(&w) {
            let v = if ww != 0.0 { wx / ww } else { wx };
            *k = if v < 0.0 {
                (-0.5 + v * one) as i32
            } else {
                (0.5 + v * one) as i32
            };
        }
        t.first.push(xmin as usize);
        t.count.push(n);
    }
    t
}

/// Fixed-point sum to a uint8 level: Pillow's `clip8` (arithmetic shift, clamp to 0..=255).
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resamples `rows` rows of `src` (`in_w` RGB pixels each) to `out_w` pixels along the row.
fn horizontal(
    src: &[u8],
    in_w: usize,
    rows: usize,
    out_w: usize,
) -> Result<Vec<u8>, PreprocessError> {
    let t = taps(in_w, out_w);
    let mut out = buffer(rows * out_w * 3, 0u8, "the resized image")?;
    for y in 0..rows {
        let line = &src[y * in_w * 3..][..in_w * 3];
        for xx in 0..out_w {
            let k = &t.weights[xx * t.ksize..][..t.count[xx]];
            let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
            for (i, &kx) in k.iter().enumerate() {
                let p = &line[(t.first[xx] + i) * 3..][..3];
                for c in 0..3 {
                    acc[c] += i32::from(p[c]) * kx;
                }
            }
            let o = &mut out[(y * out_w + xx) * 3..][..3];
            for c in 0..3 {
                o[c] = clip8(acc[c]);
            }
        }
    }
    Ok(out)
}

/// Resamples the columns of `src` (`w` RGB pixels wide, `in_h` rows) to `out_h` rows.
fn vertical(src: &[u8], w: usize, in_h: usize, out_h: usize) -> Result<Vec<u8>, PreprocessError> {
    let t = taps(in_h, out_h);
    let stride = w * 3;
    let mut out = buffer(out_h * stride, 0u8, "the resized image")?;
    for yy in 0..out_h {
        let k = &t.weights[yy * t.ksize..][..t.count[yy]];
        let mut acc = vec![1i32 << (PRECISION_BITS - 1); stride];
        for (i, &ky) in k.iter().enumerate() {
            let line = &src[(t.first[yy] + i) * stride..][..stride];
            for (a, &p) in acc.iter_mut().zip(line) {
                *a += i32::from(p) * ky;
            }
        }
        for (o, &a) in out[yy * stride..][..stride].iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    Ok(out)
}

/// `Image.resize((width, height), Image.BICUBIC)` of an RGB8 image, level for level: two
/// separable passes, each rounding to uint8, each skipped when its axis keeps its size.
///
/// Pass order matters (the intermediate is rounded), and Pillow 13 changed it: the vertical pass
/// runs first when the height shrinks by more than twice as many pixels as the width does
/// (`ImagingResampleInner`, Pillow PR #9549); otherwise horizontal first, as before.
///
/// Fails only when the host cannot give the intermediate buffers.
///
/// # Panics
/// If `width` or `height` is zero (Pillow refuses those too); callers size from `smart_resize`
/// or the Gemma budget, which never give zero.
pub fn resize_bicubic(
    img: &RgbImage,
    width: u32,
    height: u32,
) -> Result<RgbImage, PreprocessError> {
    assert!(width > 0 && height > 0, "resize to an empty image");
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    let (out_w, out_h) = (width as usize, height as usize);
    let shrink_h = in_h as i64 - out_h as i64;
    let shrink_w = in_w as i64 - out_w as i64;
    let vertical_first = shrink_h > 0 && shrink_h > shrink_w * 2;
    let mut buf = std::borrow::Cow::Borrowed(img.as_raw().as_slice());
    if vertical_first {
        buf = vertical(&buf, in_w, in_h, out_h)?.into();
        if out_w != in_w {
            buf = horizontal(&buf, in_w, out_h, out_w)?.into();
        }
    } else {
        if out_w != in_w {
            buf = horizontal(&buf, in_w, in_h, out_w)?.into();
        }
        if out_h != in_h {
            buf = vertical(&buf, out_w, in_h, out_h)?.into();
        }
    }
    Ok(RgbImage::from_raw(width, height, buf.into_owned())
        .expect("buffer sized width * height * 3"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(rel: &str) -> RgbImage {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/vision-images")
            .join(rel);
        image::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .to_rgb8()
    }

    /// Largest per-channel difference, and how many channels differ at all.
    fn diff(a: &RgbImage, b: &RgbImage) -> (u8, usize) {
        assert_eq!(a.dimensions(), b.dimensions());
        a.as_raw()
            .iter()
            .zip(b.as_raw())
            .fold((0, 0), |(m, n), (&x, &y)| {
                let d = x.abs_diff(y);
                (m.max(d), n + usize::from(d != 0))
            })
    }

    fn check(src: &str, want: &str) {
        let (s, w) = (fixture(src), fixture(want));
        let got = resize_bicubic(&s, w.width(), w.height()).unwrap();
        let (max, n) = diff(&got, &w);
        assert!(max <= 1, "{want}: max diff {max} ({n} channels differ)");
        // We follow Pillow's integer arithmetic step for step, so expect no difference at all.
        assert_eq!(n, 0, "{want}: {n} channels differ by one level");
    }

    #[test]
    fn downscales_match_pillow() {
        check(
            "resample/noise_97x83.png",
            "resample/noise_97x83-bicubic-40x33.png",
        );
        check(
            "resample/noise_300x200.png",
            "resample/noise_300x200-bicubic-64x48.png",
        );
    }

    /// Height shrinks by more than twice the width's change: Pillow 13 goes vertical first.
    #[test]
    fn vertical_first_cases_match_pillow() {
        check(
            "resample/noise_97x83.png",
            "resample/noise_97x83-bicubic-131x29.png",
        );
        check(
            "resample/noise_300x200.png",
            "resample/noise_300x200-bicubic-280x60.png",
        );
    }

    #[test]
    fn preprocessor_upscales_match_pillow() {
        for (src, want) in [
            (
                "gradient_64x48.png",
                "resized/qwen3_vl-gradient_64x48-320x224.png",
            ),
            (
                "gradient_64x48_mirror.png",
                "resized/qwen3_vl-gradient_64x48_mirror-320x224.png",
            ),
            (
                "noise_80x100.png",
                "resized/qwen3_vl-noise_80x100-256x288.png",
            ),
            (
                "gradient_64x48.png",
                "resized/gemma4-gradient_64x48-432x336.png",
            ),
            (
                "gradient_64x48_mirror.png",
                "resized/gemma4-gradient_64x48_mirror-432x336.png",
            ),
            (
                "noise_80x100.png",
                "resized/gemma4-noise_80x100-336x432.png",
            ),
        ] {
            check(src, want);
        }
    }

    #[test]
    fn same_size_is_identity() {
        let s = fixture("noise_80x100.png");
        assert_eq!(resize_bicubic(&s, 80, 100).unwrap(), s);
    }
}

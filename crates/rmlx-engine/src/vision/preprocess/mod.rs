//! Per-family image preprocessing on the host: decoded RGB8 in, the float pixel values and
//! shapes the vision tower expects out (the model code uploads them). Each family follows its
//! mlx-vlm 0.7.6 processor bit for bit; the shared resize follows Pillow's bicubic.

pub mod gemma4;
pub mod qwen3_vl;
pub mod resample;

use std::path::Path;

pub use gemma4::{Gemma4ImageConfig, GemmaImage, SUPPORTED_SOFT_TOKENS};
pub use qwen3_vl::{smart_resize, PreprocessorConfig as QwenPreprocessorConfig, QwenImage};
pub use resample::resize_bicubic;

#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("image has no pixels")]
    EmptyImage,
    /// The reference refuses these too (transformers' `smart_resize`).
    #[error("image aspect ratio must be at most 200:1, got {width}x{height}")]
    AspectRatio { width: usize, height: usize },
    #[error("max_soft_tokens must be one of 70, 140, 280, 560, 1120, got {0}")]
    SoftTokenBudget(usize),
    #[error("preprocessor config: {0}")]
    Config(String),
    /// The host could not give a buffer this image needs (see [`buffer`]).
    #[error("cannot allocate {:.1} MB for {what}", *.bytes as f64 / 1e6)]
    OutOfMemory { what: &'static str, bytes: usize },
}

/// `len` copies of `fill`, or `OutOfMemory` when the host cannot give them: an image's buffers
/// run to hundreds of MB, and a failed `vec!` would abort the whole server, not fail a request.
pub(crate) fn buffer<T: Clone>(
    len: usize,
    fill: T,
    what: &'static str,
) -> Result<Vec<T>, PreprocessError> {
    let mut out = Vec::new();
    reserve(&mut out, len, what)?;
    out.resize(len, fill);
    Ok(out)
}

/// Room for exactly `additional` more values in `out`, or `OutOfMemory` (see [`buffer`]).
pub(crate) fn reserve<T>(
    out: &mut Vec<T>,
    additional: usize,
    what: &'static str,
) -> Result<(), PreprocessError> {
    out.try_reserve_exact(additional)
        .map_err(|_| PreprocessError::OutOfMemory {
            what,
            bytes: additional.saturating_mul(std::mem::size_of::<T>()),
        })
}

/// A JSON file if it exists; `None` when absent (configs fall back to the reference defaults).
fn read_json(path: &Path) -> Result<Option<serde_json::Value>, PreprocessError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| PreprocessError::Config(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(PreprocessError::Config(format!("{}: {e}", path.display()))),
    }
}

#[cfg(test)]
pub(crate) fn fixtures_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// SHA-256 for the tests' golden comparisons (`sha256_f32le`), kept here rather than adding a
/// dependency for one hash. FIPS 180-4, straightforward and unoptimised.
#[cfg(test)]
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, b) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            (hh, g, f, e, d, c, b, a) = (g, f, e, d.wrapping_add(t1), c, b, a, t1.wrapping_add(t2));
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

/// Hash of float32 values as little-endian bytes in order: the goldens' `sha256_f32le`.
#[cfg(test)]
pub(crate) fn sha256_f32le(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    sha256_hex(&bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sha256_known_answers() {
        assert_eq!(
            super::sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            super::sha256_hex(&[b'a'; 200]),
            "c2a908d98f5df987ade41b5fce213067efbcc21ef2240212a41e54b5e7c28ae5"
        );
    }
}

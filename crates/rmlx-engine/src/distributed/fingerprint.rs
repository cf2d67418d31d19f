//! What every rank of a cluster must agree on before serving: one model, seen the same way. A
//! digest of the model folder's config, tokenizer and chat template, and of each safetensors
//! file's header and size: cheap to compute on a 100 GB model (no weight is read), and two
//! conversions of one release differ in it (their headers name other dtypes or shapes).

use std::path::Path;

use sha2::{Digest, Sha256};

/// Files that decide how a model is run, hashed whole when present.
const SMALL_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
];

/// The model folder's digest (hex), or what could not be read.
pub fn model_fingerprint(dir: &Path) -> std::io::Result<String> {
    let mut hash = Sha256::new();
    for name in SMALL_FILES {
        let path = dir.join(name);
        if path.is_file() {
            let bytes = std::fs::read(&path)?;
            hash.update(name.as_bytes());
            hash.update((bytes.len() as u64).to_le_bytes());
            hash.update(&bytes);
        }
    }
    let mut weights: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    weights.sort();
    for path in weights {
        let header = safetensors_header(&path)?;
        let size = std::fs::metadata(&path)?.len();
        let name = path.file_name().expect("read_dir names files");
        hash.update(name.as_encoded_bytes());
        hash.update(size.to_le_bytes());
        hash.update(&header);
    }
    Ok(format!("{:x}", hash.finalize()))
}

/// A safetensors file's header: its 8-byte length and the JSON after it.
pub(crate) fn safetensors_header(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length)?;
    let size = u64::from_le_bytes(length);
    // The format caps headers at 100 MB; a bigger length is a damaged file.
    if size > 100 << 20 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: a safetensors header of {size} bytes", path.display()),
        ));
    }
    let mut header = length.to_vec();
    file.take(size).read_to_end(&mut header)?;
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_config_or_weight_header_changes_the_fingerprint_and_a_copy_does_not() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-tiny");
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(&fixture).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
            }
        }
        let original = model_fingerprint(&fixture).unwrap();
        assert_eq!(model_fingerprint(dir.path()).unwrap(), original);
        // A header naming another dtype (the same length: only the text differs).
        let weights = dir.path().join("model.safetensors");
        let mut bytes = std::fs::read(&weights).unwrap();
        let at = bytes.windows(4).position(|w| w == b"F32\"").unwrap();
        bytes[at..at + 3].copy_from_slice(b"F16");
        std::fs::write(&weights, &bytes).unwrap();
        assert_ne!(model_fingerprint(dir.path()).unwrap(), original);
        std::fs::copy(fixture.join("model.safetensors"), &weights).unwrap();
        let config = dir.path().join("config.json");
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, text.replacen('{', "{\"x\": 1, ", 1)).unwrap();
        assert_ne!(model_fingerprint(dir.path()).unwrap(), original);
    }
}

//! Tokenizer, chat template and streaming text, following HF transformers
//! (`apply_chat_template`, `tokenization_utils_base.py`) and mlx-lm (`tokenizer_utils.py`).
//!
//! - [`ChatTokenizer`]: `tokenizer.json` + chat template + special tokens + EOS ids of one model dir.
//! - [`TemplateOptions`]: what `apply_chat_template` takes besides the messages.
//! - [`StreamDecoder`]: ids in, text out, never a half character.
//! - [`StopMatcher`]: holds back text that may become a stop string.

mod config;
mod detokenizer;
pub mod images;
mod pyformat;
mod stop;
mod template;
mod tokenizer;

use std::path::PathBuf;

pub use detokenizer::StreamDecoder;
pub use stop::{StopMatcher, StopStep};
pub use template::TemplateOptions;
pub use tokenizer::ChatTokenizer;

/// Everything that can go wrong loading a tokenizer dir or rendering/encoding a chat.
/// Each file-related variant names the file so the user knows what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("missing file {}", path.display())]
    MissingFile { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad JSON in {}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot load tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template syntax error in {}: {message}", path.display())]
    TemplateSyntax { path: PathBuf, message: String },
    #[error("chat template render error ({}): {message}", path.display())]
    TemplateRender { path: PathBuf, message: String },
    #[error("no chat template in {}", dir.display())]
    NoChatTemplate { dir: PathBuf },
    #[error("tokenizer {op} failed: {message}")]
    Codec { op: &'static str, message: String },
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Fixture paths and throwaway model dirs shared by the chat tests.
    use std::path::{Path, PathBuf};

    pub fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    /// A fresh temp dir holding the fixture tokenizer.json plus the given extra files.
    pub struct TempModelDir(pub PathBuf);

    impl TempModelDir {
        pub fn new(tag: &str, files: &[(&str, &str)]) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "rmlx-chat-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::copy(
                fixture("qwen3-tiny").join("tokenizer.json"),
                dir.join("tokenizer.json"),
            )
            .unwrap();
            for (name, text) in files {
                std::fs::write(dir.join(name), text).unwrap();
            }
            Self(dir)
        }
    }

    impl Drop for TempModelDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

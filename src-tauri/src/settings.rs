//! What the app remembers between launches (settings.json in the app's config folder):
//! written whole to a temporary file and renamed, so a crash never leaves half a file.

use std::{
    io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Model folders scan here (and in the Hugging Face cache); downloads land here. None: the
    /// folder `rmlx pull` uses ($RMLX_MODELS_DIR or ~/.rmlx/models).
    pub models_dir: Option<PathBuf>,
    /// Hugging Face hub (or mirror) base URL; None: $HF_ENDPOINT or https://huggingface.co.
    pub hub_url: Option<String>,
    /// The tray's "Local API server": restored at launch.
    pub server_enabled: bool,
    /// Loopback by default; another address exposes the API to the network.
    pub server_host: String,
    pub server_port: u16,
    /// Required of HTTP clients when set (the app itself passes it internally).
    pub api_key: Option<String>,
    /// Browser origins the local server admits (CORS); empty: none.
    pub cors_origins: Vec<String>,
    /// Cap on every model's context, in tokens; None: each model's own.
    pub default_max_context: Option<usize>,
    /// 8 or 4: the full-attention layers' KV cache stored quantized (`--kv-bits`); None:
    /// dense. The engine takes it when the app starts.
    pub kv_cache_bits: Option<i32>,
    /// GB the disk prefix cache may hold (`--prefix-disk-gb`): 0 turns it off; None: min(16,
    /// 10 % of the free disk). Taken when the app starts.
    pub prefix_disk_gb: Option<f64>,
    /// Its folder; None: ~/.rmlx/cache, shared with `rmlx serve`.
    pub prefix_disk_dir: Option<PathBuf>,
    /// Speculative decoding (`--speculative`): auto, off, lookup, mtp or draft; None: the
    /// engine's default.
    /// Taken when the app starts.
    pub speculative: Option<String>,
    /// A small model of the same tokenizer that drafts for every model (`--draft-model`);
    /// None: none. Taken when the app starts.
    #[serde(default)]
    pub draft_model: Option<PathBuf>,
    /// Opt-in: the app never registers itself as a login item on its own.
    pub launch_at_login: bool,
    pub update_channel: UpdateChannel,
    /// Keys a newer version wrote: kept and written back, never dropped.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdateChannel {
    #[default]
    Stable,
    Beta,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            models_dir: None,
            hub_url: None,
            server_enabled: false,
            server_host: "127.0.0.1".into(),
            server_port: 8080,
            api_key: None,
            cors_origins: Vec::new(),
            default_max_context: None,
            kv_cache_bits: None,
            prefix_disk_gb: None,
            prefix_disk_dir: None,
            speculative: None,
            draft_model: None,
            launch_at_login: false,
            update_channel: UpdateChannel::Stable,
            other: serde_json::Map::new(),
        }
    }
}

impl Settings {
    /// The saved settings, or the defaults when there are none yet; a damaged file is an error
    /// (the caller keeps the defaults and says so, rather than overwriting it silently).
    pub fn load(path: &Path) -> io::Result<Self> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(Self::default()),
            Err(error) => Err(error),
        }
    }

    pub fn save(&self, path: &Path) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        write_atomically(path, &json)
    }
}

/// Writes `bytes` beside `path` and renames over it.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temporary = path.with_extension("json.partial");
    std::fs::write(&temporary, bytes)?;
    std::fs::rename(&temporary, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_survive_a_round_trip_and_missing_fields_take_defaults() {
        let dir = std::env::temp_dir().join(format!("rmlx-app-settings-{}", std::process::id()));
        let path = dir.join("settings.json");
        assert_eq!(Settings::load(&path).unwrap(), Settings::default());
        let saved = Settings {
            server_enabled: true,
            server_port: 9123,
            kv_cache_bits: Some(4),
            speculative: Some("lookup".into()),
            draft_model: Some(PathBuf::from("/Users/me/Models/Qwen3.5-0.8B-4bit")),
            ..Settings::default()
        };
        saved.save(&path).unwrap();
        assert_eq!(Settings::load(&path).unwrap(), saved);
        std::fs::write(&path, br#"{"server_port": 7000, "future_key": [1]}"#).unwrap();
        let loaded = Settings::load(&path).unwrap();
        assert_eq!(loaded.server_port, 7000);
        assert_eq!(loaded.server_host, "127.0.0.1");
        assert_eq!(loaded.update_channel, UpdateChannel::Stable);
        loaded.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"future_key\""), "{text}");
        std::fs::write(&path, br#"{"update_channel": "nightly"}"#).unwrap();
        assert!(Settings::load(&path).is_err());
        std::fs::write(&path, b"{not json").unwrap();
        assert!(Settings::load(&path).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}

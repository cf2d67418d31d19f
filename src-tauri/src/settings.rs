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
    /// The tray's "Local API server" item: restored at launch.
    pub server_enabled: bool,
    pub server_port: u16,
    /// Model folders scan here (and in the Hugging Face cache).
    pub models_dir: Option<PathBuf>,
    /// Required of HTTP clients when set (the app itself passes it internally).
    pub api_key: Option<String>,
    /// Opt-in: the app never registers itself as a login item on its own.
    pub launch_at_login: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            server_enabled: false,
            server_port: 8080,
            models_dir: None,
            api_key: None,
            launch_at_login: false,
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
            ..Settings::default()
        };
        saved.save(&path).unwrap();
        assert_eq!(Settings::load(&path).unwrap(), saved);
        std::fs::write(&path, br#"{"server_port": 7000}"#).unwrap();
        assert_eq!(Settings::load(&path).unwrap().server_port, 7000);
        std::fs::write(&path, b"{not json").unwrap();
        assert!(Settings::load(&path).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}

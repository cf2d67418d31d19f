//! Signed updates through tauri-plugin-updater: checked at launch, from the tray and from
//! Settings; installing downloads with progress (`update-progress` events), verifies the
//! minisign signature against the public key in tauri.conf.json (a package whose signature does
//! not match is never installed), installs, and leaves the restart to the user.
//! Reference: https://v2.tauri.app/plugin/updater/ (endpoint variables, static JSON).

use std::sync::Mutex;

use serde::Serialize;
use tauri::{AppHandle, Emitter, Manager, Runtime, Url};
use tauri_plugin_updater::{Update, UpdaterExt};

use crate::settings::UpdateChannel;

/// Where releases are announced: a static `latest.json` per channel (built by
/// scripts/release/latest-json); the query carries the updater's variables for a dynamic
/// server, and a static host ignores it.
const ENDPOINT: &str = "https://updates.rmlx.app/{channel}/latest.json?target={{target}}&arch={{arch}}&current_version={{current_version}}";

/// What the UI shows of an update on offer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdateInfo {
    pub version: String,
    pub current_version: String,
    pub date: Option<String>,
    pub notes: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct Progress {
    downloaded: u64,
    total: Option<u64>,
}

/// The update found by the last check, which `install` installs.
#[derive(Default)]
pub struct Pending(Mutex<Option<Update>>);

pub fn endpoint(channel: UpdateChannel) -> Url {
    let channel = match channel {
        UpdateChannel::Stable => "stable",
        UpdateChannel::Beta => "beta",
    };
    Url::parse(&ENDPOINT.replace("{channel}", channel)).expect("a valid endpoint template")
}

/// Debug builds only: `RMLX_UPDATE_ENDPOINT`, `RMLX_UPDATE_PUBKEY` and `RMLX_UPDATE_EXECUTABLE`
/// point the updater at a local test server, a test key and a scratch file to install onto.
/// Release builds trust nothing but the configured key and endpoint.
#[cfg(debug_assertions)]
fn test_overrides(
    mut builder: tauri_plugin_updater::UpdaterBuilder,
) -> tauri_plugin_updater::Result<tauri_plugin_updater::UpdaterBuilder> {
    if let Ok(url) = std::env::var("RMLX_UPDATE_ENDPOINT") {
        let url = Url::parse(&url).map_err(|error| {
            tauri_plugin_updater::Error::Network(format!("RMLX_UPDATE_ENDPOINT: {error}"))
        })?;
        builder = builder.endpoints(vec![url])?;
    }
    if let Ok(key) = std::env::var("RMLX_UPDATE_PUBKEY") {
        builder = builder.pubkey(key);
    }
    if let Ok(path) = std::env::var("RMLX_UPDATE_EXECUTABLE") {
        builder = builder.executable_path(path);
    }
    Ok(builder)
}

/// Asks the channel's endpoint for a newer version; remembers it for [`install`].
pub async fn check<R: Runtime>(
    app: &AppHandle<R>,
    channel: UpdateChannel,
) -> Result<Option<UpdateInfo>, String> {
    let failed = |error: tauri_plugin_updater::Error| format!("cannot check for updates: {error}");
    let builder = app
        .updater_builder()
        .endpoints(vec![endpoint(channel)])
        .map_err(failed)?;
    #[cfg(debug_assertions)]
    let builder = test_overrides(builder).map_err(failed)?;
    let update = builder
        .build()
        .map_err(failed)?
        .check()
        .await
        .map_err(failed)?;
    let info = update.as_ref().map(|update| UpdateInfo {
        version: update.version.clone(),
        current_version: update.current_version.clone(),
        date: update.date.map(|date| date.to_string()),
        notes: update.body.clone(),
    });
    *app.state::<Pending>().0.lock().unwrap() = update;
    Ok(info)
}

/// Downloads the update found by the last check (emitting `update-progress`), verifies its
/// signature and installs it; the new version runs after a restart (`app_restart`).
pub async fn install<R: Runtime>(app: &AppHandle<R>) -> Result<String, String> {
    let update = app
        .state::<Pending>()
        .0
        .lock()
        .unwrap()
        .take()
        .ok_or("no update to install: check for updates first")?;
    let mut downloaded = 0u64;
    let bytes = update
        .download(
            |chunk, total| {
                downloaded += chunk as u64;
                let _ = app.emit("update-progress", Progress { downloaded, total });
            },
            || {},
        )
        .await
        .map_err(|error| format!("the update was not installed: {error}"))?;
    update
        .install(bytes)
        .map_err(|error| format!("the update was not installed: {error}"))?;
    Ok(update.version.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_channel_has_its_endpoint_with_the_updater_variables() {
        let stable = endpoint(UpdateChannel::Stable).to_string();
        assert!(stable.starts_with("https://updates.rmlx.app/stable/latest.json?"));
        for variable in ["{{target}}", "{{arch}}", "{{current_version}}"] {
            assert!(stable.contains(variable), "{stable}");
        }
        assert!(endpoint(UpdateChannel::Beta).path().starts_with("/beta/"));
    }
}

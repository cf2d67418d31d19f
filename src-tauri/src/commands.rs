//! Every IPC command the UI calls, grouped by domain; registered in one place (`lib.rs`).
//! They stay thin: chat, models and metrics go through the engine's HTTP API in-process
//! (`bridge`), the server toggle through `local_server`, files through `settings`.

use axum::http::Method;
use serde_json::{json, Value};
use tauri::{ipc::Channel, AppHandle, State};

use crate::{
    bridge::{path_segment, BridgeError, ChatEvent},
    local_server::ServerStatus,
    settings::{write_atomically, Settings},
    Shell,
};

// --- chat -------------------------------------------------------------------------------

/// Streams an answer to `request` (an OpenAI chat body) over `on_event`; returns the id
/// `chat_cancel` takes, at once.
#[tauri::command]
pub fn chat_stream(
    shell: State<'_, Shell>,
    request: Value,
    on_event: Channel<ChatEvent>,
) -> String {
    shell.bridge().start_chat(request, move |event| {
        // A closed window drops the channel: nothing left to tell.
        let _ = on_event.send(event);
    })
}

#[tauri::command]
pub fn chat_cancel(shell: State<'_, Shell>, id: String) {
    shell.bridge().cancel(&id);
}

// --- models and metrics -----------------------------------------------------------------

#[tauri::command]
pub async fn list_models(shell: State<'_, Shell>) -> Result<Value, BridgeError> {
    Ok(shell.bridge().get_json("/v1/models").await?["data"].take())
}

/// The whole `GET /v1/models` body (`data`, and `memory` where the server reports it).
#[tauri::command]
pub async fn models_overview(shell: State<'_, Shell>) -> Result<Value, BridgeError> {
    shell.bridge().get_json("/v1/models").await
}

/// Loads now (what the first chat would otherwise do); answers the model's entry.
#[tauri::command]
pub async fn model_load(shell: State<'_, Shell>, id: String) -> Result<Value, BridgeError> {
    let path = format!("/v1/models/{}/load", path_segment(&id));
    shell.bridge().call_json(Method::POST, &path, None).await
}

#[tauri::command]
pub async fn model_unload(shell: State<'_, Shell>, id: String) -> Result<Value, BridgeError> {
    let path = format!("/v1/models/{}/unload", path_segment(&id));
    shell.bridge().call_json(Method::POST, &path, None).await
}

/// Unloads and removes the model's folder (the UI asked for confirmation).
#[tauri::command]
pub async fn model_delete(shell: State<'_, Shell>, id: String) -> Result<Value, BridgeError> {
    let path = format!("/v1/models/{}", path_segment(&id));
    shell.bridge().call_json(Method::DELETE, &path, None).await
}

// --- downloads ----------------------------------------------------------------------------

#[tauri::command]
pub async fn download_start(
    shell: State<'_, Shell>,
    repo: String,
    revision: Option<String>,
) -> Result<Value, BridgeError> {
    let body = json!({"repo": repo, "revision": revision});
    shell
        .bridge()
        .call_json(Method::POST, "/admin/downloads", Some(&body))
        .await
}

#[tauri::command]
pub async fn downloads_list(shell: State<'_, Shell>) -> Result<Value, BridgeError> {
    Ok(shell.bridge().get_json("/admin/downloads").await?["data"].take())
}

#[tauri::command]
pub async fn download_pause(shell: State<'_, Shell>, id: String) -> Result<Value, BridgeError> {
    let path = format!("/admin/downloads/{}/pause", path_segment(&id));
    shell.bridge().call_json(Method::POST, &path, None).await
}

#[tauri::command]
pub async fn download_resume(shell: State<'_, Shell>, id: String) -> Result<Value, BridgeError> {
    let path = format!("/admin/downloads/{}/resume", path_segment(&id));
    shell.bridge().call_json(Method::POST, &path, None).await
}

/// Cancels (removing partial files), or clears a finished job from the list.
#[tauri::command]
pub async fn download_cancel(shell: State<'_, Shell>, id: String) -> Result<Value, BridgeError> {
    let path = format!("/admin/downloads/{}", path_segment(&id));
    shell.bridge().call_json(Method::DELETE, &path, None).await
}

// --- metrics ------------------------------------------------------------------------------

#[tauri::command]
pub async fn metrics_snapshot(shell: State<'_, Shell>) -> Result<Value, BridgeError> {
    shell.bridge().get_json("/metrics/cache").await
}

/// Deletes every file of the disk prefix cache (the settings' "Clear" button).
#[tauri::command]
pub async fn disk_cache_clear(shell: State<'_, Shell>) -> Result<Value, BridgeError> {
    shell
        .bridge()
        .call_json(Method::DELETE, "/admin/cache/disk", None)
        .await
}

// --- threads ------------------------------------------------------------------------------

/// The saved threads document, or null before the first save.
#[tauri::command]
pub fn threads_load(shell: State<'_, Shell>) -> Result<Option<Value>, String> {
    match std::fs::read(&shell.threads_path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|error| format!("{} is damaged: {error}", shell.threads_path.display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(format!(
            "cannot read {}: {error}",
            shell.threads_path.display()
        )),
    }
}

#[tauri::command]
pub fn threads_save(shell: State<'_, Shell>, document: Value) -> Result<(), String> {
    let bytes = serde_json::to_vec(&document).map_err(|error| error.to_string())?;
    write_atomically(&shell.threads_path, &bytes)
        .map_err(|error| format!("cannot save threads: {error}"))
}

// --- settings -------------------------------------------------------------------------------

#[tauri::command]
pub fn settings_get(shell: State<'_, Shell>) -> Settings {
    shell.settings.lock().unwrap().clone()
}

/// Saves the whole settings document and puts it into effect; answers what was saved.
#[tauri::command]
pub async fn settings_set(app: AppHandle, settings: Settings) -> Result<Settings, String> {
    crate::apply_settings(&app, settings).await
}

// --- local API server ---------------------------------------------------------------------

#[tauri::command]
pub fn server_status(shell: State<'_, Shell>) -> ServerStatus {
    shell.server.status()
}

/// Switches the local server on (on `port`, or the saved one) or off; remembered for the next
/// launch. A busy port comes back as a `failed` status with the message to show.
#[tauri::command]
pub async fn server_set(
    app: AppHandle,
    enabled: bool,
    port: Option<u16>,
) -> Result<ServerStatus, String> {
    Ok(crate::set_server(&app, enabled, port).await)
}

// --- launch at login ----------------------------------------------------------------------

#[tauri::command]
pub fn launch_at_login_set(app: AppHandle, enabled: bool) -> Result<bool, String> {
    use tauri_plugin_autostart::ManagerExt;
    let launcher = app.autolaunch();
    let result = if enabled {
        launcher.enable()
    } else {
        launcher.disable()
    };
    result.map_err(|error| error.to_string())?;
    crate::update_settings(&app, |settings| settings.launch_at_login = enabled)?;
    launcher.is_enabled().map_err(|error| error.to_string())
}

// --- updates ------------------------------------------------------------------------------

/// Asks the update channel in the settings for a newer version: null, or the version on offer.
#[tauri::command]
pub async fn update_check(
    app: AppHandle,
    shell: State<'_, Shell>,
) -> Result<Option<crate::updates::UpdateInfo>, String> {
    let channel = shell.settings.lock().unwrap().update_channel;
    crate::updates::check(&app, channel).await
}

/// Downloads, verifies and installs the update the last check found; answers its version.
#[tauri::command]
pub async fn update_install(app: AppHandle) -> Result<String, String> {
    crate::updates::install(&app).await
}

/// Restarts into the installed update.
#[tauri::command]
pub fn app_restart(app: AppHandle) {
    app.restart();
}

//! The app's IPC commands become ACL permissions (`allow-<command>`), so the window may call
//! only what capabilities/main.json grants it (https://v2.tauri.app/security/capabilities/).

/// Every command registered in `lib.rs`: a command missing here cannot be called at all.
const COMMANDS: &[&str] = &[
    "chat_stream",
    "chat_cancel",
    "list_models",
    "models_overview",
    "model_load",
    "model_unload",
    "model_delete",
    "download_start",
    "downloads_list",
    "download_pause",
    "download_resume",
    "download_cancel",
    "metrics_snapshot",
    "disk_cache_clear",
    "settings_get",
    "settings_set",
    "threads_load",
    "threads_save",
    "server_status",
    "server_set",
    "launch_at_login_set",
    "update_check",
    "update_install",
    "app_restart",
];

fn main() {
    tauri_build::try_build(
        tauri_build::Attributes::new()
            .app_manifest(tauri_build::AppManifest::new().commands(COMMANDS)),
    )
    .expect("the Tauri build step failed");
}

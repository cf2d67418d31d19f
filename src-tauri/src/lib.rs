//! rMLX.app: the menu-bar shell over the engine. It owns no model logic: chat, models and
//! metrics go through `rmlx-server`'s router in-process (`bridge`), and the tray's "Local API
//! server" binds that same router to 127.0.0.1 (`local_server`), so IPC and HTTP clients share
//! one engine, one request path and one set of metrics.
//! Reference: janhq/jan `src-tauri` (commands by domain, registered in one place).

pub mod bridge;
pub mod commands;
pub mod local_server;
#[cfg(target_os = "macos")]
mod macos;
pub mod settings;
mod tray;

use std::{path::PathBuf, sync::Mutex};

use tauri::{AppHandle, Manager, WindowEvent};

use crate::{
    bridge::Bridge,
    local_server::{LocalServer, ServerStatus},
    settings::Settings,
};

/// Everything the commands and the tray share.
pub struct Shell {
    pub bridge: Bridge,
    pub server: LocalServer,
    pub settings: Mutex<Settings>,
    pub settings_path: PathBuf,
    pub threads_path: PathBuf,
}

/// Model folders named by `RMLX_APP_MODELS` (a `:`-separated list; tests and `make run` use the
/// bundled fixtures), served beside the models folder.
fn extra_models() -> Vec<PathBuf> {
    std::env::var_os("RMLX_APP_MODELS")
        .map(|list| std::env::split_paths(&list).collect())
        .unwrap_or_default()
}

fn build_shell(app: &AppHandle) -> anyhow::Result<Shell> {
    // RMLX_APP_DATA moves every file the app writes (tests run it in a scratch folder).
    let data = match std::env::var_os("RMLX_APP_DATA") {
        Some(dir) => PathBuf::from(dir),
        None => app.path().app_data_dir()?,
    };
    let settings_path = data.join("settings.json");
    let settings = Settings::load(&settings_path).unwrap_or_else(|error| {
        eprintln!(
            "rmlx-app: {} is unreadable ({error}); using defaults",
            settings_path.display()
        );
        Settings::default()
    });
    let models_dir = settings
        .models_dir
        .clone()
        .unwrap_or_else(|| data.join("models"));
    std::fs::create_dir_all(&models_dir)?;
    let state = rmlx_server::AppState::new(rmlx_server::ServerConfig {
        models: extra_models(),
        models_dir: Some(models_dir),
        api_key: settings.api_key.clone(),
        ..rmlx_server::ServerConfig::default()
    })?;
    Ok(Shell {
        bridge: Bridge::new(state.clone()),
        server: LocalServer::new(state, "127.0.0.1"),
        settings: Mutex::new(settings),
        settings_path,
        threads_path: data.join("threads.json"),
    })
}

/// Applies `edit` to the settings and saves them.
pub fn update_settings(app: &AppHandle, edit: impl FnOnce(&mut Settings)) -> Result<(), String> {
    let shell = app.state::<Shell>();
    let mut settings = shell.settings.lock().unwrap();
    edit(&mut settings);
    settings
        .save(&shell.settings_path)
        .map_err(|error| format!("cannot save settings: {error}"))
}

/// Switches the local server and tells the tray and the UI; the choice is remembered only when
/// it took effect (a busy port leaves the saved state as it was).
pub async fn set_server(app: &AppHandle, enabled: bool, port: Option<u16>) -> ServerStatus {
    let shell = app.state::<Shell>();
    let port = port.unwrap_or_else(|| shell.settings.lock().unwrap().server_port);
    let status = if enabled {
        shell.server.start(port).await
    } else {
        shell.server.stop().await
    };
    if !matches!(status, ServerStatus::Failed { .. }) {
        if let Err(error) = update_settings(app, |settings| {
            settings.server_enabled = enabled;
            settings.server_port = port;
        }) {
            eprintln!("rmlx-app: {error}");
        }
    }
    tray::show_status(app, &status);
    use tauri::Emitter;
    let _ = app.emit("server-status", &status);
    status
}

/// Shows, focuses and (on macOS) gives the app a Dock icon while its window is open.
pub fn show_window(app: &AppHandle, route: Option<&str>) {
    if let Some(window) = app.get_webview_window("main") {
        #[cfg(target_os = "macos")]
        macos::window_opened(app);
        if let Some(route) = route {
            let _ = window.eval(format!("window.location.hash = {route:?}"));
        }
        let _ = window.show();
        let _ = window.unminimize();
        let _ = window.set_focus();
    }
}

pub fn run() {
    let app = tauri::Builder::default()
        // A second launch shows the running app's window instead of starting another engine.
        .plugin(tauri_plugin_single_instance::init(|app, _args, _cwd| {
            show_window(app, None);
        }))
        .plugin(tauri_plugin_autostart::init(
            tauri_plugin_autostart::MacosLauncher::LaunchAgent,
            None,
        ))
        .invoke_handler(tauri::generate_handler![
            commands::chat_stream,
            commands::chat_cancel,
            commands::list_models,
            commands::models_overview,
            commands::metrics_snapshot,
            commands::threads_load,
            commands::threads_save,
            commands::server_status,
            commands::server_set,
            commands::launch_at_login_set,
        ])
        .setup(|app| {
            #[cfg(target_os = "macos")]
            macos::setup(app.handle())?;
            let shell = build_shell(app.handle())?;
            let restore = {
                let settings = shell.settings.lock().unwrap();
                settings.server_enabled.then_some(settings.server_port)
            };
            app.manage(shell);
            tray::build(app.handle())?;
            if let Some(port) = restore {
                let handle = app.handle().clone();
                tauri::async_runtime::spawn(async move {
                    set_server(&handle, true, Some(port)).await;
                });
            }
            // RMLX_APP_SHOW=1 opens the window at launch (tests, first run from a terminal).
            if std::env::var_os("RMLX_APP_SHOW").is_some() {
                show_window(app.handle(), None);
            }
            Ok(())
        })
        .on_window_event(|window, event| {
            // Closing hides: the app lives in the menu bar until Quit.
            if let WindowEvent::CloseRequested { api, .. } = event {
                api.prevent_close();
                let _ = window.hide();
                #[cfg(target_os = "macos")]
                macos::window_closed(window.app_handle());
            }
        })
        .build(tauri::generate_context!())
        .expect("rMLX could not start its window system");
    app.run(|_app, _event| {});
}

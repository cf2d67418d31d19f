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
pub mod updates;

use std::{
    path::{Path, PathBuf},
    sync::{Mutex, RwLock},
    time::Duration,
};

use rmlx_engine::speculative::SpeculativeMode;
use rmlx_server::{AppState, ServerConfig};
use tauri::{AppHandle, Emitter, Manager, WindowEvent};

use crate::{
    bridge::Bridge,
    local_server::{LocalServer, ServerStatus},
    settings::Settings,
};

/// Everything the commands and the tray share.
pub struct Shell {
    /// The engine-facing state and its in-process router; both are replaced together when the
    /// settings change (the engine and its loaded models stay).
    current: RwLock<(AppState, Bridge)>,
    pub server: LocalServer,
    pub settings: Mutex<Settings>,
    pub settings_path: PathBuf,
    pub threads_path: PathBuf,
    data: PathBuf,
    /// Forwards the download manager's job list as `downloads` events.
    downloads_events: Mutex<Option<tauri::async_runtime::JoinHandle<()>>>,
}

impl Shell {
    pub fn bridge(&self) -> Bridge {
        self.current.read().unwrap().1.clone()
    }

    fn state(&self) -> AppState {
        self.current.read().unwrap().0.clone()
    }
}

/// Model folders named by `RMLX_APP_MODELS` (a `:`-separated list; tests and `make run` use the
/// bundled fixtures), served beside the models folder.
fn extra_models() -> Vec<PathBuf> {
    std::env::var_os("RMLX_APP_MODELS")
        .map(|list| std::env::split_paths(&list).collect())
        .unwrap_or_default()
}

/// The settings as the server's config. The models folder defaults to the one `rmlx pull` and
/// `rmlx serve` use, so models pulled from the terminal appear in the app; under
/// `RMLX_APP_DATA` (tests) it stays inside that folder.
fn server_config(settings: &Settings, data: &Path) -> ServerConfig {
    let models_dir = settings.models_dir.clone().unwrap_or_else(|| {
        match std::env::var_os("RMLX_APP_DATA") {
            Some(_) => None,
            None => rmlx_hub::default_models_dir(),
        }
        .unwrap_or_else(|| data.join("models"))
    });
    ServerConfig {
        host: settings.server_host.clone(),
        port: settings.server_port,
        models: extra_models(),
        models_dir: Some(models_dir),
        hub_url: settings.hub_url.clone(),
        max_ctx: settings.default_max_context,
        // Anything else a hand-edited file holds keeps the cache dense.
        kv_bits: settings.kv_cache_bits.filter(|bits| [8, 4].contains(bits)),
        prefix_disk_dir: disk_cache_dir(settings, data),
        // A hand-edited negative or NaN size means the default budget.
        prefix_disk_bytes: settings
            .prefix_disk_gb
            .filter(|gb| *gb > 0.0 && gb.is_finite())
            .map(|gb| (gb * 1e9) as u64),
        // A hand-edited value the engine does not know means the default.
        speculative: settings
            .speculative
            .as_deref()
            .and_then(SpeculativeMode::parse)
            .unwrap_or(ServerConfig::default().speculative),
        draft_model: settings.draft_model.clone(),
        api_key: settings.api_key.clone(),
        cors_origins: settings.cors_origins.clone(),
        ..ServerConfig::default()
    }
}

/// The disk prefix cache's folder: the setting, else `~/.rmlx/cache` as `rmlx serve` uses
/// (inside `RMLX_APP_DATA` under tests); None when the setting's size is 0 (off).
fn disk_cache_dir(settings: &Settings, data: &Path) -> Option<PathBuf> {
    if settings.prefix_disk_gb == Some(0.0) {
        return None;
    }
    settings.prefix_disk_dir.clone().or_else(|| {
        match std::env::var_os("RMLX_APP_DATA") {
            Some(_) => None,
            None => rmlx_engine::disk_cache::default_root(),
        }
        .or_else(|| Some(data.join("cache")))
    })
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
    let config = server_config(&settings, &data);
    if let Some(dir) = &config.models_dir {
        std::fs::create_dir_all(dir)?;
    }
    let state = AppState::new(config)?;
    Ok(Shell {
        current: RwLock::new((state.clone(), Bridge::new(state.clone()))),
        server: LocalServer::new(state, &settings.server_host),
        settings: Mutex::new(settings),
        settings_path,
        threads_path: data.join("threads.json"),
        data,
        downloads_events: Mutex::default(),
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

/// Saves `next` and puts it into effect at once: a new server state over the same engine (the
/// models folder, hub, key, CORS origins and context cap), the local server restarted on its
/// address if it runs. Refused, with nothing changed, when a value is unusable or a download is
/// running into a folder or from a hub that would change.
pub async fn apply_settings(app: &AppHandle, next: Settings) -> Result<Settings, String> {
    let shell = app.state::<Shell>();
    let previous = shell.settings.lock().unwrap().clone();
    if next.server_host.trim().is_empty() {
        return Err("the server host cannot be empty (127.0.0.1 keeps it on this Mac)".into());
    }
    let config = server_config(&next, &shell.data);
    if let Some(dir) = &config.models_dir {
        std::fs::create_dir_all(dir).map_err(|error| {
            format!("cannot use {} as the models folder: {error}", dir.display())
        })?;
    }
    let old = shell.state();
    let same_downloads = previous.models_dir == next.models_dir && previous.hub_url == next.hub_url;
    if let (Ok(manager), false) = (&old.downloads, same_downloads) {
        if manager.list().iter().any(|job| job.state.is_active()) {
            return Err("downloads are running: pause or cancel them before changing the models folder or hub URL".into());
        }
    }
    let state = old
        .reconfigured(config, same_downloads)
        .map_err(|error| format!("{error:#}"))?;
    if let Err(why) = &state.downloads {
        return Err(format!("the hub URL cannot be used: {why}"));
    }
    next.save(&shell.settings_path)
        .map_err(|error| format!("cannot save settings: {error}"))?;
    *shell.settings.lock().unwrap() = next.clone();
    {
        let mut current = shell.current.write().unwrap();
        let bridge = current.1.rebuilt(state.clone());
        *current = (state.clone(), bridge);
    }
    if !same_downloads {
        forward_downloads(app);
    }
    let status = shell.server.reconfigure(state, &next.server_host).await;
    tray::show_status(app, &status);
    let _ = app.emit("server-status", &status);
    Ok(next)
}

/// Switches the local server and tells the tray and the UI; the choice (with the port it got,
/// when asked for any free one) is remembered only when it took effect (a busy port leaves the
/// saved state as it was).
pub async fn set_server(app: &AppHandle, enabled: bool, port: Option<u16>) -> ServerStatus {
    let shell = app.state::<Shell>();
    let port = port.unwrap_or_else(|| shell.settings.lock().unwrap().server_port);
    let status = if enabled {
        shell.server.start(port).await
    } else {
        shell.server.stop().await
    };
    if !matches!(status, ServerStatus::Failed { .. }) {
        let port = shell.server.port().unwrap_or(port);
        if let Err(error) = update_settings(app, |settings| {
            settings.server_enabled = enabled;
            if port != 0 {
                settings.server_port = port;
            }
        }) {
            eprintln!("rmlx-app: {error}");
        }
    }
    tray::show_status(app, &status);
    let _ = app.emit("server-status", &status);
    status
}

/// Emits the job list as `downloads` after each change, at most four times a second (a watch
/// channel keeps only the newest list, so nothing queues up behind a busy window).
fn forward_downloads(app: &AppHandle) {
    let shell = app.state::<Shell>();
    let mut slot = shell.downloads_events.lock().unwrap();
    if let Some(task) = slot.take() {
        task.abort();
    }
    let Ok(manager) = shell.state().downloads else {
        return;
    };
    let app = app.clone();
    *slot = Some(tauri::async_runtime::spawn(async move {
        let mut updates = manager.subscribe();
        while updates.changed().await.is_ok() {
            let jobs = updates.borrow_and_update().clone();
            let _ = app.emit("downloads", &jobs);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }));
}

/// Emits `/metrics/cache` as `metrics` every 500 ms while the window is visible, so the
/// dashboard moves during a generation without polling over IPC.
fn forward_metrics(app: &AppHandle) {
    let app = app.clone();
    tauri::async_runtime::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let visible = app
                .get_webview_window("main")
                .and_then(|window| window.is_visible().ok())
                .unwrap_or(false);
            if !visible {
                continue;
            }
            let bridge = app.state::<Shell>().bridge();
            if let Ok(snapshot) = bridge.get_json("/metrics/cache").await {
                let _ = app.emit("metrics", &snapshot);
            }
        }
    });
}

/// Shows, focuses and (on macOS) gives the app a Dock icon while its window is open.
pub fn show_window(app: &AppHandle, route: Option<&str>) {
    if let Some(window) = app.get_webview_window("main") {
        #[cfg(target_os = "macos")]
        {
            macos::window_opened(app);
            macos::place_under_tray(&window);
        }
        if let Some(route) = route {
            let _ = window.eval(format!("window.location.hash = {route:?}"));
        }
        let _ = window.show();
        let _ = window.unminimize();
        let _ = window.set_focus();
    }
}

pub fn run() {
    let builder = tauri::Builder::default();
    #[cfg(target_os = "macos")]
    let builder = builder.plugin(tauri_plugin_positioner::init());
    let app = builder
        // A second launch shows the running app's window instead of starting another engine.
        .plugin(tauri_plugin_single_instance::init(|app, _args, _cwd| {
            show_window(app, None);
        }))
        .plugin(tauri_plugin_autostart::init(
            tauri_plugin_autostart::MacosLauncher::LaunchAgent,
            None,
        ))
        .plugin(tauri_plugin_updater::Builder::new().build())
        .manage(updates::Pending::default())
        .invoke_handler(tauri::generate_handler![
            commands::chat_stream,
            commands::chat_cancel,
            commands::list_models,
            commands::models_overview,
            commands::model_load,
            commands::model_unload,
            commands::model_delete,
            commands::download_start,
            commands::downloads_list,
            commands::download_pause,
            commands::download_resume,
            commands::download_cancel,
            commands::metrics_snapshot,
            commands::disk_cache_clear,
            commands::settings_get,
            commands::settings_set,
            commands::threads_load,
            commands::threads_save,
            commands::server_status,
            commands::server_set,
            commands::launch_at_login_set,
            commands::update_check,
            commands::update_install,
            commands::app_restart,
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
            forward_downloads(app.handle());
            forward_metrics(app.handle());
            // A quiet check at launch; RMLX_UPDATE_CHECK=0 turns it off (tests, offline use).
            if std::env::var("RMLX_UPDATE_CHECK").as_deref() != Ok("0") {
                let handle = app.handle().clone();
                tauri::async_runtime::spawn(async move {
                    tray::check_for_updates(&handle, false).await
                });
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The KV-cache setting reaches the engine; a value it does not take keeps the cache dense.
    #[test]
    fn kv_cache_bits_reach_the_server_config() {
        let data = std::env::temp_dir();
        for (saved, engine) in [
            (Some(8), Some(8)),
            (Some(4), Some(4)),
            (Some(5), None),
            (None, None),
        ] {
            let settings = Settings {
                kv_cache_bits: saved,
                models_dir: Some(data.clone()),
                ..Settings::default()
            };
            assert_eq!(server_config(&settings, &data).kv_bits, engine, "{saved:?}");
        }
    }

    /// The speculative decoding setting reaches the engine; None or a value it does not know
    /// is the server's default.
    #[test]
    fn speculative_setting_reaches_the_server_config() {
        let data = std::env::temp_dir();
        let default = ServerConfig::default().speculative;
        for (saved, engine) in [
            (Some("auto"), SpeculativeMode::Auto),
            (Some("lookup"), SpeculativeMode::Lookup),
            (Some("mtp"), SpeculativeMode::Mtp),
            (Some("draft"), SpeculativeMode::Draft),
            (Some("off"), SpeculativeMode::Off),
            (Some("always"), default),
            (None, default),
        ] {
            let settings = Settings {
                speculative: saved.map(String::from),
                models_dir: Some(data.clone()),
                ..Settings::default()
            };
            assert_eq!(
                server_config(&settings, &data).speculative,
                engine,
                "{saved:?}"
            );
        }
    }

    /// The draft model's folder reaches the engine as is; none by default.
    #[test]
    fn the_draft_model_setting_reaches_the_server_config() {
        let data = std::env::temp_dir();
        let settings = Settings {
            models_dir: Some(data.clone()),
            ..Settings::default()
        };
        assert_eq!(server_config(&settings, &data).draft_model, None);
        let draft = data.join("Qwen3.5-0.8B");
        let settings = Settings {
            draft_model: Some(draft.clone()),
            ..settings
        };
        assert_eq!(server_config(&settings, &data).draft_model, Some(draft));
    }

    #[test]
    fn disk_cache_settings_reach_the_server_config() {
        let data = std::env::temp_dir().join("rmlx-app-disk-settings");
        let with = |gb: Option<f64>, dir: Option<&str>| {
            let settings = Settings {
                prefix_disk_gb: gb,
                prefix_disk_dir: dir.map(PathBuf::from),
                models_dir: Some(data.clone()),
                ..Settings::default()
            };
            let config = server_config(&settings, &data);
            (config.prefix_disk_dir, config.prefix_disk_bytes)
        };
        // On by default (in ~/.rmlx/cache, or the test's data folder), default budget.
        let (dir, bytes) = with(None, None);
        assert!(dir.is_some() && bytes.is_none());
        assert_eq!(with(Some(0.0), Some("/x")), (None, None), "0 GB is off");
        assert_eq!(
            with(Some(2.5), Some("/x")),
            (Some(PathBuf::from("/x")), Some(2_500_000_000))
        );
        assert_eq!(
            with(Some(-1.0), Some("/x")).1,
            None,
            "a bad size is the default"
        );
    }
}

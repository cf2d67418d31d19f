//! The menu-bar icon: a status line (server state and URL), the checkable "Local API server"
//! item, Open rMLX, Dashboard, Check for Updates… and Quit. The icon is a monochrome template
//! image so macOS tints it for light and dark menu bars.

use tauri::{
    image::Image,
    menu::{CheckMenuItem, Menu, MenuItem, PredefinedMenuItem},
    tray::TrayIconBuilder,
    AppHandle, Manager, Wry,
};

use crate::{local_server::ServerStatus, show_window, Shell};

/// The items whose text or check mark changes after launch.
pub struct TrayItems {
    status: MenuItem<Wry>,
    server: CheckMenuItem<Wry>,
    updates: MenuItem<Wry>,
}

const CHECK_FOR_UPDATES: &str = "Check for Updates…";

pub fn build(app: &AppHandle) -> tauri::Result<()> {
    let shell = app.state::<Shell>();
    let status = MenuItem::with_id(
        app,
        "status",
        shell.server.status().summary(),
        false,
        None::<&str>,
    )?;
    let server =
        CheckMenuItem::with_id(app, "server", "Local API server", true, false, None::<&str>)?;
    let open = MenuItem::with_id(app, "open", "Open rMLX", true, None::<&str>)?;
    let dashboard = MenuItem::with_id(app, "dashboard", "Dashboard", true, None::<&str>)?;
    let updates = MenuItem::with_id(app, "updates", CHECK_FOR_UPDATES, true, None::<&str>)?;
    let quit = MenuItem::with_id(app, "quit", "Quit rMLX", true, Some("CmdOrCtrl+Q"))?;
    let menu = Menu::with_items(
        app,
        &[
            &status,
            &PredefinedMenuItem::separator(app)?,
            &server,
            &PredefinedMenuItem::separator(app)?,
            &open,
            &dashboard,
            &updates,
            &PredefinedMenuItem::separator(app)?,
            &quit,
        ],
    )?;
    let icon = Image::from_bytes(include_bytes!("../../icons/tray-template@2x.png"))?;
    TrayIconBuilder::with_id("main")
        .icon(icon)
        .icon_as_template(true)
        .tooltip("rMLX")
        .menu(&menu)
        .on_tray_icon_event(|_tray, _event| {
            #[cfg(target_os = "macos")]
            crate::macos::tray_event(_tray.app_handle(), &_event);
        })
        .on_menu_event(|app, event| match event.id().as_ref() {
            "server" => {
                let app = app.clone();
                let enabled = matches!(
                    app.state::<Shell>().server.status(),
                    ServerStatus::On { .. }
                );
                tauri::async_runtime::spawn(async move {
                    crate::set_server(&app, !enabled, None).await;
                });
            }
            "open" => show_window(app, None),
            "dashboard" => show_window(app, Some("#/dashboard")),
            "updates" => {
                let app = app.clone();
                tauri::async_runtime::spawn(async move { check_for_updates(&app, true).await });
            }
            // Exiting closes the listener with the process.
            "quit" => app.exit(0),
            _ => {}
        })
        .build(app)?;
    app.manage(TrayItems {
        status,
        server,
        updates,
    });
    Ok(())
}

/// Checks the update channel and says what it found on the tray item; an update on offer also
/// goes to the window (`update-available`), opened at Settings when the user asked.
pub async fn check_for_updates(app: &AppHandle, asked: bool) {
    let channel = app.state::<Shell>().settings.lock().unwrap().update_channel;
    let text = match crate::updates::check(app, channel).await {
        Ok(Some(update)) => {
            use tauri::Emitter;
            let _ = app.emit("update-available", &update);
            if asked {
                show_window(app, Some("#/settings"));
            }
            format!("Update to {}…", update.version)
        }
        Ok(None) => format!("Up to date ({}) · Check Again", app.package_info().version),
        Err(error) => {
            eprintln!("rmlx-app: {error}");
            if !asked {
                return;
            }
            "Update check failed · Try Again".to_string()
        }
    };
    if let Some(items) = app.try_state::<TrayItems>() {
        let _ = items.updates.set_text(text);
    }
}

/// Puts `status` on the tray: the status line and the check mark (a failed start unchecks it).
pub fn show_status(app: &AppHandle, status: &ServerStatus) {
    if let Some(items) = app.try_state::<TrayItems>() {
        let _ = items.status.set_text(status.summary());
        let _ = items
            .server
            .set_checked(matches!(status, ServerStatus::On { .. }));
    }
}

//! The menu-bar icon: a status line (server state and URL), the checkable "Local API server"
//! item, Open rMLX, Dashboard and Quit. The icon is a monochrome template image so macOS
//! tints it for light and dark menu bars.

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
}

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
            &PredefinedMenuItem::separator(app)?,
            &quit,
        ],
    )?;
    let icon = Image::from_bytes(include_bytes!("../icons/tray-template@2x.png"))?;
    TrayIconBuilder::with_id("main")
        .icon(icon)
        .icon_as_template(true)
        .tooltip("rMLX")
        .menu(&menu)
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
            "dashboard" => show_window(app, Some("#dashboard")),
            // Exiting closes the listener with the process.
            "quit" => app.exit(0),
            _ => {}
        })
        .build(app)?;
    app.manage(TrayItems { status, server });
    Ok(())
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

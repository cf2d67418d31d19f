//! macOS only: a menu-bar app (Accessory: no Dock icon unless a window is open) with an Edit
//! menu, so Cmd-C/V/X/A reach the web view (without one, macOS routes no edit shortcuts), whose
//! window opens under its menu-bar icon (tauri-plugin-positioner, fed the tray's events).

use tauri::{
    menu::{Menu, PredefinedMenuItem, Submenu},
    tray::TrayIconEvent,
    ActivationPolicy, AppHandle, WebviewWindow,
};
use tauri_plugin_positioner::{Position, WindowExt};

pub fn setup(app: &AppHandle) -> tauri::Result<()> {
    app.set_activation_policy(ActivationPolicy::Accessory)?;
    let edit = Submenu::with_items(
        app,
        "Edit",
        true,
        &[
            &PredefinedMenuItem::undo(app, None)?,
            &PredefinedMenuItem::redo(app, None)?,
            &PredefinedMenuItem::separator(app)?,
            &PredefinedMenuItem::cut(app, None)?,
            &PredefinedMenuItem::copy(app, None)?,
            &PredefinedMenuItem::paste(app, None)?,
            &PredefinedMenuItem::select_all(app, None)?,
        ],
    )?;
    let app_menu = Submenu::with_items(
        app,
        "rMLX",
        true,
        &[
            &PredefinedMenuItem::hide(app, None)?,
            &PredefinedMenuItem::separator(app)?,
            &PredefinedMenuItem::quit(app, None)?,
        ],
    )?;
    app.set_menu(Menu::with_items(app, &[&app_menu, &edit])?)?;
    Ok(())
}

/// A window is open: show the Dock icon and the app menu.
pub fn window_opened(app: &AppHandle) {
    let _ = app.set_activation_policy(ActivationPolicy::Regular);
}

/// The window is hidden: back to the menu bar only.
pub fn window_closed(app: &AppHandle) {
    let _ = app.set_activation_policy(ActivationPolicy::Accessory);
}

/// Remembers where the menu-bar icon is (clicks and hovers report its rectangle).
pub fn tray_event(app: &AppHandle, event: &TrayIconEvent) {
    tauri_plugin_positioner::on_tray_event(app, event);
}

/// Puts the window just below the menu-bar icon, kept on screen; before the icon has reported
/// its position (no click or hover yet) the window stays where it was.
pub fn place_under_tray(window: &WebviewWindow) {
    let _ = window.move_window_constrained(Position::TrayBottomCenter);
}

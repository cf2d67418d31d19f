//! macOS only: a menu-bar app (Accessory: no Dock icon unless a window is open) with an Edit
//! menu, so Cmd-C/V/X/A reach the web view (without one, macOS routes no edit shortcuts).

use tauri::{
    menu::{Menu, PredefinedMenuItem, Submenu},
    ActivationPolicy, AppHandle,
};

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

//! Embeds the built web UI (`ui/dist`, what `make ui-build` makes and the app ships) into the
//! server, so `rmlx serve` shows the chat at `/` with no files beside the binary. Source maps
//! stay out (they are most of the folder and only a debugger reads them). Without a built UI
//! the list is empty and the build says so; `rmlx serve` then serves no page.

use std::{fmt::Write, path::Path};

fn main() {
    // Read at run time: `env!` would bake in the folder this script was first compiled in, and
    // cargo reuses the script's binary for another checkout sharing the target folder.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap();
    let dist = Path::new(&manifest).join("../../ui/dist");
    // A folder: cargo watches everything under it.
    println!("cargo:rerun-if-changed={}", dist.display());
    let mut files = Vec::new();
    collect(&dist, &dist, &mut files);
    files.sort();
    if !files.iter().any(|(name, _)| name == "index.html") {
        println!(
            "cargo:warning=ui/dist is not built: this rmlx serve has no embedded UI (run `make ui-build`, then build again)"
        );
        files.clear();
    }
    let mut out = String::from(
        "/// The built UI: (path under ui/dist, bytes).\npub static FILES: &[(&str, &[u8])] = &[\n",
    );
    for (name, path) in &files {
        writeln!(out, "    ({name:?}, include_bytes!({path:?})),").unwrap();
    }
    out.push_str("];\n");
    let target = Path::new(&std::env::var("OUT_DIR").unwrap()).join("ui_files.rs");
    std::fs::write(target, out).unwrap();
}

fn collect(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(root, &path, files);
        } else if path.extension().is_none_or(|ext| ext != "map") {
            let name = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let absolute = path.canonicalize().unwrap();
            files.push((name, absolute.to_string_lossy().into_owned()));
        }
    }
}

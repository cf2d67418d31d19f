//! Finds and opens libmlxc (which pulls in libmlx beside it through its own rpath) once per
//! process. `RMLX_MLX_LIB_DIR`, when set, is the only place looked at; otherwise: beside the
//! executable (`./`, `../lib`, `../Frameworks` for the macOS bundle), the folder the build bound
//! to, then the system loader's own search.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::OnceLock,
};

use crate::MlxApi;

#[cfg(target_vendor = "apple")]
const LIBRARY_NAME: &str = "libmlxc.dylib";
#[cfg(not(target_vendor = "apple"))]
const LIBRARY_NAME: &str = "libmlxc.so";

/// Why MLX could not be used; the message tells the user what to do.
#[derive(Debug, Clone)]
pub struct LoadError {
    /// Every place that was tried, with the loader's reason.
    pub attempts: Vec<(String, String)>,
    /// A symbol the library lacks (a build from other headers), when that was the failure.
    pub missing_symbol: Option<String>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(symbol) = &self.missing_symbol {
            writeln!(
                f,
                "the MLX library found at {} lacks `{symbol}`: it is not the pinned mlx-c {}",
                self.attempts.last().map(|a| a.0.as_str()).unwrap_or("?"),
                env!("CARGO_PKG_VERSION")
            )?;
        } else {
            writeln!(
                f,
                "the MLX runtime library ({LIBRARY_NAME} with libmlx) was not found."
            )?;
        }
        writeln!(f, "Looked in:")?;
        for (place, reason) in &self.attempts {
            writeln!(f, "  {place}: {reason}")?;
        }
        write!(
            f,
            "Fix: run `make bootstrap` (scripts/bootstrap-mlx) in the rMLX source tree, reinstall \
             rmlx, or set RMLX_MLX_LIB_DIR to the folder holding {LIBRARY_NAME} and libmlx."
        )
    }
}

impl std::error::Error for LoadError {}

struct Loaded {
    api: MlxApi,
    path: PathBuf,
}

static LOADED: OnceLock<Result<Loaded, LoadError>> = OnceLock::new();

/// Opens MLX if it is not open yet. Call it first thing so a missing library is reported
/// cleanly; any MLX call made before it does the same and panics with this error instead.
pub fn load() -> Result<(), LoadError> {
    loaded().as_ref().map(|_| ()).map_err(Clone::clone)
}

/// Where the loaded libmlxc came from, once `load` succeeded.
pub fn library_path() -> Option<&'static Path> {
    loaded().as_ref().ok().map(|loaded| loaded.path.as_path())
}

pub(crate) fn api() -> &'static MlxApi {
    match loaded() {
        Ok(loaded) => &loaded.api,
        Err(error) => panic!("{error}"),
    }
}

fn loaded() -> &'static Result<Loaded, LoadError> {
    LOADED.get_or_init(open_first_candidate)
}

fn candidates() -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os("RMLX_MLX_LIB_DIR") {
        return vec![PathBuf::from(dir).join(LIBRARY_NAME)];
    }
    let mut dirs = Vec::new();
    if let Some(exe_dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.canonicalize().ok())
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    {
        dirs.push(exe_dir.clone());
        dirs.push(exe_dir.join("../lib"));
        dirs.push(exe_dir.join("../Frameworks"));
    }
    dirs.push(PathBuf::from(env!("MLX_SYS_BUILD_LIBDIR")));
    let mut paths: Vec<PathBuf> = dirs.into_iter().map(|dir| dir.join(LIBRARY_NAME)).collect();
    // Bare name last: the system loader's own search (ld.so.conf, Homebrew's lib via rpath).
    paths.push(PathBuf::from(LIBRARY_NAME));
    paths
}

fn open_first_candidate() -> Result<Loaded, LoadError> {
    let mut attempts = Vec::new();
    for path in candidates() {
        if path.components().count() > 1 && !path.exists() {
            attempts.push((path.display().to_string(), "no such file".to_string()));
            continue;
        }
        // SAFETY: libmlxc's initialisers only set up MLX's own globals.
        match unsafe { libloading::Library::new(&path) } {
            Ok(library) => {
                // SAFETY: the candidate is libmlxc; resolve() checks every symbol exists.
                match unsafe { MlxApi::resolve(&library) } {
                    Ok(api) => {
                        // MLX stays loaded for the life of the process.
                        std::mem::forget(library);
                        return Ok(Loaded { api, path });
                    }
                    Err(symbol) => {
                        attempts.push((path.display().to_string(), "incomplete".to_string()));
                        return Err(LoadError {
                            attempts,
                            missing_symbol: Some(symbol.to_string()),
                        });
                    }
                }
            }
            Err(error) => attempts.push((path.display().to_string(), error.to_string())),
        }
    }
    Err(LoadError {
        attempts,
        missing_symbol: None,
    })
}

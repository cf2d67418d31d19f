//! What MLX this process runs on: the loaded library, its version and the default device.
//! Reference: mlx-c `version.h`, `device.h`, `metal.h`, `cuda.h`.

use std::path::PathBuf;

/// Facts about the loaded MLX, for `rmlx doctor`, logs and version-drift warnings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RuntimeInfo {
    pub library: PathBuf,
    pub mlx_version: String,
    pub compiled_mlx_version: &'static str,
    pub default_device: String,
    pub metal_available: bool,
    pub cuda_available: bool,
}

/// The MLX version these bindings were built for (mlx.pins).
pub const PINNED_MLX_VERSION: &str = "0.32.2";

/// Loads MLX (a clear error if it is missing) and describes it.
pub fn runtime_info() -> Result<RuntimeInfo, mlx_sys::LoadError> {
    mlx_sys::load()?;
    let library = mlx_sys::library_path()
        .map(PathBuf::from)
        .unwrap_or_default();
    // SAFETY: plain queries on the loaded library; each result is freed after it is copied.
    unsafe {
        let mut version = mlx_sys::mlx_string_new();
        mlx_sys::mlx_version(&mut version);
        let mlx_version = c_text(mlx_sys::mlx_string_data(version));
        mlx_sys::mlx_string_free(version);

        let mut device = mlx_sys::mlx_device_new();
        mlx_sys::mlx_get_default_device(&mut device);
        let mut description = mlx_sys::mlx_string_new();
        mlx_sys::mlx_device_tostring(&mut description, device);
        let default_device = c_text(mlx_sys::mlx_string_data(description));
        mlx_sys::mlx_string_free(description);
        mlx_sys::mlx_device_free(device);

        let mut metal_available = false;
        mlx_sys::mlx_metal_is_available(&mut metal_available);
        let mut cuda_available = false;
        mlx_sys::mlx_cuda_is_available(&mut cuda_available);
        Ok(RuntimeInfo {
            library,
            mlx_version,
            compiled_mlx_version: PINNED_MLX_VERSION,
            default_device,
            metal_available,
            cuda_available,
        })
    }
}

unsafe fn c_text(text: *const std::os::raw::c_char) -> String {
    if text.is_null() {
        return String::new();
    }
    std::ffi::CStr::from_ptr(text)
        .to_string_lossy()
        .into_owned()
}

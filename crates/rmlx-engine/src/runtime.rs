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
pub const PINNED_MLX_VERSION: &str = mlx_sys::PINNED_MLX_VERSION;

/// A warning when the loaded MLX is not the pinned one (a package-manager symlink can point
/// anywhere); drift is allowed to run, but users deserve to know.
pub fn version_drift() -> Option<String> {
    let info = runtime_info().ok()?;
    (info.mlx_version != info.compiled_mlx_version).then(|| {
        format!(
            "warning: loaded MLX {} from {} differs from the pinned {}",
            info.mlx_version,
            info.library.display(),
            info.compiled_mlx_version
        )
    })
}

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

/// Gives the calling thread its own default stream on the default device, once, before any
/// evaluation. On Metal a thread without one fails with "There is no Stream(gpu, 0) in
/// current thread" (rMLX issues 10, 104, 206); on the CPU backend this finds the one MLX made.
/// Never create a stream per operation: each is an OS thread on Metal.
pub fn prepare_thread() -> Result<(), mlx_sys::LoadError> {
    mlx_sys::load()?;
    // SAFETY: queries and sets this thread's default stream; handles are freed here.
    unsafe {
        let mut device = mlx_sys::mlx_device_new();
        mlx_sys::mlx_get_default_device(&mut device);
        let mut stream = mlx_sys::mlx_stream_new();
        if mlx_sys::mlx_get_default_stream(&mut stream, device) != 0 {
            mlx_sys::mlx_stream_free(stream);
            stream = mlx_sys::mlx_stream_new_device(device);
            mlx_sys::mlx_set_default_stream(stream);
        }
        mlx_sys::mlx_stream_free(stream);
        mlx_sys::mlx_device_free(device);
    }
    Ok(())
}

/// Whether loaded weights should be copied into device memory: on CUDA (Linux with a GPU
/// default device) safetensors load into managed memory, which migrates page by page on the
/// first request and stays managed; on Metal memory is unified and on the CPU there is no
/// device, so nothing is copied there. `RMLX_WEIGHTS_ON_DEVICE=0` turns it off (benchmarks).
pub fn weights_go_to_device() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        if cfg!(target_os = "macos")
            || std::env::var("RMLX_WEIGHTS_ON_DEVICE").as_deref() == Ok("0")
        {
            return false;
        }
        runtime_info().is_ok_and(|info| info.cuda_available && info.default_device.contains("gpu"))
    })
}

/// `mlx.eval` that is safe to fail. When an evaluation throws partway (an allocation refused),
/// work MLX already queued on the stream still reads its inputs through raw pointers; if the
/// caller then dropped the graph (as `?` does), that work would read freed memory (seen as a
/// segfault in the CPU backend's `copy_general_general`). So on failure this waits for the
/// stream to drain while the caller's arrays still hold the graph.
pub fn eval<'a>(arrays: impl IntoIterator<Item = &'a mlx_rs::Array>) -> crate::Result<()> {
    mlx_rs::transforms::eval(arrays).map_err(drain_after_failure)
}

/// `mlx.async_eval`, safe to fail in the same way as [`eval`].
pub fn async_eval<'a>(arrays: impl IntoIterator<Item = &'a mlx_rs::Array>) -> crate::Result<()> {
    mlx_rs::transforms::async_eval(arrays).map_err(drain_after_failure)
}

fn drain_after_failure(error: mlx_rs::error::Exception) -> crate::EngineError {
    // SAFETY: MLX is loaded (an evaluation just ran); waiting on this thread's default stream
    // is always allowed.
    unsafe { mlx_sys::mlx_synchronize_default() };
    error.into()
}

/// Returns MLX's cached (freed but kept) buffers to the system: called when the engine goes
/// idle, so a desktop app does not sit on gigabytes between requests.
pub fn release_cached_memory() {
    if mlx_sys::load().is_ok() {
        // SAFETY: MLX is loaded; clearing the buffer cache is always allowed.
        unsafe { mlx_sys::mlx_clear_cache() };
    }
}

/// Memory a model may use: what the OS reports available (Linux `MemAvailable`), or the
/// physical memory on macOS, where MLX shares unified memory with everything else.
pub fn available_memory() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = meminfo
            .lines()
            .find(|line| line.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
    #[cfg(target_os = "macos")]
    {
        let mut bytes: u64 = 0;
        let mut size = std::mem::size_of::<u64>();
        let name = c"hw.memsize";
        // SAFETY: sysctlbyname writes at most `size` bytes into `bytes`.
        let status = unsafe {
            sysctlbyname(
                name.as_ptr(),
                (&mut bytes as *mut u64).cast(),
                &mut size,
                std::ptr::null_mut(),
                0,
            )
        };
        (status == 0).then_some(bytes)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        None
    }
}

/// Physical memory (Linux `MemTotal`, macOS `hw.memsize`), for the models view's memory line.
pub fn total_memory() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
    #[cfg(not(target_os = "linux"))]
    {
        // On macOS the physical memory is what `available_memory` reports.
        available_memory()
    }
}

/// What serving the model at a context of `max_ctx` positions to batches of up to `rows`
/// requests takes: [`memory_needed`] plus the KV cache filled to that context (the model's own
/// context when None; a batch's rows share it, the engine admits no more) and each row's
/// recurrent state, sized from its already-read `config` (config.json).
pub fn memory_needed_at(
    dir: &std::path::Path,
    config: &serde_json::Value,
    max_ctx: Option<usize>,
    rows: usize,
) -> std::io::Result<u64> {
    let weights = memory_needed(dir)?;
    let context = max_ctx.or_else(|| {
        let text = config.get("text_config").unwrap_or(config);
        text.get("max_position_embeddings")
            .or_else(|| config.get("max_position_embeddings"))
            .and_then(serde_json::Value::as_u64)
            .map(|n| n as usize)
    });
    let kv = crate::models::structure::kv_bytes_per_token(config) * context.unwrap_or(0) as u64;
    let state = crate::models::structure::fixed_state_bytes(config) * rows.max(1) as u64;
    Ok(weights + kv + state)
}

/// What loading the model in `dir` needs: its `.safetensors` weights (every expert included)
/// plus a tenth for activations and a first KV allocation. The engine refuses a model when
/// this exceeds [`available_memory`] (its KV then grows with each request, bounded by max_ctx).
pub fn memory_needed(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut weights = 0u64;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "safetensors") {
            // metadata() follows symlinks: Hugging Face cache snapshots link to blobs.
            weights += std::fs::metadata(&path).map_or(0, |meta| meta.len());
        }
    }
    Ok(weights + weights / 10)
}

#[cfg(target_os = "macos")]
extern "C" {
    fn sysctlbyname(
        name: *const std::os::raw::c_char,
        oldp: *mut std::ffi::c_void,
        oldlenp: *mut usize,
        newp: *mut std::ffi::c_void,
        newlen: usize,
    ) -> std::os::raw::c_int;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_thread_gets_a_stream_and_computes() {
        let value = std::thread::spawn(|| {
            prepare_thread().unwrap();
            prepare_thread().unwrap(); // idempotent
            let a = mlx_rs::Array::from_slice(&[1.0f32, 2.0], &[2]);
            let sum = mlx_rs::ops::sum(&a, None).unwrap();
            sum.item_exact::<f32>()
        })
        .join()
        .unwrap();
        assert_eq!(value, 3.0);
    }

    #[test]
    fn available_memory_is_reported() {
        let bytes = available_memory().expect("Linux and macOS report memory");
        assert!(bytes > 64 << 20, "{bytes}");
        let total = total_memory().expect("Linux and macOS report memory");
        assert!(total >= bytes, "{total} < {bytes}");
    }
}

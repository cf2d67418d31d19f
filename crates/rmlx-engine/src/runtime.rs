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

/// MLX settings read from the environment, made before any thread starts (`main`) unless the
/// user set them. MLX CUDA's shape-keyed caches (CUDA graphs, cuDNN attention and conv plans)
/// throw "cache thrashing" once a process has missed twice their capacity: a server meets that
/// many shapes in a long session (each prompt length can be one), and the throw fails every
/// later request. Past capacity the caches only evict, which is what a server wants.
pub fn prepare_environment() {
    if std::env::var_os(CACHE_THRASHING_CHECK).is_none() {
        std::env::set_var(CACHE_THRASHING_CHECK, "0");
    }
}

/// See `prepare_environment`.
pub const CACHE_THRASHING_CHECK: &str = "MLX_ENABLE_CACHE_THRASHING_CHECK";

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
        on_cuda_gpu()
    })
}

/// Whether MLX computes on a CUDA GPU (its default device is a GPU and CUDA is there).
pub fn on_cuda_gpu() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        runtime_info().is_ok_and(|info| info.cuda_available && info.default_device.contains("gpu"))
    })
}

/// `mlx.eval` that is safe to fail. When an evaluation throws partway (an allocation refused),
/// work MLX already queued on the stream still reads its inputs through raw pointers; if the
/// caller then dropped the graph (as `?` does), that work would read freed memory (seen as a
/// segfault in the CPU backend's `copy_general_general`). So on failure this waits for the
/// stream to drain while the caller's arrays still hold the graph.
pub fn eval<'a>(arrays: impl IntoIterator<Item = &'a mlx_rs::Array>) -> crate::Result<()> {
    EVALS.with(|evals| evals.set(evals.get() + 1));
    mlx_rs::transforms::eval(arrays).map_err(drain_after_failure)
}

/// Calls of [`eval`] on this thread so far: each waits for the device (tests count a decode's
/// host synchronisations with it).
pub fn evals() -> usize {
    EVALS.with(std::cell::Cell::get)
}

thread_local! {
    static EVALS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
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
/// idle, so a desktop app does not sit on gigabytes between requests. On CUDA, MLX frees into
/// the device's memory pool, which gives memory back to the driver only at a synchronisation:
/// one follows (else an idle server holds what a long prompt's prefill freed). On Linux the C
/// allocator keeps freed heap pages too (the CPU backend's buffers): they are trimmed.
pub fn release_cached_memory() {
    clear_buffer_cache();
    if mlx_sys::load().is_ok() {
        // SAFETY: MLX is loaded; waiting on this thread's default stream is always allowed.
        unsafe { mlx_sys::mlx_synchronize_default() };
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of glibc's heaps to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Linux (glibc): buffers of 1 MiB and more get pages of their own, given back when freed.
/// The CPU backend's buffers come from malloc, whose threshold for that rises with each large
/// free (up to 32 MiB), after which a long prompt's activations stay in the heap: 13 MB more
/// resident than MLX held after a 15k-token prompt on the tiny Qwen3, 8 MB with this. MLX
/// keeps reusing its own cached buffers, so decode steps do not map pages anew.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn map_large_buffers() {
    // SAFETY: mallopt only sets glibc's threshold; the value is in its accepted range.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Empties MLX's buffer cache (without the idle release's synchronisation and heap trim).
/// Between a long prompt's prefill pieces: they free activations of sizes decode never reuses,
/// and the cache would keep them all (a buffer is reused only for a request of nearly its size,
/// so each new shape allocates afresh while the old buffers stay cached; on CUDA it grows
/// towards 95 % of the card). mlx-lm clears it after every prefill chunk likewise.
pub fn clear_buffer_cache() {
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

/// How a server would hold a model: its context cap, rows decoding together, KV bits and the
/// memory it reserves beside (explicit prefix-cache budgets).
#[derive(Debug, Clone, Copy, Default)]
pub struct Serving {
    /// The context cap (`--max-ctx`); None: the model's own.
    pub max_ctx: Option<usize>,
    /// Rows decoding together (`--max-batch`): each has its own fixed state.
    pub rows: usize,
    /// `--kv-bits`.
    pub kv_bits: Option<i32>,
    /// Bytes set aside for the prefix cache (budgets given explicitly; the automatic ones take
    /// only what is left).
    pub reserved: u64,
    /// The model's draft head will be loaded (speculation on and the checkpoint ships one): its
    /// KV grows with the context beside the trunk's.
    pub draft_head: bool,
    /// One rank of a pipeline across machines: only its layers' weights, KV and state count.
    pub share: Option<StageShare>,
}

/// Which layers a pipeline rank holds, for what serving them takes there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageShare {
    pub rank: usize,
    /// Its decoder layers, `start..end`.
    pub start: usize,
    pub end: usize,
}

impl StageShare {
    /// What loading this rank's part needs (its weights, from the safetensors headers, plus a
    /// tenth as [`memory_needed`] adds), and the model's layer count.
    fn weights(
        &self,
        dir: &std::path::Path,
        config: &serde_json::Value,
    ) -> std::io::Result<(u64, u64)> {
        let bytes =
            crate::distributed::split::layer_bytes(dir, config).map_err(std::io::Error::other)?;
        let weights = bytes.of_rank(self.rank, self.start..self.end);
        Ok((weights + weights / 10, bytes.layers.len().max(1) as u64))
    }

    pub fn of(part: &crate::models::Part) -> Option<Self> {
        part.stage().map(|stage| {
            let layers = stage.own_layers();
            Self {
                rank: stage.rank(),
                start: layers.start,
                end: layers.end,
            }
        })
    }
}

/// What serving the model in `dir` as `serving` takes: [`memory_needed`] plus the KV cache
/// filled to the context (a batch's rows share it; more only where the memory this leaves allows,
/// see `EngineThread::kv_room`; stored with the KV bits), each row's fixed state (recurrent states, sliding windows) and the reserve, sized
/// from its already-read `config` (config.json).
pub fn memory_needed_at(
    dir: &std::path::Path,
    config: &serde_json::Value,
    serving: &Serving,
) -> std::io::Result<u64> {
    let (base, per_token) = serving_costs(dir, config, serving)?;
    let context = serving.max_ctx.unwrap_or_else(|| model_context(config));
    Ok(base + per_token * context as u64)
}

/// The longest context (up to the model's own) that serving the model as `serving` fits in
/// `available` bytes; None when not even the weights and fixed state fit.
pub fn largest_context_that_fits(
    dir: &std::path::Path,
    config: &serde_json::Value,
    serving: &Serving,
    available: u64,
) -> std::io::Result<Option<u64>> {
    let (base, per_token) = serving_costs(dir, config, serving)?;
    let room = available.checked_sub(base);
    let own = model_context(config) as u64;
    Ok(room.map(|room| match per_token {
        0 => own,
        per_token => (room / per_token).min(own),
    }))
}

/// Bytes that do not grow with the context, and KV bytes per position of it.
fn serving_costs(
    dir: &std::path::Path,
    config: &serde_json::Value,
    serving: &Serving,
) -> std::io::Result<(u64, u64)> {
    use crate::models::structure;
    let mut per_token = structure::kv_bytes_per_token_stored(config, serving.kv_bits);
    if serving.draft_head {
        per_token += structure::draft_head_kv_bytes_per_token(config, serving.kv_bits);
    }
    let mut state = structure::fixed_state_bytes(config) * serving.rows.max(1) as u64;
    let weights = match serving.share {
        None => memory_needed(dir)?,
        // A rank's own layers' weights (rank 0's also the rest), and its share of the layers'
        // KV and state (layers of one kind hold alike; rounded up).
        Some(share) => {
            let (weights, layers) = share.weights(dir, config)?;
            let own = (share.end - share.start) as u64;
            per_token = (per_token * own).div_ceil(layers);
            state = (state * own).div_ceil(layers);
            weights
        }
    };
    Ok((weights + state + serving.reserved, per_token))
}

fn model_context(config: &serde_json::Value) -> usize {
    let text = config.get("text_config").unwrap_or(config);
    text.get("max_position_embeddings")
        .or_else(|| config.get("max_position_embeddings"))
        .and_then(serde_json::Value::as_u64)
        .map_or(0, |n| n as usize)
}

/// Metal's recommended working set (the GPU's `max_recommended_working_set_size`); None where
/// the backend has none (the CPU).
pub fn recommended_working_set() -> Option<u64> {
    gpu_info_size(c"max_recommended_working_set_size")
}

/// The memory MLX computes in: Metal's recommended working set, a CUDA device's own memory
/// (the host's can be larger), else the system's.
pub fn working_memory() -> Option<u64> {
    let gpu = recommended_working_set().or_else(|| gpu_info_size(c"total_memory"));
    match (gpu, total_memory()) {
        (Some(gpu), Some(host)) => Some(gpu.min(host)),
        (gpu, host) => gpu.or(host),
    }
}

/// A size the GPU backend reports under `key` (`mlx::core::gpu::device_info`).
fn gpu_info_size(key: &std::ffi::CStr) -> Option<u64> {
    // SAFETY: the device and info handles are created and freed here; mlx-c reports failures
    // (no GPU on this build) as status codes.
    unsafe {
        let device = mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0);
        let mut info = mlx_sys::mlx_device_info_new();
        let (mut exists, mut value) = (false, 0usize);
        let found = mlx_sys::mlx_device_info_get(&mut info, device) == 0
            && mlx_sys::mlx_device_info_has_key(&mut exists, info, key.as_ptr()) == 0
            && exists
            && mlx_sys::mlx_device_info_get_size(&mut value, info, key.as_ptr()) == 0;
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(device);
        found.then_some(value as u64)
    }
}

/// As mlx-lm does around generation: wires memory up to the recommended working set, so a large
/// model's weights stay resident between requests instead of being paged out (macOS; the CPU
/// backend has no wired memory). Returns the limit set.
pub fn wire_memory() -> Option<u64> {
    let limit = recommended_working_set()?;
    let mut previous = 0usize;
    // SAFETY: plain values in and out.
    let status = unsafe { mlx_sys::mlx_set_wired_limit(&mut previous, limit as usize) };
    (status == 0).then_some(limit)
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

/// [`memory_needed`] for this process's `part` of the model: one pipeline stage needs its own
/// layers' weights (rank 0 also the embeddings, output layer and towers), plus a tenth.
pub fn memory_needed_for(
    dir: &std::path::Path,
    part: &crate::models::Part,
) -> std::io::Result<u64> {
    let Some(share) = StageShare::of(part) else {
        return memory_needed(dir);
    };
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)
            .map_err(std::io::Error::other)?;
    Ok(share.weights(dir, &config)?.0)
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

#[cfg(test)]
mod serving_tests {
    use super::*;

    fn fixture() -> (std::path::PathBuf, serde_json::Value) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/head-sizes/qwen3-hd128");
        let config =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        (dir, config)
    }

    /// A pipeline rank counts its own layers: their weights (rank 0 also the embeddings and
    /// output layer) and their share of the KV; the ranks' weights add up to the whole.
    #[test]
    fn a_rank_counts_its_own_layers() {
        let (dir, config) = fixture();
        let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
        let at = |share: Option<StageShare>| {
            let serving = Serving {
                rows: 1,
                max_ctx: Some(1000),
                share,
                ..Serving::default()
            };
            let needed = memory_needed_at(&dir, &config, &serving).unwrap();
            let weights = memory_needed_at(
                &dir,
                &config,
                &Serving {
                    max_ctx: Some(0),
                    ..serving
                },
            )
            .unwrap();
            (weights, needed - weights)
        };
        let half = layers / 2;
        let (whole, whole_kv) = at(None);
        let (first, first_kv) = at(Some(StageShare {
            rank: 0,
            start: 0,
            end: half,
        }));
        let (second, second_kv) = at(Some(StageShare {
            rank: 1,
            start: half,
            end: layers,
        }));
        assert!(
            first < whole && second < whole && second < first,
            "{first} {second} {whole}"
        );
        // The ranks' weights add up to the files' (less their headers: within 1 %).
        assert!(
            (first + second).abs_diff(whole) * 100 <= whole,
            "{first} + {second} vs {whole}"
        );
        assert!(first_kv < whole_kv && first_kv + second_kv >= whole_kv);
        assert!(first_kv + second_kv <= whole_kv + 2);
    }

    /// The largest context is what the memory left after the weights, the fixed state and the
    /// reserve holds of KV, up to the model's own; quantized KV holds more; the memory needed at
    /// that context is within one position of the memory given.
    #[test]
    fn the_largest_context_fills_what_is_left() {
        let (dir, config) = fixture();
        let serving = Serving {
            rows: 1,
            ..Serving::default()
        };
        let base = memory_needed_at(
            &dir,
            &config,
            &Serving {
                max_ctx: Some(0),
                ..serving
            },
        )
        .unwrap();
        let per_token = crate::models::structure::kv_bytes_per_token(&config);
        let available = base + 1000 * per_token + per_token / 2;
        let fits = largest_context_that_fits(&dir, &config, &serving, available).unwrap();
        assert_eq!(fits, Some(1000));
        let needed = memory_needed_at(
            &dir,
            &config,
            &Serving {
                max_ctx: Some(1000),
                ..serving
            },
        )
        .unwrap();
        assert!(needed <= available && available - needed < per_token);
        let quantized = Serving {
            kv_bits: Some(8),
            ..serving
        };
        assert!(
            largest_context_that_fits(&dir, &config, &quantized, available).unwrap() > Some(1800)
        );
        assert_eq!(
            largest_context_that_fits(&dir, &config, &serving, base - 1).unwrap(),
            None
        );
        let reserved = Serving {
            reserved: 500 * per_token,
            ..serving
        };
        assert_eq!(
            largest_context_that_fits(&dir, &config, &reserved, available).unwrap(),
            Some(500)
        );
        assert_eq!(
            largest_context_that_fits(&dir, &config, &serving, u64::MAX / 2).unwrap(),
            Some(40960)
        );
    }

    /// A loaded draft head's KV counts per position beside the trunk's: the same memory then
    /// holds a shorter context, by the head's share (one layer beside the trunk's full ones;
    /// this fixture has one of those).
    #[test]
    fn a_loaded_draft_head_shortens_the_context_that_fits() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/releases/qwen3.6-27b");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let trunk = crate::models::structure::kv_bytes_per_token(&config);
        let head = crate::models::structure::draft_head_kv_bytes_per_token(&config, None);
        assert!(head > 0 && head <= trunk, "{head} {trunk}");
        let plain = Serving {
            rows: 1,
            max_ctx: Some(0),
            ..Serving::default()
        };
        let base = memory_needed_at(&dir, &config, &plain).unwrap();
        let available = base + 10_000 * (trunk + head);
        let with_head = Serving {
            draft_head: true,
            max_ctx: None,
            ..plain
        };
        let without = Serving {
            max_ctx: None,
            ..plain
        };
        assert_eq!(
            largest_context_that_fits(&dir, &config, &with_head, available).unwrap(),
            Some(10_000)
        );
        assert!(
            largest_context_that_fits(&dir, &config, &without, available).unwrap() > Some(10_000)
        );
    }

    /// The CPU backend has no recommended working set, so nothing is wired.
    #[test]
    fn no_wired_memory_on_the_cpu() {
        crate::runtime::eval(Vec::<&mlx_rs::Array>::new()).ok();
        assert_eq!(recommended_working_set(), None);
        assert_eq!(wire_memory(), None);
        // Nor a device memory apart from the system's.
        assert_eq!(working_memory(), total_memory());
    }
}

//! rMLX's stand-in for the crates.io `mlx-sys` 0.7.0: the same bindings mlx-rs expects, bound at
//! build time to the pinned mlx-c (mlx.pins) and loaded at run time (see `loader`), so binaries
//! need neither `LD_LIBRARY_PATH` nor a link-time MLX, and a missing library is a clear error.
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]
#![allow(rustdoc::all)]

mod loader;

pub use loader::{library_path, load, LoadError};

/// The MLX and mlx-c versions these bindings were generated for (mlx.pins).
pub const PINNED_MLX_VERSION: &str = env!("MLX_SYS_PINNED_MLX_VERSION");
pub const PINNED_MLX_C_VERSION: &str = env!("MLX_SYS_PINNED_MLX_C_VERSION");

/// IEEE half as 16 raw bits; mlx-rs reads `.0` (upstream bindgen emits this shape on aarch64).
#[repr(transparent)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Hash)]
pub struct float16_t(pub u16);

/// bfloat16 as 16 raw bits; mlx-rs treats it as a plain `u16`.
pub type bfloat16_t = u16;

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// mlx-rs seeds its `RandomState` from this Mach clock; off macOS we provide it ourselves.
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0)
}

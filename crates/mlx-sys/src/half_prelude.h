/* Bindgen prelude for non-aarch64 targets (crates/mlx-sys/build.rs): mlx/c/half.h declares the
 * half types on aarch64 only, so the four half-precision accessors vanish elsewhere. Declare the
 * types as 16-bit storage here; Rust defines them (src/lib.rs) the way mlx-rs reads them. */
#include <stdint.h>
typedef uint16_t float16_t;
typedef uint16_t bfloat16_t;
#define HAS_FLOAT16
#define HAS_BFLOAT16

/* Forced include for building mlx-c with GCC 12 / libstdc++ 12 on Linux (scripts/bootstrap-mlx).
 * libstdc++ 12 has no <format>: mlx-c's private/io.h only needs std::format, so map it to fmt.
 * mlx/c/half.h declares float16_t/bfloat16_t on aarch64 only; give x86-64 the same types so the
 * four half-precision accessors mlx-rs calls get compiled (they take pointers, so no ABI risk). */
#ifndef RMLX_MLX_C_COMPAT_H
#define RMLX_MLX_C_COMPAT_H
#ifdef __cplusplus
#if !__has_include(<format>)
#define FMT_HEADER_ONLY
#include <fmt/format.h>
namespace std {
using fmt::format;
}
#endif
#if !defined(__aarch64__)
#include <mlx/types/half_types.h>
typedef mlx::core::float16_t float16_t;
typedef mlx::core::bfloat16_t bfloat16_t;
#define HAS_FLOAT16
#define HAS_BFLOAT16
#endif
#endif
#endif

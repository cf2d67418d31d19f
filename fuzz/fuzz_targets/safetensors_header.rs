#![no_main]
//! `cargo fuzz run safetensors_header`: see rmlx_server::fuzzing::safetensors_header.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rmlx_server::fuzzing::safetensors_header(data));

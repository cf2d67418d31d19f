#![no_main]
//! `cargo fuzz run image_decode`: see rmlx_server::fuzzing::image_decode.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rmlx_server::fuzzing::image_decode(data));

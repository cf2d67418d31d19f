#![no_main]
//! `cargo fuzz run request_json`: see rmlx_server::fuzzing::request_json.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rmlx_server::fuzzing::request_json(data));

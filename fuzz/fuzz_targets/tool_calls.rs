#![no_main]
//! `cargo fuzz run tool_calls`: see rmlx_server::fuzzing::tool_calls.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rmlx_server::fuzzing::tool_calls(data));

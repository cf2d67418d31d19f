#![no_main]
//! `cargo fuzz run sse_event`: see rmlx_server::fuzzing::sse_event.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rmlx_server::fuzzing::sse_event(data));

#![no_main]
//! `cargo fuzz run chat_template`: see rmlx_server::fuzzing::chat_template.

libfuzzer_sys::fuzz_target!(|data: &[u8]| rmlx_server::fuzzing::chat_template(data));

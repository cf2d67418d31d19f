//! config.json keys of the supported releases that no part of the loader reads, one reason
//! each. The key-coverage test (tests/release_configs.rs) fails on any other unread key and on
//! any key here that the README of tests/fixtures/real-configs tables as a structural switch.

pub const IGNORED_CONFIG_KEYS: &[(&str, &str)] = &[
    ("architectures", "the transformers class name; `model_type` picks the family"),
];

//! Replays the fuzz corpus (fuzz/corpus/<target>/: the seeds and what `make fuzz` found) and
//! every crash input kept in fuzz/artifacts/<target>/ through the targets, so a fixed bug
//! stays fixed in an ordinary `cargo test`.

use std::path::Path;

use rmlx_server::fuzzing::TARGETS;

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap();
            (path.display().to_string(), bytes)
        })
        .collect()
}

#[test]
fn the_fuzz_corpus_and_every_crash_found_replay_clean() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for (name, target) in TARGETS {
        let corpus = inputs(&fuzz.join("corpus").join(name));
        assert!(
            corpus.len() >= 5,
            "{name}: the committed corpus has {} inputs (fuzz/seed_corpus.py writes the seeds)",
            corpus.len()
        );
        assert!(
            fuzz.join("fuzz_targets")
                .join(format!("{name}.rs"))
                .is_file(),
            "{name}: no fuzz target"
        );
        for (path, bytes) in corpus
            .into_iter()
            .chain(inputs(&fuzz.join("artifacts").join(name)))
        {
            let outcome = std::panic::catch_unwind(|| target(&bytes));
            assert!(outcome.is_ok(), "{name}: {path} panics");
        }
    }
}

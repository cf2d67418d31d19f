//! The disk prefix cache's format, keys and writer (`disk_cache`): a finished request's whole
//! blocks land under the model's fingerprint, once; each block holds exactly the KV a fresh
//! prefill computes for its positions, chained to its parent; another model, a changed config
//! or another KV storage is another fingerprint; a corrupt or truncated block does not decode.

mod common;

use std::path::{Path, PathBuf};

use common::{fixture, ids_array};
use rmlx_engine::{
    cache::KvStorage,
    disk_cache::{self, BLOCK_TOKENS},
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::GenerateParams,
    models::{load_model, Logits},
};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rmlx-disk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn blocks(dir: &Path) -> Vec<(PathBuf, std::time::SystemTime)> {
    let mut out: Vec<_> = walk(dir)
        .into_iter()
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .map(|path| {
            let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
            (path, modified)
        })
        .collect();
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|entry| match entry.path().is_dir() {
            true => walk(&entry.path()),
            false => vec![entry.path()],
        })
        .collect()
}

fn run(model: &str, disk: &Path, prompt: &[u32], kv_bits: Option<i32>) {
    let engine = Engine::start_with(EngineOptions {
        prefix_disk_dir: Some(disk.to_path_buf()),
        kv_bits,
        ..EngineOptions::default()
    })
    .unwrap();
    engine
        .submit(Request {
            model: fixture(model),
            prompt: Prompt::Ids(prompt.to_vec()),
            params: GenerateParams {
                max_tokens: 4,
                ignore_eos: true,
                ..GenerateParams::default()
            },
            ..Request::default()
        })
        .unwrap()
        .wait()
        .unwrap();
    // Dropping the engine finishes the queued writes.
}

#[test]
fn finished_prefixes_become_chained_blocks_once_per_fingerprint() {
    let disk = scratch("blocks");
    let model = "qwen3-tiny";
    let prompt = common::text_ids(600, 17, 10, 500);
    run(model, &disk, &prompt, None);
    let written = blocks(&disk);
    // 600 prompt + 3 fed answer tokens: two whole blocks.
    assert_eq!(written.len(), 2, "{written:?}");
    let fingerprint = disk_cache::fingerprint(&fixture(model), KvStorage::Dense).unwrap();
    assert!(written
        .iter()
        .all(|(path, _)| path.starts_with(disk.join(&fingerprint))));

    // Each block is the KV a fresh prefill computes for its positions, chained to its parent.
    let loaded = load_model(&fixture(model)).unwrap();
    let mut caches = loaded.model.new_cache(4096);
    loaded
        .model
        .forward(&ids_array(&prompt), &mut caches, Logits::Last)
        .unwrap();
    let hashes = disk_cache::chain(&prompt);
    for (index, hash) in hashes.iter().take(2).enumerate() {
        let path = disk
            .join(&fingerprint)
            .join(format!("{}.safetensors", disk_cache::hex(hash)));
        let block = disk_cache::decode_block(&std::fs::read(&path).unwrap()).unwrap();
        let ids: Vec<String> = prompt[index * BLOCK_TOKENS..(index + 1) * BLOCK_TOKENS]
            .iter()
            .map(u32::to_string)
            .collect();
        assert_eq!(block.metadata["tokens"], ids.join(","));
        let parent = index.checked_sub(1).map_or([0u8; 32], |at| hashes[at]);
        assert_eq!(block.metadata["parent"], disk_cache::hex(&parent));
        for (layer, cache) in caches.iter().enumerate() {
            let start = (index * BLOCK_TOKENS) as i32;
            let parts = cache
                .export_columns(start, start + BLOCK_TOKENS as i32)
                .unwrap()
                .unwrap();
            for (part, want) in parts.iter().enumerate() {
                let got = &block.tensors[&format!("layer.{layer}.part.{part}")];
                let equal = mlx_rs::ops::array_eq(got, want, None)
                    .unwrap()
                    .item_exact::<bool>();
                assert!(equal, "block {index} layer {layer} part {part}");
            }
        }
    }

    // The same conversation again writes nothing new.
    run(model, &disk, &prompt, None);
    assert_eq!(blocks(&disk), written);
    // Another KV storage and another model are other fingerprints.
    run(model, &disk, &prompt, Some(8));
    run("qwen3-tiny-4bit", &disk, &prompt, None);
    let folders: std::collections::BTreeSet<_> = blocks(&disk)
        .iter()
        .map(|(path, _)| path.parent().unwrap().to_path_buf())
        .collect();
    assert_eq!(folders.len(), 3, "{folders:?}");
    let _ = std::fs::remove_dir_all(&disk);
}

#[test]
fn a_changed_checkpoint_is_another_fingerprint_and_damage_does_not_decode() {
    let copy = scratch("model");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(fixture("qwen3-tiny")).unwrap().flatten() {
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let before = disk_cache::fingerprint(&copy, KvStorage::Dense).unwrap();
    assert_eq!(
        before,
        disk_cache::fingerprint(&copy, KvStorage::Dense).unwrap()
    );
    let config = copy.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"rms_norm_eps\"", " \"rms_norm_eps\""),
    )
    .unwrap();
    assert_ne!(
        before,
        disk_cache::fingerprint(&copy, KvStorage::Dense).unwrap()
    );

    let disk = scratch("damage");
    run(
        "qwen3-tiny",
        &disk,
        &common::text_ids(300, 5, 10, 500),
        None,
    );
    let (path, _) = blocks(&disk).remove(0);
    let bytes = std::fs::read(&path).unwrap();
    assert!(disk_cache::decode_block(&bytes).is_ok());
    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert!(disk_cache::decode_block(&flipped).is_err(), "a flipped bit");
    assert!(
        disk_cache::decode_block(&bytes[..bytes.len() / 2]).is_err(),
        "truncated"
    );
    assert!(disk_cache::decode_block(&bytes[..4]).is_err(), "no header");
    let _ = std::fs::remove_dir_all(&disk);
    let _ = std::fs::remove_dir_all(&copy);
}

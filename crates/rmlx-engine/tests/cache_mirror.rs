//! Rank 0's cache log (issue 33 c, `cache_mirror.rs`): every operation the engine applies to a
//! cache outside a forward, replayed on a follower's copies, leaves them equal to rank 0's:
//! positions, rows, paddings and the stored keys and values. Its own test binary, since the
//! log is the process's (one process never turns it on).

use mlx_rs::{ops, Array};
use rmlx_engine::{
    cache::{KvCache, KvStorage},
    cache_mirror::{self, Mirrors},
};

/// `len` positions of keys and values `[1, 2, len, 4]` whose values say where they came from.
fn chunk(batch: i32, len: i32, seed: f32) -> Array {
    let values: Vec<f32> = (0..batch * 2 * len * 4)
        .map(|i| seed + i as f32 / 1000.0)
        .collect();
    Array::from_slice(&values, &[batch, 2, len, 4])
}

/// A forward's writes, which a follower's own forward makes: both sides get the same.
fn write(rank0: &mut KvCache, copy: &mut KvCache, batch: i32, len: i32, seed: f32) {
    let keys = chunk(batch, len, seed);
    let values = ops::negative(&keys).unwrap();
    rank0.update_and_fetch(&keys, &values).unwrap();
    copy.update_and_fetch(&keys, &values).unwrap();
}

fn same(rank0: &KvCache, copy: &KvCache, what: &str) {
    assert_eq!(rank0.offset(), copy.offset(), "{what}: offset");
    assert_eq!(rank0.batch_size(), copy.batch_size(), "{what}: rows");
    assert_eq!(
        rank0.row_offsets(),
        copy.row_offsets(),
        "{what}: row offsets"
    );
    assert_eq!(rank0.rope_delta(), copy.rope_delta(), "{what}: rope delta");
    let (mine, theirs) = (rank0.state(), copy.state());
    assert_eq!(mine.len(), theirs.len(), "{what}: parts");
    for (a, b) in mine.iter().zip(theirs) {
        assert_eq!(a.shape(), b.shape(), "{what}: shapes");
        let equal = ops::array_eq(*a, b, false).unwrap().item_exact::<bool>();
        assert!(equal, "{what}: stored values differ");
    }
}

#[test]
fn a_follower_replaying_the_log_holds_what_rank_0_holds() {
    cache_mirror::enable();
    let mut copies = Mirrors::default();
    let sync = |copies: &mut Mirrors| copies.apply(&cache_mirror::take_log()).unwrap();
    let id = |cache: &KvCache| cache.mirror_id().expect("logged on rank 0");

    // Two requests' caches, one quantized; each prefilled by a "forward".
    let mut first = KvCache::new(4096);
    let mut second = KvCache::new(4096);
    second.set_storage(KvStorage::quantized(8).unwrap());
    let mut windowed = KvCache::windowed(4096, 16);
    sync(&mut copies);
    let ids = [id(&first), id(&second), id(&windowed)];
    let mut theirs = copies.take(&ids).unwrap();
    write(&mut first, &mut theirs[0], 1, 7, 1.0);
    write(&mut second, &mut theirs[1], 1, 3, 2.0);
    write(&mut windowed, &mut theirs[2], 1, 40, 3.0);
    copies.put_back(&ids, theirs);

    // The engine batches them (a clone kept for the prefix cache first), decodes two steps,
    // rolls back a draft, lets one row go and takes the other out as its own cache.
    let kept = first.clone();
    let mut batch = first.clone();
    batch.join(&second).unwrap();
    batch.set_rope_delta(5);
    sync(&mut copies);
    let batch_id = id(&batch);
    let mut theirs = copies.take(&[batch_id]).unwrap();
    write(&mut batch, &mut theirs[0], 2, 1, 4.0);
    copies.put_back(&[batch_id], theirs);
    batch.begin_speculative();
    sync(&mut copies);
    let mut theirs = copies.take(&[batch_id]).unwrap();
    write(&mut batch, &mut theirs[0], 2, 3, 5.0);
    copies.put_back(&[batch_id], theirs);
    batch.keep_written(3, &[1, 3]).unwrap();
    let alone = batch.row(1).unwrap();
    batch.retain_rows(&[0]).unwrap();
    windowed.truncate(38);
    let mut trimmed = kept.clone();
    trimmed.truncate(4);
    trimmed.compact().unwrap();
    trimmed.set_max_ctx(128);
    drop(second);
    sync(&mut copies);

    for (cache, what) in [
        (&batch, "the batch"),
        (&alone, "a row taken out"),
        (&kept, "the prefix cache's clone"),
        (&trimmed, "a trimmed clone"),
        (&windowed, "a windowed cache"),
        (&first, "the first request's"),
    ] {
        let theirs = copies.take(&[id(cache)]).unwrap();
        same(cache, &theirs[0], what);
        copies.put_back(&[id(cache)], theirs);
    }
    // A dropped cache is dropped there too: only the six above remain.
    assert_eq!(copies.len(), 6);
    // An operation on a cache the follower does not hold is an error, not a guess.
    assert!(copies.apply(&[4, 999_999, 1]).is_err());
}

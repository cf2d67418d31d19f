//! What of a finished request goes to the disk prefix cache, and the model's key there.

use std::path::Path;

use crate::{cache::KvCache, generate};

use super::thread_loop::EngineThread;

/// A finished sequence for the disk: its tokens as the cache keys them, its caches and the
/// tips to write (position, the caches holding that prefix).
pub(super) struct DiskOffer {
    tokens: Vec<u32>,
    caches: Vec<KvCache>,
    tips: Vec<(usize, Vec<KvCache>)>,
}

impl EngineThread {
    /// What of a finished sequence goes to the disk: its blocks, and tips where a later turn
    /// will want to start. The last message boundary (where the answer's opener begins: the
    /// turn's prompt less its generation prompt, which a client's re-rendered history always
    /// shares) for every model; the end too where only the full-length KV's tail is needed.
    /// Recurrent and windowed models have their state at the boundary only as a snapshot
    /// (taken during prefill), and a tip of theirs is large (a window or a recurrent state), so
    /// they keep one tip per turn.
    pub(super) fn disk_offer(
        &self,
        key: &Path,
        sequence: &generate::CachedSequence,
        tokens: Vec<u32>,
    ) -> DiskOffer {
        let resident = &self.models[key];
        let model = resident.loaded.model.as_ref();
        let opener = resident.tokenizer.token_id(model.message_opener());
        let end = tokens.len();
        let boundary = opener.and_then(|opener| (1..end).rev().find(|&at| tokens[at] == opener));
        let kv_only = model.rewindable() && !model.windowed();
        let mut tips = Vec::new();
        if kv_only {
            tips.extend(boundary.map(|at| (at, sequence.caches.clone())));
            tips.push((end, sequence.caches.clone()));
        } else {
            let at = boundary.or(sequence.snapshots.last().map(|s| s.tokens.len()));
            tips.extend(
                sequence
                    .snapshots
                    .iter()
                    .find(|snapshot| Some(snapshot.tokens.len()) == at)
                    .map(|snapshot| (snapshot.tokens.len(), snapshot.caches.clone())),
            );
        }
        DiskOffer {
            tokens,
            caches: sequence.caches.clone(),
            tips,
        }
    }

    /// Queues what the disk does not hold yet of a finished sequence (encoded here, written by
    /// the disk cache's thread).
    pub(super) fn offer_to_disk(&mut self, key: &Path, offer: DiskOffer) {
        let Some(fingerprint) = self.fingerprint(key) else {
            return;
        };
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        let tips: Vec<(usize, &[KvCache])> = offer
            .tips
            .iter()
            .map(|(at, caches)| (*at, &caches[..]))
            .collect();
        if let Err(error) = disk.offer(&fingerprint, &offer.tokens, &offer.caches, &tips) {
            eprintln!("rmlx: a prefix was not written to disk: {error}");
        }
    }

    /// The disk cache's key for a resident model (None without a disk cache, or when its folder
    /// cannot be read).
    pub(super) fn fingerprint(&mut self, key: &Path) -> Option<String> {
        self.disk.as_ref()?;
        if let Some(fingerprint) = self.fingerprints.get(key) {
            return Some(fingerprint.clone());
        }
        let model = self.models.get(key).map(|resident| &resident.loaded.model);
        let draft_head = model.is_some_and(|model| model.draft_head().is_some());
        let draft_model =
            model.and_then(|model| model.draft_model().map(|draft| draft.path.clone()));
        let fingerprint = crate::disk_cache::fingerprint_with_draft(
            key,
            self.kv_storage,
            draft_head,
            draft_model.as_deref(),
        )
        .ok()?;
        self.fingerprints
            .insert(key.to_path_buf(), fingerprint.clone());
        Some(fingerprint)
    }
}

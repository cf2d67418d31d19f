//! A separate draft model for speculative decoding (`--draft-model DIR`): a small model of the
//! same tokenizer (Qwen3-0.6B for Qwen3, Qwen3.5-0.8B for Qwen3.5 / 3.6, Gemma 4 E2B for Gemma 4)
//! proposes the next tokens and the target checks them in one forward. The pair is one
//! [`LanguageModel`] to the engine: its caches are the target's (trunk and head) followed by
//! the draft's, so batches, the prefix cache and the disk cache carry both; the target's own
//! calls see only the target's caches. `generate/draft.rs` runs the draft.
//! Reference: mlx-lm `generate.py` (`speculative_generate_step`: a draft model of the same
//! tokenizer, greedy drafts, its cache trimmed to the accepted tokens).

use std::path::{Path, PathBuf};

use mlx_rs::Array;

use crate::{
    cache::KvCache,
    error::{EngineError, Result},
};

use super::{DraftHead, LanguageModel, LoadedModel, Logits, VisionLanguageModel};

/// The draft model of a pair, and how many caches it keeps after the target's.
pub struct DraftModel {
    pub model: Box<dyn LanguageModel>,
    pub caches: usize,
    pub path: PathBuf,
}

/// A target model with its draft model.
struct WithDraftModel {
    target: Box<dyn LanguageModel>,
    /// How many caches the target keeps (trunk and head).
    target_caches: usize,
    draft: DraftModel,
}

impl LanguageModel for WithDraftModel {
    /// The target's forward over its own caches (callers may pass all, or only those).
    fn forward(&self, inputs: &Array, caches: &mut [KvCache], logits: Logits) -> Result<Array> {
        let own = self.target_caches.min(caches.len());
        self.target.forward(inputs, &mut caches[..own], logits)
    }

    fn num_layers(&self) -> usize {
        self.target.num_layers()
    }

    fn vocab_size(&self) -> usize {
        self.target.vocab_size()
    }

    fn max_position_embeddings(&self) -> usize {
        self.target.max_position_embeddings()
    }

    fn new_cache(&self, max_ctx: usize) -> Vec<KvCache> {
        let mut caches = self.target.new_cache(max_ctx);
        caches.extend(self.draft.model.new_cache(max_ctx));
        caches
    }

    fn rewindable(&self) -> bool {
        self.target.rewindable() && self.draft.model.rewindable()
    }

    fn windowed(&self) -> bool {
        self.target.windowed() || self.draft.model.windowed()
    }

    fn message_opener(&self) -> &'static str {
        self.target.message_opener()
    }

    fn as_vision(&self) -> Option<&dyn VisionLanguageModel> {
        self.target.as_vision()
    }

    fn draft_head(&self) -> Option<&dyn DraftHead> {
        self.target.draft_head()
    }

    fn draft_model(&self) -> Option<&DraftModel> {
        Some(&self.draft)
    }
}

/// How many of `caches` belong to `model` itself (trunk and head): a draft model's follow.
pub fn own_caches(model: &dyn LanguageModel, caches: usize) -> usize {
    caches - model.draft_model().map_or(0, |draft| draft.caches)
}

/// `target` with the model in `draft_dir` as its draft model. The two must tokenize alike
/// (the same vocabulary, id for id): drafts are token ids.
pub fn attach(target: LoadedModel, draft_dir: &Path) -> Result<LoadedModel> {
    check_tokenizers(&target.info.path, draft_dir)?;
    let draft = super::load_model(draft_dir)?;
    if draft.model.draft_model().is_some() {
        return Err(EngineError::InvalidRequest(
            "a draft model cannot have a draft model of its own".into(),
        ));
    }
    let caches = draft.model.new_cache(1).len();
    let target_caches = target.model.new_cache(1).len();
    let mut info = target.info;
    info.draft_model = Some(draft_dir.to_path_buf());
    info.weight_bytes += draft.info.weight_bytes;
    // The draft's caches ride beside the target's in every row.
    info.kv_bytes_per_token += draft.info.kv_bytes_per_token;
    Ok(LoadedModel {
        model: Box::new(WithDraftModel {
            target: target.model,
            target_caches,
            draft: DraftModel {
                model: draft.model,
                caches,
                path: draft_dir.to_path_buf(),
            },
        }),
        info,
    })
}

/// Refuses a draft model whose vocabulary differs from the target's (a token id must mean the
/// same text to both), naming both folders and a token that differs.
fn check_tokenizers(target: &Path, draft: &Path) -> Result<()> {
    let vocab = |dir: &Path| -> Result<std::collections::HashMap<String, u32>> {
        let file = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&file)
            .map_err(|error| EngineError::InvalidRequest(format!("{}: {error}", file.display())))?;
        Ok(tokenizer.get_vocab(true))
    };
    let (ours, theirs) = (vocab(target)?, vocab(draft)?);
    let differs = ours
        .iter()
        .find(|(token, id)| theirs.get(*token) != Some(id))
        .map(|(token, id)| (token.clone(), *id))
        .or_else(|| {
            theirs
                .iter()
                .find(|(token, _)| !ours.contains_key(*token))
                .map(|(token, id)| (token.clone(), *id))
        });
    match differs {
        None => Ok(()),
        Some((token, id)) => Err(EngineError::InvalidRequest(format!(
            "the draft model {} does not share the tokenizer of {} (token {token:?}, id {id}, differs): drafts are token ids, so both must tokenize alike",
            draft.display(),
            target.display()
        ))),
    }
}

//! A request's images: prepared for the vision tower, and keyed by their pixels for the prefix
//! cache.

use crate::{
    chat::ChatTokenizer,
    error::{EngineError, Result},
    models::LoadedModel,
};

use super::Request;

/// The prompt as the prefix cache keys it: each image's soft tokens (`spans`, in image order)
/// replaced by ids no vocabulary uses (the top bit set), drawn from a digest of the image's
/// size and pixels and the token's place in it. Two prompts then share a key prefix exactly as
/// far as their text and their images agree.
pub(super) fn image_key(
    prompt: &[u32],
    spans: &[std::ops::Range<usize>],
    images: &[image::RgbImage],
) -> Vec<u32> {
    use std::hash::{Hash, Hasher};
    let mut key = prompt.to_vec();
    for (span, image) in spans.iter().zip(images) {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (image.width(), image.height(), span.len()).hash(&mut hasher);
        image.as_raw().hash(&mut hasher);
        let digest = hasher.finish();
        let seed = (digest ^ (digest >> 32)) as u32;
        for (k, slot) in key[span.clone()].iter_mut().enumerate() {
            *slot = 0x8000_0000 | (seed.wrapping_add(k as u32) & 0x7fff_ffff);
        }
    }
    key
}

/// A reused prefix that ends inside an image block is cut back to the block's start: the block
/// is prefilled whole (its positions come from its opener, and its tokens may see each other).
pub(super) fn outside_blocks(
    mut reuse: crate::prefix_cache::Reuse,
    blocks: &[std::ops::Range<usize>],
) -> Option<crate::prefix_cache::Reuse> {
    let cut = reuse.cached_tokens;
    let Some(block) = blocks
        .iter()
        .find(|block| block.start < cut && cut < block.end)
    else {
        return Some(reuse);
    };
    let start = block.start as i32;
    if start == 0
        || !reuse
            .caches
            .iter()
            .all(|cache| cache.can_truncate_to(start))
    {
        return None;
    }
    reuse
        .caches
        .iter_mut()
        .for_each(|cache| cache.truncate(start));
    reuse.cached_tokens = block.start;
    Some(reuse)
}

/// A finished request's tokens as the prefix cache keys them (see [`image_key`]).
pub(super) fn image_keyed(mut tokens: Vec<u32>, key: Option<&[u32]>) -> Vec<u32> {
    if let Some(key) = key {
        let shared = key.len().min(tokens.len());
        tokens[..shared].copy_from_slice(&key[..shared]);
    }
    tokens
}

/// Images preprocessed and placed, waiting for the vision tower (which runs only after the
/// expanded prompt has been checked against the context).
pub(super) struct PendingImages<'a> {
    model: &'a dyn crate::models::VisionLanguageModel,
    input: crate::models::ImageInput,
    pub(super) spans: Vec<std::ops::Range<usize>>,
    pub(super) blocks: Vec<std::ops::Range<usize>>,
    /// When image work began: the request's TTFT counts from here.
    started: std::time::Instant,
}

impl<'a> PendingImages<'a> {
    /// Runs the vision tower on images `first..` (those before are in the reused KV); None when
    /// every image is.
    pub(super) fn encode(self, first: usize) -> Result<Option<crate::multimodal::ImagePrefill>> {
        if first >= self.blocks.len() {
            return Ok(None);
        }
        let input = match first {
            0 => self.input,
            _ => self.input.from_image(first),
        };
        Ok(Some(crate::multimodal::ImagePrefill {
            features: self.model.encode_images(&input)?,
            first_image: first,
            spans: self.spans,
            blocks: self.blocks,
            started: Some(self.started),
        }))
    }
}

/// Preprocesses the request's images for the model's family and expands their blocks in the
/// prompt (see [`crate::multimodal::place_images`]); the tower runs later.
pub(super) fn prepare_images<'a>(
    loaded: &'a LoadedModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: Vec<u32>,
    request: &Request,
    started: std::time::Instant,
) -> Result<(Vec<u32>, PendingImages<'a>)> {
    let model = loaded.model.as_vision().ok_or_else(|| {
        EngineError::InvalidRequest(format!(
            "this model ({}) has no vision: send text only",
            loaded.info.model_type
        ))
    })?;
    let placed = crate::multimodal::place_images(
        &loaded.info.path,
        &loaded.info.model_type,
        tokenizer,
        prompt_ids,
        &request.images,
        request.image_soft_tokens,
        true,
    )?;
    Ok((
        placed.ids,
        PendingImages {
            model,
            input: placed.input.expect("pixels were asked for"),
            spans: placed.spans,
            blocks: placed.blocks,
            started,
        },
    ))
}

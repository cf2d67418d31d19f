//! Prefill of prompts with images: the vision features of each image go in with the chunk
//! that holds its block, and chunk boundaries move to block edges so no image block (and no
//! bidirectional image span) is ever split. Reference: mlx-vlm `generate.py` (one prefill of
//! the whole embedded prompt), which chunked prefill must equal.

use std::{ops::Range, path::Path};

use image::RgbImage;
use mlx_rs::{ops::indexing::IndexOp, Array};

use crate::{
    cache::KvCache,
    chat::{
        images::{expand_image_placeholders, splice_image_block, ImageTokens},
        ChatTokenizer,
    },
    error::{EngineError, Result},
    models::{DraftHead, ImageInput, Logits, VisionFeatures, VisionLanguageModel},
    vision::preprocess::PreprocessError,
};

/// A prompt's images, ready for prefill.
pub struct ImagePrefill {
    /// The features of images `first_image..` (those before are in the reused KV cache).
    pub features: VisionFeatures,
    pub first_image: usize,
    /// Where each image's soft tokens sit in the prompt, in image order.
    pub spans: Vec<Range<usize>>,
    /// Each image's whole block (open token, soft tokens, close token): the unit chunking keeps
    /// together, since position ids are computed from the block's opener.
    pub blocks: Vec<Range<usize>>,
    /// When image work (preprocessing, the vision tower) began: TTFT counts from here, so an
    /// image's encoding is part of the time to first token. None: when prefill starts.
    pub started: Option<std::time::Instant>,
}

impl ImagePrefill {
    /// The features of the image blocks that lie within `piece` (None: it holds none). A
    /// piece never cuts a block ([`plan_chunks`]).
    pub fn features_within(&self, piece: Range<usize>) -> Option<VisionFeatures> {
        let (first, last) = self.blocks_within(piece)?;
        // Feature rows of image i start at row_starts[i]; the encoded ones at `first_image`.
        let mut row_starts = vec![0usize];
        for span in &self.spans {
            row_starts.push(row_starts.last().unwrap() + span.len());
        }
        let base = row_starts[self.first_image];
        let rows = (row_starts[first] - base) as i32..(row_starts[last + 1] - base) as i32;
        let (first, last) = (first - self.first_image, last - self.first_image);
        Some(VisionFeatures {
            embeds: self.features.embeds.index(rows.clone()),
            deepstack: self
                .features
                .deepstack
                .iter()
                .map(|layer| layer.index(rows.clone()))
                .collect(),
            grid_thw: self.features.grid_thw[first..=last].to_vec(),
        })
    }

    /// The first and last image blocks that lie within `piece` (None: it holds none).
    pub fn blocks_within(&self, piece: Range<usize>) -> Option<(usize, usize)> {
        let mut inside = (0..self.blocks.len())
            .filter(|&i| self.blocks[i].start >= piece.start && self.blocks[i].end <= piece.end);
        let first = inside.next()?;
        Some((first, inside.next_back().unwrap_or(first)))
    }

    /// The image block that a step taking `start..end` of a prompt would cut, if any.
    pub fn block_cut_at(&self, start: usize, end: usize) -> Option<Range<usize>> {
        self.blocks
            .iter()
            .find(|block| block.start < end && end < block.end && block.start >= start)
            .cloned()
    }
}

/// The features of a batch chunk: each row's (None for a row without images), joined in row
/// order as the models' batch forward takes them (`ImageScatter` over the rows' ids).
pub fn join_features(rows: Vec<Option<VisionFeatures>>) -> Result<Option<VisionFeatures>> {
    let present: Vec<VisionFeatures> = rows.into_iter().flatten().collect();
    let Some(first) = present.first() else {
        return Ok(None);
    };
    if present.len() == 1 {
        return Ok(present.into_iter().next());
    }
    let embeds: Vec<&Array> = present.iter().map(|f| &f.embeds).collect();
    let deepstack = (0..first.deepstack.len())
        .map(|layer| {
            let parts: Vec<&Array> = present.iter().map(|f| &f.deepstack[layer]).collect();
            Ok(mlx_rs::ops::concatenate(&parts, 0)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(VisionFeatures {
        embeds: mlx_rs::ops::concatenate(&embeds, 0)?,
        deepstack,
        grid_thw: present.iter().flat_map(|f| f.grid_thw.clone()).collect(),
    }))
}

/// Chunks of at most `chunk` positions covering `range`, except that a boundary that would
/// cut an image span moves back to the span's start (or, when the span starts the chunk, on
/// to its end: an image larger than a chunk goes in whole). A chunk also ends where an image
/// block does: the rotary delta an image leaves is then recorded at the block's end, so a
/// prefix-cache entry cut back after it keeps the right one.
pub fn plan_chunks(range: Range<usize>, chunk: usize, spans: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let mut end = (start + chunk.max(1)).min(range.end);
        if let Some(span) = spans
            .iter()
            .find(|span| span.start >= start && span.end > start && span.end < end)
        {
            end = span.end;
        }
        if let Some(span) = spans.iter().find(|span| span.start < end && end < span.end) {
            end = if span.start > start {
                span.start
            } else {
                span.end.min(range.end)
            };
        }
        chunks.push(start..end);
        start = end;
    }
    chunks
}

/// Prefills `prompt[range]` into `caches` (all but the last prompt token, as text prefill
/// does), evaluating the cache between chunks.
pub fn prefill(
    model: &dyn VisionLanguageModel,
    images: &ImagePrefill,
    prompt: &[u32],
    range: Range<usize>,
    chunk: usize,
    caches: &mut [KvCache],
) -> Result<()> {
    check_blocks(images, range.clone())?;
    for piece in plan_chunks(range, chunk, &images.blocks) {
        prefill_piece(model, None, images, prompt, piece, caches)?;
    }
    Ok(())
}

/// Refuses a prompt whose last image block reaches past `range` (the prefilled part).
pub fn check_blocks(images: &ImagePrefill, range: Range<usize>) -> Result<()> {
    if let Some(span) = images.blocks.iter().find(|block| block.end > range.end) {
        return Err(EngineError::InvalidRequest(format!(
            "an image block ends the prompt (tokens {span:?}); text must follow it"
        )));
    }
    Ok(())
}

/// One piece of [`plan_chunks`] with the features of the image blocks inside it, then the
/// caches evaluated.
/// `primed`: the model's draft head, the token after each of the piece's, and whether the head
/// pairs a zero hidden state first (see `DraftHead::prime`).
pub fn prefill_piece(
    model: &dyn VisionLanguageModel,
    primed: Option<(&dyn DraftHead, &Array)>,
    images: &ImagePrefill,
    prompt: &[u32],
    piece: Range<usize>,
    caches: &mut [KvCache],
) -> Result<()> {
    let ids: Vec<i32> = prompt[piece.clone()].iter().map(|&id| id as i32).collect();
    let input = Array::from_slice(&ids, &[1, ids.len() as i32]);
    match images.features_within(piece) {
        Some(features) => match primed {
            Some((head, next)) => head.prime(&input, Some(&features), next, caches)?,
            None => {
                model.forward_with_images(&input, Some(&features), caches, Logits::None)?;
            }
        },
        None => match primed {
            Some((head, next)) => head.prime(&input, None, next, caches)?,
            None => {
                model.forward(&input, caches, Logits::None)?;
            }
        },
    }
    crate::runtime::eval(caches.iter().flat_map(|cache| cache.state()))?;
    Ok(())
}

/// A prompt with its images' blocks expanded, and (when asked for) their pixels.
pub struct PlacedImages {
    pub ids: Vec<u32>,
    /// Each image's soft tokens, in image order.
    pub spans: Vec<Range<usize>>,
    /// Each image's whole block (frame tokens included), the unit chunking keeps together.
    pub blocks: Vec<Range<usize>>,
    pub input: Option<ImageInput>,
}

fn preprocessor_error(dir: &Path, error: &dyn std::fmt::Display) -> EngineError {
    EngineError::Config {
        path: dir.join("preprocessor_config.json"),
        message: error.to_string(),
    }
}

/// Preprocesses `images` for the family of the checkpoint in `dir` and expands their blocks in
/// `prompt_ids`: where the template put placeholders, else by the one splice fallback (final
/// user turn, else after BOS). With `pixels` false only the token counts are computed (what
/// `count_tokens` needs), without resizing anything.
pub fn place_images(
    dir: &Path,
    model_type: &str,
    tokenizer: &ChatTokenizer,
    prompt_ids: Vec<u32>,
    images: &[RgbImage],
    soft_tokens: Option<usize>,
    pixels: bool,
) -> Result<PlacedImages> {
    let bad_image = |index: usize, error: &PreprocessError| match error {
        PreprocessError::OutOfMemory { .. } => {
            EngineError::OutOfMemory(format!("image {}: {error}", index + 1))
        }
        _ => EngineError::InvalidRequest(format!("image {}: {error}", index + 1)),
    };
    let mut rows = Vec::new();
    let mut grids = Vec::new();
    let mut counts = Vec::new();
    let mut row_len = 0;
    // Each family's preprocessing, image tokens and the turn opener the splice fallback uses.
    let (names, opener, bos) = match model_type {
        // Qwen3.5 / 3.6 use Qwen3-VL's processor and image block unchanged.
        "qwen3_vl" | "qwen3_vl_moe" | "qwen3_5" | "qwen3_5_moe" => {
            let config = crate::vision::preprocess::QwenPreprocessorConfig::load(dir)
                .map_err(|error| preprocessor_error(dir, &error))?;
            for (index, image) in images.iter().enumerate() {
                if !pixels {
                    let (h, w) = (image.height() as usize, image.width() as usize);
                    let count = config.num_image_tokens(h, w);
                    counts.push(count.map_err(|error| bad_image(index, &error))?);
                    continue;
                }
                let processed = config
                    .preprocess(image)
                    .map_err(|error| bad_image(index, &error))?;
                row_len = processed.row_len;
                // The first image's rows move; later ones are copied into room reserved first.
                if rows.is_empty() {
                    rows = processed.pixel_values;
                } else {
                    crate::error::try_grow(&mut rows, processed.pixel_values.len(), "image rows")?;
                    rows.extend_from_slice(&processed.pixel_values);
                }
                let [t, h, w] = processed.grid_thw;
                grids.push([t as i32, h as i32, w as i32]);
                counts.push(processed.num_tokens);
            }
            (
                ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                "<|im_start|>user\n",
                None,
            )
        }
        "gemma4" => {
            let config = crate::vision::preprocess::Gemma4ImageConfig::load(dir)
                .map_err(|error| preprocessor_error(dir, &error))?;
            for (index, image) in images.iter().enumerate() {
                if !pixels {
                    let (h, w) = (image.height() as usize, image.width() as usize);
                    let count = config.num_soft_tokens(h, w, soft_tokens);
                    counts.push(count.map_err(|error| bad_image(index, &error))?);
                    continue;
                }
                let processed = config
                    .preprocess(image, soft_tokens)
                    .map_err(|error| bad_image(index, &error))?;
                row_len = 3 * config.patch_size * config.patch_size;
                processed
                    .patch_rows(config.patch_size, &mut rows)
                    .map_err(|error| bad_image(index, &error))?;
                let [h, w] = processed.patch_grid_hw;
                grids.push([1, h as i32, w as i32]);
                counts.push(processed.num_soft_tokens);
            }
            (
                ["<|image>", "<|image|>", "<image|>"],
                "<|turn>user\n",
                tokenizer.token_id("<bos>"),
            )
        }
        other => {
            return Err(EngineError::InvalidRequest(format!(
                "image input for {other} is not supported yet"
            )))
        }
    };
    let token = |text: &str| tokenizer.token_id(text);
    let tokens = ImageTokens {
        open: token(names[0]),
        pad: token(names[1]).ok_or_else(|| {
            EngineError::InvalidRequest(format!("the tokenizer has no {} token", names[1]))
        })?,
        close: token(names[2]),
    };
    let placeholders = prompt_ids.iter().filter(|&&id| id == tokens.pad).count();
    let placed = if placeholders > 0 {
        expand_image_placeholders(&prompt_ids, &tokens, &counts)
    } else {
        let opener = tokenizer.encode(opener, false)?;
        splice_image_block(&prompt_ids, &tokens, &counts, &opener, bos)
    }
    .map_err(|error| EngineError::InvalidRequest(error.to_string()))?;
    // Widen each span by its frame tokens: chunking keeps whole blocks together.
    let blocks = placed
        .image_spans
        .iter()
        .map(|span| {
            let framed = |at: Option<usize>, id: Option<u32>| {
                at.and_then(|at| placed.ids.get(at)).copied() == id && id.is_some()
            };
            let start = span.start - usize::from(framed(span.start.checked_sub(1), tokens.open));
            let end = span.end + usize::from(framed(Some(span.end), tokens.close));
            start..end
        })
        .collect();
    let input = match pixels {
        true => {
            let patches = (rows.len() / row_len.max(1)) as i32;
            Some(ImageInput {
                pixel_values: crate::nn::upload(&rows, &[patches, row_len as i32])?,
                grid_thw: grids,
            })
        }
        false => None,
    };
    Ok(PlacedImages {
        ids: placed.ids,
        spans: placed.image_spans,
        blocks,
        input,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_never_cut_an_image() {
        let spans = [5..15, 20..22];
        let chunks = plan_chunks(0..30, 7, &spans);
        assert_eq!(chunks, vec![0..5, 5..15, 15..22, 22..29, 29..30]);
        // Every position once, in order, and no span split.
        assert_eq!(chunks.iter().map(|c| c.len()).sum::<usize>(), 30);
        for span in &spans {
            assert!(chunks
                .iter()
                .any(|c| c.start <= span.start && span.end <= c.end));
        }
        assert_eq!(plan_chunks(3..10, 1, &[]).len(), 7);
        // A chunk ends where an image block ends.
        assert_eq!(plan_chunks(0..30, 100, &spans), vec![0..15, 15..22, 22..30]);
    }
}

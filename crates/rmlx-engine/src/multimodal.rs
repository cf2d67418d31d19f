//! Prefill of prompts with images: the vision features of each image go in with the chunk
//! that holds its block, and chunk boundaries move to block edges so no image block (and no
//! bidirectional image span) is ever split. Reference: mlx-vlm `generate.py` (one prefill of
//! the whole embedded prompt), which chunked prefill must equal.

use std::ops::Range;

use mlx_rs::{ops::indexing::IndexOp, transforms, Array};

use crate::{
    cache::KvCache,
    error::{EngineError, Result},
    models::{Logits, VisionFeatures, VisionLanguageModel},
};

/// A prompt's images, ready for prefill.
pub struct ImagePrefill<'a> {
    pub model: &'a dyn VisionLanguageModel,
    pub features: VisionFeatures,
    /// Where each image's soft tokens sit in the prompt, in image order.
    pub spans: Vec<Range<usize>>,
    /// Each image's whole block (open token, soft tokens, close token): the unit chunking keeps
    /// together, since position ids are computed from the block's opener.
    pub blocks: Vec<Range<usize>>,
}

/// Chunks of at most `chunk` positions covering `range`, except that a boundary that would
/// cut an image span moves back to the span's start (or, when the span starts the chunk, on
/// to its end: an image larger than a chunk goes in whole).
pub fn plan_chunks(range: Range<usize>, chunk: usize, spans: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let mut end = (start + chunk.max(1)).min(range.end);
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
    images: &ImagePrefill,
    prompt: &[u32],
    range: Range<usize>,
    chunk: usize,
    caches: &mut [KvCache],
) -> Result<()> {
    if let Some(span) = images.blocks.iter().find(|block| block.end > range.end) {
        return Err(EngineError::InvalidRequest(format!(
            "an image block ends the prompt (tokens {span:?}); text must follow it"
        )));
    }
    // Feature rows of image i start at row_starts[i].
    let mut row_starts = vec![0usize];
    for span in &images.spans {
        row_starts.push(row_starts.last().unwrap() + span.len());
    }
    for piece in plan_chunks(range, chunk, &images.blocks) {
        let inside: Vec<usize> = (0..images.blocks.len())
            .filter(|&i| images.blocks[i].start >= piece.start && images.blocks[i].end <= piece.end)
            .collect();
        let ids: Vec<i32> = prompt[piece.clone()].iter().map(|&id| id as i32).collect();
        let input = Array::from_slice(&ids, &[1, ids.len() as i32]);
        match (inside.first(), inside.last()) {
            (Some(&first), Some(&last)) => {
                let rows = row_starts[first] as i32..row_starts[last + 1] as i32;
                let features = VisionFeatures {
                    embeds: images.features.embeds.index(rows.clone()),
                    deepstack: images
                        .features
                        .deepstack
                        .iter()
                        .map(|layer| layer.index(rows.clone()))
                        .collect(),
                    grid_thw: images.features.grid_thw[first..=last].to_vec(),
                };
                images
                    .model
                    .forward_with_images(&input, Some(&features), caches, Logits::Last)?;
            }
            _ => {
                images.model.forward(&input, caches, Logits::Last)?;
            }
        }
        transforms::eval(caches.iter().flat_map(|cache| cache.state()))?;
    }
    Ok(())
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
        assert_eq!(plan_chunks(0..30, 100, &spans), vec![0..30]);
    }
}

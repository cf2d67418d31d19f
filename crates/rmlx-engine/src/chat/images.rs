//! Where image tokens go in a prompt. An image stays where its content part is: the chat
//! template emits the family's placeholder there and it is expanded in place to the image's
//! block (open, N soft tokens, close), as HF processors / mlx-vlm do. Images without a
//! position (CLI `--image`, templates that emit nothing) go through one shared
//! [`splice_image_block`]: inside the final user turn right after its opener, else after BOS.
//! (rMLX 0.2.4 put them outside the user turn, and Gemma then ignored them.)
//! Reference: transformers `Qwen2VLProcessor.__call__` / `Gemma3Processor` placeholder
//! expansion; mlx-vlm `prompt_utils.py`.

use std::ops::Range;

/// A family's image token ids. `pad` is both the template's placeholder and the soft token
/// repeated per image feature; `open`/`close` frame the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageTokens {
    pub open: Option<u32>,
    pub pad: u32,
    pub close: Option<u32>,
}

/// A prompt with its images' blocks expanded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandedPrompt {
    pub ids: Vec<u32>,
    /// Positions of each image's soft tokens, in image order (where features are scattered;
    /// also the spans prefill chunks must not split).
    pub image_spans: Vec<Range<usize>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImagePlacementError {
    #[error("the prompt has {placeholders} image placeholders but {images} images were given")]
    CountMismatch { placeholders: usize, images: usize },
    #[error("image {index} has no soft tokens")]
    EmptyImage { index: usize },
}

/// Expands each placeholder, in order, into `soft_tokens[i]` pads, adding the open/close
/// tokens unless the template already wrote them around the placeholder (Qwen does; Gemma 4
/// writes the bare placeholder).
pub fn expand_image_placeholders(
    ids: &[u32],
    tokens: &ImageTokens,
    soft_tokens: &[usize],
) -> Result<ExpandedPrompt, ImagePlacementError> {
    let placeholders = ids.iter().filter(|&&id| id == tokens.pad).count();
    if placeholders != soft_tokens.len() {
        return Err(ImagePlacementError::CountMismatch {
            placeholders,
            images: soft_tokens.len(),
        });
    }
    if let Some(index) = soft_tokens.iter().position(|&count| count == 0) {
        return Err(ImagePlacementError::EmptyImage { index });
    }
    let mut out = Vec::with_capacity(ids.len() + soft_tokens.iter().sum::<usize>());
    let mut spans = Vec::with_capacity(soft_tokens.len());
    let mut image = 0;
    for (position, &id) in ids.iter().enumerate() {
        if id != tokens.pad {
            out.push(id);
            continue;
        }
        let framed_before = position > 0 && Some(ids[position - 1]) == tokens.open;
        let framed_after = ids.get(position + 1).copied() == tokens.close && tokens.close.is_some();
        if let (false, Some(open)) = (framed_before, tokens.open) {
            out.push(open);
        }
        let start = out.len();
        out.extend(std::iter::repeat_n(tokens.pad, soft_tokens[image]));
        spans.push(start..out.len());
        if let (false, Some(close)) = (framed_after, tokens.close) {
            out.push(close);
        }
        image += 1;
    }
    Ok(ExpandedPrompt {
        ids: out,
        image_spans: spans,
    })
}

/// The one fallback for images with no place in the template: their blocks go right after the
/// opener of the final user turn (`user_opener`, e.g. the ids of `<|im_start|>user\n`), else
/// right after a leading BOS, else first. Text-only prompts (no blocks) are returned as is.
pub fn splice_image_block(
    ids: &[u32],
    tokens: &ImageTokens,
    soft_tokens: &[usize],
    user_opener: &[u32],
    bos: Option<u32>,
) -> Result<ExpandedPrompt, ImagePlacementError> {
    if soft_tokens.is_empty() {
        return Ok(ExpandedPrompt {
            ids: ids.to_vec(),
            image_spans: Vec::new(),
        });
    }
    // Placeholders already in the prompt belong to the template path, not here.
    let placed = ids.iter().filter(|&&id| id == tokens.pad).count();
    if placed > 0 {
        return Err(ImagePlacementError::CountMismatch {
            placeholders: placed,
            images: soft_tokens.len(),
        });
    }
    let at = last_occurrence(ids, user_opener)
        .map(|start| start + user_opener.len())
        .or_else(|| (bos.is_some() && ids.first().copied() == bos).then_some(1))
        .unwrap_or(0);
    // Build placeholders there and let the one expansion path do the rest.
    let mut with_placeholders = ids[..at].to_vec();
    with_placeholders.extend(std::iter::repeat_n(tokens.pad, soft_tokens.len()));
    with_placeholders.extend_from_slice(&ids[at..]);
    expand_image_placeholders(&with_placeholders, tokens, soft_tokens)
}

fn last_occurrence(haystack: &[u32], needle: &[u32]) -> Option<usize> {
    if needle.is_empty() || needle.len() > haystack.len() {
        return None;
    }
    (0..=haystack.len() - needle.len())
        .rev()
        .find(|&start| haystack[start..start + needle.len()] == *needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN: ImageTokens = ImageTokens {
        open: Some(100),
        pad: 101,
        close: Some(102),
    };
    const GEMMA: ImageTokens = ImageTokens {
        open: Some(200),
        pad: 201,
        close: Some(202),
    };

    #[test]
    fn placeholders_expand_in_place_with_or_without_a_template_frame() {
        let qwen =
            expand_image_placeholders(&[1, 100, 101, 102, 7, 100, 101, 102, 8], &QWEN, &[3, 2])
                .unwrap();
        assert_eq!(
            qwen.ids,
            vec![1, 100, 101, 101, 101, 102, 7, 100, 101, 101, 102, 8]
        );
        assert_eq!(qwen.image_spans, vec![2..5, 8..10]);
        let gemma = expand_image_placeholders(&[1, 5, 201, 6], &GEMMA, &[2]).unwrap();
        assert_eq!(gemma.ids, vec![1, 5, 200, 201, 201, 202, 6]);
        assert_eq!(gemma.image_spans, vec![3..5]);
        assert_eq!(
            expand_image_placeholders(&[1, 101], &QWEN, &[2, 2]),
            Err(ImagePlacementError::CountMismatch {
                placeholders: 1,
                images: 2
            })
        );
        assert_eq!(
            expand_image_placeholders(&[101], &QWEN, &[0]),
            Err(ImagePlacementError::EmptyImage { index: 0 })
        );
    }

    #[test]
    fn splice_goes_inside_the_final_user_turn_else_after_bos() {
        let opener = [50, 51];
        // system, user, assistant, user: the block lands after the last user opener.
        let prompt = [9, 50, 51, 1, 60, 50, 51, 2, 3];
        let spliced = splice_image_block(&prompt, &QWEN, &[2], &opener, Some(9)).unwrap();
        assert_eq!(
            spliced.ids,
            vec![9, 50, 51, 1, 60, 50, 51, 100, 101, 101, 102, 2, 3]
        );
        assert_eq!(spliced.image_spans, vec![8..10]);
        // No user opener: right after BOS; no BOS either: first.
        let spliced = splice_image_block(&[9, 4, 5], &GEMMA, &[1, 1], &opener, Some(9)).unwrap();
        assert_eq!(spliced.ids, vec![9, 200, 201, 202, 200, 201, 202, 4, 5]);
        let spliced = splice_image_block(&[4, 5], &GEMMA, &[1], &opener, Some(9)).unwrap();
        assert_eq!(spliced.ids, vec![200, 201, 202, 4, 5]);
        // Text-only prompts are untouched.
        assert_eq!(
            splice_image_block(&prompt, &QWEN, &[], &opener, Some(9))
                .unwrap()
                .ids,
            prompt.to_vec()
        );
    }
}

//! Streaming detokenizer after mlx-lm `tokenizer_utils.NaiveStreamingDetokenizer` and
//! `tokenizers::DecodeStream`: decode a short window of ids, emit what it adds past the window's
//! already-emitted prefix, and hold back output while it ends in a partial character.

use std::sync::Arc;

use tokenizers::Tokenizer;

use super::ChatTokenizer;

/// After this many held tokens, a trailing U+FFFD is a real invalid byte sequence, not a character
/// still being spelled out (a UTF-8 character has at most 4 bytes, each token adds at least one
/// unless it decodes to nothing): emit it rather than grow the window without bound.
const MAX_PENDING: usize = 16;

/// Turns generated ids into text chunks. Pushing every id and then calling [`finish`] yields, in
/// total, exactly `decode(all ids)`; no chunk ends in a half-decoded character.
///
/// [`finish`]: StreamDecoder::finish
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// The ids of the last emitted chunk (context), then the ids not emitted yet (pending).
    window: Vec<u32>,
    context_len: usize,
    /// `decode(window[..context_len])`: what the window's text starts with.
    context_text: String,
}

impl std::fmt::Debug for StreamDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDecoder")
            .field("window", &self.window)
            .field("context_len", &self.context_len)
            .finish()
    }
}

impl StreamDecoder {
    /// Keeps special tokens in the text, as mlx-lm's detokenizers do (EOS never reaches them).
    pub fn new(tokenizer: &ChatTokenizer) -> Self {
        Self::with_skip_special_tokens(tokenizer, false)
    }

    pub fn with_skip_special_tokens(tokenizer: &ChatTokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer: Arc::clone(tokenizer.inner()),
            skip_special_tokens,
            window: Vec::new(),
            context_len: 0,
            context_text: String::new(),
        }
    }

    /// Adds one id and returns the text it completes (often empty while a character is split).
    pub fn push(&mut self, id: u32) -> String {
        self.window.push(id);
        let text = self.decode(&self.window);
        let pending = self.window.len() - self.context_len;
        // Byte-level BPE pieces can end mid-character; the lossy decode then ends in U+FFFD.
        if text.ends_with('\u{FFFD}') && pending < MAX_PENDING {
            return String::new();
        }
        self.emit(text)
    }

    /// Flushes held ids (a trailing partial character comes out as U+FFFD, as `decode` gives it).
    pub fn finish(&mut self) -> String {
        if self.window.len() == self.context_len {
            return String::new();
        }
        let text = self.decode(&self.window);
        let out = self.emit(text);
        self.window.clear();
        self.context_len = 0;
        self.context_text.clear();
        out
    }

    /// Emits `text` past the context and makes the pending ids the next context. Keeping one
    /// chunk of context is what lets decoders that strip a leading space (Metaspace) or clean up
    /// spacing see the token before.
    fn emit(&mut self, text: String) -> String {
        let new = match text.strip_prefix(self.context_text.as_str()) {
            Some(rest) => rest.to_owned(),
            // A decoder rewrote text across the boundary; what is out is out, so emit from the
            // first difference.
            None => {
                let common = common_prefix_len(&text, &self.context_text);
                text[common..].to_owned()
            }
        };
        self.window.drain(..self.context_len);
        self.context_len = self.window.len();
        self.context_text = self.decode(&self.window);
        new
    }

    /// Decoder errors only come from malformed tokenizer files; they must not kill a stream.
    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .unwrap_or_default()
    }
}

/// Length in bytes of the common prefix of `a` and `b`, on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

#[cfg(test)]
mod tests {
    use crate::chat::test_support::fixture;
    use crate::chat::ChatTokenizer;

    fn stream(tok: &ChatTokenizer, ids: &[u32], skip: bool) -> Vec<String> {
        let mut decoder = tok.stream_decoder(skip);
        let mut chunks: Vec<String> = ids.iter().map(|&id| decoder.push(id)).collect();
        chunks.push(decoder.finish());
        chunks
    }

    #[test]
    fn non_ascii_text_streams_without_replacement_chars() {
        let tok = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
        let text =
            "Café, naïve, 東京 and 🙂! Привет, 서울 — ¿Qué tal? Zürich 日本語のテキスト 🎉🙂";
        let ids = tok.encode(text, false).unwrap();
        // The test only means something if some single token is half a character.
        let split = ids
            .iter()
            .filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}'))
            .count();
        assert!(split > 0, "no token splits a character");
        let chunks = stream(&tok, &ids, false);
        for chunk in &chunks {
            assert!(!chunk.contains('\u{FFFD}'), "chunk {chunk:?}");
        }
        assert_eq!(chunks.concat(), text);
        assert_eq!(chunks.concat(), tok.decode(&ids, false).unwrap());
        // ...and the decoder really held some of them back.
        assert!(chunks[..ids.len()].iter().any(String::is_empty));
    }

    #[test]
    fn golden_greedy_ids_stream_like_full_decode() {
        // These include ids past the tokenizer (1013) and genuinely invalid byte sequences.
        for dir in ["qwen3-tiny", "qwen3-tiny-4bit", "qwen3-tiny-mxfp4"] {
            let tok = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
            let golden: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(fixture(dir).join("golden.json")).unwrap(),
            )
            .unwrap();
            for case in golden["cases"].as_array().unwrap() {
                let ids: Vec<u32> = case["greedy_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect();
                let mut all = ids.clone();
                all.extend(tok.encode("<|im_end|>東", false).unwrap());
                for skip in [false, true] {
                    let chunks = stream(&tok, &all, skip);
                    assert_eq!(
                        chunks.concat(),
                        tok.decode(&all, skip).unwrap(),
                        "{dir} {skip}"
                    );
                }
                let chunks = stream(&tok, &ids, false);
                assert_eq!(chunks.concat(), case["greedy_text"].as_str().unwrap());
            }
        }
    }

    #[test]
    fn window_stays_bounded() {
        let tok = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
        let ids = tok
            .encode(&"naïve 東京 story about a fox. ".repeat(40), false)
            .unwrap();
        assert!(ids.len() > 300);
        let mut decoder = tok.stream_decoder(false);
        let mut longest = 0;
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&decoder.push(id));
            longest = longest.max(decoder.window.len());
        }
        out.push_str(&decoder.finish());
        assert_eq!(out, tok.decode(&ids, false).unwrap());
        assert!(longest <= 8, "window grew to {longest}");
    }

    #[test]
    fn finish_flushes_a_dangling_partial_character() {
        let tok = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
        let ids = tok.encode("東京", false).unwrap();
        let mut decoder = tok.stream_decoder(false);
        assert_eq!(decoder.push(ids[0]), "");
        let tail = decoder.finish();
        assert_eq!(tail, tok.decode(&ids[..1], false).unwrap());
        assert!(tail.contains('\u{FFFD}'));
        assert_eq!(decoder.finish(), "");
    }
}

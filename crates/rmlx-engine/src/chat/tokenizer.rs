//! A model dir's tokenizer plus chat template, after HF `PreTrainedTokenizerBase`
//! (`apply_chat_template`, `encode`, `decode`) and mlx-lm `TokenizerWrapper` (EOS id set).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use tokenizers::Tokenizer;

use super::config::{self, TokenizerConfig};
use super::template::{ChatTemplate, TemplateOptions};
use super::{ChatError, StreamDecoder};

/// Tokenizer, chat template, special tokens and stop ids of one model directory.
#[derive(Debug)]
pub struct ChatTokenizer {
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    config: TokenizerConfig,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    dir: PathBuf,
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, the chat template and the special-token/EOS settings of `dir`.
    /// Only `tokenizer.json` is required; a dir without a template can still encode plain text.
    pub fn from_dir(dir: &Path) -> Result<Self, ChatError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ChatError::MissingFile { path: path.clone() }
            } else {
                ChatError::Io {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|err| {
            // Tell "not JSON at all" apart from "JSON but not a tokenizer we understand".
            match err.downcast::<serde_json::Error>() {
                Ok(source) if !source.is_data() => ChatError::Json {
                    path: path.clone(),
                    source: *source,
                },
                Ok(other) => ChatError::Tokenizer {
                    path: path.clone(),
                    message: other.to_string(),
                },
                Err(other) => ChatError::Tokenizer {
                    path: path.clone(),
                    message: other.to_string(),
                },
            }
        })?;

        let mut config = config::load(dir)?;
        let template = config
            .template
            .take()
            .map(ChatTemplate::compile)
            .transpose()?;

        let bos_token_id = config
            .special("bos_token")
            .and_then(|t| tokenizer.token_to_id(t));
        // Union, config eos first: HF stops on eos_token, mlx-lm adds generation_config's and
        // config.json's ids (Qwen3 lists <|endoftext|> there too).
        let mut eos_token_ids = Vec::new();
        let config_eos = config
            .special("eos_token")
            .and_then(|t| tokenizer.token_to_id(t));
        for id in config_eos
            .into_iter()
            .chain(config.extra_eos_ids.iter().copied())
        {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            template,
            config,
            bos_token_id,
            eos_token_ids,
            dir: dir.to_owned(),
        })
    }

    /// `apply_chat_template(messages, tokenize=False, ...)`.
    pub fn render(
        &self,
        messages: &[Value],
        options: &TemplateOptions,
    ) -> Result<String, ChatError> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| ChatError::NoChatTemplate {
                dir: self.dir.clone(),
            })?;
        template.render(messages, options, &self.config.special_tokens)
    }

    /// The rendered prompt and its ids; like HF, the template already wrote any BOS, so no special
    /// tokens are added.
    pub fn encode_chat(
        &self,
        messages: &[Value],
        options: &TemplateOptions,
    ) -> Result<(String, Vec<u32>), ChatError> {
        self.encode_chat_prefilled(messages, options, "")
    }

    /// `encode_chat` with `prefill` appended to the rendered prompt (the start of the assistant's
    /// answer, after the generation prompt); the joined text is encoded as one string.
    pub fn encode_chat_prefilled(
        &self,
        messages: &[Value],
        options: &TemplateOptions,
        prefill: &str,
    ) -> Result<(String, Vec<u32>), ChatError> {
        let mut prompt = self.render(messages, options)?;
        prompt.push_str(prefill);
        let ids = self.encode(&prompt, false)?;
        Ok((prompt, ids))
    }

    /// A raw prompt without a template, as mlx-lm `generate` encodes it: special tokens (BOS) are
    /// added unless the prompt already starts with the BOS text.
    pub fn encode_plain(&self, prompt: &str) -> Result<Vec<u32>, ChatError> {
        let bos = self.config.special("bos_token");
        let add_special = bos.is_none_or(|b| !prompt.starts_with(b));
        let mut ids = self.encode(prompt, add_special)?;
        // Some tokenizer.json files lack the BOS post-processor that add_bos_token asks for.
        if add_special && self.config.add_bos_token == Some(true) {
            if let Some(bos_id) = self.bos_token_id {
                if ids.first() != Some(&bos_id) {
                    ids.insert(0, bos_id);
                }
            }
        }
        Ok(ids)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ChatError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ChatError::Codec {
                op: "encode",
                message: e.to_string(),
            })
    }

    /// Ids the tokenizer does not know (e.g. padded vocab rows of the model) are dropped, as HF
    /// does; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ChatError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| ChatError::Codec {
                op: "decode",
                message: e.to_string(),
            })
    }

    /// A streaming detokenizer sharing this tokenizer.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::with_skip_special_tokens(self, skip_special_tokens)
    }

    /// Ids that end generation: the union of the config's eos token, generation_config.json and
    /// config.json `eos_token_id`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Tokens the tokenizer knows, added tokens included (the model's vocab may be padded past it).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The sampling the model's `generation_config.json` recommends (requests that do not
    /// choose get it).
    pub fn sampling_defaults(&self) -> crate::sample::SamplingDefaults {
        self.config.sampling
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.config.special("bos_token")
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.config.special("eos_token")
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The underlying `tokenizers` tokenizer, for callers that need offsets or batch encoding.
    pub fn inner(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::test_support::{fixture, TempModelDir};

    /// Every golden dir, covering both tokenizer-config layouts.
    const GOLDEN_DIRS: [&str; 3] = ["qwen3-tiny", "qwen3-tiny-4bit", "qwen3-tiny-mxfp4"];

    fn golden(dir: &str) -> Value {
        let text = std::fs::read_to_string(fixture(dir).join("golden.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn options_of(case: &Value) -> TemplateOptions {
        let kwargs = case["template_kwargs"].as_object().unwrap();
        for key in kwargs.keys() {
            assert!(
                ["enable_thinking", "tools"].contains(&key.as_str()),
                "{key}"
            );
        }
        TemplateOptions {
            add_generation_prompt: true,
            enable_thinking: kwargs.get("enable_thinking").and_then(Value::as_bool),
            tools: kwargs.get("tools").cloned(),
            ..Default::default()
        }
    }

    fn ids_of(v: &Value) -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    }

    #[test]
    fn goldens_render_and_encode_byte_for_byte() {
        let mut checked = 0;
        for dir in GOLDEN_DIRS {
            let tok = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
            for case in golden(dir)["cases"].as_array().unwrap() {
                let name = case["name"].as_str().unwrap();
                let messages = case["messages"].as_array().unwrap();
                let (prompt, ids) = tok.encode_chat(messages, &options_of(case)).unwrap();
                assert_eq!(prompt, case["prompt"].as_str().unwrap(), "{dir}/{name}");
                assert_eq!(ids, ids_of(&case["input_ids"]), "{dir}/{name}");
                checked += 1;
            }
        }
        assert_eq!(checked, 12);
    }

    #[test]
    fn golden_greedy_text_matches_decode() {
        for dir in GOLDEN_DIRS {
            let tok = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
            for case in golden(dir)["cases"].as_array().unwrap() {
                let text = tok.decode(&ids_of(&case["greedy_ids"]), false).unwrap();
                assert_eq!(text, case["greedy_text"].as_str().unwrap());
            }
        }
    }

    #[test]
    fn eos_ids_special_tokens_and_vocab() {
        for dir in ["qwen3-tiny", "qwen3-tiny-sharded", "qwen3-tiny-4bit"] {
            let tok = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
            assert_eq!(tok.eos_token_ids(), &[993, 991], "{dir}");
            assert_eq!(tok.eos_token(), Some("<|im_end|>"));
            assert_eq!(tok.bos_token(), None);
            assert_eq!(tok.vocab_size(), 1000);
            assert_eq!(tok.token_id("<think>"), Some(998));
            assert_eq!(tok.token_id("<nope>"), None);
            assert!(tok.has_chat_template());
        }
    }

    #[test]
    fn plain_prompts_and_bos() {
        let tok = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
        let ids = tok.encode_plain("<|im_start|>user").unwrap();
        assert_eq!(ids, tok.encode("<|im_start|>user", false).unwrap());
        assert_eq!(ids[0], 992, "added tokens are matched in plain text");

        // add_bos_token with a tokenizer.json that has no BOS post-processor: we prepend it once.
        let dir = TempModelDir::new(
            "bos",
            &[(
                "tokenizer_config.json",
                r#"{"bos_token": "<|endoftext|>", "add_bos_token": true}"#,
            )],
        );
        let tok = ChatTokenizer::from_dir(&dir.0).unwrap();
        assert_eq!(tok.encode_plain("hi").unwrap()[0], 991);
        let with_bos = tok.encode_plain("<|endoftext|>hi").unwrap();
        assert_eq!(with_bos.iter().filter(|&&i| i == 991).count(), 1);
        assert!(!tok.has_chat_template());
        assert!(matches!(
            tok.render(&[], &TemplateOptions::default()),
            Err(ChatError::NoChatTemplate { .. })
        ));
    }

    #[test]
    fn decode_skips_special_tokens_on_request() {
        let tok = ChatTokenizer::from_dir(&fixture("qwen3-tiny-4bit")).unwrap();
        let ids = tok.encode("<|im_start|>hi<|im_end|>", false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>hi<|im_end|>");
        assert_eq!(tok.decode(&ids, true).unwrap(), "hi");
    }

    #[test]
    fn load_errors_are_typed_and_name_the_file() {
        let empty = std::env::temp_dir().join(format!("rmlx-chat-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let err = ChatTokenizer::from_dir(&empty).unwrap_err();
        assert!(
            matches!(&err, ChatError::MissingFile { path } if path.ends_with("tokenizer.json"))
        );
        assert!(err.to_string().contains("tokenizer.json"));
        std::fs::remove_dir_all(&empty).unwrap();

        let dir = TempModelDir::new("badtok", &[]);
        std::fs::write(dir.0.join("tokenizer.json"), "{not json").unwrap();
        let err = ChatTokenizer::from_dir(&dir.0).unwrap_err();
        assert!(matches!(&err, ChatError::Json { path, .. } if path.ends_with("tokenizer.json")));

        let dir = TempModelDir::new("badcfg", &[("tokenizer_config.json", "[1,")]);
        let err = ChatTokenizer::from_dir(&dir.0).unwrap_err();
        assert!(
            matches!(&err, ChatError::Json { path, .. } if path.ends_with("tokenizer_config.json"))
        );
        assert!(err.to_string().contains("tokenizer_config.json"));

        let dir = TempModelDir::new("badtpl", &[("chat_template.jinja", "{% if x %}oops")]);
        let err = ChatTokenizer::from_dir(&dir.0).unwrap_err();
        assert!(
            matches!(&err, ChatError::TemplateSyntax { path, .. } if path.ends_with("chat_template.jinja")),
            "{err:?}"
        );
    }
}

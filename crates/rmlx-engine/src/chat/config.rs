//! Reads the tokenizer-side config files of a model dir the way HF transformers 4/5 and mlx-lm do
//! (`tokenization_utils_base.py` `from_pretrained`, mlx-lm `utils.load` for the EOS ids).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::ChatError;

/// The named special tokens HF passes to chat templates (`SPECIAL_TOKENS_ATTRIBUTES`), in its order.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Where the chat template text came from, plus its named variants (`[{name, template}]` form).
#[derive(Debug, Clone)]
pub(crate) struct TemplateSource {
    pub path: PathBuf,
    /// (name, text); a plain string template is named "default".
    pub templates: Vec<(String, String)>,
}

/// What the tokenizer config files say, before any id lookups.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    pub template: Option<TemplateSource>,
    /// (attribute name, token string), only the ones that are set, in HF's order.
    pub special_tokens: Vec<(&'static str, String)>,
    pub add_bos_token: Option<bool>,
    /// EOS ids listed by `generation_config.json` then `config.json`, in file order.
    pub extra_eos_ids: Vec<u32>,
    /// The sampling `generation_config.json` recommends.
    pub sampling: crate::sample::SamplingDefaults,
}

impl TokenizerConfig {
    pub fn special(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t.as_str())
    }
}

/// Reads a JSON file; a missing file is `Ok(None)` because all of these files are optional.
pub(crate) fn read_json_opt(path: &Path) -> Result<Option<Value>, ChatError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ChatError::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| ChatError::Json {
            path: path.to_owned(),
            source,
        })
}

/// A special token is written either as a string or as an AddedToken object `{content: ...}`.
fn token_string(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` is an int or a list of ints in both config.json and generation_config.json.
fn id_list(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64().map(|n| n as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// `chat_template` is a string, or a list of `{name, template}` (multi-template repos).
fn templates_from_value(value: &Value) -> Vec<(String, String)> {
    match value {
        Value::String(s) => vec![("default".to_owned(), s.clone())],
        Value::Array(items) => items
            .iter()
            .filter_map(|item| {
                Some((
                    item.get("name")?.as_str()?.to_owned(),
                    item.get("template")?.as_str()?.to_owned(),
                ))
            })
            .collect(),
        _ => Vec::new(),
    }
}

pub(crate) fn load(dir: &Path) -> Result<TokenizerConfig, ChatError> {
    let config_path = dir.join("tokenizer_config.json");
    let tok_config = read_json_opt(&config_path)?.unwrap_or(Value::Null);
    // transformers 4 also writes special_tokens_map.json; 5 keeps everything in tokenizer_config.
    let special_map = read_json_opt(&dir.join("special_tokens_map.json"))?.unwrap_or(Value::Null);

    let mut config = TokenizerConfig {
        add_bos_token: tok_config.get("add_bos_token").and_then(Value::as_bool),
        ..Default::default()
    };
    for name in SPECIAL_TOKEN_NAMES {
        let token = tok_config
            .get(name)
            .and_then(token_string)
            .or_else(|| special_map.get(name).and_then(token_string));
        if let Some(token) = token {
            config.special_tokens.push((name, token));
        }
    }

    // transformers 5 prefers chat_template.jinja over the inline copy; chat_template.json is the
    // older processor layout.
    let jinja_path = dir.join("chat_template.jinja");
    config.template = match std::fs::read_to_string(&jinja_path) {
        Ok(text) => Some(TemplateSource {
            path: jinja_path,
            templates: vec![("default".to_owned(), text)],
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(ChatError::Io {
                path: jinja_path,
                source,
            })
        }
    };
    if config.template.is_none() {
        if let Some(value) = tok_config.get("chat_template") {
            config.template = Some(TemplateSource {
                path: config_path.clone(),
                templates: templates_from_value(value),
            });
        }
    }
    if config.template.is_none() {
        let json_path = dir.join("chat_template.json");
        if let Some(value) = read_json_opt(&json_path)? {
            if let Some(value) = value.get("chat_template") {
                config.template = Some(TemplateSource {
                    path: json_path,
                    templates: templates_from_value(value),
                });
            }
        }
    }

    // mlx-lm stops on generation_config's eos ids as well as config.json's (VLMs nest the latter).
    if let Some(gen) = read_json_opt(&dir.join("generation_config.json"))? {
        config
            .extra_eos_ids
            .extend(id_list(gen.get("eos_token_id")));
        config.sampling = crate::sample::SamplingDefaults::from_generation_config(&gen);
    }
    if let Some(model) = read_json_opt(&dir.join("config.json"))? {
        config
            .extra_eos_ids
            .extend(id_list(model.get("eos_token_id")));
        if let Some(text) = model.get("text_config") {
            config
                .extra_eos_ids
                .extend(id_list(text.get("eos_token_id")));
        }
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::test_support::{fixture, TempModelDir};

    #[test]
    fn classic_layout_reads_inline_template_and_special_tokens() {
        let config = load(&fixture("qwen3-tiny")).unwrap();
        let source = config.template.as_ref().unwrap();
        assert!(source.path.ends_with("tokenizer_config.json"));
        assert_eq!(source.templates[0].0, "default");
        assert_eq!(source.templates[0].1.len(), 4116);
        assert_eq!(config.special("eos_token"), Some("<|im_end|>"));
        assert_eq!(config.special("pad_token"), Some("<|endoftext|>"));
        assert_eq!(config.special("bos_token"), None);
        assert_eq!(config.add_bos_token, Some(false));
        // generation_config [993, 991] then config.json 993
        assert_eq!(config.extra_eos_ids, vec![993, 991, 993]);
    }

    #[test]
    fn minimal_layout_reads_jinja_file() {
        let config = load(&fixture("qwen3-tiny-4bit")).unwrap();
        let source = config.template.as_ref().unwrap();
        assert!(source.path.ends_with("chat_template.jinja"));
        assert_eq!(source.templates[0].1.len(), 4116);
        assert_eq!(config.special("eos_token"), Some("<|im_end|>"));
        assert_eq!(config.add_bos_token, None);
    }

    #[test]
    fn object_tokens_list_templates_and_special_map_fallback() {
        let dir = TempModelDir::new(
            "cfg-objects",
            &[
                (
                    "tokenizer_config.json",
                    r#"{"bos_token": {"content": "<s>", "lstrip": false}, "add_bos_token": true,
                        "chat_template": [{"name": "tool_use", "template": "T"},
                                          {"name": "default", "template": "D"}]}"#,
                ),
                (
                    "special_tokens_map.json",
                    r#"{"eos_token": {"content": "</s>"}, "bos_token": "<ignored>"}"#,
                ),
                (
                    "config.json",
                    r#"{"text_config": {"eos_token_id": [7, 8]}}"#,
                ),
            ],
        );
        let config = load(&dir.0).unwrap();
        assert_eq!(config.special("bos_token"), Some("<s>"));
        assert_eq!(config.special("eos_token"), Some("</s>"));
        assert_eq!(config.add_bos_token, Some(true));
        let names: Vec<_> = config.template.unwrap().templates;
        assert_eq!(
            names,
            vec![
                ("tool_use".to_owned(), "T".to_owned()),
                ("default".to_owned(), "D".to_owned())
            ]
        );
        assert_eq!(config.extra_eos_ids, vec![7, 8]);
    }

    #[test]
    fn bad_json_names_the_file() {
        let dir = TempModelDir::new("cfg-badjson", &[("generation_config.json", "{\"eos\": ")]);
        match load(&dir.0) {
            Err(ChatError::Json { path, .. }) => {
                assert!(path.ends_with("generation_config.json"))
            }
            other => panic!("expected a Json error, got {other:?}"),
        }
    }
}

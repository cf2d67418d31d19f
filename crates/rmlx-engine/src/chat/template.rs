//! Chat templates rendered as HF transformers does (`utils/chat_template_utils.py`:
//! `_cached_compile_jinja_template`, `render_jinja_template`), on minijinja instead of jinja2.

use std::path::PathBuf;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use super::config::TemplateSource;
use super::{pyformat, ChatError};

/// The arguments `apply_chat_template` takes besides the messages.
#[derive(Debug, Clone, Default)]
pub struct TemplateOptions {
    pub add_generation_prompt: bool,
    /// Only passed when set: Qwen3's template tests `enable_thinking is defined`.
    pub enable_thinking: Option<bool>,
    /// Tool schemas; HF passes `tools=None` when there are none, and so do we.
    pub tools: Option<Json>,
    /// Any other template variable (e.g. `reasoning_effort`); overrides the special tokens.
    pub extra: Map<String, Json>,
}

/// A compiled template with its variants and the file it came from (for error messages).
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
    names: Vec<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .field("names", &self.names)
            .finish()
    }
}

/// Names HF copies a message's reasoning under (`_REASONING_FIELDS`); the first is the standard one.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

impl ChatTemplate {
    /// Compiles every variant now, so a syntax error shows up at load time naming the file.
    pub fn compile(source: TemplateSource) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        // jinja2 settings HF uses; keep_trailing_newline stays false (jinja2's default).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // `.startswith`, `.split`, `.items()` and friends, as Python strings/dicts have them.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", pyformat::tojson);
        // `{{ flag }}` prints `True`, `{{ args }}` a Python dict repr, as jinja2 would.
        env.set_formatter(pyformat::py_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let mut names = Vec::new();
        for (name, text) in source.templates {
            env.add_template_owned(name.clone(), text)
                .map_err(|e| ChatError::TemplateSyntax {
                    path: source.path.clone(),
                    message: describe(&e),
                })?;
            names.push(name);
        }
        Ok(Self {
            env,
            path: source.path,
            names,
        })
    }

    /// HF's choice among named variants: "tool_use" when tools are given and it exists, else
    /// "default".
    fn pick(&self, with_tools: bool) -> Option<&str> {
        let has = |n: &str| self.names.iter().any(|x| x == n);
        if with_tools && has("tool_use") {
            Some("tool_use")
        } else if has("default") {
            Some("default")
        } else {
            None
        }
    }

    pub fn render(
        &self,
        messages: &[Json],
        options: &TemplateOptions,
        special_tokens: &[(&'static str, String)],
    ) -> Result<String, ChatError> {
        let render_error = |message: String| ChatError::TemplateRender {
            path: self.path.clone(),
            message,
        };
        let name = self.pick(options.tools.is_some()).ok_or_else(|| {
            render_error(format!(
                "no \"default\" template among {:?}",
                self.names.as_slice()
            ))
        })?;
        // HF: template_kwargs = {**special_tokens_map, **kwargs}, then messages/tools/documents/
        // add_generation_prompt as named arguments.
        let mut ctx = Map::new();
        for (key, token) in special_tokens {
            ctx.insert((*key).to_owned(), Json::String(token.clone()));
        }
        ctx.extend(options.extra.clone());
        if let Some(thinking) = options.enable_thinking {
            ctx.insert("enable_thinking".to_owned(), Json::Bool(thinking));
        }
        let messages: Vec<Json> = messages.iter().map(alias_reasoning).collect();
        ctx.insert("messages".to_owned(), Json::Array(messages));
        ctx.insert(
            "tools".to_owned(),
            options.tools.clone().unwrap_or(Json::Null),
        );
        ctx.insert("documents".to_owned(), Json::Null);
        ctx.insert(
            "add_generation_prompt".to_owned(),
            Json::Bool(options.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(name)
            .map_err(|e| render_error(describe(&e)))?;
        template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| render_error(describe(&e)))
    }
}

/// minijinja's Display leaves out the chain of causes (e.g. the error inside an include).
fn describe(err: &Error) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message
}

/// HF's `_alias_reasoning_fields`: `{"thinking": r, **message, "reasoning_content": r}` for the
/// first non-null of reasoning_content/thinking/reasoning, so templates read either name.
fn alias_reasoning(message: &Json) -> Json {
    let Json::Object(fields) = message else {
        return message.clone();
    };
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|k| fields.get(*k).filter(|v| !v.is_null()));
    let Some(reasoning) = reasoning else {
        return message.clone();
    };
    let mut out = Map::new();
    out.insert("thinking".to_owned(), reasoning.clone());
    for (k, v) in fields {
        out.insert(k.clone(), v.clone());
    }
    out.insert("reasoning_content".to_owned(), reasoning.clone());
    Json::Object(out)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `datetime.now().strftime(fmt)`; we have no time-zone database, so "now" is UTC.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The C-locale strftime directives templates use (Llama 3: `%d %b %Y`), for unix seconds in UTC.
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[month as usize - 1] + day + i64::from(leap && month > 2);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(text: &str) -> ChatTemplate {
        ChatTemplate::compile(TemplateSource {
            path: PathBuf::from("/m/chat_template.jinja"),
            templates: vec![("default".to_owned(), text.to_owned())],
        })
        .unwrap()
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29T13:05:09Z, a Thursday; python: "%d %b %Y|%A %j %I%p %H:%M:%S %y %%"
        assert_eq!(
            strftime("%d %b %Y|%A %j %I%p %H:%M:%S %y %%", 1_709_211_909),
            "29 Feb 2024|Thursday 060 01PM 13:05:09 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%B %e", -86_400), "December 31");
    }

    #[test]
    fn hf_variables_and_whitespace_rules() {
        let t = template(
            "{% for m in messages %}\n  {{ m.role }}:{{ m.content }}|\n{% endfor %}\n\
             {{ tools is none }} {{ documents is none }} {{ enable_thinking is defined }} \
             {{ eos_token }} {{ bos_token is defined }} {{ add_generation_prompt }} {{ mood }}\n",
        );
        let mut extra = Map::new();
        extra.insert("mood".to_owned(), json!("calm"));
        extra.insert("eos_token".to_owned(), json!("<overridden>"));
        let options = TemplateOptions {
            add_generation_prompt: true,
            extra,
            ..Default::default()
        };
        let out = t
            .render(
                &[json!({"role": "user", "content": "hi"})],
                &options,
                &[("eos_token", "<e>".to_owned())],
            )
            .unwrap();
        // jinja2 (HF env) gives exactly this: trim_blocks eats the newline after a block tag,
        // lstrip_blocks only strips before block tags (not `{{`), the final newline is dropped.
        assert_eq!(
            out,
            "  user:hi|\nTrue True False <overridden> False True calm"
        );
    }

    #[test]
    fn python_string_methods_slices_and_namespace() {
        let t = template(
            "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% set ns.n = ns.n + 1 %}\
             {{ m.content.split('</think>')[-1].lstrip('\\n') }}{{ m.content.startswith('a') }}\
             {% endfor %}{{ ns.n }}{{ {'k': 1}.items() | list | length }}",
        );
        let out = t
            .render(
                &[
                    json!({"content": "x</think>\n\nb"}),
                    json!({"content": "ab"}),
                ],
                &TemplateOptions::default(),
                &[],
            )
            .unwrap();
        assert_eq!(out, "abTruebFalse21");
    }

    #[test]
    fn reasoning_aliases_follow_hf() {
        let aliased =
            alias_reasoning(&json!({"role": "assistant", "reasoning": "r", "content": "c"}));
        let keys: Vec<_> = aliased.as_object().unwrap().keys().cloned().collect();
        assert_eq!(
            keys,
            [
                "thinking",
                "role",
                "reasoning",
                "content",
                "reasoning_content"
            ]
        );
        assert_eq!(aliased["reasoning_content"], "r");
        assert_eq!(aliased["thinking"], "r");
        let plain = json!({"role": "user", "content": "c", "thinking": null});
        assert_eq!(alias_reasoning(&plain), plain);
    }

    #[test]
    fn raise_exception_is_a_typed_render_error_naming_the_file() {
        let t = template(
            "{% if messages | length == 0 %}{{ raise_exception('need a message') }}{% endif %}ok",
        );
        match t.render(&[], &TemplateOptions::default(), &[]) {
            Err(ChatError::TemplateRender { path, message }) => {
                assert!(path.ends_with("chat_template.jinja"));
                assert!(message.contains("need a message"), "{message}");
            }
            other => panic!("expected a render error, got {other:?}"),
        }
        assert_eq!(
            t.render(&[json!({})], &TemplateOptions::default(), &[])
                .unwrap(),
            "ok"
        );
    }

    #[test]
    fn syntax_error_names_the_file() {
        let err = ChatTemplate::compile(TemplateSource {
            path: PathBuf::from("/m/tokenizer_config.json"),
            templates: vec![("default".to_owned(), "{% for m in messages %}".to_owned())],
        })
        .unwrap_err();
        assert!(
            matches!(&err, ChatError::TemplateSyntax { path, .. } if path.ends_with("tokenizer_config.json"))
        );
        assert!(err.to_string().contains("tokenizer_config.json"));
    }

    #[test]
    fn named_variants_pick_tool_use_only_with_tools() {
        let t = ChatTemplate::compile(TemplateSource {
            path: PathBuf::from("/m/tokenizer_config.json"),
            templates: vec![
                ("tool_use".to_owned(), "T{{ tools | length }}".to_owned()),
                ("default".to_owned(), "D".to_owned()),
            ],
        })
        .unwrap();
        let mut options = TemplateOptions::default();
        assert_eq!(t.render(&[], &options, &[]).unwrap(), "D");
        options.tools = Some(json!([{"type": "function"}]));
        assert_eq!(t.render(&[], &options, &[]).unwrap(), "T1");
    }
}

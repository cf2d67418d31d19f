//! Fuzz targets (issue 17): each takes arbitrary bytes, drives one parser of untrusted input
//! the way the server does, and panics only on a bug (a typed error is the right answer to bad
//! input). `fuzz/` runs them under libFuzzer (`make fuzz`); `tests/fuzz_replay.rs` replays the
//! committed corpus and every crash found through an ordinary `cargo test`.
//! Reference: cargo-fuzz's target layout (`fuzz_target!` over `&[u8]`).

use std::{path::Path, sync::OnceLock};

use rmlx_engine::{
    chat::{ChatTokenizer, TemplateOptions},
    vision::{self, ImageLimits, SourcePolicy},
};
use serde_json::{json, Value};

use crate::{
    anthropic::{self, MessagesRequest, PromptFields},
    openai::{self, ChatRequest, CompletionRequest},
    parse::{OutputParser, Piece, ToolFormat},
    responses::{self, ResponsesRequest},
    xml_calls::{self, XmlTools},
};

/// A fuzz target: bytes in, a panic only on a bug.
pub type Target = fn(&[u8]);

/// The targets by name, as `fuzz/fuzz_targets/<name>.rs` and `fuzz/corpus/<name>/` name them.
pub const TARGETS: [(&str, Target); 6] = [
    ("request_json", request_json),
    ("chat_template", chat_template),
    ("image_decode", image_decode),
    ("safetensors_header", safetensors_header),
    ("sse_event", sse_event),
    ("tool_calls", tool_calls),
];

/// A request body → the typed request of each route that takes JSON → its conversion up to
/// the point where a model is needed.
pub fn request_json(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    if let Ok(request) = serde_json::from_value::<ChatRequest>(body.clone()) {
        if let Ok(parts) = openai::chat_parts(&request, "fuzz") {
            let max_tokens = request
                .max_completion_tokens
                .or(request.max_tokens)
                .unwrap_or(16);
            let _ = request
                .sampling
                .params(&Default::default(), Some(4096), max_tokens, None);
            drop(parts);
        }
    }
    if let Ok(request) = serde_json::from_value::<CompletionRequest>(body.clone()) {
        let _ = openai::completion_parts(&request, &Default::default(), Some(4096));
    }
    if let Ok(request) = serde_json::from_value::<MessagesRequest>(body.clone()) {
        let _ = anthropic::convert_prompt(&request.prompt, "fuzz", false);
    }
    if let Ok(request) = serde_json::from_value::<ResponsesRequest>(body.clone()) {
        let _ = responses::prepare(&request, Vec::new());
    }
    if let Ok(fields) = serde_json::from_value::<PromptFields>(body) {
        let _ = anthropic::convert_prompt(&fields, "fuzz", false);
    }
}

fn fixture_tokenizers() -> &'static [ChatTokenizer] {
    static TOKENIZERS: OnceLock<Vec<ChatTokenizer>> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        [
            "qwen3-tiny",
            "qwen3-vl-tiny",
            "gemma4-tiny",
            "releases/qwen3.6-35b-a3b",
        ]
        .iter()
        .map(|dir| ChatTokenizer::from_dir(&fixtures.join(dir)).expect("fixture tokenizer"))
        .collect()
    })
}

/// `[template byte][JSON {messages, tools?, enable_thinking?, ...kwargs}]` → the chat template
/// of one family (Qwen3, Qwen3-VL, Gemma 4, Qwen3.6) rendered as a request would render it.
pub fn chat_template(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(rest) else {
        return;
    };
    let Some(Value::Array(messages)) = fields.remove("messages") else {
        return;
    };
    let tokenizers = fixture_tokenizers();
    let tokenizer = &tokenizers[which as usize % tokenizers.len()];
    let options = TemplateOptions {
        add_generation_prompt: which & 0x80 == 0,
        enable_thinking: fields.remove("enable_thinking").and_then(|v| v.as_bool()),
        tools: fields.remove("tools"),
        extra: fields,
        ..TemplateOptions::default()
    };
    let _ = tokenizer.render(&messages, &options);
}

/// Image bytes → the decoder with limits small enough to matter; the same bytes as an inline
/// reference (data URI, base64, or what looks like a path) through the server's policy.
pub fn image_decode(data: &[u8]) {
    let limits = ImageLimits {
        max_bytes: 1 << 20,
        max_side: 2048,
        max_pixels: 1 << 20,
    };
    if let Ok(image) = vision::decode_image(data, &limits) {
        assert!(image.width() <= limits.max_side && image.height() <= limits.max_side);
        assert!(u64::from(image.width()) * u64::from(image.height()) <= limits.max_pixels);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(image) = vision::decode_image_source(text, SourcePolicy::InlineOnly, &limits) {
            assert!(u64::from(image.width()) * u64::from(image.height()) <= limits.max_pixels);
        }
    }
}

/// A safetensors file's bytes → the header check every load runs before MLX reads the file.
/// What it accepts must describe tensors that lie inside the data.
pub fn safetensors_header(data: &[u8]) {
    let file = Path::new("fuzz.safetensors");
    if let Ok(names) = rmlx_engine::weights::check_safetensors_header(data, file) {
        let header_len = u64::from_le_bytes(data[..8].try_into().expect("8 bytes were read"));
        assert!(8 + header_len <= data.len() as u64);
        assert!(names.iter().all(|name| name != "__metadata__"));
    }
}

/// Text → one SSE event of each kind the server writes (OpenAI's unnamed `data:` chunk and
/// Anthropic's named one), written by axum, read back as a client would: the same JSON.
pub fn sse_event(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let value = json!({"delta": {"type": "text_delta", "text": text}, "n": data.len()});
    for (name, event) in [
        (None, crate::sse::data(&value)),
        (
            Some("content_block_delta"),
            crate::sse::named("content_block_delta", &value),
        ),
    ] {
        let body = sse_body(event);
        let block = body
            .strip_suffix("\n\n")
            .unwrap_or_else(|| panic!("an event ends with a blank line: {body:?}"));
        assert!(!block.contains("\n\n"), "one event: {body:?}");
        let mut read_name = None;
        let mut read_data: Vec<&str> = Vec::new();
        for line in block.split('\n') {
            assert!(!line.contains('\r'), "no bare CR in a line: {line:?}");
            match line.split_once(':') {
                Some(("event", rest)) => read_name = Some(rest.strip_prefix(' ').unwrap_or(rest)),
                Some(("data", rest)) => read_data.push(rest.strip_prefix(' ').unwrap_or(rest)),
                _ => panic!("unexpected SSE line {line:?}"),
            }
        }
        assert_eq!(read_name, name);
        let parsed: Value = serde_json::from_str(&read_data.join("\n")).expect("JSON data");
        assert_eq!(parsed, value);
    }
}

fn sse_body(event: axum::response::sse::Event) -> String {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    });
    let stream = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(event)]);
    let response =
        axum::response::IntoResponse::into_response(axum::response::sse::Sse::new(stream));
    let bytes = runtime
        .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
        .expect("an in-memory body");
    String::from_utf8(bytes.to_vec()).expect("SSE is UTF-8")
}

/// `[flags][chunk size][model output]` → the output parser fed in chunks, as a stream is: what
/// it yields must equal the whole answer parsed at once (streaming equals non-streaming), and
/// every call must be whole. Flags: in reasoning, tools offered, XML calls.
pub fn tool_calls(data: &[u8]) {
    let [flags, chunk, rest @ ..] = data else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "metric": {"type": "boolean"}, "where": {"type": "object"}}}}}]);
    let in_reasoning = flags & 1 != 0;
    let format = if flags & 4 != 0 {
        ToolFormat::Xml
    } else {
        ToolFormat::Json
    };
    let offered = (flags & 2 != 0).then_some(&tools);
    let parser = || OutputParser::for_tools(in_reasoning, format, offered);
    let whole = parser().parse(&text);

    let mut streamed = parser();
    let mut pieces = Vec::new();
    let size = usize::from(*chunk % 16) + 1;
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + size).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        pieces.extend(streamed.push(&text[start..end]));
        start = end;
    }
    pieces.extend(streamed.finish());
    let (mut content, mut reasoning, mut calls) = (String::new(), None::<String>, Vec::new());
    for piece in pieces {
        match piece {
            Piece::Content(text) => content.push_str(&text),
            Piece::Reasoning(text) => reasoning.get_or_insert_with(String::new).push_str(&text),
            Piece::ToolCall(call) => calls.push(call),
        }
    }
    assert_eq!(
        content, whole.content,
        "content, streamed in {size}-byte chunks"
    );
    assert_eq!(
        reasoning, whole.reasoning,
        "reasoning, streamed in {size}-byte chunks"
    );
    assert_eq!(
        calls, whole.tool_calls,
        "calls, streamed in {size}-byte chunks"
    );
    for call in &whole.tool_calls {
        assert!(serde_json::from_str::<Value>(&call.arguments_json()).is_ok());
    }
    // The XML call parser alone, on the same text as a call body.
    if let Ok(call) = xml_calls::parse_call(&text, &XmlTools::from_tools(&tools)) {
        assert!(!call.name.is_empty());
    }
}

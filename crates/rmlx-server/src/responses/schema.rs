//! The request's shapes as the OpenAPI document describes them: the handler reads the JSON
//! itself (`input`), leniently, so these say what it takes. Item, part and tool lists are
//! `anyOf`: a type the server ignores is any object with a string `type`, which the known
//! shapes also are. Reference: OpenAI API reference (Responses: create).

use serde_json::Value;
use utoipa::{
    openapi::{
        schema::{AnyOf, Schema},
        RefOr,
    },
    Modify, ToSchema,
};

/// `input`: one user message as a string, or items.
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum ResponsesInput {
    Text(String),
    Items(Vec<InputItemIn>),
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum InputItemIn {
    Message(MessageItemIn),
    FunctionCall(FunctionCallIn),
    CustomToolCall(CustomToolCallIn),
    CallOutput(CallOutputIn),
    Reasoning(ReasoningItemIn),
    Other(OtherItemIn),
}

/// A message (`type` may be left out): leading `system` / `developer` messages join the
/// system prompt; later ones stay where they are, inside the user or tool turn next to them.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct MessageItemIn {
    #[schema(value_type = Option<String>, pattern = "^message$")]
    r#type: Option<String>,
    role: InputRole,
    content: MessageContentIn,
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(rename_all = "lowercase")]
pub(super) enum InputRole {
    User,
    Assistant,
    System,
    Developer,
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum MessageContentIn {
    Text(String),
    Parts(Vec<ContentPartIn>),
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum ContentPartIn {
    Text(TextPartIn),
    Image(ImagePartIn),
    Other(OtherItemIn),
}

/// Text of a turn: `input_text`, `output_text` (past assistant text) or `text`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct TextPartIn {
    #[schema(value_type = String, pattern = "^(input_text|output_text|text)$")]
    r#type: String,
    text: String,
}

/// An image, inline as a data URI (`data:image/png;base64,...`); never fetched.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct ImagePartIn {
    #[schema(value_type = String, pattern = "^input_image$")]
    r#type: String,
    image_url: String,
    detail: Option<String>,
}

/// A past call; `arguments` is a JSON object as a string. `namespace` names the namespace
/// tool it belongs to.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct FunctionCallIn {
    #[schema(value_type = String, pattern = "^function_call$")]
    r#type: String,
    call_id: String,
    name: String,
    namespace: Option<String>,
    arguments: String,
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct CustomToolCallIn {
    #[schema(value_type = String, pattern = "^custom_tool_call$")]
    r#type: String,
    call_id: String,
    name: String,
    namespace: Option<String>,
    input: String,
}

/// A call's result: a string, or content parts (text and inline images).
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct CallOutputIn {
    #[schema(value_type = String, pattern = "^(function_call_output|custom_tool_call_output)$")]
    r#type: String,
    call_id: String,
    output: MessageContentIn,
}

/// Past reasoning: `encrypted_content` (what this server sent: the text itself), else the
/// `content` text, else the summary, is rendered as that turn's reasoning.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct ReasoningItemIn {
    #[schema(value_type = String, pattern = "^reasoning$")]
    r#type: String,
    encrypted_content: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    summary: Option<Vec<Value>>,
    #[schema(value_type = Option<Vec<Object>>)]
    content: Option<Vec<Value>>,
}

/// Anything else with a `type` (`web_search_call`, `item_reference`, ...): ignored.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct OtherItemIn {
    r#type: String,
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum ResponseToolIn {
    Function(FunctionToolIn),
    Custom(CustomToolIn),
    Namespace(NamespaceToolIn),
    Other(OtherItemIn),
}

#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct FunctionToolIn {
    #[schema(value_type = String, pattern = "^function$")]
    r#type: String,
    #[schema(min_length = 1)]
    name: String,
    description: Option<String>,
    /// A JSON Schema of the arguments (absent: no arguments).
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
    strict: Option<bool>,
}

/// A freeform tool: the model sees a function of one string argument, `input`; `format`'s
/// grammar is shown to it, not enforced.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct CustomToolIn {
    #[schema(value_type = String, pattern = "^custom$")]
    r#type: String,
    #[schema(min_length = 1)]
    name: String,
    description: Option<String>,
    #[schema(value_type = Option<Object>)]
    format: Option<Value>,
}

/// A group of tools, each seen by the model as `NAMESPACE__NAME` (Codex's rule: the namespace
/// without trailing `_`, the name without leading `_`); calls come back with `namespace` and
/// `name`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct NamespaceToolIn {
    #[schema(value_type = String, pattern = "^namespace$")]
    r#type: String,
    #[schema(min_length = 1)]
    name: String,
    description: Option<String>,
    /// `function` and `custom` tools (others, a namespace too, are dropped).
    tools: Vec<NamespacedToolIn>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum NamespacedToolIn {
    Function(FunctionToolIn),
    Custom(CustomToolIn),
    Other(OtherItemIn),
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
pub(super) enum ToolChoiceIn {
    Mode(ToolChoiceMode),
    Object(ToolChoiceObject),
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(rename_all = "lowercase")]
pub(super) enum ToolChoiceMode {
    None,
    Auto,
    Required,
}

/// `function` / `custom` (with `name`, and `namespace` for a tool inside one),
/// `allowed_tools` (with `mode` and `tools`); a built-in tool's type means `auto`.
#[derive(ToSchema)]
#[allow(dead_code)]
pub(super) struct ToolChoiceObject {
    r#type: String,
    name: Option<String>,
    namespace: Option<String>,
    mode: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    tools: Option<Vec<Value>>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum TextFormatIn {
    Text,
    JsonObject,
    JsonSchema {
        name: Option<String>,
        description: Option<String>,
        /// A JSON Schema the answer must follow (absent: any JSON value).
        #[schema(value_type = Option<Object>)]
        schema: Option<Value>,
        /// Refuse keywords that cannot be enforced instead of ignoring them.
        strict: Option<bool>,
    },
}

/// Makes the item, part and tool lists `anyOf` (utoipa writes untagged enums as `oneOf`, which
/// a known item would fail by matching its own shape and the catch-all).
pub struct AnyOfLists;

impl Modify for AnyOfLists {
    fn modify(&self, document: &mut utoipa::openapi::OpenApi) {
        let Some(components) = document.components.as_mut() else {
            return;
        };
        for name in [
            "InputItemIn",
            "ContentPartIn",
            "ResponseToolIn",
            "NamespacedToolIn",
        ] {
            let Some(RefOr::T(schema)) = components.schemas.get_mut(name) else {
                continue;
            };
            if let Schema::OneOf(one) = schema {
                let mut any = AnyOf::new();
                any.items = std::mem::take(&mut one.items);
                any.description = one.description.take();
                *schema = Schema::AnyOf(any);
            }
        }
    }
}

//! Constrained decoding for OpenAI `response_format` (`json_object`, `json_schema`): llguidance
//! compiles the schema to a grammar and, before every step, gives the set of token ids that keep
//! the output a prefix of a valid document; the decode loop adds it to the logits as a 0 / -inf
//! mask. Reference: llguidance `Matcher` (its server-side API, as vLLM and SGLang use it) and
//! mlx-lm's `logits_processors` (the mask is one more processor on raw logits).
//!
//! A freeform tool's grammar (OpenAI custom tools: Lark or a regex) constrains the tool's raw
//! input: forced, as a [`ResponseFormat::ToolInput`] after a prefilled call opening; otherwise
//! as a [`TriggeredGrammar`], dormant until the model opens a call of that tool and done when the
//! input and the call's closing text are written, so the rest of the answer is free.

use std::sync::Arc;

use llguidance::{
    api::{GrammarWithLexer, TopLevelGrammar},
    earley::SlicedBiasComputer,
    token_bytes_from_tokenizer_json,
    toktrie::{
        InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
    },
    Matcher, ParserFactory,
};
use mlx_rs::{error::Exception, ops, Array};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::{chat::ChatTokenizer, error::EngineError};

/// Whitespace allowed between JSON tokens: flexible (models pretty-print) but bounded, so a
/// model cannot spin on newlines forever inside an otherwise valid document.
const WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,32}";

/// OpenAI's `response_format`, in its wire shape (`{"type": "json_schema", "json_schema": {..}}`)
/// so front doors can deserialize the request field straight into it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    JsonSchema {
        json_schema: JsonSchemaFormat,
    },
    /// A freeform tool's input and the call's closing text (a forced call; never on the wire).
    #[serde(skip)]
    ToolInput(ToolInputGrammar),
}

/// The grammar syntaxes of OpenAI's custom tools (`format: {type: "grammar", syntax}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarSyntax {
    /// llguidance's Lark dialect (Lark's, plus `%json`, `@grammar` and `<special>` tokens).
    Lark,
    /// A regular expression (Rust `regex` syntax) the whole input matches.
    Regex,
    /// A JSON string whose text (escapes read) matches the regular expression: the input as a
    /// JSON call format writes it.
    JsonString,
}

/// A freeform tool's raw input, then the literal text that closes the call in the model's
/// format (e.g. `\n</parameter>\n</function>`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInputGrammar {
    /// The tool's name (errors name it).
    pub tool: String,
    pub syntax: GrammarSyntax,
    pub definition: String,
    pub closing: String,
}

impl ToolInputGrammar {
    /// `start: @tool CLOSING`, the tool's own grammar kept whole as the nested `@tool` (its
    /// `start` and rule names cannot clash with ours).
    fn grammar(&self) -> TopLevelGrammar {
        let closing = serde_json::to_string(&self.closing).expect("a string serializes");
        let mut tool = match self.syntax {
            GrammarSyntax::Lark => GrammarWithLexer::from_lark(self.definition.clone()),
            GrammarSyntax::Regex => GrammarWithLexer::from_regex(&self.definition),
            GrammarSyntax::JsonString => GrammarWithLexer::from_json_schema(json!({
                "type": "string",
                "pattern": format!("^(?:{})$", self.definition),
            })),
        };
        tool.name = Some("tool".into());
        let call = GrammarWithLexer::from_lark(format!("start: @tool {closing}\n"));
        TopLevelGrammar {
            grammars: vec![call, tool],
            max_tokens: None,
        }
    }
}

/// A cap on the answer's reasoning: once `tokens` tokens of it are written, `forced` (the
/// family's end of thinking) is the next text, and the answer follows. Anthropic's
/// `budget_tokens`, Responses' `reasoning.effort`: a slow Mac is not stuck in minutes of thought.
#[derive(Debug, Clone, PartialEq)]
pub struct ReasoningBudget {
    pub tokens: usize,
    /// The reasoning's opening and closing tags (`<think>`, `</think>`).
    pub open: String,
    pub close: String,
    /// The prompt already opened the reasoning (templates that force thinking).
    pub starts_open: bool,
    /// What is written when the budget is spent (e.g. `\n</think>\n\n`).
    pub forced: String,
}

/// A grammar that applies once `trigger` appears in the output, until it is complete.
#[derive(Debug, Clone, PartialEq)]
pub struct TriggeredGrammar {
    /// The output text that opens a call of the tool, up to where its input starts.
    pub trigger: String,
    pub input: ToolInputGrammar,
}

/// The `json_schema` member of `response_format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Absent means any JSON value, as in OpenAI's API.
    #[serde(default = "any_json")]
    pub schema: Value,
    /// Strict: a keyword or format we cannot enforce is an error. Otherwise it is ignored (the
    /// rest of the schema is still enforced). Clients send `null` too, hence the Option.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

fn any_json() -> Value {
    json!({})
}

impl ResponseFormat {
    pub fn json_schema(schema: Value, strict: bool) -> Self {
        Self::JsonSchema {
            json_schema: JsonSchemaFormat {
                name: String::new(),
                description: None,
                schema,
                strict: Some(strict),
            },
        }
    }

    pub fn is_text(&self) -> bool {
        matches!(self, Self::Text)
    }

    /// The schema llguidance compiles, with our compile options unless the schema sets its own
    /// (`x-guidance`); None for plain text.
    fn grammar(&self) -> Option<TopLevelGrammar> {
        let (mut schema, strict) = match self {
            Self::Text => return None,
            Self::ToolInput(input) => return Some(input.grammar()),
            Self::JsonObject => (json!({"type": "object"}), true),
            Self::JsonSchema { json_schema } => (
                json_schema.schema.clone(),
                json_schema.strict.unwrap_or(false),
            ),
        };
        if let Some(object) = schema.as_object_mut() {
            object
                .entry("x-guidance")
                .or_insert_with(|| json!({"whitespace_pattern": WHITESPACE, "lenient": !strict}));
        }
        Some(TopLevelGrammar::from_json_schema(schema))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConstrainError {
    /// The request's schema does not compile (HTTP 400).
    #[error("the response format's JSON schema does not compile: {0}")]
    Schema(String),
    /// A custom tool's grammar does not compile (HTTP 400).
    #[error("the grammar of custom tool `{tool}` does not compile: {message}")]
    ToolGrammar { tool: String, message: String },
    #[error("constrained decoding is unavailable for this tokenizer: {0}")]
    Tokenizer(String),
    #[error("the response_format grammar rejected token {token}: {message}")]
    Rejected { token: u32, message: String },
    #[error("the response_format grammar failed: {0}")]
    Grammar(String),
    #[error("MLX failed applying the token mask: {0}")]
    Mlx(String),
}

impl From<Exception> for ConstrainError {
    fn from(error: Exception) -> Self {
        Self::Mlx(error.what().to_string())
    }
}

impl From<ConstrainError> for EngineError {
    fn from(error: ConstrainError) -> Self {
        match error {
            ConstrainError::Mlx(message) => EngineError::Mlx(message),
            other => EngineError::InvalidRequest(other.to_string()),
        }
    }
}

/// Our tokenizer as llguidance sees it: the byte trie of every id, plus `tokenize_bytes` for
/// the canonical tokenization of forced text.
struct TokenizerEnvironment {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerEnvironment {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// Per model: the token trie and llguidance's parser factory, built once (the trie walk over
/// the whole vocabulary is the slow part) and cheap to make request constraints from.
pub struct ConstraintFactory {
    parsers: ParserFactory,
    model_vocab: usize,
    /// Ids at or past this are padding rows of the embedding, never a real token.
    tokenizer_vocab: usize,
}

impl ConstraintFactory {
    /// `model_vocab` is the logits' width (config `vocab_size`, often padded past the
    /// tokenizer's); `eos_ids` are the ids allowed once the document is complete.
    pub fn from_tokenizer(
        tokenizer: &ChatTokenizer,
        model_vocab: usize,
        eos_ids: &[u32],
    ) -> Result<Self, ConstrainError> {
        let unavailable = |message: String| ConstrainError::Tokenizer(message);
        let tokenizer_json = serde_json::to_value(tokenizer.inner().as_ref())
            .map_err(|error| unavailable(error.to_string()))?;
        let mut words = token_bytes_from_tokenizer_json(&tokenizer_json)
            .map_err(|error| unavailable(error.to_string()))?;
        let tokenizer_vocab = tokenizer.vocab_size().max(words.len()).min(model_vocab);
        // Padding ids get special-token names: a JSON grammar never allows them.
        words.truncate(model_vocab);
        while words.len() < model_vocab {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let eos: Vec<TokenId> = eos_ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < tokenizer_vocab)
            .collect();
        let Some(&first_eos) = eos.first() else {
            return Err(unavailable("it has no EOS token to end a document".into()));
        };
        let info = TokRxInfo::new(model_vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let environment: TokEnv = Arc::new(TokenizerEnvironment {
            trie,
            tokenizer: tokenizer.inner().clone(),
        });
        let mut parsers = ParserFactory::new(
            &environment,
            InferenceCapabilities::default(),
            &SlicedBiasComputer::json_slices(),
        )
        .map_err(|error| unavailable(error.to_string()))?;
        // Schema warnings would go to the server's stderr on every request.
        parsers.quiet();
        Ok(Self {
            parsers,
            model_vocab,
            tokenizer_vocab,
        })
    }

    /// The constraint of one request; None for plain text. A schema that does not compile is
    /// `ConstrainError::Schema`.
    pub fn constraint(
        &self,
        format: &ResponseFormat,
    ) -> Result<Option<Constraint>, ConstrainError> {
        let Some(grammar) = format.grammar() else {
            return Ok(None);
        };
        self.compile(grammar)
            .map(Some)
            .map_err(|message| match format {
                ResponseFormat::ToolInput(input) => ConstrainError::ToolGrammar {
                    tool: input.tool.clone(),
                    message,
                },
                _ => ConstrainError::Schema(message),
            })
    }

    /// The dormant grammars of a request's freeform tools, compiled now so a bad one is the
    /// request's error before any compute.
    pub fn tool_grammars(
        &self,
        grammars: &[TriggeredGrammar],
        budget: Option<&ReasoningBudget>,
    ) -> Result<ToolGrammars, ConstrainError> {
        let mut dormant = Vec::new();
        for grammar in grammars {
            let fresh = self.compile(grammar.input.grammar()).map_err(|message| {
                ConstrainError::ToolGrammar {
                    tool: grammar.input.tool.clone(),
                    message,
                }
            })?;
            dormant.push(Dormant {
                trigger: grammar.trigger.clone(),
                closing: grammar.input.closing.clone(),
                fresh,
            });
        }
        let mut grammars = ToolGrammars::new(dormant);
        if let Some(budget) = budget {
            let forced = serde_json::to_string(&budget.forced).expect("a string serializes");
            let closing = self
                .compile(TopLevelGrammar::from_lark(format!("start: {forced}\n")))
                .map_err(ConstrainError::Grammar)?;
            grammars.reasoning = Some(Reasoning {
                budget: budget.clone(),
                closing,
                spent: None,
                tail: String::new(),
                done: false,
            });
            if budget.starts_open {
                grammars.reasoning.as_mut().expect("just set").spent = Some(0);
            }
        }
        Ok(grammars)
    }

    fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint, String> {
        let parser = self
            .parsers
            .create_parser(grammar)
            .map_err(|error| error.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(error);
        }
        Ok(Constraint {
            matcher,
            allowed_below: self.tokenizer_vocab,
            mask: vec![f32::NEG_INFINITY; self.model_vocab],
        })
    }
}

/// A `ConstraintFactory` made just for this call: fine for one-off generations, slow for large
/// vocabularies (the engine keeps a factory per resident model instead).
pub fn one_off_constraint(
    tokenizer: &ChatTokenizer,
    model_vocab: usize,
    format: &ResponseFormat,
) -> Result<Option<Constraint>, ConstrainError> {
    if format.is_text() {
        return Ok(None);
    }
    ConstraintFactory::from_tokenizer(tokenizer, model_vocab, tokenizer.eos_token_ids())?
        .constraint(format)
}

/// What constrains one request's output: its response format (or forced call), and the
/// grammars of its freeform tools.
#[derive(Default)]
pub struct Grammars {
    pub format: Option<Constraint>,
    pub tools: ToolGrammars,
}

/// A one-off factory's tool grammars (see [`one_off_constraint`]).
pub fn one_off_tool_grammars(
    tokenizer: &ChatTokenizer,
    model_vocab: usize,
    grammars: &[TriggeredGrammar],
    budget: Option<&ReasoningBudget>,
) -> Result<ToolGrammars, ConstrainError> {
    if grammars.is_empty() && budget.is_none() {
        return Ok(ToolGrammars::default());
    }
    ConstraintFactory::from_tokenizer(tokenizer, model_vocab, tokenizer.eos_token_ids())?
        .tool_grammars(grammars, budget)
}

/// A triggered grammar waiting for its trigger.
struct Dormant {
    trigger: String,
    closing: String,
    /// The grammar's state at its start, copied on each activation.
    fresh: Constraint,
}

/// The grammar switched on by a trigger, and the text it has taken.
struct Active {
    constraint: Constraint,
    closing: String,
    /// The input so far, cut to the closing text's length.
    tail: String,
}

/// The reasoning budget's state.
struct Reasoning {
    budget: ReasoningBudget,
    /// The forced closing's grammar (its literal text).
    closing: Constraint,
    /// Tokens of reasoning written, once it is open.
    spent: Option<usize>,
    /// The output until the reasoning opens or closes, cut to the tag's length.
    tail: String,
    /// Closed (by the model or forced): nothing more to count.
    done: bool,
}

impl Reasoning {
    /// Reads one token's text; true when the budget is spent now.
    fn read(&mut self, text: &str) -> bool {
        if self.done {
            return false;
        }
        self.tail.push_str(text);
        let Some(spent) = self.spent.as_mut() else {
            if let Some(at) = self.tail.find(&self.budget.open) {
                self.spent = Some(0);
                self.tail.drain(..at + self.budget.open.len());
            } else {
                keep_end(&mut self.tail, self.budget.open.len());
            }
            return false;
        };
        *spent += 1;
        if self.tail.contains(&self.budget.close) {
            self.done = true;
            return false;
        }
        keep_end(&mut self.tail, self.budget.close.len());
        if *spent >= self.budget.tokens {
            self.done = true;
            return true;
        }
        false
    }

    /// Whether the budget is at most two tokens away: the steps after must not be sampled
    /// before this one is read (the closing would come a step late).
    fn is_near(&self) -> bool {
        !self.done
            && self
                .spent
                .is_some_and(|spent| spent + 2 >= self.budget.tokens)
    }
}

/// A request's freeform-tool grammars: each dormant until its trigger shows in the output,
/// then the one active constraint until the call's input and closing text are complete. Also
/// the reasoning budget, whose closing is forced as such a constraint.
#[derive(Default)]
pub struct ToolGrammars {
    dormant: Vec<Dormant>,
    active: Option<Active>,
    reasoning: Option<Reasoning>,
    /// The output since the last call closed, cut to what a trigger could still end in.
    tail: String,
    longest_trigger: usize,
}

/// Keeps the last `keep` bytes (or a little more, at a character boundary) of `text`.
fn keep_end(text: &mut String, keep: usize) {
    if text.len() > keep {
        let mut cut = text.len() - keep;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.drain(..cut);
    }
}

impl ToolGrammars {
    fn new(dormant: Vec<Dormant>) -> Self {
        let longest_trigger = dormant.iter().map(|d| d.trigger.len()).max().unwrap_or(0);
        Self {
            dormant,
            longest_trigger,
            ..Self::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.dormant.is_empty() && self.reasoning.is_none()
    }

    /// The grammar the next token must follow, while one is active.
    pub fn active(&mut self) -> Option<&mut Constraint> {
        self.active.as_mut().map(|active| &mut active.constraint)
    }

    /// Whether the next token depends on this one's reading: a grammar is active, or the output
    /// ends partway into a trigger (the next tokens may switch one on), so they must not be
    /// sampled ahead.
    pub fn is_watching(&self) -> bool {
        self.active.is_some()
            || self.reasoning.as_ref().is_some_and(Reasoning::is_near)
            || self.dormant.iter().any(|dormant| {
                let trigger = &dormant.trigger;
                (1..trigger.len().min(self.tail.len() + 1))
                    .any(|n| trigger.is_char_boundary(n) && self.tail.ends_with(&trigger[..n]))
            })
    }

    /// Reads one output token (`text`: its decoded text). An active grammar takes the token,
    /// and ends once complete (nothing can follow) or accepting right after the closing text
    /// (a loose tool grammar could go on); else the output is searched for a trigger, whose
    /// grammar then takes the text after it. A token the grammar cannot take (sampled before
    /// the trigger was read) ends the grammar instead: the answer goes on unconstrained.
    pub fn read(&mut self, tokenizer: &ChatTokenizer, token: u32, text: &str) {
        if self.active.is_none() {
            if let Some(reasoning) = self.reasoning.as_mut() {
                if reasoning.read(text) {
                    // The budget is spent: the family's end of thinking comes next.
                    self.active = Some(Active {
                        constraint: reasoning.closing.fresh(),
                        closing: String::new(),
                        tail: String::new(),
                    });
                    return;
                }
            }
        }
        if let Some(active) = self.active.as_mut() {
            active.tail.push_str(text);
            keep_end(&mut active.tail, active.closing.len());
            let done = match active.constraint.consume(token) {
                Err(error) => {
                    eprintln!(
                        "rmlx engine: a custom tool's grammar stopped constraining its input: {error}"
                    );
                    true
                }
                Ok(()) => {
                    active.constraint.is_finished()
                        || (active.tail.ends_with(&active.closing)
                            && active.constraint.is_accepting())
                }
            };
            if done {
                self.active = None;
            }
            return;
        }
        if self.dormant.is_empty() {
            return;
        }
        self.tail.push_str(text);
        let found = self
            .dormant
            .iter()
            .filter_map(|dormant| {
                let at = self.tail.find(dormant.trigger.as_str())?;
                Some((at + dormant.trigger.len(), dormant))
            })
            .min_by_key(|(end, _)| *end);
        let Some((end, dormant)) = found else {
            // Only the end of the output can still hold the start of a trigger.
            keep_end(&mut self.tail, self.longest_trigger);
            return;
        };
        let mut active = Active {
            constraint: dormant.fresh.fresh(),
            closing: dormant.closing.clone(),
            tail: String::new(),
        };
        // The rest of the token that completed the trigger is the input's first text.
        let rest = self.tail[end..].to_string();
        self.tail.clear();
        if !rest.is_empty() {
            let ids = match tokenizer.encode(&rest, false) {
                Ok(ids) => ids,
                Err(error) => {
                    eprintln!("rmlx engine: a custom tool's input could not be read: {error}");
                    return;
                }
            };
            if let Err(error) = ids.iter().try_for_each(|&id| active.constraint.consume(id)) {
                eprintln!("rmlx engine: a custom tool's input began outside its grammar: {error}");
                return;
            }
            active.tail = rest;
        }
        self.active = Some(active);
    }
}

/// One request's grammar state: the mask for the next token, advanced by each token read.
pub struct Constraint {
    matcher: Matcher,
    allowed_below: usize,
    /// Host buffer of the mask, reused every step.
    mask: Vec<f32>,
}

impl Constraint {
    /// The ids the grammar allows next (only EOS once the document is complete).
    pub fn allowed(&mut self) -> Result<Vec<u32>, ConstrainError> {
        let mut ids = Vec::new();
        self.allowed_set()?
            .iter_set_entries(|id| ids.extend((id < self.allowed_below).then_some(id as u32)));
        Ok(ids)
    }

    fn allowed_set(&mut self) -> Result<SimpleVob, ConstrainError> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|error| ConstrainError::Grammar(error.to_string()))
    }

    /// Additive mask for the next token: 0 for allowed ids, -inf otherwise, f32 `[vocab]`.
    pub fn mask(&mut self) -> Result<Array, ConstrainError> {
        let allowed = self.allowed_set()?;
        self.mask.fill(f32::NEG_INFINITY);
        let mut any = false;
        let (buffer, limit) = (&mut self.mask, self.allowed_below);
        allowed.iter_set_entries(|id| {
            if id < limit {
                buffer[id] = 0.0;
                any = true;
            }
        });
        if !any {
            // An all -inf row would sample NaN; say why instead.
            return Err(ConstrainError::Grammar(
                "no token can continue the document".into(),
            ));
        }
        Ok(Array::from_slice(&self.mask, &[self.mask.len() as i32]))
    }

    /// `logits` (`[.., vocab]`) plus the mask, in the logits' dtype.
    pub fn apply(&mut self, logits: &Array) -> Result<Array, ConstrainError> {
        let mask = self.mask()?.as_dtype(logits.dtype())?;
        Ok(ops::add(logits, &mask)?)
    }

    /// Advance past `token`, the one just sampled under this constraint's mask.
    pub fn consume(&mut self, token: u32) -> Result<(), ConstrainError> {
        self.matcher
            .consume_token(token)
            .map_err(|error| ConstrainError::Rejected {
                token,
                message: error.to_string(),
            })
    }

    /// The masks a speculative step needs: for the next token, then after each of `drafts`
    /// in turn, as far as the grammar allows them (the drafts after the first it refuses could
    /// never be kept, so they are cut). Returns the masks (one more than the drafts kept) and
    /// leaves the grammar where it was.
    pub fn draft_masks(&mut self, drafts: &[u32]) -> Result<Vec<Array>, ConstrainError> {
        fn grammar(error: impl std::fmt::Display) -> ConstrainError {
            ConstrainError::Grammar(error.to_string())
        }
        let mut masks = vec![self.mask()?];
        let allowed = self.matcher.validate_tokens(drafts).map_err(grammar)?;
        let mut consumed = 0;
        for &draft in &drafts[..allowed] {
            if self.is_finished() {
                // A complete document: nothing but EOS follows, and the row stops there.
                break;
            }
            self.consume(draft)?;
            consumed += 1;
            masks.push(self.mask()?);
        }
        self.matcher.rollback(consumed).map_err(grammar)?;
        Ok(masks)
    }

    /// The same grammar from its start (a triggered grammar's next activation).
    fn fresh(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.deep_clone(),
            allowed_below: self.allowed_below,
            mask: vec![f32::NEG_INFINITY; self.mask.len()],
        }
    }

    /// Whether what was read so far is a whole document (more may still follow).
    fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// True once the document is complete: nothing but EOS may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    //! The mask against a hand-written oracle over the fixture vocabulary, the end-of-document
    //! state, typed schema errors and the OpenAI wire shape. Generation: tests/constrained.rs.
    use super::*;
    use crate::chat::test_support::fixture;

    /// The fixture's tokenizer (1000 ids) under a model whose vocab is padded to 1024.
    const MODEL_VOCAB: usize = 1024;

    fn tokenizer() -> ChatTokenizer {
        ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap()
    }

    fn constraint(tokenizer: &ChatTokenizer, format: &ResponseFormat) -> Constraint {
        one_off_constraint(tokenizer, MODEL_VOCAB, format)
            .unwrap()
            .expect("a JSON format has a constraint")
    }

    fn id(tokenizer: &ChatTokenizer, text: &str) -> u32 {
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(ids.len(), 1, "{text:?} is one token");
        ids[0]
    }

    /// Could a JSON object start with `text`? Exact for the fixture's tokens that start with
    /// `{`: an object opener, optional whitespace, then nothing, `}`, or the start of a key.
    fn opens_an_object(text: &str) -> bool {
        let Some(rest) = text.strip_prefix('{') else {
            return false;
        };
        let rest = rest.trim_start_matches([' ', '\n', '\r', '\t']);
        let key_start = rest
            .strip_prefix('"')
            .is_some_and(|key| !key.contains(['"', '\\']) && !key.contains(char::is_control));
        rest.is_empty() || rest == "}" || key_start
    }

    #[test]
    fn json_object_allows_exactly_the_object_openers_first() {
        let tokenizer = tokenizer();
        let mut constraint = constraint(&tokenizer, &ResponseFormat::JsonObject);
        let expected: Vec<u32> = (0..tokenizer.vocab_size() as u32)
            .filter(|&id| opens_an_object(&tokenizer.decode(&[id], false).unwrap()))
            .collect();
        assert_eq!(expected, [id(&tokenizer, "{"), id(&tokenizer, "{\"")]);
        assert_eq!(constraint.allowed().unwrap(), expected);

        let mask = constraint.mask().unwrap();
        assert_eq!(mask.shape(), [MODEL_VOCAB as i32]);
        let zeros: Vec<u32> = (0..MODEL_VOCAB as u32)
            .filter(|&id| mask.as_slice::<f32>()[id as usize] == 0.0)
            .collect();
        assert_eq!(zeros, expected);
        let rest = mask.as_slice::<f32>().iter().filter(|v| **v != 0.0);
        assert!(rest.clone().all(|v| *v == f32::NEG_INFINITY));
        assert_eq!(rest.count(), MODEL_VOCAB - expected.len());
    }

    #[test]
    fn a_complete_document_allows_only_eos() {
        let tokenizer = tokenizer();
        let mut constraint = constraint(&tokenizer, &ResponseFormat::JsonObject);
        constraint.consume(id(&tokenizer, "{")).unwrap();
        assert!(!constraint.is_finished());
        let open = constraint.allowed().unwrap();
        assert!(open.contains(&id(&tokenizer, "}")));
        assert!(!tokenizer
            .eos_token_ids()
            .iter()
            .any(|eos| open.contains(eos)));

        constraint.consume(id(&tokenizer, "}")).unwrap();
        assert!(constraint.is_finished());
        let mut eos = tokenizer.eos_token_ids().to_vec();
        eos.sort_unstable();
        assert_eq!(constraint.allowed().unwrap(), eos);
    }

    #[test]
    fn a_token_outside_the_mask_is_rejected() {
        let tokenizer = tokenizer();
        let mut constraint = constraint(&tokenizer, &ResponseFormat::JsonObject);
        let error = constraint.consume(id(&tokenizer, "}")).unwrap_err();
        assert!(matches!(error, ConstrainError::Rejected { .. }), "{error}");
    }

    #[test]
    fn bad_schemas_are_typed_errors() {
        let tokenizer = tokenizer();
        let factory =
            ConstraintFactory::from_tokenizer(&tokenizer, MODEL_VOCAB, tokenizer.eos_token_ids())
                .unwrap();
        for schema in [
            json!({"type": "no-such-type"}),
            json!({"type": "object", "properties": 5}),
            json!({"$ref": "#/$defs/missing"}),
            json!("not a schema"),
        ] {
            let result = factory.constraint(&ResponseFormat::json_schema(schema.clone(), true));
            assert!(
                matches!(result, Err(ConstrainError::Schema(_))),
                "{schema}: {:?}",
                result.map(|c| c.is_some())
            );
            let engine_error = EngineError::from(ConstrainError::Schema("x".into()));
            assert_eq!(engine_error.kind(), "invalid_request");
        }
        // A format we cannot enforce fails only a strict request.
        let unknown_format = json!({"type": "string", "format": "no-such-format"});
        let strict = ResponseFormat::json_schema(unknown_format.clone(), true);
        assert!(matches!(
            factory.constraint(&strict),
            Err(ConstrainError::Schema(_))
        ));
        let lenient = ResponseFormat::json_schema(unknown_format, false);
        assert!(factory.constraint(&lenient).unwrap().is_some());
        assert!(factory.constraint(&ResponseFormat::Text).unwrap().is_none());
    }

    /// The trigger may end inside a token: the rest of that token is the input's start. The
    /// pipeline stops while the output ends partway into a trigger, and the grammar ends with
    /// its closing text, leaving the output free.
    #[test]
    fn a_trigger_ending_inside_a_token_hands_the_rest_to_the_grammar() {
        let tokenizer = tokenizer();
        let factory =
            ConstraintFactory::from_tokenizer(&tokenizer, MODEL_VOCAB, tokenizer.eos_token_ids())
                .unwrap();
        let grammar = TriggeredGrammar {
            trigger: "<in>".into(),
            input: ToolInputGrammar {
                tool: "t".into(),
                syntax: GrammarSyntax::Regex,
                definition: "[0-9]+".into(),
                closing: "!".into(),
            },
        };
        let mut tools = factory.tool_grammars(&[grammar], None).unwrap();
        assert!(!tools.is_empty() && !tools.is_watching());
        tools.read(&tokenizer, 0, "say ");
        assert!(!tools.is_watching());
        tools.read(&tokenizer, 0, "<");
        assert!(tools.is_watching() && tools.active().is_none());
        tools.read(&tokenizer, 0, "in>1");
        let allowed = tools.active().expect("switched on").allowed().unwrap();
        assert!(allowed.contains(&id(&tokenizer, "2")) && allowed.contains(&id(&tokenizer, "!")));
        assert!(!allowed.contains(&id(&tokenizer, "x")));
        tools.read(&tokenizer, id(&tokenizer, "2"), "2");
        tools.read(&tokenizer, id(&tokenizer, "!"), "!");
        assert!(tools.active().is_none() && !tools.is_watching());
        // And again on the next call.
        tools.read(&tokenizer, 0, "<in>");
        assert!(tools.active().is_some());
    }

    #[test]
    fn response_format_reads_the_openai_wire_shape() {
        let parse = |value: Value| serde_json::from_value::<ResponseFormat>(value).unwrap();
        assert_eq!(parse(json!({"type": "text"})), ResponseFormat::Text);
        assert_eq!(
            parse(json!({"type": "json_object"})),
            ResponseFormat::JsonObject
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let wire = json!({
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema, "strict": true}
        });
        let ResponseFormat::JsonSchema { json_schema } = parse(wire.clone()) else {
            panic!("not json_schema");
        };
        assert_eq!(
            (json_schema.name.as_str(), json_schema.strict),
            ("thing", Some(true))
        );
        assert_eq!(json_schema.schema, schema);
        let round_trip = serde_json::to_value(ResponseFormat::JsonSchema { json_schema }).unwrap();
        assert_eq!(round_trip, wire);
        assert!(serde_json::from_value::<ResponseFormat>(json!({"type": "yaml"})).is_err());
        let loose = json!({"type": "json_schema", "json_schema": {"name": "x", "strict": null}});
        let ResponseFormat::JsonSchema { json_schema } = parse(loose) else {
            panic!("not json_schema");
        };
        assert_eq!((json_schema.strict, json_schema.schema), (None, json!({})));
    }
}

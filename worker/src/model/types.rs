//! The conversation as the agent keeps it, and the tolerant parsing of what servers send back.
//!
//! "OpenAI-compatible" servers disagree in the details: `arguments` arrives as a JSON string, an
//! object, `""`, double-encoded or HTML-escaped; tool-call ids go missing; reasoning comes in four
//! shapes. Everything is normalised here so the agent loop and the output format see one shape.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::tokens::CallTokens;
use crate::pricing::{PriceTier, Tokens};

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    System(String),
    User(String),
    Assistant(AssistantMessage),
    Tool(ToolMessage),
}

/// A model reply.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AssistantMessage {
    /// Text content, as sent (inline `<think>` blocks stay in it).
    pub content: String,
    /// Reasoning the server returned outside the content.
    pub reasoning: Option<Reasoning>,
    pub tool_calls: Vec<ToolCall>,
}

/// Reasoning text and the shape it arrived in, so it can be sent back the way the provider expects.
#[derive(Debug, Clone, PartialEq)]
pub struct Reasoning {
    pub text: String,
    pub shape: ReasoningShape,
}

/// Where a server put its reasoning.
#[derive(Debug, Clone, PartialEq)]
pub enum ReasoningShape {
    /// `message.reasoning` (`DeepSeek`, Qwen, vLLM's newer parsers).
    Reasoning,
    /// `message.reasoning_content` (vLLM, Moonshot).
    ReasoningContent,
    /// `message.reasoning_details` (`OpenRouter`); kept verbatim because it carries signatures.
    Details(Value),
}

/// A tool call, normalised.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The server's id, or one we made up when it sent none.
    pub id: String,
    pub name: String,
    /// The arguments exactly as received (for sending back).
    pub raw_arguments: String,
    /// The parsed arguments object, or why they could not be parsed.
    pub arguments: Result<Map<String, Value>, String>,
}

/// A tool result (serialised as the turn log keeps it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolMessage {
    pub tool_call_id: String,
    pub name: String,
    pub content: String,
}

/// Token counts of one call or a whole conversation, in one convention whatever the server's:
/// `prompt_tokens` counts every input token, those read from a cache (`cached_tokens`) and those
/// written to one (`cache_write_tokens`) included, as `OpenAI` counts them; `completion_tokens`
/// counts every output token, reasoning (`reasoning_tokens`) included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub reasoning_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(default)]
    pub cache_write_tokens: u64,
}

impl Usage {
    pub fn add(&mut self, other: Self) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
        self.cached_tokens += other.cached_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
    }

    /// A completion's `usage`, normalised: `OpenAI`'s (`prompt_tokens` with the cache reads in
    /// `prompt_tokens_details.cached_tokens`), the same with Anthropic's cache fields beside it,
    /// as gateways in front of Anthropic send it (`cache_read_input_tokens`,
    /// `cache_creation_input_tokens`, counted inside `prompt_tokens`), or Anthropic's own
    /// (`input_tokens`, `output_tokens`, where the input excludes both cache counts).
    pub fn from_json(usage: &Value) -> Self {
        let count = |value: Option<&Value>| value.and_then(Value::as_u64).unwrap_or(0);
        let detail = |details: &str, key: &str| count(usage.get(details).and_then(|d| d.get(key)));
        let cache_read = count(usage.get("cache_read_input_tokens"));
        let cache_write = count(usage.get("cache_creation_input_tokens"))
            .max(detail("prompt_tokens_details", "cache_write_tokens"))
            .max(detail("prompt_tokens_details", "cache_creation_tokens"));
        let cached = detail("prompt_tokens_details", "cached_tokens").max(cache_read);
        let reasoning = detail("completion_tokens_details", "reasoning_tokens");
        if usage.get("prompt_tokens").is_none() && usage.get("input_tokens").is_some() {
            return Self {
                prompt_tokens: count(usage.get("input_tokens")) + cached + cache_write,
                completion_tokens: count(usage.get("output_tokens")),
                reasoning_tokens: reasoning,
                cached_tokens: cached,
                cache_write_tokens: cache_write,
            };
        }
        Self {
            prompt_tokens: count(usage.get("prompt_tokens")),
            completion_tokens: count(usage.get("completion_tokens")),
            reasoning_tokens: reasoning,
            cached_tokens: cached,
            cache_write_tokens: cache_write,
        }
    }

    /// The counts a price applies to.
    pub fn tokens(&self) -> Tokens {
        Tokens {
            prompt: self.prompt_tokens,
            cached: self.cached_tokens,
            cache_write: self.cache_write_tokens,
            completion: self.completion_tokens,
            reasoning: self.reasoning_tokens,
        }
    }

    /// The cost a provider reports with the usage (`OpenRouter`'s `usage.cost`, USD).
    pub fn reported_cost(usage: &Value) -> Option<f64> {
        usage
            .get("cost")
            .and_then(Value::as_f64)
            .filter(|cost| cost.is_finite() && *cost >= 0.0)
    }
}

/// One parsed completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub message: AssistantMessage,
    pub finish_reason: Option<String>,
    pub usage: Usage,
    /// What it cost, as the provider reported it with the usage (`OpenRouter`'s `usage.cost`,
    /// USD); the run's prices are applied by the client ([`super::ModelClient::cost_of`]).
    pub reported_cost: Option<f64>,
    /// The token ids and logprobs the server gave with it, if any (`spec.model.tokens`).
    pub tokens: Option<CallTokens>,
    /// The base URL of the endpoint that answered (set by the client that asked).
    pub endpoint: Option<String>,
    /// The service tier it was billed at: as the response's `service_tier` names it, else the
    /// one asked (set by the client that asked).
    pub tier: Option<PriceTier>,
}

impl Message {
    /// The message as the chat-completions API expects it.
    pub fn to_wire(&self) -> Value {
        match self {
            Self::System(content) => serde_json::json!({"role": "system", "content": content}),
            Self::User(content) => serde_json::json!({"role": "user", "content": content}),
            Self::Tool(tool) => serde_json::json!({
                "role": "tool",
                "tool_call_id": tool.tool_call_id,
                "content": tool.content,
            }),
            Self::Assistant(message) => {
                serde_json::to_value(WireAssistant(message)).expect("a reply serialises")
            }
        }
    }
}

/// An assistant message as the chat-completions API expects it, serialised straight from the
/// message (the turn log writes each reply so, without building a [`Value`] first).
#[derive(Debug)]
pub struct WireAssistant<'a>(pub &'a AssistantMessage);

impl Serialize for WireAssistant<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;

        /// A tool call in the wire shape.
        #[derive(Serialize)]
        struct WireCall<'a> {
            id: &'a str,
            r#type: &'static str,
            function: WireFunction<'a>,
        }
        #[derive(Serialize)]
        struct WireFunction<'a> {
            name: &'a str,
            arguments: &'a str,
        }

        let message = self.0;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("role", "assistant")?;
        // Always send `content`: some servers (llama.cpp among them) answer 500 to an assistant
        // message that has tool calls but no content key.
        map.serialize_entry("content", &message.content)?;
        if !message.tool_calls.is_empty() {
            let calls: Vec<WireCall<'_>> = message
                .tool_calls
                .iter()
                .map(|call| WireCall {
                    id: &call.id,
                    r#type: "function",
                    function: WireFunction {
                        name: &call.name,
                        arguments: &call.raw_arguments,
                    },
                })
                .collect();
            map.serialize_entry("tool_calls", &calls)?;
        }
        if let Some(reasoning) = &message.reasoning {
            match &reasoning.shape {
                ReasoningShape::Reasoning => map.serialize_entry("reasoning", &reasoning.text)?,
                ReasoningShape::ReasoningContent => {
                    map.serialize_entry("reasoning_content", &reasoning.text)?;
                }
                ReasoningShape::Details(details) => {
                    map.serialize_entry("reasoning_details", details)?;
                }
            }
        }
        map.end()
    }
}

/// Why a response body could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseFailure {
    /// Not JSON, or JSON of the wrong shape.
    Malformed(String),
    /// Valid JSON with no choice in it (some servers do this under load).
    EmptyChoices,
}

/// Parses a non-streaming chat-completions response body, and its tokens when `read_tokens`
/// (a run keeping them asked for them).
///
/// The body is read into the few parts used ([`Envelope`]), skipping the rest unread: a
/// response's token ids and logprobs (thousands of numbers with tokens kept) are never built
/// into a `Value`. A body of another shape is read again as a `Value`, which says what is wrong.
pub fn parse_completion(
    body: &[u8],
    turn: usize,
    read_tokens: bool,
) -> Result<Completion, ParseFailure> {
    let Ok(envelope) = serde_json::from_slice::<Envelope>(body) else {
        return parse_completion_value(body, turn, read_tokens);
    };
    let choice = match envelope.choices {
        Some(choices) => choices
            .into_iter()
            .next()
            .ok_or(ParseFailure::EmptyChoices)?,
        None => return Err(ParseFailure::EmptyChoices),
    };
    let message = choice
        .message
        .ok_or_else(|| ParseFailure::Malformed("choice has no `message`".into()))?;
    let usage = envelope
        .usage
        .as_ref()
        .map(Usage::from_json)
        .unwrap_or_default();
    let tokens = read_tokens
        .then(|| {
            CallTokens::from_response_bytes(body, usage.prompt_tokens, usage.completion_tokens)
        })
        .filter(|tokens| *tokens != CallTokens::default());
    Ok(Completion {
        message: parse_assistant(&message, turn),
        finish_reason: choice
            .finish_reason
            .as_ref()
            .and_then(Value::as_str)
            .map(str::to_owned),
        usage,
        reported_cost: envelope.usage.as_ref().and_then(Usage::reported_cost),
        tokens,
        endpoint: None,
        tier: envelope
            .service_tier
            .as_deref()
            .and_then(PriceTier::from_service_tier),
    })
}

/// The parts of a chat-completions response [`parse_completion`] uses; serde skips the others.
#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    choices: Option<Vec<ChoiceEnvelope>>,
    #[serde(default, deserialize_with = "present")]
    usage: Option<Value>,
    #[serde(default)]
    service_tier: Option<String>,
}

#[derive(Deserialize)]
struct ChoiceEnvelope {
    #[serde(default, deserialize_with = "present")]
    message: Option<Value>,
    #[serde(default)]
    finish_reason: Option<Value>,
}

/// A field that is there, `null` included (a `null` message is read as an empty one, as the
/// `Value` path reads it).
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

/// [`parse_completion`] through a `Value`, for bodies of another shape than [`Envelope`]'s.
fn parse_completion_value(
    body: &[u8],
    turn: usize,
    read_tokens: bool,
) -> Result<Completion, ParseFailure> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|err| ParseFailure::Malformed(format!("response is not JSON: {err}")))?;
    let choice = match value.get("choices") {
        Some(Value::Array(choices)) if choices.is_empty() => {
            return Err(ParseFailure::EmptyChoices);
        }
        Some(Value::Array(choices)) => &choices[0],
        None | Some(Value::Null) => return Err(ParseFailure::EmptyChoices),
        Some(other) => {
            return Err(ParseFailure::Malformed(format!(
                "`choices` is not an array: {other}"
            )));
        }
    };
    let message = choice
        .get("message")
        .ok_or_else(|| ParseFailure::Malformed("choice has no `message`".into()))?;
    let usage = value.get("usage").map(Usage::from_json).unwrap_or_default();
    let tokens = read_tokens
        .then(|| CallTokens::from_response(&value, usage.prompt_tokens, usage.completion_tokens))
        .filter(|tokens| *tokens != CallTokens::default());
    Ok(Completion {
        message: parse_assistant(message, turn),
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned),
        usage,
        reported_cost: value.get("usage").and_then(Usage::reported_cost),
        tokens,
        endpoint: None,
        tier: value
            .get("service_tier")
            .and_then(Value::as_str)
            .and_then(PriceTier::from_service_tier),
    })
}

/// Reads an assistant message in any of the shapes servers send.
pub(crate) fn parse_assistant(message: &Value, turn: usize) -> AssistantMessage {
    let content = content_text(message.get("content"));
    let reasoning = parse_reasoning(message);
    let tool_calls = match message.get("tool_calls") {
        Some(Value::Array(calls)) => calls
            .iter()
            .filter(|call| call.is_object())
            .enumerate()
            .map(|(position, call)| {
                let function = call.get("function").unwrap_or(call);
                let name = function
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let id = call
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|id| !id.is_empty())
                    .map_or_else(|| synthetic_call_id(turn, position), str::to_owned);
                tool_call(id, name, function.get("arguments"))
            })
            .collect(),
        _ => Vec::new(),
    };
    AssistantMessage {
        content,
        reasoning,
        tool_calls,
    }
}

/// Builds a tool call from whatever `arguments` the server sent.
pub fn tool_call(id: String, name: String, arguments: Option<&Value>) -> ToolCall {
    let (raw_arguments, arguments) = match arguments {
        None | Some(Value::Null) => ("{}".to_owned(), Ok(Map::new())),
        Some(Value::Object(object)) => (
            Value::Object(object.clone()).to_string(),
            Ok(object.clone()),
        ),
        Some(Value::String(text)) => (text.clone(), parse_arguments(text)),
        Some(other) => (
            other.to_string(),
            Err(format!("arguments must be a JSON object, got {other}")),
        ),
    };
    ToolCall {
        id,
        name,
        raw_arguments,
        arguments,
    }
}

/// An id for a tool call that arrived without one; unique within the conversation.
pub(crate) fn synthetic_call_id(turn: usize, position: usize) -> String {
    format!("call_{turn}_{position}")
}

/// Parses an `arguments` string: `""` is `{}`, double-encoded JSON is unwrapped, and HTML-escaped
/// JSON (`&quot;`) is unescaped, as small models produce all three.
pub fn parse_arguments(text: &str) -> Result<Map<String, Value>, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Ok(Map::new());
    }
    let first_error = match serde_json::from_str::<Value>(trimmed) {
        Ok(Value::Object(object)) => return Ok(object),
        Ok(Value::String(inner)) => match serde_json::from_str::<Value>(&inner) {
            Ok(Value::Object(object)) => return Ok(object),
            _ => format!("arguments are a JSON string, not an object: {inner:?}"),
        },
        Ok(other) => format!("arguments must be a JSON object, got {other}"),
        Err(err) => format!("arguments are not valid JSON ({err})"),
    };
    if trimmed.contains('&') {
        let unescaped = trimmed
            .replace("&quot;", "\"")
            .replace("&#34;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&");
        if let Ok(Value::Object(object)) = serde_json::from_str::<Value>(&unescaped) {
            return Ok(object);
        }
    }
    Err(first_error)
}

/// Content may be a string, null, or a list of `{type: text, text}` parts.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| {
                part.get("text")
                    .and_then(Value::as_str)
                    .or_else(|| part.as_str())
            })
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn parse_reasoning(message: &Value) -> Option<Reasoning> {
    let non_blank = |key: &str| {
        message
            .get(key)
            .and_then(Value::as_str)
            .filter(|text| !text.trim().is_empty())
            .map(str::to_owned)
    };
    if let Some(Value::Array(details)) = message.get("reasoning_details") {
        let text = details
            .iter()
            .filter_map(|detail| {
                ["text", "summary", "content"]
                    .iter()
                    .find_map(|key| detail.get(*key).and_then(Value::as_str))
            })
            .filter(|text| !text.trim().is_empty())
            .collect::<Vec<_>>()
            .join("\n\n");
        if !text.is_empty() {
            return Some(Reasoning {
                text,
                shape: ReasoningShape::Details(Value::Array(details.clone())),
            });
        }
    }
    if let Some(text) = non_blank("reasoning_content") {
        return Some(Reasoning {
            text,
            shape: ReasoningShape::ReasoningContent,
        });
    }
    non_blank("reasoning").map(|text| Reasoning {
        text,
        shape: ReasoningShape::Reasoning,
    })
}

/// The text of the first `<think>…</think>` block in content, if any and non-blank.
pub fn inline_think(content: &str) -> Option<&str> {
    let start = content.find("<think>")? + "<think>".len();
    let end = content[start..]
        .find("</think>")
        .map_or(content.len(), |end| start + end);
    let text = content[start..end].trim();
    (!text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(message: &Value) -> Vec<u8> {
        json!({"choices": [{"message": message, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 7,
                         "completion_tokens_details": {"reasoning_tokens": 3}}})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn arguments_are_accepted_in_every_tolerated_shape() {
        let expected: Map<String, Value> = json!({"command": "ls"}).as_object().unwrap().clone();
        for arguments in [
            json!({"command": "ls"}),
            json!("{\"command\": \"ls\"}"),
            json!("\"{\\\"command\\\": \\\"ls\\\"}\""),
            json!("{&quot;command&quot;: &quot;ls&quot;}"),
        ] {
            let message = json!({"tool_calls": [{"id": "a", "function": {"name": "terminal", "arguments": arguments}}]});
            let completion = parse_completion(&body(&message), 0, true).unwrap();
            assert_eq!(
                completion.message.tool_calls[0].arguments,
                Ok(expected.clone()),
                "{arguments}"
            );
        }
        for empty in [json!(""), json!(null), json!("  ")] {
            let message =
                json!({"tool_calls": [{"id": "a", "function": {"name": "t", "arguments": empty}}]});
            let completion = parse_completion(&body(&message), 0, true).unwrap();
            assert_eq!(completion.message.tool_calls[0].arguments, Ok(Map::new()));
        }
        let message =
            json!({"tool_calls": [{"id": "a", "function": {"name": "t", "arguments": "{oops"}}]});
        let completion = parse_completion(&body(&message), 0, true).unwrap();
        assert!(completion.message.tool_calls[0].arguments.is_err());
    }

    #[test]
    fn missing_call_ids_are_made_up_uniquely() {
        let message = json!({"content": null, "tool_calls": [
            {"function": {"name": "a", "arguments": "{}"}},
            {"id": "", "function": {"name": "b", "arguments": "{}"}},
        ]});
        let completion = parse_completion(&body(&message), 3, true).unwrap();
        let ids: Vec<_> = completion
            .message
            .tool_calls
            .iter()
            .map(|call| call.id.as_str())
            .collect();
        assert_eq!(ids, ["call_3_0", "call_3_1"]);
        assert_eq!(completion.message.content, "");
    }

    #[test]
    fn reasoning_is_read_from_all_three_fields() {
        let cases = [
            (json!({"content": "x", "reasoning": "r1"}), "r1"),
            (json!({"content": "x", "reasoning_content": "r2"}), "r2"),
            (
                json!({"content": "x", "reasoning_details": [{"type": "reasoning.text", "text": "r3"}, {"type": "reasoning.summary", "summary": "r4"}]}),
                "r3\n\nr4",
            ),
        ];
        for (message, expected) in cases {
            let completion = parse_completion(&body(&message), 0, true).unwrap();
            assert_eq!(completion.message.reasoning.unwrap().text, expected);
        }
        assert_eq!(inline_think("<think>\n r5 \n</think>answer"), Some("r5"));
        assert_eq!(inline_think("<think>\n</think>answer"), None);
    }

    #[test]
    fn reasoning_goes_back_in_the_shape_it_came() {
        let details = json!([{"type": "reasoning.encrypted", "data": "sig", "text": "t"}]);
        let message = json!({"content": "", "reasoning_details": details});
        let completion = parse_completion(&body(&message), 0, true).unwrap();
        let wire = Message::Assistant(completion.message).to_wire();
        assert_eq!(wire["reasoning_details"], details);
        assert_eq!(wire["content"], "");
    }

    #[test]
    fn the_envelope_reads_every_body_as_the_value_path_does() {
        let bodies = [
            json!({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.5}}),
            json!({"choices": [{"message": null, "finish_reason": 7}], "usage": null}),
            json!({"choices": [{"message": {"tool_calls": [{"id": "a", "function": {"name": "t", "arguments": "{}"}}]}}],
                   "prompt_token_ids": [1, 2, 3], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}),
            json!({"choices": [{"finish_reason": "stop"}]}),
            json!({"choices": "none"}),
            json!({"choices": [5]}),
            json!({"choices": null}),
            json!({}),
            json!([1]),
        ];
        for body in bodies {
            let bytes = serde_json::to_vec(&body).unwrap();
            for read_tokens in [true, false] {
                assert_eq!(
                    parse_completion(&bytes, 1, read_tokens),
                    parse_completion_value(&bytes, 1, read_tokens),
                    "{body}"
                );
            }
        }
    }

    #[test]
    fn empty_and_malformed_bodies_are_told_apart() {
        assert_eq!(
            parse_completion(br#"{"choices": []}"#, 0, true),
            Err(ParseFailure::EmptyChoices)
        );
        assert!(matches!(
            parse_completion(b"{\"choices\": [", 0, true),
            Err(ParseFailure::Malformed(_))
        ));
        let usage = parse_completion(&body(&json!({"content": "hi"})), 0, true)
            .unwrap()
            .usage;
        assert_eq!(
            usage,
            Usage {
                prompt_tokens: 5,
                completion_tokens: 7,
                reasoning_tokens: 3,
                ..Usage::default()
            }
        );
    }
}

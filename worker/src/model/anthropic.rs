//! Anthropic's Messages API, as its Message Batches take it: a chat-completions request
//! translated into the parameters of one message, and the message it answers translated back
//! into the chat completion the client reads. Pure functions of JSON, so the live client (which
//! speaks chat completions) and the batch path see one shape.
//!
//! Requests: `system`/`developer` messages become `system` text blocks; a tool result becomes a
//! `tool_result` block of a user turn (consecutive ones, and a user message after them, share
//! that turn, as the API wants tool results first in the turn that follows the tool use); an
//! assistant's tool calls become `tool_use` blocks whose `input` is the parsed arguments
//! (arguments that are not a JSON object, which a small model may write, are sent as
//! `{"invalid_arguments": "<text>"}` so that the history stays as it was); tools get an
//! `input_schema`; `tool_choice` and `parallel_tool_calls` become Anthropic's `tool_choice`;
//! `stop` becomes `stop_sequences`; `max_tokens` is required ([`DEFAULT_MAX_TOKENS`] when unset).
//! A `prompt_cache_key` asks for caching the way Anthropic does it: a `cache_control`
//! breakpoint on the last block, so the next round of the conversation reads its prefix from
//! the cache. Fields of chat completions alone (`stream`, `service_tier`, `reasoning_effort`,
//! …) are dropped; any other field (say `top_k` or `thinking` from `spec.model.extraBody`) is
//! passed as it is.
//!
//! Answers: text blocks joined as the content, `tool_use` blocks as tool calls (arguments the
//! input's JSON), `thinking` blocks as `reasoning_content` (kept as text: their signatures are
//! not sent back), `stop_reason` as `finish_reason`, and `usage` as Anthropic gives it (which
//! [`super::types::Usage::from_json`] reads, cache reads and writes included).

use serde_json::{Map, Value, json};

/// The API version every request names (`anthropic-version`).
pub const VERSION: &str = "2023-06-01";

/// `max_tokens` of a request that sets none: Anthropic requires one.
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

/// Fields of a chat-completions request with no Messages equivalent, dropped.
const CHAT_ONLY: &[&str] = &[
    "stream",
    "stream_options",
    "service_tier",
    "reasoning_effort",
    "reasoning",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "n",
];

/// The Messages parameters of the chat-completions request `chat`, or why it has none.
pub fn messages_params(chat: &Value) -> Result<Value, String> {
    let chat = chat.as_object().ok_or("the request is not a JSON object")?;
    if chat.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err("n above 1: a message has one answer".into());
    }
    let mut system = Vec::new();
    let mut messages: Vec<(&'static str, Vec<Value>)> = Vec::new();
    let wire = chat
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("the request has no messages")?;
    for (index, message) in wire.iter().enumerate() {
        let role = message["role"].as_str().unwrap_or_default();
        let at = |error: String| format!("messages[{index}] ({role}): {error}");
        let (role, blocks) = match role {
            "system" | "developer" => {
                system.extend(content_blocks(&message["content"]).map_err(at)?);
                continue;
            }
            "user" => ("user", content_blocks(&message["content"]).map_err(at)?),
            "assistant" => ("assistant", assistant_blocks(message).map_err(at)?),
            "tool" => ("user", vec![tool_result(message)]),
            other => return Err(at(format!("the role {other:?} has no Messages equivalent"))),
        };
        if blocks.is_empty() {
            continue;
        }
        match messages.last_mut() {
            Some((last, held)) if *last == role => held.extend(blocks),
            _ => messages.push((role, blocks)),
        }
    }
    if chat.contains_key("prompt_cache_key")
        && let Some(last) = messages
            .last_mut()
            .and_then(|(_, blocks)| blocks.last_mut())
    {
        last["cache_control"] = json!({"type": "ephemeral"});
    }

    let mut params = Map::new();
    for (key, value) in chat {
        match key.as_str() {
            "messages" | "prompt_cache_key" | "max_completion_tokens" | "parallel_tool_calls" => {}
            "tools" => {
                params.insert(key.clone(), tools(value)?);
            }
            "tool_choice" => {
                params.insert(key.clone(), tool_choice(value)?);
            }
            "stop" => {
                let stops = match value {
                    Value::String(stop) => vec![Value::String(stop.clone())],
                    Value::Array(stops) => stops.clone(),
                    _ => Vec::new(),
                };
                params.insert("stop_sequences".into(), Value::Array(stops));
            }
            "user" => {
                params.insert("metadata".into(), json!({"user_id": value}));
            }
            key if CHAT_ONLY.contains(&key) => {}
            _ => {
                params.insert(key.clone(), value.clone());
            }
        }
    }
    if !params.contains_key("max_tokens") {
        let max_tokens = chat
            .get("max_completion_tokens")
            .cloned()
            .unwrap_or_else(|| DEFAULT_MAX_TOKENS.into());
        params.insert("max_tokens".into(), max_tokens);
    }
    if chat.get("parallel_tool_calls") == Some(&Value::Bool(false)) && params.contains_key("tools")
    {
        let choice = params
            .entry("tool_choice")
            .or_insert_with(|| json!({"type": "auto"}));
        choice["disable_parallel_tool_use"] = true.into();
    }
    if !system.is_empty() {
        params.insert("system".into(), Value::Array(system));
    }
    let messages = messages
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    params.insert("messages".into(), Value::Array(messages));
    Ok(Value::Object(params))
}

/// A message's content as Messages blocks: its text, its text and image parts.
fn content_blocks(content: &Value) -> Result<Vec<Value>, String> {
    match content {
        Value::Null => Ok(Vec::new()),
        Value::String(text) if text.is_empty() => Ok(Vec::new()),
        Value::String(text) => Ok(vec![json!({"type": "text", "text": text})]),
        Value::Array(parts) => parts.iter().map(content_part).collect(),
        other => Err(format!("content of an unknown shape: {other}")),
    }
}

fn content_part(part: &Value) -> Result<Value, String> {
    match part["type"].as_str() {
        Some("text") => Ok(json!({"type": "text", "text": part["text"]})),
        Some("image_url") => {
            let url = part["image_url"]["url"]
                .as_str()
                .or_else(|| part["image_url"].as_str())
                .ok_or("an image part without a URL")?;
            let source = match url
                .strip_prefix("data:")
                .and_then(|data| data.split_once(";base64,"))
            {
                Some((media_type, data)) => {
                    json!({"type": "base64", "media_type": media_type, "data": data})
                }
                None => json!({"type": "url", "url": url}),
            };
            Ok(json!({"type": "image", "source": source}))
        }
        other => Err(format!("a content part of type {other:?}")),
    }
}

/// An assistant message's text and tool calls as blocks.
fn assistant_blocks(message: &Value) -> Result<Vec<Value>, String> {
    let mut blocks = content_blocks(&message["content"])?;
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        let function = &call["function"];
        let input = match &function["arguments"] {
            Value::Object(arguments) => Value::Object(arguments.clone()),
            Value::String(raw) if raw.trim().is_empty() => json!({}),
            Value::String(raw) => match serde_json::from_str::<Value>(raw) {
                Ok(Value::Object(arguments)) => Value::Object(arguments),
                _ => json!({"invalid_arguments": raw}),
            },
            _ => json!({}),
        };
        blocks.push(json!({
            "type": "tool_use",
            "id": call["id"],
            "name": function["name"],
            "input": input,
        }));
    }
    Ok(blocks)
}

fn tool_result(message: &Value) -> Value {
    let content = match &message["content"] {
        Value::String(text) => Value::String(text.clone()),
        Value::Null => Value::String(String::new()),
        other => Value::String(other.to_string()),
    };
    json!({"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": content})
}

/// Chat-completions tools as Messages tools.
fn tools(tools: &Value) -> Result<Value, String> {
    let tools = tools.as_array().ok_or("tools is not a list")?;
    let translated = tools
        .iter()
        .map(|tool| {
            let function = tool
                .get("function")
                .ok_or_else(|| format!("a tool of type {} has no function", tool["type"]))?;
            let mut translated = Map::new();
            translated.insert("name".into(), function["name"].clone());
            if let Some(description) = function.get("description") {
                translated.insert("description".into(), description.clone());
            }
            let schema = function
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            translated.insert("input_schema".into(), schema);
            Ok(Value::Object(translated))
        })
        .collect::<Result<_, String>>()?;
    Ok(Value::Array(translated))
}

fn tool_choice(choice: &Value) -> Result<Value, String> {
    match choice {
        Value::String(mode) => match mode.as_str() {
            "auto" => Ok(json!({"type": "auto"})),
            "required" => Ok(json!({"type": "any"})),
            "none" => Ok(json!({"type": "none"})),
            other => Err(format!("tool_choice {other:?}")),
        },
        Value::Object(named) => match named["function"]["name"].as_str() {
            Some(name) => Ok(json!({"type": "tool", "name": name})),
            // Already in Anthropic's shape (from extraBody).
            None => Ok(choice.clone()),
        },
        other => Err(format!("tool_choice {other}")),
    }
}

/// The HTTP status an error of type `kind` comes with, as Anthropic documents them: how a
/// batch line's error is classed as a live call's would be.
pub fn error_status(kind: &str) -> u16 {
    match kind {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "billing_error" => 402,
        "permission_error" => 403,
        "not_found_error" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "timeout_error" => 504,
        "overloaded_error" => 529,
        _ => 500,
    }
}

/// The chat completion of the Messages answer `message`.
pub fn chat_completion(message: &Value) -> Value {
    let (mut text, mut reasoning, mut tool_calls) = (String::new(), String::new(), Vec::new());
    for block in message["content"].as_array().into_iter().flatten() {
        match block["type"].as_str() {
            Some("text") => text.push_str(block["text"].as_str().unwrap_or_default()),
            Some("thinking") => reasoning.push_str(block["thinking"].as_str().unwrap_or_default()),
            Some("tool_use") => tool_calls.push(json!({
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": block["input"].to_string()},
            })),
            _ => {}
        }
    }
    let finish_reason = match message["stop_reason"].as_str() {
        Some("end_turn" | "stop_sequence" | "pause_turn") | None => "stop",
        Some("max_tokens" | "model_context_window_exceeded") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        Some(other) => other,
    };
    let mut reply = Map::new();
    reply.insert("role".into(), "assistant".into());
    reply.insert(
        "content".into(),
        if text.is_empty() && !tool_calls.is_empty() {
            Value::Null
        } else {
            text.into()
        },
    );
    if !tool_calls.is_empty() {
        reply.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    if !reasoning.is_empty() {
        reply.insert("reasoning_content".into(), reasoning.into());
    }
    json!({
        "id": message["id"],
        "object": "chat.completion",
        "model": message["model"],
        "choices": [{"index": 0, "message": reply, "finish_reason": finish_reason}],
        "usage": message["usage"],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_loop_history_becomes_alternating_turns_with_tool_results_first() {
        let chat = json!({
            "model": "claude", "temperature": 0.2, "stream": true, "service_tier": "flex",
            "prompt_cache_key": "row-1", "top_k": 5, "parallel_tool_calls": false,
            "stop": "END",
            "tools": [{"type": "function", "function": {"name": "terminal",
                "description": "runs a command", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "terminal"}},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "t1", "type": "function",
                     "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}},
                    {"id": "t2", "type": "function",
                     "function": {"name": "terminal", "arguments": "{oops"}}]},
                {"role": "tool", "tool_call_id": "t1", "name": "terminal", "content": "a.txt"},
                {"role": "tool", "tool_call_id": "t2", "name": "terminal", "content": "bad"},
                {"role": "user", "content": "and now?"},
            ],
        });
        let params = messages_params(&chat).unwrap();
        assert_eq!(
            params,
            json!({
                "model": "claude", "temperature": 0.2, "top_k": 5,
                "stop_sequences": ["END"],
                "tools": [{"name": "terminal", "description": "runs a command",
                           "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "terminal",
                                "disable_parallel_tool_use": true},
                "max_tokens": DEFAULT_MAX_TOKENS,
                "system": [{"type": "text", "text": "be brief"}],
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "list files"}]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "terminal",
                         "input": {"command": "ls"}},
                        {"type": "tool_use", "id": "t2", "name": "terminal",
                         "input": {"invalid_arguments": "{oops"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"},
                        {"type": "tool_result", "tool_use_id": "t2", "content": "bad"},
                        {"type": "text", "text": "and now?",
                         "cache_control": {"type": "ephemeral"}}]},
                ],
            })
        );
    }

    #[test]
    fn requests_without_an_equivalent_are_named() {
        let refused = [
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
            json!({"messages": [{"role": "function", "content": "x"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}),
            json!({"model": "m"}),
        ];
        for chat in refused {
            assert!(messages_params(&chat).is_err(), "{chat}");
        }
        let image = json!({"max_tokens": 9, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]});
        let params = messages_params(&image).unwrap();
        assert_eq!(params["max_tokens"], 9);
        assert_eq!(
            params["messages"][0]["content"][1]["source"],
            json!({"type": "base64", "media_type": "image/png", "data": "AAAA"})
        );
        assert_eq!(params["messages"][0]["content"][2]["source"]["type"], "url");
    }

    #[test]
    fn a_message_becomes_the_chat_completion_the_client_reads() {
        let message = json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
            "content": [
                {"type": "thinking", "thinking": "ls is enough", "signature": "s"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "terminal",
                 "input": {"command": "ls"}},
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 90,
                      "cache_creation_input_tokens": 0},
        });
        let completion = chat_completion(&message);
        let body = serde_json::to_vec(&completion).unwrap();
        let parsed = super::super::types::parse_completion(&body, 0, false).unwrap();
        assert_eq!(parsed.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(parsed.message.content, "Listing.");
        assert_eq!(parsed.message.tool_calls.len(), 1);
        assert_eq!(parsed.message.tool_calls[0].id, "toolu_1");
        assert_eq!(
            parsed.message.tool_calls[0].arguments.as_ref().unwrap()["command"],
            "ls"
        );
        assert_eq!(
            parsed.message.reasoning.as_ref().map(|r| r.text.as_str()),
            Some("ls is enough")
        );
        assert_eq!(
            (parsed.usage.prompt_tokens, parsed.usage.cached_tokens),
            (100, 90)
        );
        for (stop, finish) in [
            ("end_turn", "stop"),
            ("max_tokens", "length"),
            ("refusal", "content_filter"),
        ] {
            let message = json!({"content": [{"type": "text", "text": "x"}], "stop_reason": stop});
            assert_eq!(
                chat_completion(&message)["choices"][0]["finish_reason"],
                finish
            );
        }
    }
}

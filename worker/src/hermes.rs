//! The Hermes trajectory format: a finished conversation as one training record.
//!
//! Compatibility matters here: trainers and datasets built on the reference read these lines, so
//! keys, their order, the `ShareGPT` roles, the system-prompt template and the `<think>`,
//! `<tool_call>` and `<tool_response>` encodings follow the reference byte for byte (reference
//! sections 7.2 and 11), with JSON written as Python writes it ([`crate::pyjson`]). Our additions
//! come after the reference's keys.

use serde_json::{Map, Value, json};

use crate::agent::Conversation;
use crate::model::{AssistantMessage, Message, ToolMessage};
use crate::tools::ToolSpec;

const SYSTEM_PROMPT_HEAD: &str = "You are a function calling AI model. You are provided with function signatures within <tools> </tools> XML tags. You may call one or more functions to assist with the user query. If available tools are not relevant in assisting with user query, just respond in natural conversational language. Don't make assumptions about what values to plug into functions. After calling & executing the functions, you will be provided with function results within <tool_response> </tool_response> XML tags. Here are the available tools:\n<tools>\n";

const SYSTEM_PROMPT_TAIL: &str = "\n</tools>\nFor each function call return a JSON object, with the following pydantic model json schema for each:\n{'title': 'FunctionCall', 'type': 'object', 'properties': {'name': {'title': 'Name', 'type': 'string'}, 'arguments': {'title': 'Arguments', 'type': 'object'}}, 'required': ['name', 'arguments']}\nEach function call should be enclosed within <tool_call> </tool_call> XML tags.\nExample:\n<tool_call>\n{'name': <function-name>,'arguments': <args-dict>}\n</tool_call>";

/// The Hermes function-calling system turn listing the offered tools.
pub fn system_turn(tools: &[ToolSpec]) -> String {
    let listed: Vec<Value> = tools
        .iter()
        .map(|tool| {
            json!({
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
                "required": null,
            })
        })
        .collect();
    format!(
        "{SYSTEM_PROMPT_HEAD}{}{SYSTEM_PROMPT_TAIL}",
        crate::pyjson::to_string(&listed)
    )
}

fn turn(from: &str, value: impl Into<Value>) -> Value {
    let value = value.into();
    json!({"from": from, "value": value})
}

/// The `ShareGPT` turns of a conversation: system, human, then gpt / tool / human turns.
pub fn sharegpt(conversation: &Conversation, tools: &[ToolSpec]) -> Vec<Value> {
    let mut turns = vec![turn("system", system_turn(tools))];
    let mut messages = conversation.messages.iter().peekable();
    while let Some(message) = messages.next() {
        match message {
            Message::System(_) => {}
            Message::User(content) => turns.push(turn("human", content.clone())),
            Message::Assistant(assistant) if assistant.tool_calls.is_empty() => {
                turns.push(turn("gpt", final_turn_value(assistant)));
            }
            Message::Assistant(assistant) => {
                turns.push(turn("gpt", tool_call_turn_value(assistant)));
                let mut responses = Vec::new();
                while let Some(Message::Tool(result)) = messages.peek() {
                    responses.push(tool_response(result, assistant, responses.len()));
                    messages.next();
                }
                if !responses.is_empty() {
                    turns.push(turn("tool", responses.join("\n")));
                }
            }
            // A tool message without a preceding call cannot happen in our loop; show it anyway.
            Message::Tool(result) => turns.push(turn(
                "tool",
                tool_response(result, &AssistantMessage::default(), 0),
            )),
        }
    }
    turns
}

fn think_prefix(assistant: &AssistantMessage) -> String {
    match &assistant.reasoning {
        Some(reasoning) if !reasoning.text.trim().is_empty() => {
            format!("<think>\n{}\n</think>\n", reasoning.text)
        }
        _ => String::new(),
    }
}

fn convert_scratchpad(content: &str) -> String {
    content
        .replace("<REASONING_SCRATCHPAD>", "<think>")
        .replace("</REASONING_SCRATCHPAD>", "</think>")
}

fn ensure_think(value: String) -> String {
    if value.contains("<think>") {
        value
    } else {
        format!("<think>\n</think>\n{value}")
    }
}

fn tool_call_turn_value(assistant: &AssistantMessage) -> String {
    let mut value = think_prefix(assistant);
    if !assistant.content.trim().is_empty() {
        value.push_str(&convert_scratchpad(&assistant.content));
        value.push('\n');
    }
    for call in &assistant.tool_calls {
        let arguments = call
            .arguments
            .clone()
            .map_or_else(|_| Value::Object(Map::new()), Value::Object);
        let payload = json!({"name": call.name, "arguments": arguments});
        value.push_str("<tool_call>\n");
        value.push_str(&crate::pyjson::to_string(&payload));
        value.push_str("\n</tool_call>\n");
    }
    ensure_think(value).trim_end().to_owned()
}

fn final_turn_value(assistant: &AssistantMessage) -> String {
    let value = think_prefix(assistant) + &convert_scratchpad(&assistant.content);
    ensure_think(value).trim().to_owned()
}

fn tool_response(result: &ToolMessage, parent: &AssistantMessage, position: usize) -> String {
    // The reference names each result after the parent's call at the same position.
    let name = parent
        .tool_calls
        .get(position)
        .map_or("unknown", |call| call.name.as_str());
    let content = parse_json_content(&result.content)
        .unwrap_or_else(|| Value::String(result.content.clone()));
    let payload = json!({"tool_call_id": result.tool_call_id, "name": name, "content": content});
    format!(
        "<tool_response>\n{}\n</tool_response>",
        crate::pyjson::to_string(&payload)
    )
}

/// Content that looks like a JSON object or array and parses is embedded as JSON.
fn parse_json_content(content: &str) -> Option<Value> {
    let trimmed = content.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        serde_json::from_str(trimmed).ok()
    } else {
        None
    }
}

/// Whether a tool result counts as a failure, by the reference's rules (section 5.1).
pub fn is_tool_failure(content: &str) -> bool {
    match serde_json::from_str::<Value>(content) {
        Ok(Value::Object(object)) => {
            let error_set = |object: &Map<String, Value>| {
                object.get("error").is_some_and(|error| !error.is_null())
            };
            error_set(&object)
                || object
                    .get("content")
                    .and_then(Value::as_object)
                    .is_some_and(error_set)
                || object.get("success") == Some(&Value::Bool(false))
        }
        Ok(_) => false,
        Err(_) => {
            let trimmed = content.trim();
            trimmed.is_empty() || trimmed.to_lowercase().starts_with("error:")
        }
    }
}

/// Per-tool call counts of one conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolCounts {
    pub count: u64,
    pub success: u64,
    pub failure: u64,
}

/// `tool_stats` normalised over the run's catalog: every catalog tool in catalog order, then any
/// other name the model called, in call order.
pub fn tool_stats(messages: &[Message], catalog: &[String]) -> Vec<(String, ToolCounts)> {
    let mut stats: Vec<(String, ToolCounts)> = catalog
        .iter()
        .map(|name| (name.clone(), ToolCounts::default()))
        .collect();
    let mut call_names: Vec<(&str, &str)> = Vec::new();
    let entry = |stats: &mut Vec<(String, ToolCounts)>, name: &str| -> usize {
        if let Some(position) = stats.iter().position(|(known, _)| known == name) {
            position
        } else {
            stats.push((name.to_owned(), ToolCounts::default()));
            stats.len() - 1
        }
    };
    for message in messages {
        match message {
            Message::Assistant(assistant) => {
                for call in &assistant.tool_calls {
                    let position = entry(&mut stats, &call.name);
                    stats[position].1.count += 1;
                    call_names.push((&call.id, &call.name));
                }
            }
            Message::Tool(result) => {
                let Some((_, name)) = call_names.iter().find(|(id, _)| *id == result.tool_call_id)
                else {
                    continue;
                };
                let position = entry(&mut stats, name);
                if is_tool_failure(&result.content) {
                    stats[position].1.failure += 1;
                } else {
                    stats[position].1.success += 1;
                }
            }
            _ => {}
        }
    }
    stats
}

/// Reasoning coverage of one conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReasoningStats {
    pub total_assistant_turns: u64,
    pub turns_with_reasoning: u64,
}

impl ReasoningStats {
    pub fn has_any_reasoning(&self) -> bool {
        self.turns_with_reasoning > 0
    }
}

/// A turn has reasoning when the server returned it separately, or the content carries a
/// non-blank `<think>` block or a scratchpad. (The reference ignored inline `<think>`, which threw
/// away every sample of servers that reason inline.)
pub fn reasoning_stats(messages: &[Message]) -> ReasoningStats {
    let mut stats = ReasoningStats::default();
    for message in messages {
        if let Message::Assistant(assistant) = message {
            stats.total_assistant_turns += 1;
            let separate = assistant
                .reasoning
                .as_ref()
                .is_some_and(|r| !r.text.trim().is_empty());
            let inline = crate::model::types::inline_think(&assistant.content).is_some()
                || assistant.content.contains("<REASONING_SCRATCHPAD>");
            if separate || inline {
                stats.turns_with_reasoning += 1;
            }
        }
    }
    stats
}

/// Everything a record needs besides the conversation.
#[derive(Debug, Clone)]
pub struct RecordContext<'a> {
    pub id: &'a str,
    pub prompt_index: u64,
    pub sample: u32,
    pub batch: u32,
    pub model: &'a str,
    pub toolsets_used: &'a [String],
    pub tools_offered: &'a [ToolSpec],
    pub catalog: &'a [String],
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub finished_at: chrono::DateTime<chrono::Utc>,
    /// The dataset row's other fields.
    pub source: &'a Map<String, Value>,
}

/// A UTC timestamp with microseconds, like the reference's but with its zone.
pub fn timestamp(time: chrono::DateTime<chrono::Utc>) -> String {
    time.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// The full trajectory record, keys in the reference's order followed by ours.
pub fn trajectory_record(
    conversation: &Conversation,
    context: &RecordContext<'_>,
) -> Map<String, Value> {
    let stats = tool_stats(&conversation.messages, context.catalog);
    let reasoning = reasoning_stats(&conversation.messages);
    let duration_ms = (context.finished_at - context.started_at)
        .num_milliseconds()
        .max(0);
    let mut record = Map::new();
    record.insert("prompt_index".into(), context.prompt_index.into());
    record.insert(
        "conversations".into(),
        Value::Array(sharegpt(conversation, context.tools_offered)),
    );
    record.insert(
        "metadata".into(),
        json!({"batch_num": context.batch, "timestamp": timestamp(context.finished_at), "model": context.model}),
    );
    record.insert("completed".into(), conversation.completed.into());
    record.insert("partial".into(), conversation.partial.into());
    record.insert("api_calls".into(), conversation.api_calls.into());
    record.insert("toolsets_used".into(), json!(context.toolsets_used));
    record.insert(
        "tool_stats".into(),
        Value::Object(
            stats
                .iter()
                .map(|(name, c)| {
                    (
                        name.clone(),
                        json!({"count": c.count, "success": c.success, "failure": c.failure}),
                    )
                })
                .collect(),
        ),
    );
    record.insert(
        "tool_error_counts".into(),
        Value::Object(
            stats
                .iter()
                .map(|(name, c)| (name.clone(), c.failure.into()))
                .collect(),
        ),
    );
    record.insert("id".into(), context.id.into());
    record.insert("sample".into(), context.sample.into());
    record.insert(
        "tools_offered".into(),
        json!(
            context
                .tools_offered
                .iter()
                .map(|tool| tool.name.as_str())
                .collect::<Vec<_>>()
        ),
    );
    let usage = conversation.usage;
    record.insert(
        "usage".into(),
        json!({
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "reasoning_tokens": usage.reasoning_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }),
    );
    record.insert(
        "reasoning_stats".into(),
        json!({
            "total_assistant_turns": reasoning.total_assistant_turns,
            "turns_with_reasoning": reasoning.turns_with_reasoning,
            "turns_without_reasoning": reasoning.total_assistant_turns - reasoning.turns_with_reasoning,
        }),
    );
    record.insert("duration_ms".into(), duration_ms.into());
    record.insert(
        "model_time_ms".into(),
        u64::try_from(conversation.model_time.as_millis())
            .unwrap_or(u64::MAX)
            .into(),
    );
    record.insert("started_at".into(), timestamp(context.started_at).into());
    record.insert("finished_at".into(), timestamp(context.finished_at).into());
    record.insert("source".into(), Value::Object(context.source.clone()));
    record
}

/// The same conversation in `OpenAI` `messages` + `tools` form, for trainers that want it.
pub fn openai_record(
    conversation: &Conversation,
    context: &RecordContext<'_>,
) -> Map<String, Value> {
    let tools: Vec<Value> = context
        .tools_offered
        .iter()
        .map(|tool| {
            json!({"type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": tool.parameters}})
        })
        .collect();
    let mut record = Map::new();
    record.insert("id".into(), context.id.into());
    record.insert("prompt_index".into(), context.prompt_index.into());
    record.insert("sample".into(), context.sample.into());
    record.insert(
        "messages".into(),
        Value::Array(conversation.messages.iter().map(Message::to_wire).collect()),
    );
    record.insert("tools".into(), Value::Array(tools));
    record
}

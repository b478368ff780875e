//! The chat formats supervised trainers and Hugging Face `datasets` read: `ShareGPT` (the
//! Hermes `conversations`, as `trajectories.jsonl` holds them) and `OpenAI` messages with their
//! tools. Each line carries the same few keys, so a loader infers one schema for the file
//! (the records' own extra keys, such as the dataset row under `source`, vary from row to row).

use serde_json::{Map, Value, json};

use super::hermes_text::{Turn, tool_definitions};
use crate::hermes::SYSTEM_PROMPT_HEAD;

/// The identity and outcome every chat line starts with.
fn head(record: &Value) -> Map<String, Value> {
    let mut line = Map::new();
    for key in ["id", "prompt_index", "sample"] {
        line.insert(key.into(), record[key].clone());
    }
    line.insert(
        "reward".into(),
        record.get("reward").cloned().unwrap_or(Value::Null),
    );
    line
}

/// A `ShareGPT` line: the record's `conversations` unchanged.
pub fn sharegpt(record: &Value) -> Value {
    let mut line = head(record);
    line.insert("conversations".into(), record["conversations"].clone());
    Value::Object(line)
}

/// An `OpenAI` line: `messages` with structured tool calls and `tool` results, and `tools`.
/// The Hermes system turn only lists the tools, which `tools` carries, so it is left out; any
/// other system turn stays a system message.
pub fn openai(record: &Value, turns: &[Turn]) -> Value {
    let mut tools = Vec::new();
    let mut messages = Vec::with_capacity(turns.len());
    for turn in turns {
        match turn {
            Turn::System(text) => {
                if text.starts_with(SYSTEM_PROMPT_HEAD) {
                    tools = tool_definitions(text);
                } else {
                    messages.push(json!({"role": "system", "content": text}));
                }
            }
            Turn::User(text) => messages.push(json!({"role": "user", "content": text})),
            Turn::Agent(agent) => {
                let mut message = json!({"role": "assistant", "content": agent.content});
                if let Some(reasoning) = &agent.reasoning {
                    message["reasoning_content"] = reasoning.as_str().into();
                }
                if !agent.calls.is_empty() {
                    let calls: Vec<Value> = agent
                        .calls
                        .iter()
                        .map(|call| {
                            json!({"id": call.id, "type": "function", "function": {
                                "name": call.name,
                                "arguments": Value::Object(call.arguments.clone()).to_string(),
                            }})
                        })
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                }
                messages.push(message);
                messages.extend(agent.results.iter().map(|result| {
                    json!({"role": "tool", "tool_call_id": result.tool_call_id, "content": result.content})
                }));
            }
            Turn::Results(results) => messages.extend(results.iter().map(|result| {
                json!({"role": "tool", "tool_call_id": result.tool_call_id, "content": result.content})
            })),
        }
    }
    let mut line = head(record);
    line.insert("messages".into(), Value::Array(messages));
    line.insert("tools".into(), Value::Array(tools));
    Value::Object(line)
}

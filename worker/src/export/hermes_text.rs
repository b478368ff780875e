//! A Hermes record's `conversations` read back into structured turns: the inverse of
//! [`crate::hermes::sharegpt_turns`] for the formats that keep calls and results apart (ATIF,
//! ADP, `OpenAI` messages).
//!
//! The rendering is regular enough to undo: a `gpt` turn is `<think>` reasoning `</think>`, the
//! reply's text, then each call as a `<tool_call>` block holding one line of JSON; a `tool` turn
//! is one `<tool_response>` block per result, each one line of JSON naming its call's id. A
//! call's id is that of the result at its position (the reference pairs them by position too),
//! or made up (`call_<turn>_<n>`) for a call no result answered.

use serde_json::{Map, Value};

/// One turn of a conversation, as its parts.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    System(String),
    User(String),
    Agent(AgentTurn),
    /// Tool results with no call before them (the renderer shows such a result anyway).
    Results(Vec<ToolResult>),
}

/// A model reply: its reasoning, its text, its calls and the results that answered them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AgentTurn {
    /// The index of its `gpt` turn in `conversations` (the tokens line's `conversation_index`).
    pub index: usize,
    pub reasoning: Option<String>,
    pub content: String,
    pub calls: Vec<ToolCall>,
    pub results: Vec<ToolResult>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolResult {
    pub tool_call_id: String,
    pub name: String,
    /// The result as the tool gave it (JSON results written back as compact JSON).
    pub content: String,
}

/// Why a record's conversation could not be read back; `turn` indexes `conversations`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("conversations[{turn}]: {message}")]
pub struct TurnError {
    pub turn: usize,
    pub message: String,
}

/// The turns of a record's `conversations` array.
pub fn parse(conversations: &Value) -> Result<Vec<Turn>, TurnError> {
    let Some(turns) = conversations.as_array() else {
        return Err(TurnError {
            turn: 0,
            message: "`conversations` is not an array".into(),
        });
    };
    let mut parsed: Vec<Turn> = Vec::with_capacity(turns.len());
    for (index, turn) in turns.iter().enumerate() {
        let error = |message: String| TurnError {
            turn: index,
            message,
        };
        let (Some(from), Some(value)) = (turn["from"].as_str(), turn["value"].as_str()) else {
            return Err(error("a turn needs string `from` and `value`".into()));
        };
        match from {
            "system" => parsed.push(Turn::System(value.to_owned())),
            "human" => parsed.push(Turn::User(value.to_owned())),
            "gpt" => parsed.push(Turn::Agent(agent_turn(index, value).map_err(error)?)),
            "tool" => {
                let results = tool_results(value).map_err(error)?;
                match parsed.last_mut() {
                    Some(Turn::Agent(agent)) if agent.results.is_empty() => {
                        for (position, call) in agent.calls.iter_mut().enumerate() {
                            if let Some(result) = results
                                .get(position)
                                .filter(|result| !result.tool_call_id.is_empty())
                            {
                                call.id.clone_from(&result.tool_call_id);
                            }
                        }
                        agent.results = results;
                    }
                    _ => parsed.push(Turn::Results(results)),
                }
            }
            other => return Err(error(format!("unknown role {other:?}"))),
        }
    }
    Ok(parsed)
}

fn agent_turn(index: usize, value: &str) -> Result<AgentTurn, String> {
    let (reasoning, rest) = match value.strip_prefix("<think>") {
        Some(after) => {
            let end = after
                .find("</think>")
                .ok_or("a <think> without its </think>")?;
            let reasoning = after[..end].trim_matches('\n');
            let rest = &after[end + "</think>".len()..];
            (
                (!reasoning.trim().is_empty()).then(|| reasoning.to_owned()),
                rest.strip_prefix('\n').unwrap_or(rest),
            )
        }
        None => (None, value),
    };
    let (content, calls_text) = match rest.find("<tool_call>\n") {
        Some(start) => (rest[..start].trim_end_matches('\n'), &rest[start..]),
        None => (rest, ""),
    };
    let mut calls = Vec::new();
    let mut lines = calls_text.lines();
    while let Some(line) = lines.next() {
        match line {
            "<tool_call>" => {
                let payload = lines.next().ok_or("a <tool_call> without its call")?;
                let payload: Value = serde_json::from_str(payload)
                    .map_err(|err| format!("a <tool_call> that is not JSON: {err}"))?;
                let name = payload["name"]
                    .as_str()
                    .ok_or("a <tool_call> without a string `name`")?;
                let arguments = match &payload["arguments"] {
                    Value::Object(arguments) => arguments.clone(),
                    _ => Map::new(),
                };
                calls.push(ToolCall {
                    id: format!("call_{index}_{}", calls.len()),
                    name: name.to_owned(),
                    arguments,
                });
            }
            "</tool_call>" | "" => {}
            other => return Err(format!("unexpected text among the tool calls: {other:?}")),
        }
    }
    Ok(AgentTurn {
        index,
        reasoning,
        content: content.to_owned(),
        calls,
        results: Vec::new(),
    })
}

fn tool_results(value: &str) -> Result<Vec<ToolResult>, String> {
    let mut results = Vec::new();
    let mut lines = value.lines();
    while let Some(line) = lines.next() {
        match line {
            "<tool_response>" => {
                let payload = lines.next().ok_or("a <tool_response> without its result")?;
                let payload: Value = serde_json::from_str(payload)
                    .map_err(|err| format!("a <tool_response> that is not JSON: {err}"))?;
                let content = match &payload["content"] {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                };
                results.push(ToolResult {
                    tool_call_id: payload["tool_call_id"].as_str().unwrap_or("").to_owned(),
                    name: payload["name"].as_str().unwrap_or("unknown").to_owned(),
                    content,
                });
            }
            "</tool_response>" | "" => {}
            other => return Err(format!("unexpected text among the tool results: {other:?}")),
        }
    }
    Ok(results)
}

/// The tools a Hermes system turn lists (between `<tools>` and `</tools>`), as `OpenAI` function
/// definitions; none when the turn lists none or is not the Hermes one.
pub fn tool_definitions(system: &str) -> Vec<Value> {
    let listed = system
        .split_once("<tools>\n")
        .and_then(|(_, rest)| rest.split_once("\n</tools>"))
        .and_then(|(listing, _)| serde_json::from_str::<Vec<Value>>(listing).ok())
        .unwrap_or_default();
    listed
        .into_iter()
        .map(|tool| {
            serde_json::json!({"type": "function", "function": {
                "name": tool["name"], "description": tool["description"], "parameters": tool["parameters"]}})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::Conversation;
    use crate::model::types::tool_call;
    use crate::model::{AssistantMessage, Message, Reasoning, ReasoningShape, ToolMessage};
    use crate::tools::ToolSpec;

    fn rendered(conversation: &Conversation, tools: &[ToolSpec]) -> Value {
        Value::Array(crate::hermes::sharegpt(conversation, tools))
    }

    #[test]
    fn a_rendered_conversation_reads_back_into_its_messages() {
        let mut conversation = Conversation::new("list the files");
        conversation
            .messages
            .push(Message::Assistant(AssistantMessage {
                content: "Let me look.".into(),
                reasoning: Some(Reasoning {
                    text: "the user wants ls".into(),
                    shape: ReasoningShape::Reasoning,
                }),
                tool_calls: vec![
                    tool_call(
                        "c1".into(),
                        "terminal".into(),
                        Some(&serde_json::json!({"command": "ls"})),
                    ),
                    tool_call("c2".into(), "clock".into(), None),
                ],
            }));
        conversation.messages.push(Message::Tool(ToolMessage {
            tool_call_id: "c1".into(),
            name: "terminal".into(),
            content: r#"{"output": "a\nb", "exit_code": 0}"#.into(),
        }));
        conversation.messages.push(Message::Tool(ToolMessage {
            tool_call_id: "c2".into(),
            name: "clock".into(),
            content: "noon </tool_response> <tool_call>".into(),
        }));
        conversation
            .messages
            .push(Message::Assistant(AssistantMessage {
                content: "Two files: a and b.".into(),
                ..AssistantMessage::default()
            }));
        let tools = [ToolSpec {
            name: "terminal".into(),
            description: "Run a command".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        let turns = parse(&rendered(&conversation, &tools)).unwrap();
        assert_eq!(turns.len(), 4);
        let Turn::System(system) = &turns[0] else {
            panic!("{turns:?}")
        };
        assert_eq!(tool_definitions(system)[0]["function"]["name"], "terminal");
        assert_eq!(turns[1], Turn::User("list the files".into()));
        let Turn::Agent(first) = &turns[2] else {
            panic!("{turns:?}")
        };
        assert_eq!(first.index, 2);
        assert_eq!(first.reasoning.as_deref(), Some("the user wants ls"));
        assert_eq!(first.content, "Let me look.");
        assert_eq!(
            first
                .calls
                .iter()
                .map(|call| (call.id.as_str(), call.name.as_str()))
                .collect::<Vec<_>>(),
            [("c1", "terminal"), ("c2", "clock")]
        );
        assert_eq!(first.calls[0].arguments["command"], "ls");
        assert!(first.calls[1].arguments.is_empty());
        assert_eq!(
            serde_json::from_str::<Value>(&first.results[0].content).unwrap(),
            serde_json::json!({"output": "a\nb", "exit_code": 0})
        );
        assert_eq!(
            first.results[1].content,
            "noon </tool_response> <tool_call>"
        );
        let Turn::Agent(last) = &turns[3] else {
            panic!("{turns:?}")
        };
        assert_eq!(
            (last.index, last.reasoning.as_deref(), last.content.as_str()),
            (4, None, "Two files: a and b.")
        );
    }

    #[test]
    fn a_malformed_turn_is_named_by_its_index() {
        let conversations = serde_json::json!([
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "<think>\n</think>\n<tool_call>\n{not json\n</tool_call>"},
        ]);
        let error = parse(&conversations).unwrap_err();
        assert_eq!(error.turn, 1);
        assert!(error.message.contains("not JSON"), "{error}");
    }
}

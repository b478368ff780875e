//! The Agent Data Protocol's standardized trajectory (neulab/agent-data-protocol, schema
//! 1.5.0), a line per trajectory as its converters write `full_std.jsonl`.
//!
//! `content` alternates actions and observations: the prompt is a `text_observation` from the
//! user; a reply is a `message_action`, or, when it calls tools, an `api_action` per call (the
//! reply's text as the first call's `description`), each answered by the `text_observation`
//! from the environment that carries its `tool_call_id`. Reasoning goes in the action's
//! `reasoning_content`. ADP has no system turn; the tools offered are named in
//! `available_custom_tools`, the rest of the record in `details`.

use std::collections::HashSet;

use serde_json::{Value, json};

use super::hermes_text::{AgentTurn, ToolResult, Turn, tool_definitions};
use super::{OUTCOME_KEYS, copied};

pub const SCHEMA_VERSION: &str = "1.5.0";

/// The ADP trajectory of one merged record.
pub fn trajectory(record: &Value, turns: &[Turn]) -> Value {
    let mut content = Vec::with_capacity(turns.len() * 2);
    let mut offered: Vec<Value> = Vec::new();
    let mut used: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for turn in turns {
        match turn {
            Turn::System(text) => {
                offered = tool_definitions(text)
                    .into_iter()
                    .map(|tool| tool["function"]["name"].clone())
                    .collect();
            }
            Turn::User(text) => content.push(json!({
                "class_": "text_observation", "content": text, "source": "user",
            })),
            Turn::Agent(agent) if agent.calls.is_empty() => content.push(json!({
                "class_": "message_action",
                "content": agent.content,
                "description": null,
                "reasoning_content": agent.reasoning,
            })),
            Turn::Agent(agent) => calls(&mut content, agent, &mut seen, &mut used),
            Turn::Results(results) => content.extend(results.iter().map(unanswering)),
        }
    }
    let mut tools: Vec<String> = offered
        .iter()
        .filter_map(|name| name.as_str().map(str::to_owned))
        .collect();
    for name in used {
        if !tools.contains(&name) {
            tools.push(name);
        }
    }
    let mut details = copied(record, &OUTCOME_KEYS);
    details.extend(copied(record, &["api_calls", "usage", "cost", "source"]));
    details.insert("model".into(), record["metadata"]["model"].clone());
    json!({
        "schema_version": SCHEMA_VERSION,
        "id": record["id"],
        "content": content,
        "available_custom_tools": tools,
        "details": details,
    })
}

/// A reply that calls tools: an `api_action` per call, then each call's result.
fn calls(
    content: &mut Vec<Value>,
    agent: &AgentTurn,
    seen: &mut HashSet<String>,
    used: &mut Vec<String>,
) {
    // ADP wants ids unique in the trajectory; some servers number calls afresh in
    // every reply.
    let ids: Vec<String> = agent
        .calls
        .iter()
        .map(|call| {
            let mut id = call.id.clone();
            while !seen.insert(id.clone()) {
                id = format!("{}_{}", call.id, agent.index);
                if seen.contains(&id) {
                    id = format!("{id}_{}", seen.len());
                }
            }
            id
        })
        .collect();
    for (position, (call, id)) in agent.calls.iter().zip(&ids).enumerate() {
        let first = position == 0;
        content.push(json!({
            "class_": "api_action",
            "tool_call_id": id,
            "function": call.name,
            "kwargs": call.arguments,
            "description": (first && !agent.content.is_empty()).then_some(&agent.content),
            "reasoning_content": if first { agent.reasoning.as_deref() } else { None },
        }));
        if !used.contains(&call.name) {
            used.push(call.name.clone());
        }
    }
    // Every call has exactly one result (ADP's rule), paired by position as the
    // Hermes turns pair them: a call nobody answered gets an empty one, a result
    // past the calls stands alone.
    for (position, (call, id)) in agent.calls.iter().zip(&ids).enumerate() {
        let result = agent.results.get(position);
        content.push(observation(
            Some(id),
            result.map_or("", |result| &result.content),
            &call.name,
        ));
    }
    content.extend(
        agent
            .results
            .iter()
            .skip(agent.calls.len())
            .map(unanswering),
    );
}

fn observation(tool_call_id: Option<&str>, content: &str, name: &str) -> Value {
    let mut observation = json!({
        "class_": "text_observation",
        "content": content,
        "name": name,
        "source": "environment",
    });
    if let Some(id) = tool_call_id {
        observation["tool_call_id"] = id.into();
    }
    observation
}

/// A result that answers no call of its reply: shown as the environment's, without an id.
fn unanswering(result: &ToolResult) -> Value {
    observation(None, &result.content, &result.name)
}

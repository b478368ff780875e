//! ATIF, the Agent Trajectory Interchange Format (Harbor's RFC 0001), at the version Harbor
//! 0.25.0 reads and writes by default: `ATIF-v1.8`. One trajectory document per line.
//!
//! Steps follow the conversation: the system prompt, the user's prompt, then one `agent` step
//! per model reply carrying its reasoning, its tool calls and, as its `observation`, the results
//! that answered them. A reply's `metrics` are its model call's, from the tokens line when the
//! run kept tokens: the counts, and the server's own prompt and completion ids with one logprob
//! per sampled token when it gave them (ATIF's fields for training without re-tokenization).
//! What ATIF has no field for (the dataset row, reward, the ids' provenance, sampling) is in the
//! documents' `extra`.

use serde_json::{Map, Value, json};

use super::hermes_text::{AgentTurn, ToolResult, Turn, tool_definitions};
use super::{OUTCOME_KEYS, TokensLine, copied};

pub const SCHEMA_VERSION: &str = "ATIF-v1.8";

/// The ATIF document of one merged record and its tokens line, if the run kept tokens.
pub fn trajectory(record: &Value, turns: &[Turn], tokens: Option<&TokensLine>) -> Value {
    let mut steps: Vec<Value> = Vec::with_capacity(turns.len());
    let mut definitions = Vec::new();
    for turn in turns {
        let mut step = Map::new();
        step.insert("step_id".into(), (steps.len() + 1).into());
        match turn {
            Turn::System(text) => {
                if definitions.is_empty() {
                    definitions = tool_definitions(text);
                }
                step.insert("source".into(), "system".into());
                step.insert("message".into(), text.as_str().into());
            }
            Turn::User(text) => {
                step.insert("source".into(), "user".into());
                step.insert("message".into(), text.as_str().into());
            }
            Turn::Agent(agent) => agent_step(&mut step, agent, tokens),
            Turn::Results(results) => {
                step.insert("source".into(), "system".into());
                step.insert("message".into(), "".into());
                step.insert("observation".into(), observation(results));
            }
        }
        steps.push(Value::Object(step));
    }
    let usage = &record["usage"];
    let mut final_metrics = Map::new();
    for (atif, ours) in [
        ("total_prompt_tokens", "prompt_tokens"),
        ("total_completion_tokens", "completion_tokens"),
        ("total_cached_tokens", "cached_tokens"),
    ] {
        final_metrics.insert(atif.into(), usage[ours].as_u64().unwrap_or(0).into());
    }
    if let Some(cost) = record["cost"]["total"].as_f64() {
        final_metrics.insert("total_cost_usd".into(), cost.into());
    }
    final_metrics.insert("total_steps".into(), steps.len().into());
    final_metrics.insert(
        "extra".into(),
        json!({"api_calls": record["api_calls"], "reasoning_tokens": usage["reasoning_tokens"]}),
    );
    let mut agent = json!({
        "name": "trajectory-operator",
        "version": env!("CARGO_PKG_VERSION"),
        "model_name": record["metadata"]["model"],
        "extra": {"toolsets_used": record["toolsets_used"]},
    });
    if !definitions.is_empty() {
        agent["tool_definitions"] = Value::Array(definitions);
    }
    let mut extra = copied(record, &OUTCOME_KEYS);
    extra.extend(copied(
        record,
        &["verification", "started_at", "finished_at", "source"],
    ));
    if let Some(tokens) = tokens {
        extra.insert("tokenization".into(), tokens.tokenization.to_value());
        extra.insert("sampling".into(), Value::Object(tokens.sampling.clone()));
        // A reply cut off by the token limit is not in the conversation, so no step has its call.
        let unplaced = tokens
            .steps
            .iter()
            .filter(|step| step.conversation_index.is_none())
            .count();
        if unplaced > 0 {
            extra.insert("calls_without_a_step".into(), unplaced.into());
        }
    }
    json!({
        "schema_version": SCHEMA_VERSION,
        "trajectory_id": record["id"],
        "agent": agent,
        "steps": steps,
        "final_metrics": final_metrics,
        "extra": extra,
    })
}

fn agent_step(step: &mut Map<String, Value>, agent: &AgentTurn, tokens: Option<&TokensLine>) {
    step.insert("source".into(), "agent".into());
    step.insert("message".into(), agent.content.as_str().into());
    if let Some(reasoning) = &agent.reasoning {
        step.insert("reasoning_content".into(), reasoning.as_str().into());
    }
    if !agent.calls.is_empty() {
        let calls: Vec<Value> = agent
            .calls
            .iter()
            .map(|call| {
                json!({"tool_call_id": call.id, "function_name": call.name, "arguments": call.arguments})
            })
            .collect();
        step.insert("tool_calls".into(), Value::Array(calls));
    }
    if !agent.results.is_empty() {
        step.insert("observation".into(), observation(&agent.results));
    }
    let call = tokens.and_then(|tokens| {
        tokens
            .steps
            .iter()
            .find(|call| call.conversation_index == Some(agent.index))
    });
    if let Some(call) = call {
        let mut metrics = json!({
            "prompt_tokens": call.prompt_tokens,
            "completion_tokens": call.completion_tokens,
            "cached_tokens": call.cached_tokens,
        });
        if let (Some(prompt), Some(completion)) =
            (&call.prompt_token_ids, &call.completion_token_ids)
        {
            metrics["prompt_token_ids"] = json!(prompt);
            metrics["completion_token_ids"] = json!(completion);
        }
        if !call.logprobs.is_empty() {
            metrics["logprobs"] = json!(call.logprobs);
        }
        let mut extra = json!({"finish_reason": call.finish_reason});
        if !call.top_logprobs.is_empty() {
            extra["top_logprobs"] = Value::Array(call.top_logprobs.clone());
        }
        metrics["extra"] = extra;
        step.insert("metrics".into(), metrics);
        step.insert("llm_call_count".into(), 1.into());
    }
}

fn observation(results: &[ToolResult]) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|result| {
            json!({
                "source_call_id": (!result.tool_call_id.is_empty()).then_some(&result.tool_call_id),
                "content": result.content,
                "extra": {"tool": result.name},
            })
        })
        .collect();
    json!({ "results": results })
}

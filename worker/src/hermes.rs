//! The Hermes trajectory format: a finished conversation as one training record.
//!
//! Compatibility matters here: trainers and datasets built on the reference read these lines, so
//! keys, their order, the `ShareGPT` roles, the system-prompt template and the `<think>`,
//! `<tool_call>` and `<tool_response>` encodings follow the reference byte for byte (reference
//! sections 7.2 and 11), with JSON written as Python writes it ([`crate::pyjson`]). Our additions
//! come after the reference's keys.
//!
//! Every line a batch writes is rendered here: a trajectory ([`write_trajectory_record`], and its
//! `OpenAI`-format twin [`write_openai_record`]), a discarded record
//! ([`write_discarded_record`]) or a failed record ([`write_failed_record`]).

use std::borrow::Cow;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value, json};

use crate::agent::{Conversation, Spent, UserOrigin};
use crate::model::{AssistantMessage, Message, ToolMessage, Usage};
use crate::pricing::{ByTier, Cost, CostSource};
use crate::tools::ToolSpec;
use crate::verify::Verification;

pub const SYSTEM_PROMPT_HEAD: &str = "You are a function calling AI model. You are provided with function signatures within <tools> </tools> XML tags. You may call one or more functions to assist with the user query. If available tools are not relevant in assisting with user query, just respond in natural conversational language. Don't make assumptions about what values to plug into functions. After calling & executing the functions, you will be provided with function results within <tool_response> </tool_response> XML tags. Here are the available tools:\n<tools>\n";

const SYSTEM_PROMPT_TAIL: &str = "\n</tools>\nFor each function call return a JSON object, with the following pydantic model json schema for each:\n{'title': 'FunctionCall', 'type': 'object', 'properties': {'name': {'title': 'Name', 'type': 'string'}, 'arguments': {'title': 'Arguments', 'type': 'object'}}, 'required': ['name', 'arguments']}\nEach function call should be enclosed within <tool_call> </tool_call> XML tags.\nExample:\n<tool_call>\n{'name': <function-name>,'arguments': <args-dict>}\n</tool_call>";

/// The Hermes function-calling system turn listing the offered tools.
pub fn system_turn(tools: &[ToolSpec]) -> String {
    /// One listed tool, borrowed (the schemas are not copied); keys in the reference's order.
    #[derive(serde::Serialize)]
    struct Listed<'a> {
        name: &'a str,
        description: &'a str,
        parameters: &'a Value,
        required: (),
    }
    let listed: Vec<Listed<'_>> = tools
        .iter()
        .map(|tool| Listed {
            name: &tool.name,
            description: &tool.description,
            parameters: &tool.parameters,
            required: (),
        })
        .collect();
    format!(
        "{SYSTEM_PROMPT_HEAD}{}{SYSTEM_PROMPT_TAIL}",
        crate::pyjson::to_string(&listed)
    )
}

/// One `ShareGPT` turn, borrowing what it can from the conversation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Turn<'a> {
    pub from: &'static str,
    pub value: Cow<'a, str>,
    /// Who wrote it (an episode's record lists them as `turn_origin`).
    #[serde(skip)]
    pub origin: Origin,
    /// The conversation message it starts at (`None`: the system turn).
    #[serde(skip)]
    pub message: Option<usize>,
}

/// Who wrote a turn of a record: a trainer trains on `model` turns only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    System,
    /// The row: its prompt, or a later turn of an episode.
    Dataset,
    /// The agent loop: its request for a final answer.
    Harness,
    /// The simulated user (`spec.userSimulator`).
    UserSimulator,
    Model,
    Tool,
}

/// The `ShareGPT` turns of a conversation: system, human, then gpt / tool / human turns.
pub fn sharegpt(conversation: &Conversation, tools: &[ToolSpec]) -> Vec<Value> {
    sharegpt_turns(conversation, Cow::Owned(system_turn(tools)))
        .into_iter()
        .map(|turn| json!({"from": turn.from, "value": turn.value}))
        .collect()
}

/// [`sharegpt`] as borrowed turns, with the system turn already rendered.
pub fn sharegpt_turns<'a>(conversation: &'a Conversation, system: Cow<'a, str>) -> Vec<Turn<'a>> {
    let turn = |from, value, origin, message| Turn {
        from,
        value,
        origin,
        message,
    };
    let mut turns = vec![turn("system", system, Origin::System, None)];
    let mut messages = conversation.messages.iter().enumerate().peekable();
    while let Some((index, message)) = messages.next() {
        let at = Some(index);
        match message {
            Message::System(_) => {}
            Message::User(content) => {
                let origin = match conversation.user_origin(index) {
                    UserOrigin::Dataset => Origin::Dataset,
                    UserOrigin::Harness => Origin::Harness,
                    UserOrigin::Simulator => Origin::UserSimulator,
                };
                turns.push(turn("human", Cow::Borrowed(content), origin, at));
            }
            Message::Assistant(assistant) if assistant.tool_calls.is_empty() => {
                let value = Cow::Owned(final_turn_value(assistant));
                turns.push(turn("gpt", value, Origin::Model, at));
            }
            Message::Assistant(assistant) => {
                let value = Cow::Owned(tool_call_turn_value(assistant));
                turns.push(turn("gpt", value, Origin::Model, at));
                let mut responses = Vec::new();
                while let Some((_, Message::Tool(result))) = messages.peek() {
                    responses.push(tool_response(result, assistant, responses.len()));
                    messages.next();
                }
                if !responses.is_empty() {
                    let value = Cow::Owned(responses.join("\n"));
                    turns.push(turn("tool", value, Origin::Tool, Some(index + 1)));
                }
            }
            // A tool message without a preceding call cannot happen in our loop; show it anyway.
            Message::Tool(result) => {
                let value = Cow::Owned(tool_response(result, &AssistantMessage::default(), 0));
                turns.push(turn("tool", value, Origin::Tool, at));
            }
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

/// Per-tool call counts of one conversation (serialised as the record's `tool_stats` entries:
/// field names and order are their keys).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
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
    /// [`system_turn`] of `tools_offered` if the caller has it already (it is the same for every
    /// conversation offered the same tools); `None` renders it.
    pub system_turn: Option<&'a str>,
    pub catalog: &'a [String],
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub finished_at: chrono::DateTime<chrono::Utc>,
    /// The dataset row's other fields.
    pub source: &'a Map<String, Value>,
    /// What the row's verifier found, when it has one: the record's `reward` and
    /// `verification`.
    pub verification: Option<&'a Verification>,
    /// The filter that keeps this record out of the trajectories, the whole record kept
    /// (`status: discarded`, `filter`): a reward below `minReward`.
    pub discarded_by: Option<&'a str>,
}

/// A UTC timestamp with microseconds, like the reference's but with its zone.
pub fn timestamp(time: chrono::DateTime<chrono::Utc>) -> String {
    time.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// Milliseconds from `started_at` to `finished_at`; never negative, though the clock may step back.
fn duration_ms(
    started_at: chrono::DateTime<chrono::Utc>,
    finished_at: chrono::DateTime<chrono::Utc>,
) -> i64 {
    (finished_at - started_at).num_milliseconds().max(0)
}

/// The full trajectory record, keys in the reference's order followed by ours.
pub fn trajectory_record(
    conversation: &Conversation,
    context: &RecordContext<'_>,
) -> Map<String, Value> {
    match serde_json::to_value(TrajectoryRecord::new(conversation, context)) {
        Ok(Value::Object(record)) => record,
        _ => unreachable!("a trajectory record serialises to a JSON object"),
    }
}

/// [`trajectory_record`] written as one line of Python-style JSON into `out`, without building
/// the record as a value first (the batch's path: it renders a record per conversation).
pub fn write_trajectory_record(
    out: &mut Vec<u8>,
    conversation: &Conversation,
    context: &RecordContext<'_>,
) {
    crate::pyjson::write(out, &TrajectoryRecord::new(conversation, context));
}

/// A trajectory record borrowing from its conversation and context.
struct TrajectoryRecord<'a> {
    conversation: &'a Conversation,
    context: &'a RecordContext<'a>,
    turns: Vec<Turn<'a>>,
    stats: Vec<(String, ToolCounts)>,
    reasoning: ReasoningStats,
    /// The paths the sandbox refused that the terminal's notes named, by prefix.
    sandbox_refusals: std::collections::BTreeMap<String, u64>,
}

impl<'a> TrajectoryRecord<'a> {
    fn new(conversation: &'a Conversation, context: &'a RecordContext<'a>) -> Self {
        let system = context.system_turn.map_or_else(
            || Cow::Owned(system_turn(context.tools_offered)),
            Cow::Borrowed,
        );
        Self {
            conversation,
            context,
            turns: sharegpt_turns(conversation, system),
            stats: tool_stats(&conversation.messages, context.catalog),
            reasoning: reasoning_stats(&conversation.messages),
            sandbox_refusals: crate::tools::terminal::refusal_counts(&conversation.messages),
        }
    }
}

/// A map written entry by entry from an iterator of key/value pairs.
struct MapOf<I>(std::cell::Cell<Option<I>>);

impl<I> MapOf<I> {
    fn new(entries: I) -> Self {
        Self(std::cell::Cell::new(Some(entries)))
    }
}

impl<K: Serialize, V: Serialize, I: Iterator<Item = (K, V)>> Serialize for MapOf<I> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let entries = self.0.take().expect("a MapOf is serialised once");
        serializer.collect_map(entries)
    }
}

// The trajectory record's nested objects; field names and their order are the record's keys.

#[derive(serde::Serialize)]
struct Metadata<'a> {
    batch_num: u32,
    timestamp: String,
    model: &'a str,
}

#[allow(clippy::struct_field_names)]
#[derive(serde::Serialize)]
struct TokenUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
    reasoning_tokens: u64,
    total_tokens: u64,
    /// Of the prompt tokens, those read from and written to the provider's cache: written only
    /// when there are any, so records of servers without a cache keep the reference's keys.
    #[serde(skip_serializing_if = "is_zero")]
    cached_tokens: u64,
    #[serde(skip_serializing_if = "is_zero")]
    cache_write_tokens: u64,
}

impl From<&Usage> for TokenUsage {
    fn from(usage: &Usage) -> Self {
        Self {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            reasoning_tokens: usage.reasoning_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            cached_tokens: usage.cached_tokens,
            cache_write_tokens: usage.cache_write_tokens,
        }
    }
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(count: &u64) -> bool {
    *count == 0
}

/// A record's `cost`: USD, by kind of token, and where it came from.
#[derive(serde::Serialize)]
struct CostEntry {
    input: f64,
    cached_input: f64,
    cache_write: f64,
    output: f64,
    total: f64,
    currency: &'static str,
    source: CostSource,
    /// Calls and cost per service tier, when any call was billed at another than the standard.
    #[serde(skip_serializing_if = "ByTier::only_standard")]
    tiers: ByTier,
    /// What the same calls would have cost at the standard tier, likewise.
    #[serde(skip_serializing_if = "Option::is_none")]
    at_standard: Option<f64>,
}

impl From<&Cost> for CostEntry {
    fn from(cost: &Cost) -> Self {
        Self {
            input: cost.input,
            cached_input: cost.cached_input,
            cache_write: cost.cache_write,
            output: cost.output,
            total: cost.total,
            currency: "USD",
            source: cost.source,
            tiers: cost.tiers,
            at_standard: cost.at_standard,
        }
    }
}

#[allow(clippy::struct_field_names)]
#[derive(serde::Serialize)]
struct Reasoning {
    total_assistant_turns: u64,
    turns_with_reasoning: u64,
    turns_without_reasoning: u64,
}

impl Serialize for TrajectoryRecord<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (conversation, context) = (self.conversation, self.context);
        let duration_ms = duration_ms(context.started_at, context.finished_at);
        let usage = conversation.usage;
        let mut record = serializer.serialize_map(None)?;
        record.serialize_entry("prompt_index", &context.prompt_index)?;
        record.serialize_entry("conversations", &self.turns)?;
        record.serialize_entry(
            "metadata",
            &Metadata {
                batch_num: context.batch,
                timestamp: timestamp(context.finished_at),
                model: context.model,
            },
        )?;
        record.serialize_entry("completed", &conversation.completed)?;
        record.serialize_entry("partial", &conversation.partial)?;
        record.serialize_entry("api_calls", &conversation.api_calls)?;
        record.serialize_entry("toolsets_used", context.toolsets_used)?;
        record.serialize_entry(
            "tool_stats",
            &MapOf::new(self.stats.iter().map(|(name, counts)| (name, counts))),
        )?;
        record.serialize_entry(
            "tool_error_counts",
            &MapOf::new(
                self.stats
                    .iter()
                    .map(|(name, counts)| (name, counts.failure)),
            ),
        )?;
        record.serialize_entry("id", context.id)?;
        record.serialize_entry("sample", &context.sample)?;
        let offered: Vec<&str> = context
            .tools_offered
            .iter()
            .map(|tool| tool.name.as_str())
            .collect();
        record.serialize_entry("tools_offered", &offered)?;
        record.serialize_entry("usage", &TokenUsage::from(&usage))?;
        if let Some(cost) = &conversation.cost {
            record.serialize_entry("cost", &CostEntry::from(cost))?;
        }
        record.serialize_entry(
            "reasoning_stats",
            &Reasoning {
                total_assistant_turns: self.reasoning.total_assistant_turns,
                turns_with_reasoning: self.reasoning.turns_with_reasoning,
                turns_without_reasoning: self.reasoning.total_assistant_turns
                    - self.reasoning.turns_with_reasoning,
            },
        )?;
        record.serialize_entry("duration_ms", &duration_ms)?;
        record.serialize_entry(
            "model_time_ms",
            &u64::try_from(conversation.model_time.as_millis()).unwrap_or(u64::MAX),
        )?;
        if !conversation.batch_waits_ms.is_empty() {
            record.serialize_entry("batch_waits_ms", &conversation.batch_waits_ms)?;
        }
        record.serialize_entry("started_at", &timestamp(context.started_at))?;
        record.serialize_entry("finished_at", &timestamp(context.finished_at))?;
        if let Some(verification) = context.verification {
            record.serialize_entry("reward", &verification.reward)?;
            record.serialize_entry("verification", &VerificationEntry::from(verification))?;
        }
        if let Some(filter) = context.discarded_by {
            record.serialize_entry("status", "discarded")?;
            record.serialize_entry("filter", filter)?;
        }
        record.serialize_entry("source", context.source)?;
        if !self.sandbox_refusals.is_empty() {
            record.serialize_entry("sandbox_refusals", &self.sandbox_refusals)?;
        }
        if let Some(resume) = &conversation.resume {
            record.serialize_entry("resumed_from_turn", &resume.from_turn)?;
            record.serialize_entry("resume", &ResumeEntry::from(resume))?;
        }
        self.serialize_episode(&mut record)?;
        if let Some(replayed) = &conversation.replayed {
            record.serialize_entry(
                "replay",
                &serde_json::json!({
                    "calls": replayed.calls,
                    "ran_for_state": replayed.ran_for_state,
                }),
            )?;
        }
        record.end()
    }
}

impl TrajectoryRecord<'_> {
    /// An episode's `turn_origin`, `episode` and, with a simulated user, `user_simulator`.
    fn serialize_episode<M: SerializeMap>(&self, record: &mut M) -> Result<(), M::Error> {
        let conversation = self.conversation;
        if conversation.is_episode() {
            let origins: Vec<Origin> = self.turns.iter().map(|turn| turn.origin).collect();
            record.serialize_entry("turn_origin", &origins)?;
            let turn_of_message = |message: usize| {
                self.turns
                    .iter()
                    .position(|turn| turn.message == Some(message))
            };
            record.serialize_entry(
                "episode",
                &crate::episode::EpisodeEntry::of(conversation, turn_of_message, self.turns.len()),
            )?;
        }
        if let Some(simulation) = &conversation.user_simulation {
            record.serialize_entry(
                "user_simulator",
                &crate::episode::SimulatorEntry {
                    turns: simulation.turns,
                    stopped: simulation.stopped,
                    usage: TokenUsage::from(&simulation.usage),
                    cost: simulation.cost.as_ref().map(CostEntry::from),
                },
            )?;
        }
        Ok(())
    }
}

/// A resumed record's `resume`: how it took up the turns an earlier attempt left (see
/// `docs/storage.md`, "The turn log"); field names and their order are its keys.
#[derive(serde::Serialize)]
struct ResumeEntry<'a> {
    from_turn: u32,
    replayed_calls: u32,
    divergences: Vec<DivergenceEntry<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    restarted: Option<&'a str>,
    earlier_ms: u64,
}

#[derive(serde::Serialize)]
struct DivergenceEntry<'a> {
    turn: u32,
    tool: &'a str,
    call_id: &'a str,
}

impl<'a> From<&'a crate::agent::Resumed> for ResumeEntry<'a> {
    fn from(resume: &'a crate::agent::Resumed) -> Self {
        Self {
            from_turn: resume.from_turn,
            replayed_calls: resume.replayed_calls,
            divergences: resume
                .divergences
                .iter()
                .map(|divergence| DivergenceEntry {
                    turn: divergence.turn,
                    tool: &divergence.tool,
                    call_id: &divergence.call_id,
                })
                .collect(),
            restarted: resume.restarted.as_deref(),
            earlier_ms: u64::try_from(resume.earlier_time.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// A record's `verification`; field names and their order are its keys.
#[derive(serde::Serialize)]
struct VerificationEntry<'a> {
    passed: bool,
    exit_code: Option<i32>,
    duration_ms: u64,
    output: &'a str,
    error: Option<&'a str>,
}

impl<'a> From<&'a Verification> for VerificationEntry<'a> {
    fn from(verification: &'a Verification) -> Self {
        Self {
            passed: verification.passed,
            exit_code: verification.exit_code,
            duration_ms: u64::try_from(verification.duration.as_millis()).unwrap_or(u64::MAX),
            output: &verification.output,
            error: verification.error.as_deref(),
        }
    }
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
    if let Some(verification) = context.verification {
        record.insert("reward".into(), verification.reward.into());
    }
    if let Some(cost) = &conversation.cost {
        record.insert("cost".into(), cost.total.into());
    }
    // The Hermes record's own `finished_at`: within its writer's twin file it tells this
    // conversation's line from an orphan of the same (prompt, sample), so merge pairs the two
    // forms exactly (and in the single file of older workers, from an earlier attempt's).
    record.insert("finished_at".into(), timestamp(context.finished_at).into());
    record
}

/// [`openai_record`] written as one line of compact JSON into `out`.
pub fn write_openai_record(
    out: &mut Vec<u8>,
    conversation: &Conversation,
    context: &RecordContext<'_>,
) {
    // A map of JSON values written into memory: no non-string key, no I/O error.
    serde_json::to_writer(out, &openai_record(conversation, context))
        .expect("writing a JSON object into memory cannot fail");
}

/// What names a record besides its status: its id, the (prompt, sample) it stands for, and the
/// batch that wrote it.
#[derive(Debug, Clone, Copy)]
pub struct RecordIdentity<'a> {
    pub id: &'a str,
    pub prompt_index: u64,
    pub sample: u32,
    pub batch: u32,
}

/// The record of a conversation that finished but that `filter` keeps out of the trajectories,
/// written as one line of Python-style JSON into `out` (merge counts it; resume does not run it
/// again).
pub fn write_discarded_record(
    out: &mut Vec<u8>,
    identity: &RecordIdentity<'_>,
    filter: &str,
    api_calls: u32,
    finished_at: chrono::DateTime<chrono::Utc>,
) {
    /// Field names and order are the record's keys.
    #[derive(serde::Serialize)]
    struct Discarded<'a> {
        prompt_index: u64,
        sample: u32,
        id: &'a str,
        status: &'static str,
        filter: &'a str,
        batch_num: u32,
        api_calls: u32,
        timestamp: String,
    }
    crate::pyjson::write(
        out,
        &Discarded {
            prompt_index: identity.prompt_index,
            sample: identity.sample,
            id: identity.id,
            status: "discarded",
            filter,
            batch_num: identity.batch,
            api_calls,
            timestamp: timestamp(finished_at),
        },
    );
}

/// Why a (prompt, sample) has no trajectory: the error's class (its stable label, as statistics
/// count them) and its message.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    pub class: &'a str,
    pub message: &'a str,
}

/// The record of a (prompt, sample) that failed, written as one line of Python-style JSON into
/// `out`. A conversation that ended early keeps what it spent (`usage`, `cost`), and one that
/// ran out of time is still verified (its changes are there): its record then carries `reward`
/// and `verification` as a trajectory's would.
pub fn write_failed_record(
    out: &mut Vec<u8>,
    identity: &RecordIdentity<'_>,
    failure: Failure<'_>,
    (spent, verification): (Option<&Spent>, Option<&Verification>),
    (started_at, finished_at): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>),
) {
    /// Field names and order are the record's keys.
    #[derive(serde::Serialize)]
    struct Failed<'a> {
        prompt_index: u64,
        sample: u32,
        id: &'a str,
        status: &'static str,
        error_class: &'a str,
        error: &'a str,
        batch_num: u32,
        duration_ms: i64,
        timestamp: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        usage: Option<TokenUsage>,
        #[serde(skip_serializing_if = "Option::is_none")]
        cost: Option<CostEntry>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reward: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        verification: Option<VerificationEntry<'a>>,
    }
    crate::pyjson::write(
        out,
        &Failed {
            prompt_index: identity.prompt_index,
            sample: identity.sample,
            id: identity.id,
            status: "failed",
            error_class: failure.class,
            error: failure.message,
            batch_num: identity.batch,
            duration_ms: duration_ms(started_at, finished_at),
            timestamp: timestamp(finished_at),
            usage: spent
                .filter(|spent| spent.usage.prompt_tokens + spent.usage.completion_tokens > 0)
                .map(|spent| TokenUsage::from(&spent.usage)),
            cost: spent
                .and_then(|spent| spent.cost.as_ref())
                .map(CostEntry::from),
            reward: verification.map(|verification| verification.reward),
            verification: verification.map(VerificationEntry::from),
        },
    );
}

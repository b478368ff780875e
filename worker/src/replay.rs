//! `spec.replay.from`: a conversation takes its tool outputs from another run's conversation of
//! the same row and sample, call by call, while it makes the same calls in the same positions;
//! from its first call that differs its tools run for real.
//!
//! A call whose output is taken from the recording does not run. Calls that change nothing in
//! the conversation's environment (their tool's [`ResumeRule::Recorded`]: reads, web searches,
//! HTTP endpoints, MCP tools) never run at all; the others (terminal commands, file writes)
//! are owed to the environment, and run, in order and with their outputs set aside, just before
//! the first call that runs for real, so that it finds the workspace the recorded calls left.
//! A conversation that never leaves the recording runs no tool: regenerating a dataset with
//! another model or system prompt pays for tools only where the new conversations go their own
//! way, and a test of the agent loop gets its tools from a recording.
//!
//! Outputs are read from the other run's `trajectories.jsonl` (its `ShareGPT` turns): a result
//! that was a JSON object is rendered compactly again, which is how tools render theirs.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::join_all;
use serde_json::Value;

use crate::model::{ToolCall, ToolMessage};
use crate::tools::{ResumeRule, Tool, ToolContext, execute};

/// One tool call of a recorded conversation and its output.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedCall {
    pub name: String,
    pub arguments: Value,
    pub output: String,
}

/// What a recorded conversation asked of its tools, in order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Recording {
    /// Its prompt: a recording of another prompt is not used.
    pub prompt: String,
    pub calls: Vec<RecordedCall>,
}

/// The recordings of the trajectory records in `data` (a `trajectories.jsonl`) whose
/// `prompt_index` is in `prompts`, by (`prompt_index`, sample). Lines that are not trajectory
/// records (or not JSON) are passed over.
pub fn read_recordings(
    data: &[u8],
    prompts: std::ops::Range<u64>,
) -> HashMap<(u64, u32), Recording> {
    #[derive(serde::Deserialize)]
    struct Key {
        prompt_index: u64,
        #[serde(default)]
        sample: u32,
    }
    let mut recordings = HashMap::new();
    for line in data.split(|byte| *byte == b'\n') {
        let Ok(key) = serde_json::from_slice::<Key>(line) else {
            continue;
        };
        if !prompts.contains(&key.prompt_index) {
            continue;
        }
        let Ok(record) = serde_json::from_slice::<Value>(line) else {
            continue;
        };
        if let Some(recording) = Recording::of_record(&record) {
            recordings.insert((key.prompt_index, key.sample), recording);
        }
    }
    recordings
}

impl Recording {
    /// The calls and outputs of a trajectory record's `conversations`.
    pub fn of_record(record: &Value) -> Option<Self> {
        let turns = record.get("conversations")?.as_array()?;
        let mut recording = Self::default();
        let mut outputs = Vec::new();
        for turn in turns {
            let value = turn
                .get("value")
                .and_then(Value::as_str)
                .unwrap_or_default();
            match turn.get("from").and_then(Value::as_str) {
                Some("human") if recording.prompt.is_empty() => {
                    value.clone_into(&mut recording.prompt);
                }
                Some("gpt") => {
                    for payload in tagged(value, "<tool_call>\n") {
                        recording.calls.push(RecordedCall {
                            name: payload.get("name")?.as_str()?.to_owned(),
                            arguments: payload.get("arguments").cloned().unwrap_or(Value::Null),
                            output: String::new(),
                        });
                    }
                }
                Some("tool") => {
                    outputs.extend(tagged(value, "<tool_response>\n").map(|payload| {
                        match payload.get("content") {
                            Some(Value::String(text)) => text.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        }
                    }));
                }
                _ => {}
            }
        }
        // A call without its output (a conversation cut off) cannot be replayed, nor anything
        // after it.
        recording.calls.truncate(outputs.len());
        for (call, output) in recording.calls.iter_mut().zip(outputs) {
            call.output = output;
        }
        Some(recording)
    }
}

/// The JSON values that follow each `tag` in `text`.
fn tagged<'a>(text: &'a str, tag: &'a str) -> impl Iterator<Item = Value> + 'a {
    text.match_indices(tag).filter_map(move |(at, _)| {
        serde_json::Deserializer::from_str(&text[at + tag.len()..])
            .into_iter::<Value>()
            .next()?
            .ok()
    })
}

/// A conversation's way through its recording.
#[derive(Debug)]
pub struct Replay {
    recording: Arc<Recording>,
    /// The position of the conversation's next tool call (over the whole conversation).
    position: usize,
    /// Every call so far was the recording's: the next may be too.
    on_recording: bool,
    /// Calls that took their output from the recording and that the environment still owes,
    /// by turn.
    owed: Vec<Vec<ToolCall>>,
    /// Calls that took their output from the recording.
    pub replayed: u32,
    /// Of those, the ones run afterwards for what they leave in the environment.
    pub ran_for_state: u32,
}

impl Replay {
    pub fn new(recording: Arc<Recording>) -> Self {
        Self {
            recording,
            position: 0,
            on_recording: true,
            owed: Vec::new(),
            replayed: 0,
            ran_for_state: 0,
        }
    }

    /// Goes on after `calls`, which an earlier attempt made and whose environment is already
    /// rebuilt (a conversation taken up from the turn log).
    pub fn skip(&mut self, calls: &[ToolCall]) {
        for call in calls {
            self.on_recording = self.on_recording && self.recorded(self.position, call).is_some();
            self.position += 1;
        }
    }

    /// The output the recording has for `call` at `position`, if it made the same call there.
    fn recorded(&self, position: usize, call: &ToolCall) -> Option<&str> {
        let recorded = self.recording.calls.get(position)?;
        let arguments = call.arguments.as_ref().ok()?;
        (recorded.name == call.name && recorded.arguments.as_object() == Some(arguments))
            .then_some(recorded.output.as_str())
    }

    /// The results of one turn's calls: the recording's while the calls are its own, then
    /// (after running what the environment owes) the tools' own.
    pub async fn run_turn(
        &mut self,
        calls: &[ToolCall],
        tools: &[Arc<dyn Tool>],
        ctx: &ToolContext,
    ) -> Vec<ToolMessage> {
        let mut results = Vec::with_capacity(calls.len());
        let mut first_real = calls.len();
        for (index, call) in calls.iter().enumerate() {
            let recorded = if self.on_recording {
                self.recorded(self.position + index, call)
            } else {
                None
            };
            let Some(output) = recorded else {
                self.on_recording = false;
                first_real = index;
                break;
            };
            results.push(ToolMessage {
                tool_call_id: call.id.clone(),
                name: call.name.clone(),
                content: output.to_owned(),
            });
        }
        self.position += calls.len();
        self.replayed += u32::try_from(first_real).unwrap_or(u32::MAX);
        self.owed.push(calls[..first_real].to_vec());
        if first_real == calls.len() {
            return results;
        }
        self.settle(tools, ctx).await;
        results.extend(
            join_all(
                calls[first_real..]
                    .iter()
                    .map(|call| execute(call, tools, ctx)),
            )
            .await,
        );
        results
    }

    /// Runs, turn by turn, the replayed calls whose tools change the environment, so that it
    /// is where those calls would have left it.
    async fn settle(&mut self, tools: &[Arc<dyn Tool>], ctx: &ToolContext) {
        for turn in std::mem::take(&mut self.owed) {
            let owed: Vec<&ToolCall> = turn
                .iter()
                .filter(|call| {
                    tools
                        .iter()
                        .find(|tool| tool.spec().name == call.name)
                        .is_some_and(|tool| tool.on_resume() != ResumeRule::Recorded)
                })
                .collect();
            self.ran_for_state += u32::try_from(owed.len()).unwrap_or(u32::MAX);
            join_all(owed.into_iter().map(|call| execute(call, tools, ctx))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_records_calls_and_outputs_are_read_in_order_and_a_call_without_output_is_dropped() {
        let record = serde_json::json!({
            "prompt_index": 3,
            "conversations": [
                {"from": "system", "value": "tools"},
                {"from": "human", "value": "do it"},
                {"from": "gpt", "value": "<think>\n</think>\n<tool_call>\n{\"name\": \"terminal\", \"arguments\": {\"command\": \"ls\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a\"}}\n</tool_call>"},
                {"from": "tool", "value": "<tool_response>\n{\"tool_call_id\": \"c1\", \"name\": \"terminal\", \"content\": {\"output\": \"a\", \"exit_code\": 0}}\n</tool_response>\n<tool_response>\n{\"tool_call_id\": \"c2\", \"name\": \"read_file\", \"content\": \"plain text\"}\n</tool_response>"},
                {"from": "gpt", "value": "<tool_call>\n{\"name\": \"terminal\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call>"},
            ],
        });
        let recording = Recording::of_record(&record).unwrap();
        assert_eq!(recording.prompt, "do it");
        assert_eq!(recording.calls.len(), 2);
        assert_eq!(recording.calls[0].name, "terminal");
        assert_eq!(
            recording.calls[0].arguments,
            serde_json::json!({"command": "ls"})
        );
        assert_eq!(recording.calls[0].output, r#"{"output":"a","exit_code":0}"#);
        assert_eq!(recording.calls[1].output, "plain text");
        let lines = format!(
            "{record}\nnot json\n{}\n",
            serde_json::json!({"prompt_index": 9})
        );
        let read = read_recordings(lines.as_bytes(), 0..5);
        assert_eq!(read.len(), 1);
        assert_eq!(read[&(3, 0)], recording);
    }
}

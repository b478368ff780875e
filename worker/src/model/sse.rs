//! Reading a streamed (server-sent events) completion into the same [`Completion`] a
//! non-streaming call returns.

use futures::StreamExt;
use serde_json::{Map, Value};

use super::client::{AttemptError, parse_failure, transport_error};
use super::types::{Completion, ParseFailure, Usage, parse_assistant};

/// One tool call being assembled from deltas.
#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

#[derive(Default)]
struct Accumulator {
    saw_choice: bool,
    content: String,
    reasoning: String,
    reasoning_field: &'static str,
    calls: Vec<PartialCall>,
    finish_reason: Option<String>,
    usage: Usage,
    reported_cost: Option<f64>,
}

impl Accumulator {
    fn apply(&mut self, chunk: &Value) -> Result<(), ParseFailure> {
        if let Some(error) = chunk.get("error") {
            return Err(ParseFailure::Malformed(format!("error in stream: {error}")));
        }
        if let Some(usage) = chunk.get("usage").filter(|usage| usage.is_object()) {
            self.usage = Usage::from_json(usage);
            self.reported_cost = Usage::reported_cost(usage);
        }
        let Some(choice) = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return Ok(());
        };
        self.saw_choice = true;
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
        let Some(delta) = choice.get("delta") else {
            return Ok(());
        };
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            self.content.push_str(text);
        }
        for field in ["reasoning_content", "reasoning"] {
            if let Some(text) = delta.get(field).and_then(Value::as_str) {
                self.reasoning.push_str(text);
                self.reasoning_field = if field == "reasoning" {
                    "reasoning"
                } else {
                    "reasoning_content"
                };
            }
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for (position, call) in calls.iter().enumerate() {
                let index = call
                    .get("index")
                    .and_then(Value::as_u64)
                    .and_then(|index| usize::try_from(index).ok())
                    .unwrap_or(position);
                if self.calls.len() <= index {
                    self.calls.resize_with(index + 1, PartialCall::default);
                }
                let partial = &mut self.calls[index];
                if let Some(id) = call.get("id").and_then(Value::as_str) {
                    partial.id.push_str(id);
                }
                if let Some(function) = call.get("function") {
                    if let Some(name) = function.get("name").and_then(Value::as_str) {
                        partial.name.push_str(name);
                    }
                    match function.get("arguments") {
                        Some(Value::String(text)) => partial.arguments.push_str(text),
                        Some(Value::Object(object)) => {
                            partial
                                .arguments
                                .push_str(&Value::Object(object.clone()).to_string());
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }

    fn finish(self, turn: usize) -> Result<Completion, ParseFailure> {
        if !self.saw_choice {
            return Err(ParseFailure::EmptyChoices);
        }
        // Every OpenAI-compatible server ends a whole answer with a finish_reason; a stream that
        // stops without one was cut short (llama-cpp-python ends a stream early when another
        // request waits, unless started with `--interrupt_requests False`), and keeping it would
        // record half an answer as the model's.
        if self.finish_reason.is_none() {
            return Err(ParseFailure::Malformed(
                "the stream ended without a finish_reason: the answer was cut short".to_owned(),
            ));
        }
        let mut message = Map::new();
        message.insert("content".into(), self.content.into());
        if !self.reasoning.is_empty() {
            message.insert(self.reasoning_field.into(), self.reasoning.into());
        }
        let calls: Vec<Value> = self
            .calls
            .into_iter()
            .filter(|call| !call.name.is_empty())
            .map(|call| {
                serde_json::json!({"id": call.id, "function": {"name": call.name, "arguments": call.arguments}})
            })
            .collect();
        if !calls.is_empty() {
            message.insert("tool_calls".into(), Value::Array(calls));
        }
        Ok(Completion {
            message: parse_assistant(&Value::Object(message), turn),
            finish_reason: self.finish_reason,
            usage: self.usage,
            reported_cost: self.reported_cost,
            // A run that keeps tokens does not stream (validation says so).
            tokens: None,
            endpoint: None,
            tier: None,
        })
    }
}

/// Reads `data:` events until `[DONE]` or the end of the body.
pub(super) async fn read_completion(
    response: reqwest::Response,
    turn: usize,
) -> Result<Result<Completion, ParseFailure>, AttemptError> {
    let status = response.status().as_u16();
    let mut stream = response.bytes_stream();
    let mut buffer: Vec<u8> = Vec::new();
    let mut accumulator = Accumulator::default();
    let mut done = false;
    while !done {
        let Some(chunk) = stream.next().await else {
            break;
        };
        buffer.extend_from_slice(&chunk.map_err(transport_error)?);
        while let Some(newline) = buffer.iter().position(|&byte| byte == b'\n') {
            let line: Vec<u8> = buffer.drain(..=newline).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                break;
            }
            let event: Value = match serde_json::from_str(data) {
                Ok(event) => event,
                Err(err) => {
                    return Err(parse_failure(
                        ParseFailure::Malformed(format!("bad stream event: {err}")),
                        status,
                    ));
                }
            };
            if let Err(failure) = accumulator.apply(&event) {
                return Err(parse_failure(failure, status));
            }
        }
    }
    Ok(accumulator.finish(turn))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn deltas_assemble_into_one_message() {
        let mut accumulator = Accumulator::default();
        for chunk in [
            json!({"choices": [{"delta": {"reasoning_content": "thin"}}]}),
            json!({"choices": [{"delta": {"reasoning_content": "king", "content": "Let me "}}]}),
            json!({"choices": [{"delta": {"content": "check.", "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "terminal", "arguments": "{\"comm"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "and\": \"ls\"}"}}]}}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        ] {
            accumulator.apply(&chunk).unwrap();
        }
        let completion = accumulator.finish(0).unwrap();
        assert_eq!(completion.message.content, "Let me check.");
        assert_eq!(completion.message.reasoning.unwrap().text, "thinking");
        assert_eq!(completion.message.tool_calls[0].id, "c1");
        assert_eq!(
            completion.message.tool_calls[0].arguments.as_ref().unwrap()["command"],
            "ls"
        );
        assert_eq!(completion.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(completion.usage.completion_tokens, 4);
    }

    #[test]
    fn a_stream_cut_short_before_its_finish_reason_is_malformed() {
        let mut accumulator = Accumulator::default();
        accumulator
            .apply(
                &json!({"choices": [{"delta": {"content": "Half an ans"}, "finish_reason": null}]}),
            )
            .unwrap();
        assert!(matches!(
            accumulator.finish(0),
            Err(ParseFailure::Malformed(message)) if message.contains("cut short")
        ));
    }

    #[test]
    fn a_stream_without_choices_is_empty() {
        assert!(matches!(
            Accumulator::default().finish(0),
            Err(ParseFailure::EmptyChoices)
        ));
    }
}

//! What trainers read beside the Hermes record: a trajectory's tokens line.
//!
//! When a run keeps tokens (`spec.model.tokens`), each trajectory's record line in its batch
//! file ends with one more key, `tokens`, written last: the conversation's model calls in call
//! order, each with the server's prompt and completion ids, the sampled tokens' logprobs, its
//! finish reason and token counts, and how the ids were had. Merge cuts the key off again: the
//! record goes to `trajectories.jsonl` byte for byte as a run without tokens writes it, the
//! value to `trajectories.tokens.jsonl`, line for line beside it. One line holds both until
//! then, so the tokens are written, resumed and merged exactly once with their record, by the
//! paths every record takes.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::agent::{Conversation, Step};
use crate::model::tokens::TopLogprob;
use crate::model::{CallTokens, Message};
use crate::spec::TokenRequest;

/// The top-level key of a record line that holds its tokens; written last.
pub const TOKENS_KEY: &str = "tokens";

/// The run-wide facts a tokens line carries.
#[derive(Debug, Clone)]
pub struct TokensContext {
    pub request: TokenRequest,
    /// The model name the requests carry.
    pub model: String,
    /// The sampling parameters the requests set (the behaviour policy a trainer must know):
    /// `temperature`, `max_tokens` and those of `extraBody` that shape sampling.
    pub sampling: Map<String, Value>,
    /// The SHA-256 of the chat template the server says it applies, when it says (llama.cpp's
    /// server does).
    pub chat_template_sha256: Option<String>,
}

/// Request fields that shape sampling, as `extraBody` may set them.
const SAMPLING_FIELDS: &[&str] = &[
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
];

impl TokensContext {
    /// The context of a run's settings.
    pub fn new(
        request: TokenRequest,
        model: &str,
        temperature: Option<f64>,
        max_tokens: Option<u32>,
        extra_body: &Map<String, Value>,
    ) -> Self {
        let mut sampling = Map::new();
        if let Some(temperature) = temperature {
            sampling.insert("temperature".into(), temperature.into());
        }
        if let Some(max_tokens) = max_tokens {
            sampling.insert("max_tokens".into(), max_tokens.into());
        }
        for field in SAMPLING_FIELDS {
            if let Some(value) = extra_body.get(*field) {
                sampling.insert((*field).to_owned(), value.clone());
            }
        }
        Self {
            request,
            model: model.to_owned(),
            sampling,
            chat_template_sha256: None,
        }
    }
}

/// Where a conversation's ids came from, as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IdSource {
    /// Every call's prompt and completion ids are the server's own.
    Server,
    /// Every call has ids, some or all made again from the text (`Retokenize`): not
    /// necessarily the sampled ones.
    Retokenized,
    /// Some calls have ids, others none (a server or tokenizer that gave them only at times).
    Partial,
    /// No call has ids (a server that gives logprobs at most).
    None,
}

impl IdSource {
    pub fn of(steps: &[Step]) -> Self {
        let with_ids = steps.iter().filter(|step| step.tokens.has_ids()).count();
        let from_server = steps
            .iter()
            .filter(|step| step.tokens.has_server_ids())
            .count();
        match with_ids {
            0 => Self::None,
            all if all == steps.len() && from_server == all => Self::Server,
            all if all == steps.len() => Self::Retokenized,
            _ => Self::Partial,
        }
    }
}

#[derive(Serialize)]
struct TokensLine<'a> {
    id: &'a str,
    prompt_index: u64,
    sample: u32,
    tokenization: Tokenization<'a>,
    /// Per endpoint that answered, its calls and how many gave ids and logprobs: merge counts
    /// them per endpoint from here, at the line's head, without reading the steps.
    endpoints: Vec<EndpointCalls>,
    sampling: &'a Map<String, Value>,
    steps: Vec<StepLine<'a>>,
}

/// One endpoint's calls of a conversation (or, summed by merge, of a run).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointCalls {
    /// Its base URL (`unknown` for calls of a worker that did not record it).
    pub endpoint: String,
    pub calls: u64,
    /// Calls that came with the server's prompt and completion ids.
    pub with_ids: u64,
    /// Calls whose ids were made again from the text (`Retokenize`).
    #[serde(default)]
    pub retokenized: u64,
    /// Calls that came with logprobs.
    pub with_logprobs: u64,
}

impl EndpointCalls {
    /// Each endpoint's calls among `steps`, in the order the endpoints first answered.
    fn of(steps: &[Step]) -> Vec<Self> {
        let mut endpoints: Vec<Self> = Vec::new();
        for step in steps {
            let name = step.endpoint.as_deref().unwrap_or("unknown");
            let at = endpoints
                .iter()
                .position(|entry| entry.endpoint == name)
                .unwrap_or_else(|| {
                    endpoints.push(Self {
                        endpoint: name.to_owned(),
                        ..Self::default()
                    });
                    endpoints.len() - 1
                });
            let entry = &mut endpoints[at];
            entry.calls += 1;
            entry.with_ids += u64::from(step.tokens.has_server_ids());
            entry.retokenized += u64::from(step.tokens.has_ids() && step.tokens.retokenized);
            entry.with_logprobs += u64::from(!step.tokens.logprobs.is_empty());
        }
        endpoints
    }

    /// Adds `other`'s counts (of the same endpoint) to these.
    pub fn add(&mut self, other: &Self) {
        self.calls += other.calls;
        self.with_ids += other.with_ids;
        self.retokenized += other.retokenized;
        self.with_logprobs += other.with_logprobs;
    }
}

#[derive(Serialize)]
struct Tokenization<'a> {
    source: IdSource,
    /// How they were asked for (`spec.model.tokens.request`).
    request: TokenRequest,
    model: &'a str,
    /// Which chat template rendered the prompts, when the server says (see
    /// [`TokensContext::chat_template_sha256`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_sha256: Option<&'a str>,
}

#[derive(Serialize)]
struct StepLine<'a> {
    /// The index in the record's `conversations` of the `gpt` turn this call gave; `null` for a
    /// reply cut off by the token limit (not kept in the conversation).
    conversation_index: Option<usize>,
    /// The prompt's ids, when it does not extend the call before (see [`prompt_ids`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
    /// When the prompt extends the call before, its prompt and completion ids: the ids after
    /// them (the tool results and the template's framing between the two calls).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids_new: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_token_ids: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "<[f32]>::is_empty")]
    logprobs: &'a [f32],
    #[serde(skip_serializing_if = "<[Vec<TopLogprob>]>::is_empty")]
    top_logprobs: &'a [Vec<TopLogprob>],
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    retokenized: bool,
    finish_reason: Option<&'a str>,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
}

/// A call's prompt ids as a tokens line keeps them: whole, or, where they begin with the previous
/// call's prompt and completion ids (as a conversation's calls do while the template renders
/// its history as sampled), only the ids after those, so that a conversation's ids grow with its
/// length, not with its square. `(whole, new)`, one of them set when the call has prompt ids.
fn prompt_ids<'a>(
    tokens: &'a CallTokens,
    previous: Option<&CallTokens>,
) -> (Option<&'a [u32]>, Option<&'a [u32]>) {
    let Some(prompt) = tokens.prompt_token_ids.as_deref() else {
        return (None, None);
    };
    let before = previous.and_then(|previous| {
        Some((
            previous.prompt_token_ids.as_deref()?,
            previous.completion_token_ids.as_deref()?,
        ))
    });
    match before {
        Some((last_prompt, last_completion))
            if prompt.len() >= last_prompt.len() + last_completion.len()
                && prompt.starts_with(last_prompt)
                && prompt[last_prompt.len()..].starts_with(last_completion) =>
        {
            (
                None,
                Some(&prompt[last_prompt.len() + last_completion.len()..]),
            )
        }
        _ => (Some(prompt), None),
    }
}

/// Each call's whole prompt ids from the steps of a tokens line as [`append_tokens`] writes them
/// (`prompt_token_ids`, or `prompt_token_ids_new` after the call before's prompt and completion),
/// `None` for a call without them.
pub fn whole_prompt_ids<'a>(
    steps: impl IntoIterator<Item = (Option<&'a [u32]>, Option<&'a [u32]>, Option<&'a [u32]>)>,
) -> Vec<Option<Vec<u32>>> {
    let mut before: Option<Vec<u32>> = None;
    steps
        .into_iter()
        .map(|(whole, new, completion)| {
            let prompt = match (whole, new, before.take()) {
                (Some(whole), _, _) => Some(whole.to_vec()),
                (None, Some(new), Some(mut so_far)) => {
                    so_far.extend_from_slice(new);
                    Some(so_far)
                }
                _ => None,
            };
            before = prompt.as_ref().zip(completion).map(|(prompt, completion)| {
                let mut so_far = Vec::with_capacity(prompt.len() + completion.len());
                so_far.extend_from_slice(prompt);
                so_far.extend_from_slice(completion);
                so_far
            });
            prompt
        })
        .collect()
}

/// Appends the conversation's tokens to the record line `line` (one JSON object, its closing
/// brace last) as its last key. Nothing is appended for a conversation without steps.
pub fn append_tokens(
    line: &mut Vec<u8>,
    conversation: &Conversation,
    context: &TokensContext,
    identity: (&str, u64, u32),
) {
    if conversation.steps.is_empty() || line.last() != Some(&b'}') {
        return;
    }
    let positions = gpt_turn_positions(&conversation.messages);
    let steps = conversation
        .steps
        .iter()
        .enumerate()
        .map(|(index, step)| {
            let previous = index
                .checked_sub(1)
                .map(|before| &conversation.steps[before].tokens);
            let (prompt_token_ids, prompt_token_ids_new) = prompt_ids(&step.tokens, previous);
            StepLine {
                conversation_index: step
                    .reply
                    .and_then(|reply| positions.get(reply as usize).copied()),
                prompt_token_ids,
                prompt_token_ids_new,
                completion_token_ids: step.tokens.completion_token_ids.as_deref(),
                logprobs: &step.tokens.logprobs,
                top_logprobs: &step.tokens.top_logprobs,
                retokenized: step.tokens.retokenized,
                finish_reason: step.finish_reason.as_deref(),
                prompt_tokens: step.usage.prompt_tokens,
                completion_tokens: step.usage.completion_tokens,
                cached_tokens: step.usage.cached_tokens,
            }
        })
        .collect();
    let (id, prompt_index, sample) = identity;
    let tokens = TokensLine {
        id,
        prompt_index,
        sample,
        tokenization: Tokenization {
            source: IdSource::of(&conversation.steps),
            request: context.request,
            model: &context.model,
            chat_template_sha256: context.chat_template_sha256.as_deref(),
        },
        endpoints: EndpointCalls::of(&conversation.steps),
        sampling: &context.sampling,
        steps,
    };
    line.pop();
    line.extend_from_slice(b", \"");
    line.extend_from_slice(TOKENS_KEY.as_bytes());
    line.extend_from_slice(b"\": ");
    serde_json::to_writer(&mut *line, &tokens).expect("a tokens line serialises");
    line.push(b'}');
}

/// Where a record line's tokens are (byte offsets in the line): the `,` before their key, where
/// the record without them ends (a `}` there closes it), and their value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokensAt {
    pub cut: usize,
    pub value: Range<usize>,
}

impl TokensAt {
    /// The tokens of `line` whose key's opening quote is at `key_quote` and whose value spans
    /// `value`, if they are its last field (as [`append_tokens`] writes them).
    pub fn of_field(line: &[u8], key_quote: usize, value: Range<usize>) -> Option<Self> {
        let before = line[..key_quote].trim_ascii_end();
        let last_field = line[value.end..].trim_ascii() == b"}";
        (before.last() == Some(&b',') && last_field).then(|| Self {
            cut: before.len() - 1,
            value,
        })
    }

    /// The tokens of a line known to have them (a line the syntax scan could not vouch for):
    /// the last `"tokens": ` in it begins them, since they are its last field and hold no key of
    /// that name.
    pub fn find(line: &[u8]) -> Option<Self> {
        let key = format!("\"{TOKENS_KEY}\":");
        let key_quote = memchr::memmem::rfind(line, key.as_bytes())?;
        let after = key_quote + key.len();
        let start = after + (line[after..].len() - line[after..].trim_ascii_start().len());
        let end = line.trim_ascii_end().len().checked_sub(1)?;
        let end = start + line[start..end].trim_ascii_end().len();
        Self::of_field(line, key_quote, start..end)
    }
}

/// What a tokens line says of its ids' source, read from its head (where
/// [`append_tokens`] writes it, before the steps): no need to parse the steps for it.
pub fn source_of(tokens: &[u8]) -> Option<IdSource> {
    let head = &tokens[..tokens.len().min(HEAD_BYTES)];
    let marker = b"\"source\":\"";
    let at = memchr::memmem::find(head, marker)? + marker.len();
    let rest = &head[at..];
    [
        (b"server\"".as_slice(), IdSource::Server),
        (b"retokenized\"".as_slice(), IdSource::Retokenized),
        (b"partial\"".as_slice(), IdSource::Partial),
        (b"none\"".as_slice(), IdSource::None),
    ]
    .into_iter()
    .find_map(|(word, source)| rest.starts_with(word).then_some(source))
}

/// What a tokens line says of its calls per endpoint, read from its head (where
/// [`append_tokens`] writes it, before the sampling and the steps); none for a line without it
/// (a placeholder, or a worker before it).
pub fn endpoints_of(tokens: &[u8]) -> Vec<EndpointCalls> {
    let marker = b"\"endpoints\":";
    let Some(at) = memchr::memmem::find(&tokens[..tokens.len().min(HEAD_BYTES)], marker) else {
        return Vec::new();
    };
    // The value alone: the deserializer stops at its end, the steps after it never read.
    serde_json::Deserializer::from_slice(&tokens[at + marker.len()..])
        .into_iter::<Vec<EndpointCalls>>()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default()
}

/// Bytes of a tokens line searched for its source: its id, keys and model name come first.
const HEAD_BYTES: usize = 1024;

/// The index in `conversations` (the Hermes `ShareGPT` turns: the system turn first) of each
/// assistant message's `gpt` turn, in order. It follows [`crate::hermes::sharegpt_turns`]: a
/// user message is one turn, an assistant message one, and the tool results after a reply with
/// calls one together.
pub fn gpt_turn_positions(messages: &[Message]) -> Vec<usize> {
    /// Where the walk stands with respect to a reply's tool results.
    #[derive(PartialEq)]
    enum Results {
        /// Not after a reply with calls: a tool message is a turn of its own.
        None,
        /// Right after a reply with calls: its first result opens their one turn.
        Expected,
        /// Within that turn.
        Open,
    }
    let mut positions = Vec::new();
    let mut turns = 1; // the system turn
    let mut results = Results::None;
    for message in messages {
        match message {
            Message::System(_) => {}
            Message::User(_) => {
                turns += 1;
                results = Results::None;
            }
            Message::Assistant(assistant) => {
                positions.push(turns);
                turns += 1;
                results = if assistant.tool_calls.is_empty() {
                    Results::None
                } else {
                    Results::Expected
                };
            }
            Message::Tool(_) if results == Results::Open => {}
            Message::Tool(_) => {
                turns += 1;
                if results == Results::Expected {
                    results = Results::Open;
                }
            }
        }
    }
    positions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AssistantMessage, ToolMessage, Usage, types::tool_call};

    fn with_calls(calls: usize) -> Message {
        Message::Assistant(AssistantMessage {
            tool_calls: (0..calls)
                .map(|call| tool_call(format!("c{call}"), "terminal".into(), None))
                .collect(),
            ..AssistantMessage::default()
        })
    }

    fn result() -> Message {
        Message::Tool(ToolMessage {
            tool_call_id: "c0".into(),
            name: "terminal".into(),
            content: "ok".into(),
        })
    }

    #[test]
    fn gpt_positions_are_those_of_the_sharegpt_turns() {
        let mut conversation = Conversation::new("do it");
        conversation.messages.extend([
            with_calls(2),
            result(),
            result(),
            with_calls(1),
            result(),
            Message::User("final answer please".into()),
            with_calls(0),
        ]);
        let turns = crate::hermes::sharegpt(&conversation, &[]);
        let from_turns: Vec<usize> = turns
            .iter()
            .enumerate()
            .filter(|(_, turn)| turn["from"] == "gpt")
            .map(|(index, _)| index)
            .collect();
        assert_eq!(gpt_turn_positions(&conversation.messages), from_turns);
        assert_eq!(from_turns, vec![2, 4, 7]);
    }

    #[test]
    fn the_tokens_go_last_and_say_where_the_ids_came_from() {
        let mut conversation = Conversation::new("q");
        conversation.messages.push(with_calls(0));
        let step = |ids: bool| Step {
            reply: Some(0),
            tokens: CallTokens {
                prompt_token_ids: ids.then(|| vec![1, 2]),
                completion_token_ids: ids.then(|| vec![3]),
                logprobs: vec![-0.5],
                top_logprobs: Vec::new(),
                retokenized: false,
            },
            finish_reason: Some("stop".into()),
            tier: None,
            usage: Usage {
                prompt_tokens: 2,
                completion_tokens: 1,
                ..Usage::default()
            },
            endpoint: Some(if ids { "http://a/v1" } else { "http://b/v1" }.into()),
        };
        conversation.steps = vec![step(true)];
        let context = TokensContext::new(
            TokenRequest::LlamaServer,
            "m",
            Some(0.7),
            None,
            &serde_json::json!({"seed": 7, "n": 1})
                .as_object()
                .unwrap()
                .clone(),
        );
        let mut line = br#"{"conversations": []}"#.to_vec();
        append_tokens(&mut line, &conversation, &context, ("r-0-0", 0, 0));
        let record: Value = serde_json::from_slice(&line).unwrap();
        let keys: Vec<&String> = record.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["conversations", TOKENS_KEY]);
        let tokens = &record[TOKENS_KEY];
        assert_eq!(tokens["tokenization"]["source"], "server");
        assert_eq!(tokens["tokenization"]["request"], "LlamaServer");
        assert_eq!(
            tokens["sampling"],
            serde_json::json!({"temperature": 0.7, "seed": 7})
        );
        assert_eq!(tokens["steps"][0]["conversation_index"], 2);
        assert_eq!(
            tokens["steps"][0]["prompt_token_ids"],
            serde_json::json!([1, 2])
        );
        conversation.steps.push(step(false));
        assert_eq!(IdSource::of(&conversation.steps), IdSource::Partial);
        // Per endpoint, at the head: merge reads it there without the steps.
        let mut line = br#"{"conversations": []}"#.to_vec();
        append_tokens(&mut line, &conversation, &context, ("r-0-0", 0, 0));
        let at = TokensAt::find(&line).unwrap();
        let endpoints = endpoints_of(&line[at.value]);
        let calls = |endpoint: &str, ids: u64, retokenized: u64| EndpointCalls {
            endpoint: endpoint.into(),
            calls: 1,
            with_ids: ids,
            retokenized,
            with_logprobs: 1,
        };
        assert_eq!(
            endpoints,
            [calls("http://a/v1", 1, 0), calls("http://b/v1", 0, 0)]
        );
        conversation.steps.remove(0);
        assert_eq!(IdSource::of(&conversation.steps), IdSource::None);
        // Ids made again from the text are ids, not the server's.
        let mut remade = step(true);
        remade.tokens.retokenized = true;
        conversation.steps = vec![step(true), remade];
        assert_eq!(IdSource::of(&conversation.steps), IdSource::Retokenized);
        let mut line = br#"{"conversations": []}"#.to_vec();
        append_tokens(&mut line, &conversation, &context, ("r-0-0", 0, 0));
        let at = TokensAt::find(&line).unwrap();
        assert_eq!(
            source_of(&line[at.value.clone()]),
            Some(IdSource::Retokenized)
        );
        assert_eq!(
            endpoints_of(&line[at.value.clone()]),
            [EndpointCalls {
                calls: 2,
                with_logprobs: 2,
                ..calls("http://a/v1", 1, 1)
            }]
        );
        let record: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(record[TOKENS_KEY]["steps"][1]["retokenized"], true);
        assert!(record[TOKENS_KEY]["steps"][0].get("retokenized").is_none());
        conversation.steps.remove(0);
        assert_eq!(IdSource::of(&conversation.steps), IdSource::Retokenized);
        conversation.steps.remove(0);
        conversation.steps.clear();
        let mut untouched = b"{}".to_vec();
        append_tokens(&mut untouched, &conversation, &context, ("r", 0, 0));
        assert_eq!(untouched, b"{}");
    }

    #[test]
    fn a_prompt_extending_the_call_before_keeps_only_its_new_ids_and_reads_back_whole() {
        let mut conversation = Conversation::new("q");
        conversation.messages.push(with_calls(0));
        let call = |prompt: Vec<u32>, completion: Vec<u32>| Step {
            reply: Some(0),
            tokens: CallTokens {
                prompt_token_ids: Some(prompt),
                completion_token_ids: Some(completion),
                ..CallTokens::default()
            },
            finish_reason: None,
            tier: None,
            usage: Usage::default(),
            endpoint: None,
        };
        conversation.steps = vec![
            call(vec![1, 2], vec![3]),
            call(vec![1, 2, 3, 4, 5], vec![6]),
            // The template rendered the reply otherwise than sampled: kept whole.
            call(vec![1, 2, 3, 4, 5, 7, 8], vec![9]),
            call(vec![1, 2, 3, 4, 5, 7, 8, 9], vec![10]),
        ];
        let context =
            TokensContext::new(TokenRequest::ReturnTokenIds, "m", None, None, &Map::new());
        let mut line = br#"{"conversations": []}"#.to_vec();
        append_tokens(&mut line, &conversation, &context, ("r-0-0", 0, 0));
        let record: Value = serde_json::from_slice(&line).unwrap();
        let steps = record[TOKENS_KEY]["steps"].as_array().unwrap();
        let kept: Vec<(&Value, &Value)> = steps
            .iter()
            .map(|step| (&step["prompt_token_ids"], &step["prompt_token_ids_new"]))
            .collect();
        assert_eq!(
            kept,
            [
                (&serde_json::json!([1, 2]), &Value::Null),
                (&Value::Null, &serde_json::json!([4, 5])),
                (&serde_json::json!([1, 2, 3, 4, 5, 7, 8]), &Value::Null),
                (&Value::Null, &serde_json::json!([])),
            ]
        );
        let ids =
            |value: &Value| -> Option<Vec<u32>> { serde_json::from_value(value.clone()).ok() };
        let read: Vec<[Option<Vec<u32>>; 3]> = steps
            .iter()
            .map(|step| {
                [
                    ids(&step["prompt_token_ids"]),
                    ids(&step["prompt_token_ids_new"]),
                    ids(&step["completion_token_ids"]),
                ]
            })
            .collect();
        let whole = whole_prompt_ids(read.iter().map(|[whole, new, completion]| {
            (whole.as_deref(), new.as_deref(), completion.as_deref())
        }));
        let sent: Vec<Option<Vec<u32>>> = conversation
            .steps
            .iter()
            .map(|step| step.tokens.prompt_token_ids.clone())
            .collect();
        assert_eq!(whole, sent);
    }

    #[test]
    fn the_tokens_are_found_by_field_or_by_search_and_their_source_read_from_the_head() {
        let mut conversation = Conversation::new("q");
        conversation.messages.push(with_calls(0));
        conversation.steps = vec![Step {
            reply: Some(0),
            tokens: CallTokens {
                prompt_token_ids: Some(vec![1]),
                completion_token_ids: Some(vec![2]),
                ..CallTokens::default()
            },
            finish_reason: None,
            tier: None,
            usage: Usage::default(),
            endpoint: None,
        }];
        let context =
            TokensContext::new(TokenRequest::ReturnTokenIds, "m", None, None, &Map::new());
        let record = br#"{"conversations": [{"from": "human", "value": "\"tokens\": no"}], "source": {"tokens": {"a": 1}}}"#;
        let mut line = record.to_vec();
        append_tokens(&mut line, &conversation, &context, ("r", 3, 1));
        let found = TokensAt::find(&line).unwrap();
        let mut cut = line.clone();
        cut[found.cut] = b'}';
        assert_eq!(
            &cut[..=found.cut],
            record,
            "the record as written without tokens"
        );
        let value: Value = serde_json::from_slice(&line[found.value.clone()]).unwrap();
        assert_eq!(value["prompt_index"], 3);
        assert_eq!(
            source_of(&line[found.value.clone()]),
            Some(IdSource::Server)
        );
        // The scan's field gives the same place.
        let mut by_field = None;
        crate::json_scan::object_line(&line, |field| {
            if field.is(TOKENS_KEY) {
                let key_quote = field.raw_key.as_ptr().addr() - line.as_ptr().addr() - 1;
                by_field = TokensAt::of_field(&line, key_quote, field.value.clone());
            }
            true
        });
        assert_eq!(by_field, Some(found));
        // A record without tokens has none to find, whatever its fields hold.
        assert_eq!(TokensAt::find(record), None);
    }
}

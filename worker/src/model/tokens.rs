//! The server's own token ids and logprobs of each call (`spec.model.tokens`).
//!
//! Trainers that learn from a conversation's calls (reinforcement learning, distillation) need
//! the ids the server read and sampled, not ids made again from the text: re-tokenizing a reply
//! gives other ids often enough to matter, and some sampled pieces map to no token at all. So
//! they are asked of the server with each call and kept as it gave them, each call's in a
//! [`CallTokens`]:
//!
//! - `ReturnTokenIds` (vLLM, `SGLang`) sends `return_token_ids` and `logprobs`: the response has
//!   `prompt_token_ids` (vLLM at its top, `SGLang` in the choice) and the choice's `token_ids`.
//! - `LlamaServer` sends `logprobs`: each logprob of llama.cpp's server carries its token's
//!   `id`; the prompt's ids are asked of the same server's `/apply-template` and `/tokenize` with
//!   the same request, the two steps its chat endpoint takes before it evaluates a prompt (the
//!   template rendered, then tokenized with special tokens added and parsed).
//! - `LogprobsOnly` sends `logprobs`: hosted APIs give logprobs, never ids.
//! - `Retokenize` sends `logprobs` and makes the ids again from the text, with a llama.cpp
//!   server's template and tokenizer ([`LlamaCppTokenizer::retokenize`]); they are marked so.
//!
//! Ids whose count disagrees with the usage the server reported for the same call are not kept
//! as exact: a count the server itself made is the one check a client can make of them.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::spec::{TokenRequest, TokensSpec};

/// What a client asks of the server for each call's tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSettings {
    pub request: TokenRequest,
    pub top_logprobs: u8,
    /// Where `Retokenize` makes ids (`tokenizerUrl`); `None`: the endpoint's own root.
    pub tokenizer_url: Option<String>,
}

impl TokenSettings {
    pub fn from_spec(spec: &TokensSpec) -> Self {
        Self {
            request: spec.request,
            top_logprobs: spec.top_logprobs,
            tokenizer_url: spec.tokenizer_url.clone(),
        }
    }

    /// Adds the fields that ask for the tokens to a request body.
    pub fn add_request_fields(&self, body: &mut Map<String, Value>) {
        body.insert("logprobs".into(), true.into());
        let top_logprobs = match self.request {
            // llama.cpp's server gives no logprobs at all (nor ids) for 0 alternatives; the one
            // it then sends is dropped again ([`Self::keep_asked`]).
            TokenRequest::LlamaServer => self.top_logprobs.max(1),
            TokenRequest::ReturnTokenIds
            | TokenRequest::LogprobsOnly
            | TokenRequest::Retokenize => self.top_logprobs,
        };
        body.insert("top_logprobs".into(), top_logprobs.into());
        if self.request == TokenRequest::ReturnTokenIds {
            body.insert("return_token_ids".into(), true.into());
        }
    }

    /// Drops what was asked of the server only to get the rest: alternatives when none were
    /// wanted.
    pub fn keep_asked(&self, tokens: &mut CallTokens) {
        if self.top_logprobs == 0 {
            tokens.top_logprobs.clear();
        }
    }
}

/// One alternative to a sampled token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_id: Option<u32>,
    /// The token's text as the server gave it, when it gave no id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    pub logprob: f32,
}

/// The tokens of one call, as the server gave them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallTokens {
    /// The ids of the prompt the server evaluated, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// The ids it sampled, in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_token_ids: Option<Vec<u32>>,
    /// The logprob of each sampled token (f32: what servers compute them in).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
    /// The alternatives to each sampled token, when asked for (`topLogprobs` above 0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top_logprobs: Vec<Vec<TopLogprob>>,
    /// Whether the ids were made again from the text (`Retokenize`), not given by the server.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retokenized: bool,
}

impl CallTokens {
    /// Whether the call has both the prompt's and the completion's ids.
    pub fn has_ids(&self) -> bool {
        self.prompt_token_ids.is_some() && self.completion_token_ids.is_some()
    }

    /// Whether the call has both ids, and they are the server's own.
    pub fn has_server_ids(&self) -> bool {
        self.has_ids() && !self.retokenized
    }

    /// [`Self::from_response`] of a response's bytes, read straight into ids and logprobs (no
    /// `Value` built of them); a response of another shape (an id out of range, a logprob that is
    /// not a number) is read as a `Value` instead, with the same result as before.
    pub fn from_response_bytes(body: &[u8], prompt_tokens: u64, completion_tokens: u64) -> Self {
        match serde_json::from_slice::<ResponseTokens>(body) {
            Ok(response) => response.into_tokens(prompt_tokens, completion_tokens),
            Err(_) => serde_json::from_slice::<Value>(body)
                .map(|value| Self::from_response(&value, prompt_tokens, completion_tokens))
                .unwrap_or_default(),
        }
    }

    /// The tokens a chat-completions response carries (its first choice's), with ids only where
    /// their count agrees with the reported usage (`prompt_tokens`, `completion_tokens`).
    pub fn from_response(response: &Value, prompt_tokens: u64, completion_tokens: u64) -> Self {
        let choice = response
            .get("choices")
            .and_then(|choices| choices.get(0))
            .unwrap_or(&Value::Null);
        let content = choice
            .get("logprobs")
            .and_then(|logprobs| logprobs.get("content"))
            .and_then(Value::as_array)
            .map(|content| {
                content
                    .iter()
                    .map(|entry| LogprobEntry {
                        logprob: entry.get("logprob").and_then(Value::as_f64),
                        id: entry.get("id").and_then(id),
                        top_logprobs: entry.get("top_logprobs").and_then(Value::as_array).cloned(),
                    })
                    .collect()
            });
        ResponseTokens {
            prompt_token_ids: response.get("prompt_token_ids").and_then(ids),
            choices: vec![ChoiceTokens {
                prompt_token_ids: choice.get("prompt_token_ids").and_then(ids),
                token_ids: choice.get("token_ids").and_then(ids),
                logprobs: Some(LogprobsTokens { content }),
            }],
        }
        .into_tokens(prompt_tokens, completion_tokens)
    }
}

/// The token fields of a chat-completions response, as [`CallTokens::from_response_bytes`]
/// reads them; serde skips every other field.
#[derive(Deserialize)]
struct ResponseTokens {
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    choices: Vec<ChoiceTokens>,
}

#[derive(Deserialize)]
struct ChoiceTokens {
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Option<LogprobsTokens>,
}

#[derive(Deserialize)]
struct LogprobsTokens {
    #[serde(default)]
    content: Option<Vec<LogprobEntry>>,
}

#[derive(Deserialize)]
struct LogprobEntry {
    #[serde(default)]
    logprob: Option<f64>,
    /// llama.cpp's server names the sampled token by its id.
    #[serde(default)]
    id: Option<u32>,
    #[serde(default)]
    top_logprobs: Option<Vec<Value>>,
}

impl ResponseTokens {
    /// The call's tokens: the first choice's logprobs (all or none), alternatives where any
    /// were given, and ids where their count agrees with the usage.
    fn into_tokens(self, prompt_tokens: u64, completion_tokens: u64) -> CallTokens {
        let top_prompt = self.prompt_token_ids;
        let Some(choice) = self.choices.into_iter().next() else {
            return CallTokens {
                prompt_token_ids: top_prompt.filter(|prompt| count(prompt) == prompt_tokens),
                ..CallTokens::default()
            };
        };
        let content = choice
            .logprobs
            .and_then(|logprobs| logprobs.content)
            .unwrap_or_default();
        let logprobs: Vec<f32> = content
            .iter()
            .map_while(|entry| entry.logprob)
            .map(narrow)
            .collect();
        let logprobs = if logprobs.len() == content.len() {
            logprobs
        } else {
            Vec::new()
        };
        let top_logprobs: Vec<Vec<TopLogprob>> = content
            .iter()
            .map(|entry| {
                entry
                    .top_logprobs
                    .as_deref()
                    .map(|top| top.iter().filter_map(top_logprob).collect())
                    .unwrap_or_default()
            })
            .collect();
        let top_logprobs = if top_logprobs.iter().any(|top| !top.is_empty()) {
            top_logprobs
        } else {
            Vec::new()
        };
        let prompt = top_prompt.or(choice.prompt_token_ids);
        let completion = choice.token_ids.or_else(|| {
            let from_logprobs: Option<Vec<u32>> = content.iter().map(|entry| entry.id).collect();
            from_logprobs.filter(|found| !found.is_empty())
        });
        CallTokens {
            prompt_token_ids: prompt.filter(|prompt| count(prompt) == prompt_tokens),
            completion_token_ids: completion
                .filter(|completion| count(completion) == completion_tokens),
            logprobs,
            top_logprobs,
            retokenized: false,
        }
    }
}

fn count(ids: &[u32]) -> u64 {
    ids.len() as u64
}

#[allow(clippy::cast_possible_truncation)] // servers compute logprobs in f32
fn narrow(logprob: f64) -> f32 {
    logprob as f32
}

fn id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|id| u32::try_from(id).ok())
}

fn ids(value: &Value) -> Option<Vec<u32>> {
    value.as_array()?.iter().map(id).collect()
}

fn top_logprob(entry: &Value) -> Option<TopLogprob> {
    let logprob = narrow(entry.get("logprob")?.as_f64()?);
    let token_id = entry.get("id").and_then(id);
    Some(TopLogprob {
        token_id,
        token: token_id
            .is_none()
            .then(|| {
                entry
                    .get("token")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .flatten(),
        logprob,
    })
}

/// The root of a llama.cpp server whose OpenAI-compatible API is at `base_url` (`…/v1`).
pub fn server_root(base_url: &str) -> &str {
    let trimmed = base_url.trim_end_matches('/');
    trimmed.strip_suffix("/v1").unwrap_or(trimmed)
}

/// Why a llama.cpp server did not give a prompt's or reply's ids.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {message}")]
pub struct TokenizeError {
    step: &'static str,
    message: String,
}

/// A llama.cpp server's chat template and tokenizer, through its own API: `/apply-template`
/// renders a chat request as its chat endpoint does, `/tokenize` tokenizes text as it does
/// before evaluating a prompt (special tokens added and parsed).
#[derive(Debug)]
pub struct LlamaCppTokenizer<'a> {
    pub http: &'a reqwest::Client,
    /// Its root (`http://host:port`, no `/v1`).
    pub root: &'a str,
    pub authorization: Option<&'a HeaderValue>,
    pub timeout: Duration,
}

impl LlamaCppTokenizer<'_> {
    /// The ids of the prompt the server evaluates for the chat request `body`.
    pub async fn prompt_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let rendered = self.render(body.to_vec()).await?;
        self.tokenize(&rendered, true).await
    }

    /// Ids made again from text for the call `body` that `reply` (its assistant message as the
    /// next request sends it) answered: the prompt's, and the reply's as a later prompt holds
    /// it, the template's rendering of it with its end of turn. The reply's are what follows
    /// the prompt's ids in the ids of the history rendered through it; where those do not begin
    /// with the prompt's (a boundary tokenized differently), its rendering beyond the prompt,
    /// tokenized alone.
    pub async fn retokenize(
        &self,
        body: &[u8],
        reply: Value,
    ) -> Result<(Vec<u32>, Vec<u32>), TokenizeError> {
        let prompt_text = self.render(body.to_vec()).await?;
        let prompt = self.tokenize(&prompt_text, true).await?;
        let request: Map<String, Value> =
            serde_json::from_slice(body).map_err(|err| TokenizeError {
                step: "the request",
                message: err.to_string(),
            })?;
        // llama.cpp renders an assistant message last as one to continue (its prefill), not
        // as a closed turn: the reply is rendered with a user turn after it, then cut off.
        let user_after = serde_json::json!({"role": "user", "content": "."});
        let history = self.render_history(&request, Vec::new()).await?;
        let with_user = self
            .render_history(&request, vec![user_after.clone()])
            .await?;
        let whole = self
            .render_history(&request, vec![reply, user_after])
            .await?;
        let apart = |what: &str| TokenizeError {
            step: "/apply-template",
            message: format!("the template renders {what} apart from the prompt's history"),
        };
        let user_turn = with_user
            .strip_prefix(&history)
            .ok_or_else(|| apart("a user turn after it"))?;
        let through_reply = whole
            .strip_suffix(user_turn)
            .filter(|through| through.starts_with(&history))
            .ok_or_else(|| apart("the reply"))?;
        let ids = self.tokenize(through_reply, true).await?;
        let reply_ids = if let Some(after) = ids.strip_prefix(prompt.as_slice()) {
            after.to_vec()
        } else {
            let after = through_reply
                .strip_prefix(&prompt_text)
                .ok_or_else(|| apart("the reply's opening"))?;
            self.tokenize(after, false).await?
        };
        Ok((prompt, reply_ids))
    }

    /// The chat request `request` with `more` messages, rendered as history: no turn of the
    /// model's opened after it.
    async fn render_history(
        &self,
        request: &Map<String, Value>,
        more: Vec<Value>,
    ) -> Result<String, TokenizeError> {
        let mut request = request.clone();
        if let Some(Value::Array(messages)) = request.get_mut("messages") {
            messages.extend(more);
        }
        request.insert("add_generation_prompt".into(), false.into());
        self.render(serde_json::to_vec(&request).expect("a JSON map serialises"))
            .await
    }

    async fn render(&self, body: Vec<u8>) -> Result<String, TokenizeError> {
        let rendered = self.post("/apply-template", body).await?;
        match rendered.get("prompt") {
            Some(Value::String(prompt)) => Ok(prompt.clone()),
            _ => Err(TokenizeError {
                step: "/apply-template",
                message: "no `prompt` in its answer".to_owned(),
            }),
        }
    }

    async fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        let request =
            serde_json::json!({"content": text, "add_special": add_special, "parse_special": true});
        let tokens = self
            .post(
                "/tokenize",
                serde_json::to_vec(&request).expect("a JSON value serialises"),
            )
            .await?;
        tokens.get("tokens").and_then(ids).ok_or(TokenizeError {
            step: "/tokenize",
            message: "no `tokens` ids in its answer".to_owned(),
        })
    }

    async fn post(&self, step: &'static str, body: Vec<u8>) -> Result<Value, TokenizeError> {
        let mut request = self
            .http
            .post(format!("{}{step}", self.root))
            .timeout(self.timeout)
            .header(CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(authorization) = self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        read_json(request)
            .await
            .map_err(|message| TokenizeError { step, message })
    }
}

async fn read_json(request: reqwest::RequestBuilder) -> Result<Value, String> {
    let response = request.send().await.map_err(|err| err.to_string())?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|err| err.to_string())?;
    if !status.is_success() {
        return Err(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ));
    }
    serde_json::from_slice(&bytes).map_err(|err| err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vllm_ids_are_read_from_the_top_and_the_choice_and_checked_against_the_usage() {
        let response = json!({
            "prompt_token_ids": [1, 2, 3],
            "choices": [{
                "token_ids": [7, 8],
                "logprobs": {"content": [
                    {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]},
                    {"token": "b", "logprob": -1.25, "top_logprobs": []}
                ]}
            }]
        });
        let tokens = CallTokens::from_response(&response, 3, 2);
        assert_eq!(tokens.prompt_token_ids, Some(vec![1, 2, 3]));
        assert_eq!(tokens.completion_token_ids, Some(vec![7, 8]));
        assert_eq!(tokens.logprobs, vec![-0.5, -1.25]);
        assert_eq!(tokens.top_logprobs[0][0].token.as_deref(), Some("a"));
        assert!(tokens.has_ids());
        // Counts that disagree with the usage: the ids are not kept as the server's.
        let miscounted = CallTokens::from_response(&response, 4, 2);
        assert_eq!(miscounted.prompt_token_ids, None);
        assert!(!miscounted.has_ids());
    }

    #[test]
    fn llama_server_ids_come_with_each_logprob_and_sglang_puts_the_prompt_in_the_choice() {
        let llama = json!({"choices": [{"logprobs": {"content": [
            {"id": 42, "token": "x", "logprob": -0.1, "top_logprobs": [{"id": 42, "token": "x", "logprob": -0.1}]},
            {"id": 43, "token": "y", "logprob": -0.2, "top_logprobs": []}
        ]}}]});
        let tokens = CallTokens::from_response(&llama, 0, 2);
        assert_eq!(tokens.completion_token_ids, Some(vec![42, 43]));
        assert_eq!(tokens.prompt_token_ids, None);
        assert_eq!(tokens.top_logprobs[0][0].token_id, Some(42));
        assert_eq!(tokens.top_logprobs[0][0].token, None);
        let sglang = json!({"choices": [{"prompt_token_ids": [5], "token_ids": [6]}]});
        let tokens = CallTokens::from_response(&sglang, 1, 1);
        assert!(tokens.has_ids());
        assert!(tokens.logprobs.is_empty());
    }

    #[test]
    fn hosted_logprobs_without_ids_keep_the_logprobs_only() {
        let hosted = json!({"choices": [{"logprobs": {"content": [
            {"token": "hi", "logprob": -0.01, "bytes": [104, 105], "top_logprobs": []}
        ]}}]});
        let tokens = CallTokens::from_response(&hosted, 9, 1);
        assert_eq!(tokens.completion_token_ids, None);
        assert_eq!(tokens.logprobs, vec![-0.01]);
        assert!(tokens.top_logprobs.is_empty());
        let none = CallTokens::from_response(&json!({"choices": [{"logprobs": null}]}), 1, 1);
        assert_eq!(none, CallTokens::default());
    }

    #[test]
    fn bytes_read_straight_give_what_the_value_gives() {
        let entry = |id: Value, logprob: Value| {
            json!({"token": "a", "id": id, "logprob": logprob, "bytes": [97],
                   "top_logprobs": [{"token": "a", "id": 5, "logprob": -0.5}, {"token": "b", "logprob": -1.5}]})
        };
        let responses = [
            json!({"prompt_token_ids": [1, 2, 3], "choices": [{"token_ids": [7, 8],
                "logprobs": {"content": [entry(json!(7), json!(-0.1)), entry(json!(8), json!(-0.2))]}}]}),
            json!({"choices": [{"prompt_token_ids": [1, 2, 3],
                "logprobs": {"content": [entry(json!(7), json!(-0.1)), entry(json!(8), json!(-0.2))]}}]}),
            json!({"choices": [{"logprobs": {"content": [entry(Value::Null, json!(-0.1)), entry(json!(8), Value::Null)]}}]}),
            // Of another shape: read through a `Value`.
            json!({"choices": [{"logprobs": {"content": [entry(json!(-1), json!(-0.1)), entry(json!(8), json!("x"))]}}]}),
            json!({"prompt_token_ids": [1, 2, 3, 4], "choices": []}),
            json!({"choices": [{"logprobs": null, "token_ids": [1, 2]}]}),
        ];
        for response in responses {
            let bytes = serde_json::to_vec(&response).unwrap();
            for (prompt, completion) in [(3, 2), (4, 2), (0, 0)] {
                assert_eq!(
                    CallTokens::from_response_bytes(&bytes, prompt, completion),
                    CallTokens::from_response(&response, prompt, completion),
                    "{response}"
                );
            }
        }
        assert_eq!(
            CallTokens::from_response_bytes(b"not json", 1, 1),
            CallTokens::default()
        );
    }

    #[test]
    fn the_request_asks_for_ids_only_where_the_server_takes_the_field() {
        let mut body = Map::new();
        TokenSettings {
            request: TokenRequest::ReturnTokenIds,
            top_logprobs: 2,
            tokenizer_url: None,
        }
        .add_request_fields(&mut body);
        assert_eq!(
            Value::Object(body),
            json!({"logprobs": true, "top_logprobs": 2, "return_token_ids": true})
        );
        let mut body = Map::new();
        TokenSettings {
            request: TokenRequest::LlamaServer,
            top_logprobs: 0,
            tokenizer_url: None,
        }
        .add_request_fields(&mut body);
        assert_eq!(
            Value::Object(body),
            json!({"logprobs": true, "top_logprobs": 1}),
            "llama.cpp's server gives nothing for 0 alternatives"
        );
        assert_eq!(server_root("http://h:8080/v1/"), "http://h:8080");
        assert_eq!(server_root("http://h:8080"), "http://h:8080");
    }
}

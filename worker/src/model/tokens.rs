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
//!
//! Ids whose count disagrees with the usage the server reported for the same call are not kept
//! as exact: a count the server itself made is the one check a client can make of them.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::spec::{TokenRequest, TokensSpec};

/// What a client asks of the server for each call's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSettings {
    pub request: TokenRequest,
    pub top_logprobs: u8,
}

impl TokenSettings {
    pub fn from_spec(spec: &TokensSpec) -> Self {
        Self {
            request: spec.request,
            top_logprobs: spec.top_logprobs,
        }
    }

    /// Adds the fields that ask for the tokens to a request body.
    pub fn add_request_fields(&self, body: &mut Map<String, Value>) {
        body.insert("logprobs".into(), true.into());
        let top_logprobs = match self.request {
            // llama.cpp's server gives no logprobs at all (nor ids) for 0 alternatives; the one
            // it then sends is dropped again ([`Self::keep_asked`]).
            TokenRequest::LlamaServer => self.top_logprobs.max(1),
            TokenRequest::ReturnTokenIds | TokenRequest::LogprobsOnly => self.top_logprobs,
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
}

impl CallTokens {
    /// Whether both the prompt's and the completion's ids are the server's.
    pub fn has_ids(&self) -> bool {
        self.prompt_token_ids.is_some() && self.completion_token_ids.is_some()
    }

    /// The tokens a chat-completions response carries (its first choice's), with ids only where
    /// their count agrees with the reported usage (`prompt_tokens`, `completion_tokens`).
    pub fn from_response(response: &Value, prompt_tokens: u64, completion_tokens: u64) -> Self {
        let choice = response
            .get("choices")
            .and_then(|choices| choices.get(0))
            .unwrap_or(&Value::Null);
        let content: &[Value] = choice
            .get("logprobs")
            .and_then(|logprobs| logprobs.get("content"))
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice);
        let logprobs: Vec<f32> = content
            .iter()
            .map_while(|entry| entry.get("logprob").and_then(Value::as_f64))
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
                    .get("top_logprobs")
                    .and_then(Value::as_array)
                    .map(|top| top.iter().filter_map(top_logprob).collect())
                    .unwrap_or_default()
            })
            .collect();
        let top_logprobs = if top_logprobs.iter().any(|top| !top.is_empty()) {
            top_logprobs
        } else {
            Vec::new()
        };
        let prompt = response
            .get("prompt_token_ids")
            .or_else(|| choice.get("prompt_token_ids"))
            .and_then(ids);
        // llama.cpp's server names each logprob's token by its id instead.
        let completion = choice.get("token_ids").and_then(ids).or_else(|| {
            let from_logprobs: Option<Vec<u32>> = content
                .iter()
                .map(|entry| entry.get("id").and_then(id))
                .collect();
            from_logprobs.filter(|found| !found.is_empty())
        });
        Self {
            prompt_token_ids: prompt.filter(|prompt| count(prompt) == prompt_tokens),
            completion_token_ids: completion
                .filter(|completion| count(completion) == completion_tokens),
            logprobs,
            top_logprobs,
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

/// Why a llama.cpp server did not give a prompt's ids.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {message}")]
pub struct PromptIdsError {
    step: &'static str,
    message: String,
}

/// The ids of the prompt a llama.cpp server evaluates for the chat request `body`: its template
/// rendered by `/apply-template`, tokenized by `/tokenize` as its chat endpoint tokenizes it.
pub async fn llama_server_prompt_ids(
    http: &reqwest::Client,
    root: &str,
    body: &[u8],
    authorization: Option<&HeaderValue>,
    timeout: Duration,
) -> Result<Vec<u32>, PromptIdsError> {
    let post = |path: &str, body: Vec<u8>| {
        let mut request = http
            .post(format!("{root}{path}"))
            .timeout(timeout)
            .header(CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(authorization) = authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        request
    };
    let answer = |step: &'static str| move |message: String| PromptIdsError { step, message };
    let rendered: Value = read_json(post("/apply-template", body.to_vec()))
        .await
        .map_err(answer("/apply-template"))?;
    let prompt = rendered
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| answer("/apply-template")("no `prompt` in its answer".to_owned()))?;
    let tokenize =
        serde_json::json!({"content": prompt, "add_special": true, "parse_special": true});
    let tokens: Value = read_json(post(
        "/tokenize",
        serde_json::to_vec(&tokenize).expect("a JSON value serialises"),
    ))
    .await
    .map_err(answer("/tokenize"))?;
    tokens
        .get("tokens")
        .and_then(ids)
        .ok_or_else(|| answer("/tokenize")("no `tokens` ids in its answer".to_owned()))
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
    fn the_request_asks_for_ids_only_where_the_server_takes_the_field() {
        let mut body = Map::new();
        TokenSettings {
            request: TokenRequest::ReturnTokenIds,
            top_logprobs: 2,
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

//! A provider's Batch API in `OpenAI`'s dialect (files and batches), which `OpenAI`, `OpenRouter`,
//! Together, Groq, Fireworks and self-hosted gateways speak: a JSONL file of requests, each with
//! a `custom_id`, uploaded with `purpose=batch`; a batch created from it for a completion window;
//! its status polled; at its end an output file of the answered requests and an error file of the
//! rest, each line naming its `custom_id`, in any order.
//!
//! This module only speaks the API: what goes in a batch, and what is done with its results, is
//! the caller's.

use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderValue, RETRY_AFTER};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::client::parse_retry_after;

/// What a call to the Batch API met.
#[derive(Debug, thiserror::Error)]
pub enum BatchApiError {
    /// The provider answered with an error status.
    #[error("the batch API answered {status} to {what}: {message}")]
    Status {
        what: &'static str,
        status: u16,
        message: String,
        /// The provider's `Retry-After`, when it said to slow down.
        retry_after: Option<std::time::Duration>,
    },
    /// The request did not get an answer.
    #[error("the batch API could not be reached for {what}: {message}")]
    Transport { what: &'static str, message: String },
    /// An answer of another shape than the API's.
    #[error("the batch API's answer to {what} is not what the API gives: {message}")]
    Malformed { what: &'static str, message: String },
}

impl BatchApiError {
    /// The provider said to slow down (429), or is briefly unavailable (5xx, no answer): asking
    /// again later can succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Status { status, .. } => *status == 429 || *status >= 500,
            Self::Transport { .. } => true,
            Self::Malformed { .. } => false,
        }
    }
}

/// Where a provider batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    Validating,
    /// Refused at validation: none of its requests ran.
    Failed,
    InProgress,
    Finalizing,
    Completed,
    /// Its window passed: what ran is in its files, the rest in the error file.
    Expired,
    Cancelling,
    Cancelled,
    /// A status this client does not know; treated as still running.
    #[serde(other)]
    Unknown,
}

impl BatchStatus {
    /// The batch will change no more: its files (if any) are final.
    pub fn ended(self) -> bool {
        matches!(
            self,
            Self::Failed | Self::Completed | Self::Expired | Self::Cancelled
        )
    }
}

/// A provider batch, as `GET /batches/{id}` gives it (the fields used).
#[derive(Debug, Clone, Deserialize)]
pub struct ProviderBatch {
    pub id: String,
    pub status: BatchStatus,
    #[serde(default)]
    pub output_file_id: Option<String>,
    #[serde(default)]
    pub error_file_id: Option<String>,
    /// Why a batch failed validation.
    #[serde(default)]
    pub errors: Option<Value>,
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub created_at: u64,
}

impl ProviderBatch {
    /// The messages of why it failed validation, joined.
    pub fn failure(&self) -> String {
        let messages: Vec<&str> = self
            .errors
            .as_ref()
            .and_then(|errors| errors.get("data"))
            .and_then(Value::as_array)
            .map(|data| {
                data.iter()
                    .filter_map(|error| error.get("message").and_then(Value::as_str))
                    .collect()
            })
            .unwrap_or_default();
        if messages.is_empty() {
            format!("batch {} {:?} without a reason", self.id, self.status)
        } else {
            messages.join("; ")
        }
    }
}

/// One request's result, from a batch's output or error file.
#[derive(Debug, Clone, PartialEq)]
pub struct LineResult {
    pub custom_id: String,
    pub outcome: LineOutcome,
}

/// What became of one request of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum LineOutcome {
    /// Answered 200: the chat completion's body, as a live call would have received it.
    Answered(Vec<u8>),
    /// Answered with an error status: its body's text.
    Refused { status: u16, message: String },
    /// Never ran: the batch expired or was cancelled first (`batch_expired`,
    /// `batch_cancelled`), or another error code of the provider's.
    NotRun { code: String, message: String },
}

/// A client of one provider's Batch API.
#[derive(Debug, Clone)]
pub struct BatchApi {
    http: reqwest::Client,
    /// The base URL, including `/v1`, without a trailing `/`.
    base_url: String,
    authorization: Option<HeaderValue>,
}

/// The endpoint every line of a batch asks.
pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";

impl BatchApi {
    pub fn new(http: reqwest::Client, base_url: &str, authorization: Option<HeaderValue>) -> Self {
        Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
            authorization,
        }
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self
            .http
            .request(method, format!("{}{path}", self.base_url));
        match &self.authorization {
            Some(authorization) => request.header(AUTHORIZATION, authorization.clone()),
            None => request,
        }
    }

    /// Sends `request` and reads its answer's body, an error status made a [`BatchApiError`].
    async fn send(
        what: &'static str,
        request: reqwest::RequestBuilder,
    ) -> Result<Vec<u8>, BatchApiError> {
        let response = request
            .send()
            .await
            .map_err(|err| BatchApiError::Transport {
                what,
                message: err.to_string(),
            })?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(parse_retry_after);
        let body = response
            .bytes()
            .await
            .map_err(|err| BatchApiError::Transport {
                what,
                message: err.to_string(),
            })?;
        if status != StatusCode::OK {
            return Err(BatchApiError::Status {
                what,
                status: status.as_u16(),
                message: String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned(),
                retry_after,
            });
        }
        Ok(body.to_vec())
    }

    async fn json<T: serde::de::DeserializeOwned>(
        what: &'static str,
        request: reqwest::RequestBuilder,
    ) -> Result<T, BatchApiError> {
        let body = Self::send(what, request).await?;
        serde_json::from_slice(&body).map_err(|err| BatchApiError::Malformed {
            what,
            message: err.to_string(),
        })
    }

    /// Uploads a batch's input file (`purpose=batch`); returns its id.
    pub async fn upload(&self, name: &str, jsonl: Vec<u8>) -> Result<String, BatchApiError> {
        #[derive(Deserialize)]
        struct File {
            id: String,
        }
        let part = reqwest::multipart::Part::bytes(jsonl)
            .file_name(name.to_owned())
            .mime_str("application/jsonl")
            .expect("a valid MIME type");
        let form = reqwest::multipart::Form::new()
            .text("purpose", "batch")
            .part("file", part);
        let request = self
            .request(reqwest::Method::POST, "/files")
            .multipart(form);
        Ok(Self::json::<File>("a file upload", request).await?.id)
    }

    /// Creates a batch of the uploaded `file_id`'s requests, within 24 hours, with `metadata`
    /// (which names it when it is looked for again).
    pub async fn create(
        &self,
        file_id: &str,
        metadata: &Map<String, Value>,
    ) -> Result<ProviderBatch, BatchApiError> {
        let request = self
            .request(reqwest::Method::POST, "/batches")
            .json(&json!({
                "input_file_id": file_id,
                "endpoint": CHAT_COMPLETIONS,
                "completion_window": "24h",
                "metadata": metadata,
            }));
        Self::json("a batch's creation", request).await
    }

    pub async fn retrieve(&self, id: &str) -> Result<ProviderBatch, BatchApiError> {
        let request = self.request(reqwest::Method::GET, &format!("/batches/{id}"));
        Self::json("a batch's status", request).await
    }

    /// Asks the provider to stop a batch; what already ran stays in its files.
    pub async fn cancel(&self, id: &str) -> Result<ProviderBatch, BatchApiError> {
        let request = self.request(reqwest::Method::POST, &format!("/batches/{id}/cancel"));
        Self::json("a batch's cancel", request).await
    }

    /// The batches whose metadata holds every key and value of `metadata`, newest first,
    /// among those created at or after `since` (seconds since the epoch): how a batch whose
    /// creation was not recorded is found again.
    pub async fn find(
        &self,
        metadata: &Map<String, Value>,
        since: u64,
    ) -> Result<Vec<ProviderBatch>, BatchApiError> {
        #[derive(Deserialize)]
        struct Page {
            data: Vec<ProviderBatch>,
            #[serde(default)]
            has_more: bool,
        }
        let mut found = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut request = self
                .request(reqwest::Method::GET, "/batches")
                .query(&[("limit", "100")]);
            if let Some(after) = &after {
                request = request.query(&[("after", after.as_str())]);
            }
            let page: Page = Self::json("the list of batches", request).await?;
            let older = page
                .data
                .last()
                .is_none_or(|batch| batch.created_at < since);
            after = page.data.last().map(|batch| batch.id.clone());
            found.extend(page.data.into_iter().filter(|batch| {
                batch.created_at >= since
                    && metadata.iter().all(|(key, value)| {
                        batch
                            .metadata
                            .as_ref()
                            .and_then(|held| held.get(key))
                            .is_some_and(|held| held == value)
                    })
            }));
            if !page.has_more || older {
                return Ok(found);
            }
        }
    }

    /// The results of an ended batch: its output file's lines and its error file's.
    pub async fn results(&self, batch: &ProviderBatch) -> Result<Vec<LineResult>, BatchApiError> {
        let mut results = Vec::new();
        for file in [&batch.output_file_id, &batch.error_file_id]
            .into_iter()
            .flatten()
        {
            let request = self.request(reqwest::Method::GET, &format!("/files/{file}/content"));
            let content = Self::send("a batch's results", request).await?;
            for line in content.split(|byte| *byte == b'\n') {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                results.push(parse_result_line(line).map_err(|message| {
                    BatchApiError::Malformed {
                        what: "a batch's results",
                        message,
                    }
                })?);
            }
        }
        Ok(results)
    }
}

/// One line of a batch's input file.
pub fn request_line(custom_id: &str, body: &Value) -> Vec<u8> {
    let mut line = serde_json::to_vec(&json!({
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT_COMPLETIONS,
        "body": body,
    }))
    .expect("a JSON value serialises");
    line.push(b'\n');
    line
}

/// One line of an output or error file.
fn parse_result_line(line: &[u8]) -> Result<LineResult, String> {
    #[derive(Deserialize)]
    struct Line {
        custom_id: String,
        #[serde(default)]
        response: Option<Response>,
        #[serde(default)]
        error: Option<LineErrorBody>,
    }
    #[derive(Deserialize)]
    struct Response {
        status_code: u16,
        #[serde(default)]
        body: Value,
    }
    #[derive(Deserialize)]
    struct LineErrorBody {
        #[serde(default)]
        code: Option<String>,
        #[serde(default)]
        message: Option<String>,
    }
    let line: Line = serde_json::from_slice(line).map_err(|err| err.to_string())?;
    let outcome = match (line.response, line.error) {
        (Some(response), _) if response.status_code == 200 => LineOutcome::Answered(
            serde_json::to_vec(&response.body).expect("a JSON value serialises"),
        ),
        (Some(response), _) => LineOutcome::Refused {
            status: response.status_code,
            message: response.body.to_string(),
        },
        (None, Some(error)) => LineOutcome::NotRun {
            code: error.code.unwrap_or_default(),
            message: error.message.unwrap_or_default(),
        },
        (None, None) => {
            return Err(format!(
                "the line of {} has neither a response nor an error",
                line.custom_id
            ));
        }
    };
    Ok(LineResult {
        custom_id: line.custom_id,
        outcome,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_of_each_kind_are_read() {
        let answered = br#"{"id":"r1","custom_id":"a","response":{"status_code":200,"request_id":"q","body":{"choices":[]}},"error":null}"#;
        let refused = br#"{"id":"r2","custom_id":"b","response":{"status_code":400,"body":{"error":{"message":"no"}}},"error":null}"#;
        let expired = br#"{"id":"r3","custom_id":"c","response":null,"error":{"code":"batch_expired","message":"late"}}"#;
        assert_eq!(
            parse_result_line(answered).unwrap().outcome,
            LineOutcome::Answered(br#"{"choices":[]}"#.to_vec())
        );
        assert!(matches!(
            parse_result_line(refused).unwrap().outcome,
            LineOutcome::Refused { status: 400, .. }
        ));
        assert_eq!(
            parse_result_line(expired).unwrap().outcome,
            LineOutcome::NotRun {
                code: "batch_expired".into(),
                message: "late".into()
            }
        );
        assert!(parse_result_line(br#"{"custom_id":"d"}"#).is_err());
        let line: Value =
            serde_json::from_slice(&request_line("a-0", &json!({"model": "m"}))).unwrap();
        assert_eq!(line["url"], CHAT_COMPLETIONS);
        assert_eq!(line["body"]["model"], "m");
    }
}

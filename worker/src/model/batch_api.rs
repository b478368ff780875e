//! A provider's Batch API, in one of two dialects ([`BatchProvider`]):
//!
//! - `OpenAI`'s (files and batches), which `OpenAI`, `OpenRouter`, Together, Groq, Fireworks and
//!   self-hosted gateways speak: a JSONL file of requests, each with a `custom_id`, uploaded with
//!   `purpose=batch`; a batch created from it for a completion window, named in its metadata;
//!   its status polled; at its end an output file of the answered requests and an error file of
//!   the rest, each line naming its `custom_id`, in any order.
//! - Anthropic's Message Batches: the requests (`custom_id` and a message's `params`, translated
//!   from the chat request by [`super::anthropic`]) sent in the create itself; its
//!   `processing_status` polled until `ended`; its results (`succeeded`, `errored`, `canceled`,
//!   `expired` per line) read from its `results_url`, each message translated back into the
//!   chat completion a live call would have received. No metadata: a batch is known by its id
//!   alone.
//!
//! This module only speaks the API: what goes in a batch, and what is done with its results, is
//! the caller's.

use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue, InvalidHeaderValue, RETRY_AFTER};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::anthropic;
use super::client::parse_retry_after;
pub use crate::spec::BatchProvider;

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
    /// Where an ended Message Batch's results are (Anthropic).
    #[serde(default)]
    pub results_url: Option<String>,
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

/// How a dialect reads one line of a batch's results.
type ParseResultLine = fn(&[u8]) -> Result<LineResult, String>;

/// A client of one provider's Batch API.
#[derive(Debug, Clone)]
pub struct BatchApi {
    http: reqwest::Client,
    /// The base URL, including `/v1`, without a trailing `/`.
    base_url: String,
    /// The key, as the dialect sends it, and Anthropic's version.
    headers: HeaderMap,
    provider: BatchProvider,
}

/// The endpoint every line of a batch asks.
pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";

/// What a batch is created from: an uploaded file (`OpenAI`), or the requests themselves
/// (Anthropic).
#[derive(Debug, Clone)]
pub enum BatchInput {
    File(String),
    Requests(Vec<u8>),
}

impl BatchApi {
    /// A client of the API at `base_url`, sending `api_key` as `provider` takes it.
    pub fn new(
        http: reqwest::Client,
        base_url: &str,
        provider: BatchProvider,
        api_key: Option<&str>,
    ) -> Result<Self, InvalidHeaderValue> {
        let mut headers = HeaderMap::new();
        if let Some(key) = api_key {
            let (name, mut value) = match provider {
                BatchProvider::OpenAI => (
                    AUTHORIZATION,
                    HeaderValue::from_str(&format!("Bearer {key}"))?,
                ),
                BatchProvider::Anthropic => (
                    reqwest::header::HeaderName::from_static("x-api-key"),
                    HeaderValue::from_str(key)?,
                ),
            };
            // Keeps the key out of any debug output of the request.
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        if provider == BatchProvider::Anthropic {
            headers.insert(
                "anthropic-version",
                HeaderValue::from_static(anthropic::VERSION),
            );
        }
        Ok(Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
            headers,
            provider,
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Whether a batch can be found again by its window's name ([`BatchApi::find`]):
    /// Anthropic's batches carry no metadata.
    pub fn names_batches(&self) -> bool {
        self.provider == BatchProvider::OpenAI
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base_url))
            .headers(self.headers.clone())
    }

    /// The path of batch `id` (and what follows it) in this dialect.
    fn batch_path(&self, id: &str) -> String {
        match self.provider {
            BatchProvider::OpenAI => format!("/batches/{id}"),
            BatchProvider::Anthropic => format!("/messages/batches/{id}"),
        }
    }

    /// One request of a batch, `custom_id` asking the chat request `body`; an error when
    /// the dialect cannot say what `body` asks.
    pub fn request_line(&self, custom_id: &str, body: &Value) -> Result<Vec<u8>, String> {
        match self.provider {
            BatchProvider::OpenAI => Ok(request_line(custom_id, body)),
            BatchProvider::Anthropic => {
                let params = anthropic::messages_params(body)?;
                let mut line =
                    serde_json::to_vec(&json!({"custom_id": custom_id, "params": params}))
                        .expect("a JSON value serialises");
                line.push(b'\n');
                Ok(line)
            }
        }
    }

    /// Makes `lines` (each ending in a newline) something a batch is created from: uploads
    /// them as a file (`OpenAI`), or holds them for the create (Anthropic).
    pub async fn prepare(&self, lines: &[u8]) -> Result<BatchInput, BatchApiError> {
        match self.provider {
            BatchProvider::OpenAI => self
                .upload("window.jsonl", lines.to_vec())
                .await
                .map(BatchInput::File),
            BatchProvider::Anthropic => {
                let mut body = Vec::with_capacity(lines.len() + 16);
                body.extend_from_slice(b"{\"requests\":[");
                let requests = lines
                    .split(|byte| *byte == b'\n')
                    .filter(|line| !line.is_empty());
                for (index, line) in requests.enumerate() {
                    if index > 0 {
                        body.push(b',');
                    }
                    body.extend_from_slice(line);
                }
                body.extend_from_slice(b"]}");
                Ok(BatchInput::Requests(body))
            }
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
    async fn upload(&self, name: &str, jsonl: Vec<u8>) -> Result<String, BatchApiError> {
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

    /// Creates a batch of `input`'s requests, within 24 hours, named by `metadata` where the
    /// dialect keeps it (which names it when it is looked for again).
    pub async fn create(
        &self,
        input: &BatchInput,
        metadata: &Map<String, Value>,
    ) -> Result<ProviderBatch, BatchApiError> {
        match input {
            BatchInput::File(file_id) => {
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
            BatchInput::Requests(body) => {
                let request = self
                    .request(reqwest::Method::POST, "/messages/batches")
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body.clone());
                self.batch_answer("a batch's creation", request).await
            }
        }
    }

    pub async fn retrieve(&self, id: &str) -> Result<ProviderBatch, BatchApiError> {
        let request = self.request(reqwest::Method::GET, &self.batch_path(id));
        self.batch_answer("a batch's status", request).await
    }

    /// Asks the provider to stop a batch; what already ran stays in its results.
    pub async fn cancel(&self, id: &str) -> Result<ProviderBatch, BatchApiError> {
        let path = format!("{}/cancel", self.batch_path(id));
        let request = self.request(reqwest::Method::POST, &path);
        self.batch_answer("a batch's cancel", request).await
    }

    /// A batch as the dialect describes it.
    async fn batch_answer(
        &self,
        what: &'static str,
        request: reqwest::RequestBuilder,
    ) -> Result<ProviderBatch, BatchApiError> {
        match self.provider {
            BatchProvider::OpenAI => Self::json(what, request).await,
            BatchProvider::Anthropic => Ok(Self::json::<MessageBatch>(what, request)
                .await?
                .into_provider_batch()),
        }
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
        if !self.names_batches() {
            return Ok(Vec::new());
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

    /// The results of an ended batch: its output file's lines and its error file's (`OpenAI`),
    /// or the lines at its `results_url` (Anthropic).
    pub async fn results(&self, batch: &ProviderBatch) -> Result<Vec<LineResult>, BatchApiError> {
        let (contents, parse): (Vec<reqwest::RequestBuilder>, ParseResultLine) = match self.provider
        {
            BatchProvider::OpenAI => (
                [&batch.output_file_id, &batch.error_file_id]
                    .into_iter()
                    .flatten()
                    .map(|file| {
                        self.request(reqwest::Method::GET, &format!("/files/{file}/content"))
                    })
                    .collect(),
                parse_result_line,
            ),
            BatchProvider::Anthropic => (
                // The URL the provider gave, with the key (results are the account's), which
                // goes to the batch API's own host only.
                batch
                    .results_url
                    .iter()
                    .map(|url| {
                        if same_origin(url, &self.base_url) {
                            Ok(self.http.get(url).headers(self.headers.clone()))
                        } else {
                            Err(BatchApiError::Malformed {
                                what: "a batch's results",
                                message: format!(
                                    "its results_url {url} is not on the batch API's host ({}): \
                                     the key is not sent there",
                                    self.base_url
                                ),
                            })
                        }
                    })
                    .collect::<Result<_, _>>()?,
                parse_message_result_line,
            ),
        };
        let mut results = Vec::new();
        for request in contents {
            let content = Self::send("a batch's results", request).await?;
            for line in content.split(|byte| *byte == b'\n') {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                results.push(parse(line).map_err(|message| BatchApiError::Malformed {
                    what: "a batch's results",
                    message,
                })?);
            }
        }
        Ok(results)
    }
}

/// One line of a batch's input file.
fn request_line(custom_id: &str, body: &Value) -> Vec<u8> {
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

/// Whether `url` has the scheme, host and port of `base`.
fn same_origin(url: &str, base: &str) -> bool {
    match (url::Url::parse(url), url::Url::parse(base)) {
        (Ok(url), Ok(base)) => url.origin() == base.origin(),
        _ => false,
    }
}

/// A Message Batch, as Anthropic describes it (the fields used).
#[derive(Debug, Deserialize)]
struct MessageBatch {
    id: String,
    processing_status: String,
    #[serde(default)]
    results_url: Option<String>,
    #[serde(default)]
    created_at: Option<String>,
}

impl MessageBatch {
    /// As the batch path sees any provider's batch. `ended` covers what `OpenAI` calls
    /// completed, expired and cancelled alike: each line's result says which it met.
    fn into_provider_batch(self) -> ProviderBatch {
        let status = match self.processing_status.as_str() {
            "in_progress" => BatchStatus::InProgress,
            "canceling" => BatchStatus::Cancelling,
            "ended" => BatchStatus::Completed,
            _ => BatchStatus::Unknown,
        };
        let created_at = self
            .created_at
            .as_deref()
            .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
            .and_then(|at| u64::try_from(at.timestamp()).ok())
            .unwrap_or(0);
        ProviderBatch {
            id: self.id,
            status,
            output_file_id: None,
            error_file_id: None,
            errors: None,
            metadata: None,
            created_at,
            results_url: self.results_url,
        }
    }
}

/// One line of a Message Batch's results: `{custom_id, result: {type, message | error}}`.
fn parse_message_result_line(line: &[u8]) -> Result<LineResult, String> {
    #[derive(Deserialize)]
    struct Line {
        custom_id: String,
        result: Value,
    }
    let line: Line = serde_json::from_slice(line).map_err(|err| err.to_string())?;
    let result = &line.result;
    let outcome = match result["type"].as_str() {
        Some("succeeded") => LineOutcome::Answered(
            serde_json::to_vec(&anthropic::chat_completion(&result["message"]))
                .expect("a JSON value serialises"),
        ),
        Some("errored") => {
            // `{type: error, error: {type, message}}`, the body a live call would have had.
            let error = result["error"].get("error").unwrap_or(&result["error"]);
            LineOutcome::Refused {
                status: anthropic::error_status(error["type"].as_str().unwrap_or_default()),
                message: result["error"].to_string(),
            }
        }
        Some(kind @ ("canceled" | "expired")) => LineOutcome::NotRun {
            code: format!("batch_{kind}"),
            message: if kind == "expired" {
                "the batch expired before this request ran".into()
            } else {
                "the batch was canceled before this request ran".into()
            },
        },
        other => {
            return Err(format!(
                "the result of {} has the type {other:?}",
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
    fn the_key_goes_to_the_batch_apis_own_host_only() {
        let base = "https://api.anthropic.com/v1";
        assert!(same_origin(
            "https://api.anthropic.com/v1/messages/batches/m/results",
            base
        ));
        for elsewhere in [
            "https://results.example.com/v1/messages/batches/m/results",
            "http://api.anthropic.com/v1/messages/batches/m/results",
            "https://api.anthropic.com:8443/x",
            "not a url",
        ] {
            assert!(!same_origin(elsewhere, base), "{elsewhere}");
        }
    }

    #[test]
    fn message_batch_result_lines_of_each_kind_are_read() {
        let succeeded = br#"{"custom_id":"a","result":{"type":"succeeded","message":{"id":"m","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn","usage":{"input_tokens":3,"output_tokens":1}}}}"#;
        let errored = br#"{"custom_id":"b","result":{"type":"errored","error":{"type":"error","error":{"type":"overloaded_error","message":"busy"}}}}"#;
        let expired = br#"{"custom_id":"c","result":{"type":"expired"}}"#;
        let LineOutcome::Answered(body) = parse_message_result_line(succeeded).unwrap().outcome
        else {
            panic!("not answered");
        };
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "hi");
        assert!(matches!(
            parse_message_result_line(errored).unwrap().outcome,
            LineOutcome::Refused { status: 529, .. }
        ));
        assert_eq!(
            parse_message_result_line(expired).unwrap().outcome,
            LineOutcome::NotRun {
                code: "batch_expired".into(),
                message: "the batch expired before this request ran".into()
            }
        );
        assert!(
            parse_message_result_line(br#"{"custom_id":"d","result":{"type":"odd"}}"#).is_err()
        );
    }

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

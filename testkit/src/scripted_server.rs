//! A scripted OpenAI-compatible server: a test double for the exact edge cases a real model server
//! produces only by accident (429 with `Retry-After`, 5xx, truncated JSON, empty `choices`, SSE,
//! hangs). The worker's integration tests and benches and the end-to-end tests use it.
//!
//! It binds `127.0.0.1:0` (or another address: the `*_on` constructors, e.g. `0.0.0.0` for pods of
//! the local cluster's real node, which reach the host at its bridge address) on the caller's tokio
//! runtime and serves `POST /v1/chat/completions`, `POST /v1/images/generations` (for the image
//! tool: scripted like completions, see [`images_b64_reply`]) and `GET /v1/models`. It runs in
//! one of two modes:
//!
//! - **Script**: each request consumes the next [`Step`] of a queue; when the queue is empty the
//!   default step answers (by default a 500 saying the script is exhausted, so a test that makes
//!   more calls than it scripted fails loudly).
//! - **Fixed latency** ([`FixedLatency`], for benchmarks): every request sleeps `latency`, then a
//!   request without a `tool` message gets a tool call and one with a `tool` message gets a final
//!   answer, so every conversation is exactly two calls. Concurrency is unbounded.
//!
//! Every request's path, body and `Authorization` header are recorded; see
//! [`ScriptedServer::requests`].

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use trajectory_worker::model::{ModelSettings, RetryPolicy};

/// Where the server listens unless told otherwise.
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// The model name the server reports and the settings helper requests.
pub const MODEL: &str = "scripted";

/// What the server does with one request.
#[derive(Debug, Clone)]
pub enum Step {
    /// Answers with this status and JSON body.
    Json(u16, Value),
    /// Answers with this status, an OpenAI-style error body and `Retry-After: <seconds>`.
    RetryAfterSeconds(u16, u64),
    /// Answers with this status, an OpenAI-style error body and `Retry-After` as an HTTP-date this
    /// far in the future (HTTP-dates have whole seconds, so the real wait is up to 1 s shorter).
    RetryAfterDate(u16, Duration),
    /// Answers 429 with an OpenAI-style error body and these headers, no `Retry-After` (a
    /// provider's rate-limit headers, such as `x-ratelimit-reset-requests`).
    RateLimited(Vec<(&'static str, String)>),
    /// Answers with this status and these bytes verbatim (truncated or malformed JSON).
    Raw(u16, Vec<u8>),
    /// Answers 200 with these chunks as server-sent events, then `data: [DONE]`.
    Sse(Vec<Value>),
    /// Never answers (for timeouts).
    Hang,
    /// Waits, then does the inner step.
    Delay(Duration, Box<Step>),
}

impl Step {
    /// An OpenAI-style error answer: `{"error": {"message", "type", "code"}}`.
    pub fn error(status: u16, code: &str, message: &str) -> Self {
        Self::Json(
            status,
            json!({"error": {"message": message, "type": code, "code": code}}),
        )
    }

    /// A 200 answer with this completion body.
    pub fn ok(body: Value) -> Self {
        Self::Json(200, body)
    }
}

/// The benchmark mode: every request waits `latency`, then gets `tool_call` when its messages hold
/// no `tool` message (the first call of a conversation) and `final_answer` otherwise.
#[derive(Debug, Clone)]
pub struct FixedLatency {
    pub latency: Duration,
    pub tool_call: Value,
    pub final_answer: Value,
}

impl FixedLatency {
    /// Calls `tool_name` with `{}` first, then answers "done".
    pub fn new(latency: Duration, tool_name: &str) -> Self {
        Self {
            latency,
            tool_call: tool_call_reply(tool_name, &json!({})),
            final_answer: text_reply("done"),
        }
    }
}

/// One request as the server received it.
#[derive(Debug, Clone)]
pub struct ReceivedRequest {
    /// The request's path (`/v1/chat/completions`, `/v1/images/generations`).
    pub path: String,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// The `x-session-id` header (a conversation's identity, as the worker sends it), if any.
    pub session: Option<String>,
    /// The JSON body (a JSON string holding the raw text when the body was not JSON).
    pub body: Value,
}

enum Mode {
    Script {
        steps: Mutex<VecDeque<Step>>,
        default: Step,
    },
    FixedLatency {
        latency: Duration,
        tool_call: Bytes,
        final_answer: Bytes,
    },
    Respond(Box<Responder>),
}

/// A function from a request's JSON body to the step that answers it.
pub type Responder = dyn Fn(&Value) -> Step + Send + Sync;

/// A request as recorded: path, `Authorization` and `x-session-id` headers, raw body.
type Received = (&'static str, Option<String>, Option<String>, Bytes);

struct Shared {
    mode: Mode,
    /// Paths, headers and raw bodies; parsed only when a test asks, so the
    /// benchmark server spends no CPU on it.
    received: Mutex<Vec<Received>>,
    /// When the first request arrived (a benchmark's time to the first model request).
    first_request: OnceLock<Instant>,
}

/// A running scripted server; it stops accepting connections when dropped.
#[derive(Debug)]
pub struct ScriptedServer {
    address: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedServer {
    /// Serves `steps` in order, then a 500 saying the script is exhausted.
    pub async fn start(steps: impl IntoIterator<Item = Step>) -> Self {
        let exhausted = Step::error(
            500,
            "script_exhausted",
            "the scripted server's script is exhausted",
        );
        Self::start_with_default(steps, exhausted).await
    }

    /// Serves `steps` in order, then `default` for every further request.
    #[allow(
        clippy::unused_async,
        reason = "async so that it is called on the tokio runtime it spawns onto"
    )]
    pub async fn start_with_default(steps: impl IntoIterator<Item = Step>, default: Step) -> Self {
        Self::start_with_default_on(LOOPBACK, steps, default).await
    }

    /// [`ScriptedServer::start_with_default`] listening on `ip` (port picked free).
    #[allow(
        clippy::unused_async,
        reason = "async so that it is called on the tokio runtime it spawns onto"
    )]
    pub async fn start_with_default_on(
        ip: IpAddr,
        steps: impl IntoIterator<Item = Step>,
        default: Step,
    ) -> Self {
        let steps = Mutex::new(steps.into_iter().collect());
        Self::serve(ip, Mode::Script { steps, default })
    }

    /// Answers each request with `responder(body)`: for conversations whose turns depend on what
    /// the request offers (its `tools`) or already holds (its `messages`), which a fixed script
    /// cannot know in advance. A body that is not JSON is passed as a JSON string.
    #[allow(
        clippy::unused_async,
        reason = "async so that it is called on the tokio runtime it spawns onto"
    )]
    pub async fn start_responding(
        responder: impl Fn(&Value) -> Step + Send + Sync + 'static,
    ) -> Self {
        Self::serve(LOOPBACK, Mode::Respond(Box::new(responder)))
    }

    /// [`ScriptedServer::start_responding`] listening on `ip` (port picked free).
    #[allow(
        clippy::unused_async,
        reason = "async so that it is called on the tokio runtime it spawns onto"
    )]
    pub async fn start_responding_on(
        ip: IpAddr,
        responder: impl Fn(&Value) -> Step + Send + Sync + 'static,
    ) -> Self {
        Self::serve(ip, Mode::Respond(Box::new(responder)))
    }

    /// Serves the benchmark mode.
    #[allow(
        clippy::unused_async,
        reason = "async so that it is called on the tokio runtime it spawns onto"
    )]
    pub async fn start_fixed_latency(config: FixedLatency) -> Self {
        Self::start_fixed_latency_on(LOOPBACK, config).await
    }

    /// [`ScriptedServer::start_fixed_latency`] listening on `ip` (port picked free).
    #[allow(
        clippy::unused_async,
        reason = "async so that it is called on the tokio runtime it spawns onto"
    )]
    pub async fn start_fixed_latency_on(ip: IpAddr, config: FixedLatency) -> Self {
        Self::serve(
            ip,
            Mode::FixedLatency {
                latency: config.latency,
                tool_call: Bytes::from(config.tool_call.to_string()),
                final_answer: Bytes::from(config.final_answer.to_string()),
            },
        )
    }

    /// Binds `ip:0`, and spawns the server onto the current tokio runtime.
    fn serve(ip: IpAddr, mode: Mode) -> Self {
        let shared = Arc::new(Shared {
            mode,
            received: Mutex::new(Vec::new()),
            first_request: OnceLock::new(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/images/generations", post(image_generations))
            .route("/v1/messages", post(messages))
            .route("/v1/models", get(models))
            .with_state(Arc::clone(&shared));
        // A backlog larger than tokio's default 1024, so a benchmark opening a thousand
        // connections at once is not slowed by SYN retransmits.
        let socket = if ip.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .expect("a test server can open a socket");
        socket
            .bind(SocketAddr::new(ip, 0))
            .unwrap_or_else(|e| panic!("a test server can bind {ip}:0: {e}"));
        let listener = socket.listen(4096).expect("a test server can listen");
        let address = listener
            .local_addr()
            .expect("a bound socket has an address");
        // As real servers do: without it, Nagle's algorithm and delayed ACKs add up to 40 ms to
        // some replies, which the benchmark would blame on the client.
        let listener = listener.tap_io(|stream| {
            let _ = stream.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            // Serving only fails when accepting fails for good; the test then sees refused connections.
            let _ = axum::serve(listener, app).await;
        });
        Self {
            address,
            shared,
            task,
        }
    }

    /// The base URL, as `spec.model.baseUrl` takes it: `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.address)
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Appends a step to the script (no effect in fixed-latency mode).
    pub fn push(&self, step: Step) {
        if let Mode::Script { steps, .. } = &self.shared.mode {
            lock(steps).push_back(step);
        }
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<ReceivedRequest> {
        self.requests_since(0)
    }

    /// The requests received after the first `seen`, in arrival order: a test following the
    /// requests as a run goes parses each body once.
    pub fn requests_since(&self, seen: usize) -> Vec<ReceivedRequest> {
        // Parsed after the lock is let go (cloning `Bytes` only counts a reference), so that the
        // requests arriving meanwhile do not wait.
        let raw: Vec<Received> = lock(&self.shared.received)
            .iter()
            .skip(seen)
            .cloned()
            .collect();
        raw.into_iter()
            .map(|(path, authorization, session, body)| ReceivedRequest {
                path: path.to_owned(),
                authorization,
                session,
                body: serde_json::from_slice(&body)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned())),
            })
            .collect()
    }

    /// When the first request arrived, if one has.
    pub fn first_request_at(&self) -> Option<Instant> {
        self.shared.first_request.get().copied()
    }

    pub fn request_count(&self) -> usize {
        lock(&self.shared.received).len()
    }

    /// Settings for a client of this server, with fast retries (10 ms base delay, 4 attempts) and a
    /// 5 s request timeout; tests adjust the public fields they care about.
    pub fn settings(&self) -> ModelSettings {
        ModelSettings {
            base_urls: vec![self.base_url()],
            routing: trajectory_worker::model::RoutingSettings::default(),
            model: MODEL.to_owned(),
            api_key: None,
            max_tokens: None,
            temperature: None,
            reasoning_fields: serde_json::Map::new(),
            extra_body: serde_json::Map::new(),
            request_timeout: Duration::from_secs(5),
            stream: false,
            retry: RetryPolicy {
                max_attempts: 4,
                base_delay: Duration::from_millis(10),
                max_delay: Duration::from_secs(5),
                max_total_wait: Duration::from_secs(30),
            },
            prices: None,
            tokens: None,
            service_tier: None,
            batch: None,
        }
    }
}

/// A panic in a handler only poisons the lock; the data is still usable for assertions.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&shared, "/v1/chat/completions", &headers, body).await
}

/// Anthropic's Messages API: scripted like completions (the script answers in its shape), so
/// that a batch double can run Message Batches on exact turns.
async fn messages(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&shared, "/v1/messages", &headers, body).await
}

/// The Images API: scripted like completions (in fixed-latency mode it answers what a
/// completion would, so a benchmark scripts it with `start_with_default`).
async fn image_generations(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&shared, "/v1/images/generations", &headers, body).await
}

async fn answer(shared: &Shared, path: &'static str, headers: &HeaderMap, body: Bytes) -> Response {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let (authorization, session) = (text(header::AUTHORIZATION.as_str()), text("x-session-id"));
    shared.first_request.get_or_init(Instant::now);
    lock(&shared.received).push((path, authorization, session, body.clone()));
    match &shared.mode {
        Mode::Script { steps, default } => {
            let step = lock(steps).pop_front().unwrap_or_else(|| default.clone());
            perform(step).await
        }
        Mode::Respond(responder) => {
            let request = serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
            perform(responder(&request)).await
        }
        Mode::FixedLatency {
            latency,
            tool_call,
            final_answer,
        } => {
            tokio::time::sleep(*latency).await;
            // The client serialises compactly, so a tool result is exactly this byte string.
            let has_tool_result = contains(&body, br#""role":"tool""#);
            let reply = if has_tool_result {
                final_answer
            } else {
                tool_call
            };
            respond(
                StatusCode::OK,
                "application/json",
                None,
                Body::from(reply.clone()),
            )
        }
    }
}

async fn models() -> Response {
    let body =
        json!({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]});
    respond(
        StatusCode::OK,
        "application/json",
        None,
        Body::from(body.to_string()),
    )
}

async fn perform(mut step: Step) -> Response {
    loop {
        step = match step {
            Step::Delay(delay, inner) => {
                tokio::time::sleep(delay).await;
                *inner
            }
            Step::Hang => std::future::pending().await,
            Step::Json(status, body) => {
                return respond(
                    status_code(status),
                    "application/json",
                    None,
                    body.to_string().into(),
                );
            }
            Step::Raw(status, bytes) => {
                return respond(status_code(status), "application/json", None, bytes.into());
            }
            Step::RetryAfterSeconds(status, seconds) => {
                let after = HeaderValue::from(seconds);
                return respond(
                    status_code(status),
                    "application/json",
                    Some(after),
                    rate_limit_body(),
                );
            }
            Step::RateLimited(headers) => {
                let mut response = respond(
                    StatusCode::TOO_MANY_REQUESTS,
                    "application/json",
                    None,
                    rate_limit_body(),
                );
                for (name, value) in headers {
                    response.headers_mut().insert(
                        name,
                        HeaderValue::from_str(&value).expect("scripts use valid header values"),
                    );
                }
                return response;
            }
            Step::RetryAfterDate(status, after) => {
                let date = httpdate::fmt_http_date(SystemTime::now() + after);
                let after =
                    HeaderValue::from_str(&date).expect("an HTTP-date is a valid header value");
                return respond(
                    status_code(status),
                    "application/json",
                    Some(after),
                    rate_limit_body(),
                );
            }
            Step::Sse(events) => {
                let mut text = String::new();
                for event in events {
                    text.push_str("data: ");
                    text.push_str(&event.to_string());
                    text.push_str("\n\n");
                }
                text.push_str("data: [DONE]\n\n");
                return respond(StatusCode::OK, "text/event-stream", None, text.into());
            }
        }
    }
}

fn rate_limit_body() -> Body {
    let body = json!({"error": {"message": "Rate limit reached; try again later.", "type": "rate_limit_exceeded"}});
    Body::from(body.to_string())
}

fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).expect("scripts use valid HTTP status codes")
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    retry_after: Option<HeaderValue>,
    body: Body,
) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(after) = retry_after {
        headers.insert(header::RETRY_AFTER, after);
    }
    response
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

// ---- Requests ------------------------------------------------------------------------------------

/// The first user message of a chat request: the task a conversation is about ("" when there is
/// none).
pub fn first_user_message(body: &Value) -> &str {
    body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|message| message["role"] == "user")
        .and_then(|message| message["content"].as_str())
        .unwrap_or_default()
}

// ---- Replies -------------------------------------------------------------------------------------

/// A non-streaming completion body around one assistant message.
pub fn completion(message: Value, finish_reason: &str) -> Value {
    let mut body = json!({
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": null, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    });
    body["choices"][0]["message"] = message;
    body
}

/// A final answer.
pub fn text_reply(content: &str) -> Value {
    completion(json!({"role": "assistant", "content": content}), "stop")
}

/// One tool call with `arguments` JSON-encoded into a string, as the `OpenAI` API sends them.
pub fn tool_call_reply(name: &str, arguments: &Value) -> Value {
    tool_calls_reply(&[(name, Value::String(arguments.to_string()))])
}

/// Several tool calls in one reply; each `arguments` is sent verbatim, so odd shapes (an object,
/// `""`, double-encoded or HTML-escaped strings) can be scripted. Ids are unique per process.
pub fn tool_calls_reply(calls: &[(&str, Value)]) -> Value {
    static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
    let calls: Vec<Value> = calls
        .iter()
        .map(|(name, arguments)| {
            let id = format!("call_{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
        })
        .collect();
    completion(
        json!({"role": "assistant", "content": null, "tool_calls": calls}),
        "tool_calls",
    )
}

/// An Images API answer carrying `image` base64-encoded (`response_format: b64_json`).
pub fn images_b64_reply(image: &[u8]) -> Value {
    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode(image);
    json!({"created": 0, "data": [{"b64_json": encoded, "revised_prompt": "scripted"}]})
}

/// An Images API answer pointing at `url` (`response_format: url`).
pub fn images_url_reply(url: &str) -> Value {
    json!({"created": 0, "data": [{"url": url}]})
}

/// Where a reply carries its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningField {
    /// `message.reasoning`
    Reasoning,
    /// `message.reasoning_content`
    ReasoningContent,
    /// `message.reasoning_details`, one `reasoning.text` entry with a signature.
    ReasoningDetails,
    /// A `<think>…</think>` block at the start of `message.content`.
    InlineThink,
}

/// Adds reasoning to a reply made by [`text_reply`] or [`tool_calls_reply`].
pub fn with_reasoning(mut reply: Value, field: ReasoningField, text: &str) -> Value {
    let message = &mut reply["choices"][0]["message"];
    match field {
        ReasoningField::Reasoning => message["reasoning"] = text.into(),
        ReasoningField::ReasoningContent => message["reasoning_content"] = text.into(),
        ReasoningField::ReasoningDetails => {
            message["reasoning_details"] = json!([{"type": "reasoning.text", "text": text, "signature": "sig-scripted", "index": 0}]);
        }
        ReasoningField::InlineThink => {
            let content = message["content"].as_str().unwrap_or_default();
            message["content"] = format!("<think>{text}</think>{content}").into();
        }
    }
    reply
}

/// The same completion as a stream of chunks, each text split across two deltas, for
/// [`Step::Sse`]. `reasoning_details` are not streamed.
pub fn sse_events(completion: &Value) -> Vec<Value> {
    let chunk = |delta: Value, finish_reason: Value| {
        json!({
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        })
    };
    let choice = &completion["choices"][0];
    let message = &choice["message"];
    let mut events = vec![chunk(json!({"role": "assistant"}), Value::Null)];
    for field in ["reasoning", "reasoning_content", "content"] {
        if let Some(text) = message[field].as_str() {
            let (head, tail) = halves(text);
            events.push(chunk(json!({ field: head }), Value::Null));
            events.push(chunk(json!({ field: tail }), Value::Null));
        }
    }
    for (index, call) in message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let function = &call["function"];
        let arguments = match &function["arguments"] {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        let (head, tail) = halves(&arguments);
        let opening = json!({"index": index, "id": call["id"], "type": "function",
                             "function": {"name": function["name"], "arguments": head}});
        events.push(chunk(json!({"tool_calls": [opening]}), Value::Null));
        let rest = json!({"index": index, "function": {"arguments": tail}});
        events.push(chunk(json!({"tool_calls": [rest]}), Value::Null));
    }
    events.push(chunk(json!({}), choice["finish_reason"].clone()));
    events.push(
        json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "choices": [],
                       "usage": completion["usage"]}),
    );
    events
}

fn halves(text: &str) -> (&str, &str) {
    let mut middle = text.len() / 2;
    while !text.is_char_boundary(middle) {
        middle += 1;
    }
    text.split_at(middle)
}

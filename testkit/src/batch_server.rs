//! A test double of a provider's Batch API: `OpenAI`'s Files and Batches endpoints, each batch's
//! lines executed against a real OpenAI-compatible model server. No server here has the API
//! (`LiteLLM`'s proxy, which runs batches itself, needs Prisma's engines, downloaded at start-up
//! from a host this machine cannot reach), so this one stands in, and does what providers do
//! only by accident on demand: a turnaround, expiry with partial output, a line refused, a batch
//! refused at validation, a create answered 429; and it holds a create's answer or a results download
//! open, so that a test can kill its client at that moment.
//!
//! - `POST /v1/files` (multipart, `purpose=batch`), `GET /v1/files/{id}/content`.
//! - `POST /v1/batches` (`input_file_id`, `endpoint`, `completion_window`, `metadata`),
//!   `GET /v1/batches/{id}`, `GET /v1/batches` (newest first, `limit`, `after`),
//!   `POST /v1/batches/{id}/cancel`.
//! - Output and error files in `OpenAI`'s shape: `{id, custom_id, response: {status_code,
//!   request_id, body}, error}` per line, in the order they finished; lines an expired batch
//!   never ran in the error file with code `batch_expired`. A cancelled batch keeps what ran.
//!
//! - Anthropic's Message Batches: `POST /v1/messages/batches` (`requests` of `custom_id` and
//!   `params`, the `anthropic-version` header required), `GET /v1/messages/batches/{id}`,
//!   `POST /v1/messages/batches/{id}/cancel`, and the results at the batch's `results_url`
//!   (`{custom_id, result: {type: succeeded | errored | expired, ...}}` per line), each request's
//!   params run on the model server's `/v1/messages` (llama.cpp's `llama-server` serves it). A
//!   refused batch is refused at its creation (400), as Anthropic does.
//!
//! It counts what it executed (each line sent to the model server is a request paid for), so a
//! test can check that no turn was paid twice.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde_json::{Value, json};

/// Lines of one batch sent to the model server at once, unless [`Behaviour::parallel_lines`]
/// says otherwise.
const LINES_AT_ONCE: usize = 4;

/// What the server does to the batches created from now on.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// How long a batch takes at least, from its creation to its end.
    pub turnaround: Duration,
    /// A batch ends `expired` after running this many of its lines: their results in the output,
    /// the rest in the error file as `batch_expired`.
    pub expire_after_lines: Option<usize>,
    /// Lines whose `custom_id` contains one of these are answered 400 (in the error file).
    pub refuse_lines_containing: Vec<String>,
    /// The next this many batches fail validation (`status: failed`, `errors`).
    pub fail_batches: usize,
    /// The next this many `POST /v1/batches` are answered 429.
    pub throttle_creates: usize,
    /// Lines of one batch sent to the model server at once (unset: 4); a benchmark whose model
    /// takes seconds a call sets it to a window's size, so that a batch ends at its turnaround.
    pub parallel_lines: Option<usize>,
    /// The `n`th batch created (from 1) is created and runs, but the answer to its creation is
    /// never sent: a test kills its client at that moment, its batch created and not known.
    pub hold_create_of: Option<usize>,
    /// The first download of a results file of the `n`th batch created is never answered: a
    /// test kills its client between the batch's end and its results.
    pub hold_results_of: Option<usize>,
}

/// What the server did, so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Batches created (429s not counted).
    pub batches: usize,
    /// Lines sent to the model server: requests paid for.
    pub executed: usize,
    /// Of those, per `custom_id`.
    pub executed_ids: BTreeMap<String, usize>,
    /// Creates answered 429.
    pub throttled: usize,
    /// Answers held ([`Behaviour::hold_create_of`], [`Behaviour::hold_results_of`]).
    pub held: usize,
}

#[derive(Debug, Default)]
struct Store {
    behaviour: Behaviour,
    files: BTreeMap<String, Vec<u8>>,
    /// By creation order.
    batches: Vec<Value>,
    counts: BatchCounts,
}

#[derive(Debug)]
struct Shared {
    upstream: String,
    http: reqwest::Client,
    store: Mutex<Store>,
    next_id: AtomicU64,
    /// Its own base URL, which a Message Batch's `results_url` names.
    base_url: std::sync::OnceLock<String>,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn id(&self, prefix: &str) -> String {
        format!(
            "{prefix}_{:06}",
            self.next_id.fetch_add(1, Ordering::SeqCst)
        )
    }

    fn update_batch(&self, id: &str, update: impl FnOnce(&mut Value)) {
        let mut store = self.store();
        if let Some(batch) = store.batches.iter_mut().find(|batch| batch["id"] == id) {
            update(batch);
        }
    }

    /// Records a batch just created; whether its creation's answer is to be held
    /// ([`Behaviour::hold_create_of`]).
    fn add_batch(&self, batch: Value) -> bool {
        let mut store = self.store();
        store.counts.batches += 1;
        store.batches.push(batch);
        let held = store.behaviour.hold_create_of == Some(store.counts.batches);
        if held {
            store.counts.held += 1;
        }
        held
    }

    /// Whether a download of the results of the first batch `of` names is to be held
    /// ([`Behaviour::hold_results_of`], once).
    fn hold_results(&self, of: impl Fn(&Value) -> bool) -> bool {
        let mut store = self.store();
        let index = store.batches.iter().position(of);
        let held = index.is_some_and(|index| store.behaviour.hold_results_of == Some(index + 1));
        if held {
            store.behaviour.hold_results_of = None;
            store.counts.held += 1;
        }
        held
    }

    fn batch(&self, id: &str) -> Option<Value> {
        self.store()
            .batches
            .iter()
            .find(|batch| batch["id"] == id)
            .cloned()
    }
}

/// A running batch server; it stops accepting connections when dropped.
#[derive(Debug)]
pub struct BatchServer {
    served: crate::Served,
    shared: Arc<Shared>,
}

impl BatchServer {
    /// A server whose batches run their lines against `upstream` (a base URL ending `/v1`).
    pub async fn start(upstream: &str, behaviour: Behaviour) -> Self {
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            http: reqwest::Client::new(),
            store: Mutex::new(Store {
                behaviour,
                ..Store::default()
            }),
            next_id: AtomicU64::new(1),
            base_url: std::sync::OnceLock::new(),
        });
        let app = Router::new()
            .route("/v1/files", post(upload))
            .route("/v1/files/{id}/content", get(content))
            .route("/v1/batches", post(create).get(list))
            .route("/v1/batches/{id}", get(retrieve))
            .route("/v1/batches/{id}/cancel", post(cancel))
            .route("/v1/messages/batches", post(create_message_batch))
            .route("/v1/messages/batches/{id}", get(retrieve))
            .route(
                "/v1/messages/batches/{id}/cancel",
                post(cancel_message_batch),
            )
            .route(
                "/v1/messages/batches/{id}/results",
                get(message_batch_results),
            )
            // A provider takes input files of up to 200 MB (axum's default limit is 2 MB).
            .layer(axum::extract::DefaultBodyLimit::max(200 << 20))
            .with_state(Arc::clone(&shared));
        let served = crate::Served::start(app).await;
        let _ = shared.base_url.set(served.base_url());
        Self { served, shared }
    }

    /// The base URL, as `spec.model.baseUrl` takes it.
    pub fn base_url(&self) -> String {
        self.served.base_url()
    }

    /// Changes what the server does to batches created from now on.
    pub fn set_behaviour(&self, behaviour: Behaviour) {
        self.shared.store().behaviour = behaviour;
    }

    pub fn counts(&self) -> BatchCounts {
        self.shared.store().counts.clone()
    }

    /// Every batch, in creation order, as `GET /v1/batches/{id}` shows it.
    pub fn batches(&self) -> Vec<Value> {
        self.shared.store().batches.clone()
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error"}});
    (status, axum::Json(body)).into_response()
}

async fn upload(State(shared): State<Arc<Shared>>, mut form: Multipart) -> Response {
    let (mut purpose, mut file) = (None, None);
    while let Ok(Some(field)) = form.next_field().await {
        match field.name() {
            Some("purpose") => purpose = field.text().await.ok(),
            Some("file") => {
                let filename = field.file_name().unwrap_or("input.jsonl").to_owned();
                file = field.bytes().await.ok().map(|bytes| (filename, bytes));
            }
            _ => {}
        }
    }
    let (Some(purpose), Some((filename, bytes))) = (purpose, file) else {
        return error(
            StatusCode::BAD_REQUEST,
            "a file upload needs `purpose` and `file`",
        );
    };
    let id = shared.id("file");
    let size = bytes.len();
    shared.store().files.insert(id.clone(), bytes.to_vec());
    axum::Json(
        json!({"id": id, "object": "file", "bytes": size, "created_at": now(),
                      "filename": filename, "purpose": purpose}),
    )
    .into_response()
}

async fn content(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let held =
        shared.hold_results(|batch| batch["output_file_id"] == id || batch["error_file_id"] == id);
    if held {
        std::future::pending::<()>().await;
    }
    match shared.store().files.get(&id) {
        Some(bytes) => (StatusCode::OK, bytes.clone()).into_response(),
        None => error(StatusCode::NOT_FOUND, &format!("no file {id}")),
    }
}

async fn create(
    State(shared): State<Arc<Shared>>,
    axum::Json(request): axum::Json<Value>,
) -> Response {
    let (input, behaviour) = {
        let mut store = shared.store();
        if store.behaviour.throttle_creates > 0 {
            store.behaviour.throttle_creates -= 1;
            store.counts.throttled += 1;
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "1")],
                axum::Json(
                    json!({"error": {"message": "too many batches being created",
                                            "type": "rate_limit_error"}}),
                ),
            )
                .into_response();
        }
        let Some(input) = request["input_file_id"]
            .as_str()
            .and_then(|id| store.files.get(id))
            .cloned()
        else {
            return error(StatusCode::BAD_REQUEST, "input_file_id names no file");
        };
        let behaviour = store.behaviour.clone();
        if store.behaviour.fail_batches > 0 {
            store.behaviour.fail_batches -= 1;
        }
        (input, behaviour)
    };
    let id = shared.id("batch");
    let created = now();
    let batch = json!({
        "id": id, "object": "batch", "endpoint": request["endpoint"],
        "input_file_id": request["input_file_id"],
        "completion_window": request["completion_window"], "status": "validating",
        "output_file_id": null, "error_file_id": null, "errors": null,
        "created_at": created, "in_progress_at": null, "expires_at": created + 86_400,
        "completed_at": null, "failed_at": null, "expired_at": null, "cancelled_at": null,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": request.get("metadata").cloned().unwrap_or(Value::Null),
    });
    let held = shared.add_batch(batch.clone());
    tokio::spawn(run_batch(Arc::clone(&shared), id, input, behaviour));
    if held {
        std::future::pending::<()>().await;
    }
    axum::Json(batch).into_response()
}

/// Validates the batch's lines, runs them against the model server and ends the batch as
/// `behaviour` says.
async fn run_batch(shared: Arc<Shared>, id: String, input: Vec<u8>, behaviour: Behaviour) {
    let started = tokio::time::Instant::now();
    let lines: Vec<Value> = match validate(&input) {
        Ok(lines) if behaviour.fail_batches == 0 => lines,
        result => {
            let message = result
                .err()
                .unwrap_or_else(|| "the batch was refused".to_owned());
            shared.update_batch(&id, |batch| {
                batch["status"] = "failed".into();
                batch["failed_at"] = now().into();
                batch["errors"] = json!({"object": "list", "data": [
                    {"code": "invalid_request", "message": message, "param": null, "line": null}]});
            });
            return;
        }
    };
    shared.update_batch(&id, |batch| {
        batch["status"] = "in_progress".into();
        batch["in_progress_at"] = now().into();
        batch["request_counts"]["total"] = lines.len().into();
    });
    let requests = lines
        .into_iter()
        .map(|mut line| {
            let custom_id = line["custom_id"].as_str().unwrap_or_default().to_owned();
            (custom_id, line["body"].take())
        })
        .collect();
    let (fates, expired) = execute(&shared, requests, &behaviour, "chat/completions").await;
    let (output, errors) = openai_result_files(&id, fates);
    tokio::time::sleep_until(started + behaviour.turnaround).await;
    let write = |lines: &[Value]| {
        (!lines.is_empty()).then(|| {
            let file_id = shared.id("file");
            let mut bytes = Vec::new();
            for line in lines {
                bytes.extend_from_slice(line.to_string().as_bytes());
                bytes.push(b'\n');
            }
            shared.store().files.insert(file_id.clone(), bytes);
            file_id
        })
    };
    let (output_file, error_file) = (write(&output), write(&errors));
    // A cancel keeps what already ran, as providers do.
    let cancelled = shared
        .batch(&id)
        .is_some_and(|batch| batch["status"] == "cancelling");
    let (status, at) = if cancelled {
        ("cancelled", "cancelled_at")
    } else if expired {
        ("expired", "expired_at")
    } else {
        ("completed", "completed_at")
    };
    shared.update_batch(&id, |batch| {
        batch["status"] = status.into();
        batch[at] = now().into();
        batch["output_file_id"] = output_file.into();
        batch["error_file_id"] = error_file.into();
        batch["request_counts"]["completed"] = output.len().into();
        batch["request_counts"]["failed"] = errors.len().into();
    });
}

/// What became of one request of a batch.
enum Ran {
    /// Sent to the model server: its answer's status and body.
    Answered { status: u16, body: Value },
    /// Refused by [`Behaviour::refuse_lines_containing`] without running.
    Refused,
    /// Never ran: the batch expired first.
    Expired,
}

/// Runs the `requests` (`custom_id`, body) of batch `id` against the model server's `path`, as
/// `behaviour` says: each one's fate, in the order they finished (those never run first), and
/// whether the batch expired before running them all.
async fn execute(
    shared: &Shared,
    requests: Vec<(String, Value)>,
    behaviour: &Behaviour,
    path: &str,
) -> (Vec<(String, Ran)>, bool) {
    let total = requests.len();
    let run = total.min(behaviour.expire_after_lines.unwrap_or(usize::MAX));
    let mut fates = Vec::with_capacity(total);
    let mut to_run = Vec::new();
    for (index, (custom_id, body)) in requests.into_iter().enumerate() {
        if index >= run {
            fates.push((custom_id, Ran::Expired));
        } else if behaviour
            .refuse_lines_containing
            .iter()
            .any(|part| custom_id.contains(part.as_str()))
        {
            fates.push((custom_id, Ran::Refused));
        } else {
            to_run.push((custom_id, body));
        }
    }
    let ran: Vec<(String, Ran)> = futures::stream::iter(to_run)
        .map(|(custom_id, body)| async move {
            let answer = shared
                .http
                .post(format!("{}/{path}", shared.upstream))
                .header("anthropic-version", "2023-06-01")
                .json(&body)
                .send()
                .await;
            {
                let mut store = shared.store();
                store.counts.executed += 1;
                *store
                    .counts
                    .executed_ids
                    .entry(custom_id.clone())
                    .or_default() += 1;
            }
            let (status, body) = match answer {
                Ok(answer) => {
                    let status = answer.status().as_u16();
                    (status, answer.json::<Value>().await.unwrap_or(Value::Null))
                }
                Err(err) => (502, json!({"error": {"message": err.to_string()}})),
            };
            (custom_id, Ran::Answered { status, body })
        })
        .buffer_unordered(behaviour.parallel_lines.unwrap_or(LINES_AT_ONCE).max(1))
        .collect()
        .await;
    fates.extend(ran);
    (fates, run < total)
}

/// The output file's lines and the error file's of batch `id`'s `fates`, in `OpenAI`'s shape.
fn openai_result_files(id: &str, fates: Vec<(String, Ran)>) -> (Vec<Value>, Vec<Value>) {
    let (mut output, mut errors) = (Vec::new(), Vec::new());
    for (index, (custom_id, ran)) in fates.into_iter().enumerate() {
        let request_id = format!("req_{id}_{index}");
        match ran {
            Ran::Answered { status, body } => {
                let line = json!({"id": request_id, "custom_id": custom_id, "error": null,
                    "response": {"status_code": status, "request_id": request_id, "body": body}});
                if status == 200 {
                    output.push(line);
                } else {
                    errors.push(line);
                }
            }
            Ran::Refused => errors.push(json!({"id": request_id, "custom_id": custom_id,
                "error": null,
                "response": {"status_code": 400, "request_id": request_id,
                  "body": {"error": {"message": "this request was refused",
                                     "type": "invalid_request_error"}}}})),
            Ran::Expired => errors.push(json!({"id": request_id, "custom_id": custom_id,
                "response": null,
                "error": {"code": "batch_expired",
                          "message": "the batch expired before this request ran"}})),
        }
    }
    (output, errors)
}

/// The input file's lines, as `OpenAI` validates them: JSON objects with a `custom_id` unique in
/// the file, `method: POST`, one `url` for all, and a `body`.
fn validate(input: &[u8]) -> Result<Vec<Value>, String> {
    let mut lines = Vec::new();
    let (mut ids, mut urls) = (BTreeSet::new(), BTreeSet::new());
    for (number, line) in input.split(|byte| *byte == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let line: Value = serde_json::from_slice(line)
            .map_err(|err| format!("line {}: not JSON: {err}", number + 1))?;
        let custom_id = line["custom_id"]
            .as_str()
            .ok_or_else(|| format!("line {}: no custom_id", number + 1))?;
        if !ids.insert(custom_id.to_owned()) {
            return Err(format!(
                "line {}: custom_id {custom_id} is not unique",
                number + 1
            ));
        }
        if line["method"] != "POST" || !line["body"].is_object() {
            return Err(format!("line {}: needs method POST and a body", number + 1));
        }
        urls.insert(line["url"].as_str().unwrap_or_default().to_owned());
        lines.push(line);
    }
    if urls.len() > 1 {
        return Err("every line must have the same url".to_owned());
    }
    Ok(lines)
}

async fn retrieve(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    match shared.batch(&id) {
        Some(batch) => axum::Json(batch).into_response(),
        None => error(StatusCode::NOT_FOUND, &format!("no batch {id}")),
    }
}

async fn list(
    State(shared): State<Arc<Shared>>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let limit = query
        .get("limit")
        .and_then(|limit| limit.parse().ok())
        .unwrap_or(20usize);
    let store = shared.store();
    let newest_first = store
        .batches
        .iter()
        .rev()
        .filter(|batch| batch["object"] == "batch");
    let page: Vec<Value> = match query.get("after") {
        Some(after) => newest_first
            .skip_while(|batch| batch["id"] != after.as_str())
            .skip(1)
            .take(limit + 1)
            .cloned()
            .collect(),
        None => newest_first.take(limit + 1).cloned().collect(),
    };
    let has_more = page.len() > limit;
    let data: Vec<Value> = page.into_iter().take(limit).collect();
    axum::Json(json!({
        "object": "list",
        "first_id": data.first().map(|batch| batch["id"].clone()),
        "last_id": data.last().map(|batch| batch["id"].clone()),
        "has_more": has_more,
        "data": data,
    }))
    .into_response()
}

async fn cancel(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let mut found = None;
    shared.update_batch(&id, |batch| {
        if matches!(batch["status"].as_str(), Some("validating" | "in_progress")) {
            batch["status"] = "cancelling".into();
        }
        found = Some(batch.clone());
    });
    match found {
        Some(batch) => axum::Json(batch).into_response(),
        None => error(StatusCode::NOT_FOUND, &format!("no batch {id}")),
    }
}

/// An error in Anthropic's shape.
fn anthropic_error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, axum::Json(body)).into_response()
}

/// RFC 3339, as Anthropic gives its times.
fn rfc3339(seconds: u64) -> String {
    chrono::DateTime::from_timestamp(i64::try_from(seconds).unwrap_or(0), 0)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The requests of a Message Batch's create, as Anthropic validates them: each with a
/// `custom_id` of 1 to 64 letters, digits, `-` and `_`, unique in the batch, and `params` with a
/// model, `max_tokens` and messages.
fn validate_message_requests(request: &Value) -> Result<Vec<(String, Value)>, String> {
    let requests = request["requests"]
        .as_array()
        .filter(|requests| !requests.is_empty())
        .ok_or("requests: a non-empty list is required")?;
    let mut ids = BTreeSet::new();
    let mut valid = Vec::with_capacity(requests.len());
    for (index, request) in requests.iter().enumerate() {
        let custom_id = request["custom_id"].as_str().unwrap_or_default();
        let well_formed = (1..=64).contains(&custom_id.len())
            && custom_id
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_');
        if !well_formed {
            return Err(format!(
                "requests.{index}.custom_id: {custom_id:?} does not match ^[a-zA-Z0-9_-]{{1,64}}$"
            ));
        }
        if !ids.insert(custom_id) {
            return Err(format!(
                "requests.{index}.custom_id: {custom_id} is not unique"
            ));
        }
        let params = &request["params"];
        for field in ["model", "max_tokens", "messages"] {
            if params.get(field).is_none() {
                return Err(format!("requests.{index}.params.{field}: Field required"));
            }
        }
        valid.push((custom_id.to_owned(), params.clone()));
    }
    Ok(valid)
}

async fn create_message_batch(
    State(shared): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
    axum::Json(request): axum::Json<Value>,
) -> Response {
    if !headers.contains_key("anthropic-version") {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "anthropic-version: header is required",
        );
    }
    let requests = match validate_message_requests(&request) {
        Ok(requests) => requests,
        Err(message) => {
            return anthropic_error(StatusCode::BAD_REQUEST, "invalid_request_error", &message);
        }
    };
    let behaviour = {
        let mut store = shared.store();
        if store.behaviour.throttle_creates > 0 {
            store.behaviour.throttle_creates -= 1;
            store.counts.throttled += 1;
            let mut response = anthropic_error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "too many batches being created",
            );
            response
                .headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
            return response;
        }
        // Anthropic refuses a batch at its creation, not after.
        if store.behaviour.fail_batches > 0 {
            store.behaviour.fail_batches -= 1;
            return anthropic_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "the batch was refused",
            );
        }
        store.behaviour.clone()
    };
    let id = shared.id("msgbatch");
    let created = now();
    let batch = json!({
        "id": id, "type": "message_batch", "processing_status": "in_progress",
        "request_counts": {"processing": requests.len(), "succeeded": 0, "errored": 0,
                           "canceled": 0, "expired": 0},
        "ended_at": null, "created_at": rfc3339(created), "expires_at": rfc3339(created + 86_400),
        "archived_at": null, "cancel_initiated_at": null, "results_url": null,
    });
    let held = shared.add_batch(batch.clone());
    tokio::spawn(run_message_batch(
        Arc::clone(&shared),
        id,
        requests,
        behaviour,
    ));
    if held {
        std::future::pending::<()>().await;
    }
    axum::Json(batch).into_response()
}

/// Runs a Message Batch's requests against the model server's Messages endpoint and ends it,
/// its results at its `results_url`.
async fn run_message_batch(
    shared: Arc<Shared>,
    id: String,
    requests: Vec<(String, Value)>,
    behaviour: Behaviour,
) {
    let started = tokio::time::Instant::now();
    let (fates, _) = execute(&shared, requests, &behaviour, "messages").await;
    tokio::time::sleep_until(started + behaviour.turnaround).await;
    let (mut succeeded, mut errored, mut expired) = (0, 0, 0);
    let mut results = Vec::new();
    for (custom_id, ran) in fates {
        let result = match ran {
            Ran::Answered { status: 200, body } => {
                succeeded += 1;
                json!({"type": "succeeded", "message": body})
            }
            Ran::Answered { body, .. } => {
                errored += 1;
                json!({"type": "errored", "error": body})
            }
            Ran::Refused => {
                errored += 1;
                json!({"type": "errored", "error": {"type": "error", "error": {
                    "type": "invalid_request_error", "message": "this request was refused"}}})
            }
            Ran::Expired => {
                expired += 1;
                json!({"type": "expired"})
            }
        };
        results.extend_from_slice(
            json!({"custom_id": custom_id, "result": result})
                .to_string()
                .as_bytes(),
        );
        results.push(b'\n');
    }
    shared
        .store()
        .files
        .insert(format!("results_{id}"), results);
    let results_url = format!(
        "{}/messages/batches/{id}/results",
        shared.base_url.get().map_or("", String::as_str)
    );
    shared.update_batch(&id, |batch| {
        batch["processing_status"] = "ended".into();
        batch["ended_at"] = rfc3339(now()).into();
        batch["results_url"] = results_url.into();
        batch["request_counts"] = json!({"processing": 0, "succeeded": succeeded,
            "errored": errored, "canceled": 0, "expired": expired});
    });
}

async fn message_batch_results(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Response {
    let held = shared.hold_results(|batch| batch["id"] == id.as_str());
    if held {
        std::future::pending::<()>().await;
    }
    match shared.store().files.get(&format!("results_{id}")) {
        Some(bytes) => (
            StatusCode::OK,
            [("content-type", "application/x-jsonl")],
            bytes.clone(),
        )
            .into_response(),
        None => anthropic_error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            &format!("batch {id} has not ended"),
        ),
    }
}

async fn cancel_message_batch(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Response {
    let mut found = None;
    shared.update_batch(&id, |batch| {
        if batch["processing_status"] == "in_progress" {
            batch["processing_status"] = "canceling".into();
            batch["cancel_initiated_at"] = rfc3339(now()).into();
        }
        found = Some(batch.clone());
    });
    match found {
        Some(batch) => axum::Json(batch).into_response(),
        None => anthropic_error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            &format!("no batch {id}"),
        ),
    }
}

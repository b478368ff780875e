//! A test double for exact edge cases of object storage: an HTTP proxy in front of a real S3
//! server ([`crate::versitygw`]) that passes every request through unchanged (its `Host` header
//! too, so the client's signature still holds) except those a test told it to fault: answered
//! `503 SlowDown` without reaching the server, cut off mid-answer after the server handled them
//! (the client sees a reset connection and cannot know whether its write landed), or held for a
//! while before they go on. It also counts the requests by kind, what a cloud bill counts.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode};
use axum::response::Response;

/// What happens to a request the proxy faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answered `503 SlowDown` (S3's throttling), without reaching the server.
    SlowDown,
    /// Passed to the server, whose answer is then never sent: the request took effect, and the
    /// client sees the connection closed.
    ResetAfter,
    /// Held this long, then passed through.
    Stall(Duration),
}

/// Which requests a fault applies to: the next one of this kind whose key contains `key_part`.
#[derive(Debug, Clone)]
pub struct Rule {
    pub kind: Kind,
    pub key_part: String,
    pub fault: Fault,
}

/// A request's kind, as S3 bills them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `GET` with `list-type` (`ListObjectsV2`).
    List,
    Get,
    Head,
    /// `PUT` of an object or of a part, and `POST` of a multipart upload's start or end.
    Put,
    Delete,
}

#[derive(Debug, Default)]
struct Shared {
    rules: VecDeque<Rule>,
    counts: BTreeMap<Kind, u64>,
    faulted: Vec<(Kind, String, Fault)>,
    answered: Vec<(Kind, String, u16)>,
}

/// A running proxy.
#[derive(Debug)]
pub struct FaultProxy {
    /// Its address, as the client's endpoint (`http://127.0.0.1:<port>`).
    pub endpoint: String,
    shared: Arc<Mutex<Shared>>,
    _server: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Upstream {
    url: String,
    client: reqwest::Client,
    shared: Arc<Mutex<Shared>>,
}

impl FaultProxy {
    /// Starts one in front of `upstream` (`http://127.0.0.1:<port>`), on the current runtime.
    pub async fn start(upstream: &str) -> Self {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let state = Upstream {
            url: upstream.trim_end_matches('/').to_owned(),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("an HTTP client"),
            shared: shared.clone(),
        };
        let app = Router::new().fallback(forward).with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let endpoint = format!("http://{}", listener.local_addr().expect("its address"));
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("the proxy serves");
        });
        Self {
            endpoint,
            shared,
            _server: server,
        }
    }

    /// Faults the next request that matches `rule` (rules are matched in the order given).
    pub fn fault(&self, rule: Rule) {
        lock(&self.shared).rules.push_back(rule);
    }

    /// The requests passed so far, by kind (faulted ones included).
    pub fn counts(&self) -> BTreeMap<Kind, u64> {
        lock(&self.shared).counts.clone()
    }

    /// The faults done so far: the request's kind, its path, the fault.
    pub fn faulted(&self) -> Vec<(Kind, String, Fault)> {
        lock(&self.shared).faulted.clone()
    }

    /// The server's answers so far: the request's kind, its path, the status.
    pub fn answered(&self) -> Vec<(Kind, String, u16)> {
        lock(&self.shared).answered.clone()
    }

    /// Rules not used yet.
    pub fn pending(&self) -> usize {
        lock(&self.shared).rules.len()
    }
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

fn kind_of(method: &Method, query: &str) -> Kind {
    match *method {
        Method::GET if query.contains("list-type") => Kind::List,
        Method::GET => Kind::Get,
        Method::HEAD => Kind::Head,
        Method::DELETE => Kind::Delete,
        // S3's DeleteObjects (`POST /<bucket>?delete`), which object_store's delete sends.
        Method::POST if query.contains("delete") => Kind::Delete,
        _ => Kind::Put,
    }
}

async fn forward(State(upstream): State<Upstream>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    let query = parts.uri.query().unwrap_or_default().to_owned();
    let kind = kind_of(&parts.method, &query);
    let fault = {
        let mut shared = lock(&upstream.shared);
        *shared.counts.entry(kind).or_default() += 1;
        let position = shared
            .rules
            .iter()
            .position(|rule| rule.kind == kind && path.contains(&rule.key_part));
        let fault = position
            .and_then(|at| shared.rules.remove(at))
            .map(|rule| rule.fault);
        if let Some(fault) = fault {
            shared.faulted.push((kind, path.clone(), fault));
        }
        fault
    };
    match fault {
        Some(Fault::SlowDown) => {
            return Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .header("content-type", "application/xml")
                .body(Body::from(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>\
                     <Message>Please reduce your request rate.</Message></Error>",
                ))
                .expect("a response");
        }
        Some(Fault::Stall(pause)) => tokio::time::sleep(pause).await,
        Some(Fault::ResetAfter) | None => {}
    }
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let mut url = format!("{}{path}", upstream.url);
    if !query.is_empty() {
        url.push('?');
        url.push_str(&query);
    }
    let mut headers = HeaderMap::new();
    for (name, value) in &parts.headers {
        // The client's Host is kept: the signature covers it.
        if name != HeaderName::from_static("content-length") {
            headers.append(name.clone(), value.clone());
        }
    }
    let answer = upstream
        .client
        .request(parts.method.clone(), url)
        .headers(headers)
        .body(body)
        .send()
        .await;
    let Ok(answer) = answer else {
        return Response::builder()
            .status(StatusCode::BAD_GATEWAY)
            .body(Body::empty())
            .expect("a response");
    };
    lock(&upstream.shared)
        .answered
        .push((kind, path.clone(), answer.status().as_u16()));
    let mut response = Response::builder().status(answer.status());
    for (name, value) in answer.headers() {
        response = response.header(name, value);
    }
    if fault == Some(Fault::ResetAfter) {
        // The server handled it; the client gets no answer: unwinding the connection's task
        // drops the connection (without the panic hook's message).
        drop(answer);
        std::panic::resume_unwind(Box::new("the proxy cuts the connection"));
    }
    let bytes = answer.bytes().await.unwrap_or_default();
    response.body(Body::from(bytes)).expect("a response")
}

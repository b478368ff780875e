//! A test double of a provider's service tiers in front of a real model server: what `OpenAI`'s
//! flex tier does, which no server here has. Requests asking `service_tier: "flex"` are refused
//! with a 429 (`OpenAI`'s body for no flex capacity, no `Retry-After`) while the gate has no
//! capacity: the first `refusals` of them, or all of them. Every other request goes to the
//! upstream server unchanged but for the `service_tier` field, and its answer comes back with the
//! `service_tier` it was served at (`"flex"`, else `"default"`), as `OpenAI` answers.
//!
//! It counts what it refused and what it served at each tier, so that a test can check every
//! call was priced at the tier it was served at.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// What the gate did, so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierCounts {
    /// Flex requests refused with a 429.
    pub refused: usize,
    /// Requests served at the flex tier.
    pub flex: usize,
    /// Requests served at the default tier (they asked none).
    pub standard: usize,
}

#[derive(Debug)]
struct Shared {
    upstream: String,
    http: reqwest::Client,
    /// Flex requests still to refuse (`usize::MAX`: every one).
    refusals: AtomicUsize,
    refused: AtomicUsize,
    flex: AtomicUsize,
    standard: AtomicUsize,
}

/// A running gate; it stops accepting connections when dropped.
#[derive(Debug)]
pub struct TierGate {
    served: crate::Served,
    shared: Arc<Shared>,
}

impl TierGate {
    /// A gate in front of the OpenAI-compatible `upstream` (a base URL ending `/v1`) that refuses
    /// the first `refusals` flex requests (`usize::MAX`: all).
    pub async fn start(upstream: &str, refusals: usize) -> Self {
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            http: reqwest::Client::new(),
            refusals: AtomicUsize::new(refusals),
            refused: AtomicUsize::new(0),
            flex: AtomicUsize::new(0),
            standard: AtomicUsize::new(0),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .with_state(Arc::clone(&shared));
        Self {
            served: crate::Served::start(app).await,
            shared,
        }
    }

    /// The base URL, as `spec.model.baseUrl` takes it.
    pub fn base_url(&self) -> String {
        self.served.base_url()
    }

    pub fn counts(&self) -> TierCounts {
        TierCounts {
            refused: self.shared.refused.load(Ordering::SeqCst),
            flex: self.shared.flex.load(Ordering::SeqCst),
            standard: self.shared.standard.load(Ordering::SeqCst),
        }
    }
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(mut request) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "not JSON").into_response();
    };
    let flex = request.get("service_tier").and_then(Value::as_str) == Some("flex");
    if flex
        && shared
            .refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| match left {
                0 => None,
                usize::MAX => Some(usize::MAX),
                left => Some(left - 1),
            })
            .is_ok()
    {
        shared.refused.fetch_add(1, Ordering::SeqCst);
        let error = json!({"error": {
            "message": "Resource unavailable: flex processing has no capacity right now.",
            "type": "rate_limit_error",
            "code": "resource_unavailable",
        }});
        return (StatusCode::TOO_MANY_REQUESTS, axum::Json(error)).into_response();
    }
    if let Some(fields) = request.as_object_mut() {
        fields.remove("service_tier");
    }
    let answer = shared
        .http
        .post(format!("{}/chat/completions", shared.upstream))
        .json(&request)
        .send()
        .await;
    let answer = match answer {
        Ok(answer) => answer,
        Err(err) => return (StatusCode::BAD_GATEWAY, err.to_string()).into_response(),
    };
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let Ok(mut completion) = answer.json::<Value>().await else {
        return (StatusCode::BAD_GATEWAY, "the upstream answered no JSON").into_response();
    };
    if status.is_success() {
        let tier = if flex { "flex" } else { "default" };
        completion["service_tier"] = tier.into();
        let counter = if flex { &shared.flex } else { &shared.standard };
        counter.fetch_add(1, Ordering::SeqCst);
    }
    (status, axum::Json(completion)).into_response()
}

//! The OpenAI-compatible chat-completions client.
//!
//! One pooled [`ModelClient`] per process. Each [`ModelClient::complete`] call retries what a retry
//! can fix (408, 429, 5xx, 529, timeouts, connection errors, empty or malformed replies) with
//! jittered exponential backoff that honours `Retry-After`, within a bounded number of attempts and
//! a bounded total wait; an answer that says to slow down (429, 529, 503 with `Retry-After` or
//! shed by a proxy) spends no attempt, lowers how many requests the client and its clones send
//! that endpoint at once (additive increase, multiplicative decrease: `admission`), and with a
//! `Retry-After` (or, on a 429, the provider's rate-limit reset headers: `reset_headers`) pauses
//! every call of theirs to it. What a retry
//! cannot fix is classified: prompt-level failures (400, 422,
//! context length) fail the prompt; configuration failures (401, 403, 402, exhausted quota, 404
//! on the model path, an unknown model name) stop the batch, because every other prompt would
//! fail the same way. Retries that run out ([`ModelError::Exhausted`]) stop the batch too, as
//! transient: an outage says nothing about the prompt. A [`Circuit`] shared by a batch's
//! conversations sees every attempt (a "slow down" counts as an answer), so that a batch stops
//! starting conversations while the server keeps failing. The table of what becomes what is in `docs/troubleshooting.md`.

pub mod admission;
pub mod anthropic;
pub mod batch_api;
pub mod batch_journal;
pub mod batch_windows;
mod circuit;
mod client;
pub mod limits;
mod reset_headers;
pub mod routing;
mod sse;
pub mod tiers;
pub mod tokens;
pub mod types;

pub use circuit::Circuit;
pub use client::{ApiKey, ModelClient, ModelSettings, RetryPolicy, RoutingSettings, Spending};
pub use tiers::ServiceTierSettings;
pub use tokens::{CallTokens, TokenSettings};
pub use types::{
    AssistantMessage, Completion, Message, Reasoning, ReasoningShape, ToolCall, ToolMessage, Usage,
    WireAssistant,
};

use std::time::Duration;

/// Why a model call failed, after retries.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A configuration error no retry fixes: stop the batch (exit code `PERMANENT_CONFIG`).
    #[error("model server refused the configuration ({class}): HTTP {status}: {message}")]
    Permanent {
        class: ErrorClass,
        status: u16,
        message: String,
    },
    /// This prompt cannot be completed (bad request, context too long, unprocessable content).
    #[error("model server rejected the request ({class}): HTTP {status}: {message}")]
    Rejected {
        class: ErrorClass,
        status: u16,
        message: String,
    },
    /// Retryable failures went on past the attempt or wait budget.
    #[error("model call failed after {attempts} attempts ({class}): {message}")]
    Exhausted {
        class: ErrorClass,
        attempts: u32,
        message: String,
    },
    /// The settings cannot produce a request at all.
    #[error("invalid model settings: {0}")]
    Settings(String),
}

impl ModelError {
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Permanent { class, .. }
            | Self::Rejected { class, .. }
            | Self::Exhausted { class, .. } => *class,
            Self::Settings(_) => ErrorClass::InvalidSettings,
        }
    }

    /// True when no other prompt can succeed either: the batch stops.
    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::Permanent { .. } | Self::Settings(_))
    }

    /// True when retries ran out on failures a later retry may get past (5xx, 429, 408, timeouts,
    /// connection errors, empty or malformed replies): the batch stops as transient and the prompt
    /// keeps no record, so that an outage never turns prompts into failures.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Exhausted { .. })
    }

    /// True when the model or its path does not exist on the server (a run-wide misconfiguration).
    pub fn is_model_missing(&self) -> bool {
        matches!(
            self,
            Self::Permanent {
                class: ErrorClass::NotFound | ErrorClass::UnknownModel,
                ..
            }
        )
    }
}

/// A short, stable label for an error, recorded per failed prompt and in statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorClass {
    Unauthorized,
    Forbidden,
    PaymentRequired,
    QuotaExhausted,
    BadRequest,
    NotFound,
    UnknownModel,
    Unprocessable,
    ContextLength,
    RateLimited,
    ServerError,
    Timeout,
    Connection,
    EmptyResponse,
    MalformedResponse,
    HttpError,
    InvalidSettings,
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::PaymentRequired => "payment_required",
            Self::QuotaExhausted => "quota_exhausted",
            Self::BadRequest => "bad_request",
            Self::NotFound => "not_found",
            Self::UnknownModel => "unknown_model",
            Self::Unprocessable => "unprocessable",
            Self::ContextLength => "context_length",
            Self::RateLimited => "rate_limited",
            Self::ServerError => "server_error",
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::EmptyResponse => "empty_response",
            Self::MalformedResponse => "malformed_response",
            Self::HttpError => "http_error",
            Self::InvalidSettings => "invalid_settings",
        }
    }
}

impl std::fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one HTTP outcome is handled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Try again after the backoff (or the server's `Retry-After`, when it sent one).
    Retry {
        class: ErrorClass,
        retry_after: Option<Duration>,
    },
    /// Fail this prompt.
    Reject(ErrorClass),
    /// Stop the batch.
    Permanent(ErrorClass),
}

/// A failed call to retry: its class, the server's `Retry-After` and its message.
pub(crate) type Retry = (ErrorClass, Option<Duration>, String);

impl Verdict {
    /// The error a call that failed with `status` and `message` ends in, unless it is to be
    /// retried.
    pub(crate) fn settle(self, status: u16, message: String) -> Result<Retry, ModelError> {
        match self {
            Self::Retry { class, retry_after } => Ok((class, retry_after, message)),
            Self::Reject(class) => Err(ModelError::Rejected {
                class,
                status,
                message,
            }),
            Self::Permanent(class) => Err(ModelError::Permanent {
                class,
                status,
                message,
            }),
        }
    }
}

/// What error bodies say when the requested model does not exist.
const MODEL_MISSING: [&str; 5] = [
    "model_not_found",
    "model not found",
    "does not exist",
    "unknown model",
    "no such model",
];

/// Classifies an HTTP error status and its body.
pub(crate) fn classify_status(status: u16, body: &str, retry_after: Option<Duration>) -> Verdict {
    let lower = body.to_ascii_lowercase();
    let mentions = |needles: &[&str]| needles.iter().any(|needle| lower.contains(needle));
    match status {
        401 => Verdict::Permanent(ErrorClass::Unauthorized),
        403 => Verdict::Permanent(ErrorClass::Forbidden),
        402 => Verdict::Permanent(ErrorClass::PaymentRequired),
        429 if mentions(&[
            "insufficient_quota",
            "quota exceeded",
            "exceeded your current quota",
            "credit",
        ]) =>
        {
            Verdict::Permanent(ErrorClass::QuotaExhausted)
        }
        429 => Verdict::Retry {
            class: ErrorClass::RateLimited,
            retry_after,
        },
        408 => Verdict::Retry {
            class: ErrorClass::Timeout,
            retry_after,
        },
        500..=504 | 529 => Verdict::Retry {
            class: ErrorClass::ServerError,
            retry_after,
        },
        _ if mentions(&[
            "context length",
            "context_length",
            "maximum context",
            "context window",
            "too many tokens",
            "exceeds the available context",
        ]) =>
        {
            Verdict::Reject(ErrorClass::ContextLength)
        }
        // vLLM and OpenAI answer an unknown model name with 404, others with 400 or 422; the
        // body names the model either way. Checked after context length, whose messages also say
        // "model".
        400 | 404 | 422 if lower.contains("model") && mentions(&MODEL_MISSING) => {
            Verdict::Permanent(ErrorClass::UnknownModel)
        }
        // A 404 or 405 from the chat-completions path is about the path (a wrong `baseUrl`),
        // never about one prompt.
        404 | 405 => Verdict::Permanent(ErrorClass::NotFound),
        400 => Verdict::Reject(ErrorClass::BadRequest),
        422 => Verdict::Reject(ErrorClass::Unprocessable),
        _ => Verdict::Reject(ErrorClass::HttpError),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified_as_the_contract_says() {
        let after = Some(Duration::from_secs(2));
        assert_eq!(
            classify_status(401, "", None),
            Verdict::Permanent(ErrorClass::Unauthorized)
        );
        assert_eq!(
            classify_status(403, "", None),
            Verdict::Permanent(ErrorClass::Forbidden)
        );
        assert_eq!(
            classify_status(402, "", None),
            Verdict::Permanent(ErrorClass::PaymentRequired)
        );
        assert_eq!(
            classify_status(429, r#"{"error":{"code":"insufficient_quota"}}"#, None),
            Verdict::Permanent(ErrorClass::QuotaExhausted)
        );
        assert_eq!(
            classify_status(429, "slow down", after),
            Verdict::Retry {
                class: ErrorClass::RateLimited,
                retry_after: after
            }
        );
        for status in [408, 500, 502, 503, 504, 529] {
            assert!(
                matches!(classify_status(status, "", None), Verdict::Retry { .. }),
                "{status}"
            );
        }
        assert_eq!(
            classify_status(
                400,
                "This model's maximum context length is 4096 tokens",
                None
            ),
            Verdict::Reject(ErrorClass::ContextLength)
        );
        assert_eq!(
            classify_status(400, "bad", None),
            Verdict::Reject(ErrorClass::BadRequest)
        );
        assert_eq!(
            classify_status(404, "", None),
            Verdict::Permanent(ErrorClass::NotFound)
        );
        assert_eq!(
            classify_status(404, "The model `llama-70b` does not exist.", None),
            Verdict::Permanent(ErrorClass::UnknownModel)
        );
        assert_eq!(
            classify_status(400, r#"{"error":{"code":"model_not_found"}}"#, None),
            Verdict::Permanent(ErrorClass::UnknownModel)
        );
        assert_eq!(
            classify_status(400, "file data.csv does not exist", None),
            Verdict::Reject(ErrorClass::BadRequest)
        );
        assert_eq!(
            classify_status(422, "", None),
            Verdict::Reject(ErrorClass::Unprocessable)
        );
    }
}

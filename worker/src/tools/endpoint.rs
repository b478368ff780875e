//! The model endpoints behind the `vision` and `image_gen` toolsets (and `browser_vision`): an
//! OpenAI-compatible API with a base URL, model and key of its own, set in `spec.tools`.
//!
//! The key comes from the environment variable its `apiKey` names (on a cluster the operator
//! fills that variable from the Secret, in the worker container only, never the sandbox's), is
//! sent as `Authorization: Bearer <key>`, and appears in no record, log or error. Every failure —
//! the endpoint down or too slow, an error status, an answer too long or not JSON — is an error
//! message that the tool hands the model; nothing here panics or waits without a limit.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use serde_json::Value;

use super::web::{error_chain, read_capped};
use crate::spec::ValueSource;

/// Characters of an endpoint's error answer shown to the model.
const ERROR_CHARS: usize = 300;

/// Redirects an endpoint may answer with (reqwest drops the key on a redirect to another host).
const MAX_REDIRECTS: usize = 5;

/// Why an endpoint cannot be set up from a run's settings (the run is refused before it starts).
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("spec.{field} is not set: configure its endpoint")]
    NotConfigured { field: &'static str },
    #[error("spec.{field}.apiKey names the environment variable {variable}, which is not set")]
    MissingKey {
        field: &'static str,
        variable: String,
    },
    #[error("spec.{field}.apiKey sets neither `env` nor `secretKeyRef`")]
    NoKeySource { field: &'static str },
    #[error("the API key of spec.{field} holds characters no HTTP header may carry")]
    BadKey { field: &'static str },
    #[error("cannot build the HTTP client of spec.{field}: {source}")]
    Client {
        field: &'static str,
        #[source]
        source: reqwest::Error,
    },
}

/// One endpoint: where requests go, with which key, through which client.
#[derive(Debug)]
pub(crate) struct Endpoint {
    url: String,
    key: Option<HeaderValue>,
    client: reqwest::Client,
    max_answer_bytes: usize,
}

impl Endpoint {
    /// The endpoint `<base_url>/<path>` of the setting `spec.<field>`, whose answers may be up to
    /// `max_answer_bytes` long and must come within `timeout`.
    pub(crate) fn new(
        field: &'static str,
        base_url: &str,
        path: &str,
        api_key: Option<&ValueSource>,
        timeout: Duration,
        max_answer_bytes: usize,
    ) -> Result<Self, EndpointError> {
        let key = api_key.map(|source| bearer(field, source)).transpose()?;
        let client = client(timeout)
            .build()
            .map_err(|source| EndpointError::Client { field, source })?;
        Ok(Self {
            url: format!("{}/{path}", base_url.trim_end_matches('/')),
            key,
            client,
            max_answer_bytes,
        })
    }

    /// Posts `body` (JSON text) and returns the answer's JSON, or what went wrong in words the
    /// model can read.
    pub(crate) async fn post_json(&self, body: Vec<u8>) -> Result<Value, String> {
        let mut request = self
            .client
            .post(&self.url)
            .header(CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(key) = &self.key {
            request = request.header(AUTHORIZATION, key.clone());
        }
        let mut response = request
            .send()
            .await
            .map_err(|err| format!("the endpoint did not answer: {}", error_chain(&err)))?;
        let status = response.status();
        let (answer, cut) = read_capped(&mut response, self.max_answer_bytes)
            .await
            .map_err(|err| format!("the endpoint's answer broke off: {}", error_chain(&err)))?;
        if !status.is_success() {
            return Err(format!(
                "the endpoint answered HTTP {status}: {}",
                error_message(&answer)
            ));
        }
        if cut {
            return Err(format!(
                "the endpoint's answer is longer than {} bytes",
                self.max_answer_bytes
            ));
        }
        serde_json::from_slice(&answer).map_err(|err| {
            format!(
                "the endpoint's answer is not JSON ({err}): {}",
                error_message(&answer)
            )
        })
    }
}

/// A client builder for a configured endpoint (and the URLs it answers with): at most
/// [`MAX_REDIRECTS`] redirects, and `timeout` for the whole request.
pub(crate) fn client(timeout: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(Duration::from_secs(10)))
        .redirect(reqwest::redirect::Policy::limited(MAX_REDIRECTS))
        .user_agent(concat!("trajectory-worker/", env!("CARGO_PKG_VERSION")))
}

/// `Bearer <key>` from the variable `source` names, marked sensitive (kept out of debug output).
fn bearer(field: &'static str, source: &ValueSource) -> Result<HeaderValue, EndpointError> {
    let variable = source
        .env_var()
        .ok_or(EndpointError::NoKeySource { field })?;
    let key = std::env::var(&variable)
        .ok()
        .map(|key| key.trim().to_owned())
        .filter(|key| !key.is_empty())
        .ok_or(EndpointError::MissingKey { field, variable })?;
    let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
        .map_err(|_| EndpointError::BadKey { field })?;
    value.set_sensitive(true);
    Ok(value)
}

/// The message of an error answer: `error.message` (`OpenAI`), `error` or `detail` as text (other
/// servers), else the body's start.
fn error_message(body: &[u8]) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let message = parsed.as_ref().and_then(|value| {
        value
            .pointer("/error/message")
            .or_else(|| value.get("error"))
            .or_else(|| value.get("detail"))
            .or_else(|| value.get("message"))
            .map(|message| match message {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            })
    });
    let text = message.unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let text = text.trim();
    if text.is_empty() {
        return "(no message)".to_owned();
    }
    match text.char_indices().nth(ERROR_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_answers_are_read_in_the_shapes_servers_send() {
        assert_eq!(
            error_message(br#"{"error": {"message": "model not found", "type": "x"}}"#),
            "model not found"
        );
        assert_eq!(error_message(br#"{"detail": "Not Found"}"#), "Not Found");
        assert_eq!(
            error_message(b"<html>bad gateway</html>"),
            "<html>bad gateway</html>"
        );
        assert_eq!(error_message(b""), "(no message)");
        assert!(error_message("é".repeat(400).as_bytes()).ends_with('…'));
    }

    #[test]
    fn a_key_variable_that_is_not_set_is_named_and_the_key_never_shown() {
        let source = ValueSource {
            env: Some("TRAJ_TEST_ENDPOINT_KEY_THAT_IS_NOT_SET".to_owned()),
            secret_key_ref: None,
        };
        let error = Endpoint::new(
            "tools.vision",
            "http://127.0.0.1:1/v1",
            "chat/completions",
            Some(&source),
            Duration::from_secs(1),
            1024,
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "spec.tools.vision.apiKey names the environment variable \
             TRAJ_TEST_ENDPOINT_KEY_THAT_IS_NOT_SET, which is not set"
        );
    }
}

//! The model client against the scripted server: retries, backoff, `Retry-After`, error classes,
//! timeouts, streaming, and what goes on the wire.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    ReasoningField, ScriptedServer, Step, sse_events, text_reply, tool_calls_reply, with_reasoning,
};
use trajectory_worker::model::{
    ApiKey, Completion, ErrorClass, Message, ModelClient, ModelError, ModelSettings,
};

fn client(settings: ModelSettings) -> ModelClient {
    ModelClient::new(settings).expect("settings of the scripted server are valid")
}

/// One call with a one-message conversation and no tools.
async fn call(client: &ModelClient) -> Result<Completion, ModelError> {
    let body = client.request_body(None, &[Message::User("hi".into())], None);
    client.complete(&body, 0).await
}

async fn assert_permanent_without_retry(step: Step, class: ErrorClass) {
    let server = ScriptedServer::start([step, Step::ok(text_reply("never reached"))]).await;
    let error = call(&client(server.settings())).await.unwrap_err();
    assert!(matches!(error, ModelError::Permanent { .. }), "{error:?}");
    assert_eq!(error.class(), class);
    assert!(error.is_permanent());
    assert_eq!(
        server.request_count(),
        1,
        "a permanent error must not be retried"
    );
}

#[tokio::test]
async fn rate_limit_with_retry_after_in_seconds_is_waited_out() {
    let server = ScriptedServer::start([
        Step::RetryAfterSeconds(429, 1),
        Step::ok(text_reply("hello")),
    ])
    .await;
    let started = Instant::now();
    let completion = call(&client(server.settings())).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited only {:?}",
        started.elapsed()
    );
    assert_eq!(completion.message.content, "hello");
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn rate_limit_with_retry_after_as_http_date_is_waited_out() {
    // An HTTP-date has whole seconds: a date 2 s ahead means a wait of more than 1 s.
    let server = ScriptedServer::start([
        Step::RetryAfterDate(429, Duration::from_secs(2)),
        Step::ok(text_reply("hello")),
    ])
    .await;
    let started = Instant::now();
    let completion = call(&client(server.settings())).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited only {:?}",
        started.elapsed()
    );
    assert_eq!(completion.message.content, "hello");
    assert_eq!(server.request_count(), 2);
}

/// A server that says to slow down (the named test double: a 429 with `Retry-After`) pauses every
/// call of the process, not only the one it told, and the throttled turn is asked again without
/// spending an attempt: with one attempt a call, both calls still succeed.
#[tokio::test]
async fn a_retry_after_pauses_every_call_of_the_process_and_spends_no_attempt() {
    assert_the_first_answer_pauses_every_call(
        || Step::RetryAfterSeconds(429, 1),
        Duration::from_millis(950),
    )
    .await;
}

/// A 429 without `Retry-After` whose rate-limit headers say when the exhausted limit resets (the
/// named test double: `OpenAI`'s `x-ratelimit-*` headers) pauses every call until then, and
/// spends no attempt.
#[tokio::test]
async fn a_rate_limits_reset_header_pauses_every_call_like_a_retry_after() {
    assert_the_first_answer_pauses_every_call(
        || {
            Step::RateLimited(vec![
                ("x-ratelimit-remaining-requests", "0".into()),
                ("x-ratelimit-reset-requests", "1.2s".into()),
                ("x-ratelimit-remaining-tokens", "80000".into()),
                ("x-ratelimit-reset-tokens", "10ms".into()),
            ])
        },
        Duration::from_millis(1150),
    )
    .await;
}

/// The server answers the first request with `slow_down`, then "hello": a call told to slow
/// down and another that starts during the pause both succeed with one attempt each, and neither
/// reaches the server again until `pause` has passed.
async fn assert_the_first_answer_pauses_every_call(
    slow_down: impl Fn() -> Step + Send + Sync + 'static,
    pause: Duration,
) {
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = Arc::clone(&arrivals);
    let server = ScriptedServer::start_responding(move |_| {
        let mut seen = seen.lock().unwrap();
        seen.push(Instant::now());
        if seen.len() == 1 {
            slow_down()
        } else {
            Step::ok(text_reply("hello"))
        }
    })
    .await;
    let mut settings = server.settings();
    settings.retry.max_attempts = 1;
    let told = client(settings);
    let other = told.clone();
    let first = tokio::spawn(async move { call(&told).await });
    while arrivals.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The slow-down is answered by now; a call that starts during the pause waits it out too.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = call(&other)
        .await
        .expect("the other call succeeds after the pause");
    let first = first
        .await
        .unwrap()
        .expect("a throttled turn spends no attempt");
    assert_eq!(
        (
            first.message.content.as_str(),
            second.message.content.as_str()
        ),
        ("hello", "hello")
    );
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 3, "one slow-down, then each call once");
    for later in &arrivals[1..] {
        let after = *later - arrivals[0];
        assert!(
            after >= pause,
            "a call reached the server {after:?} after the slow-down, inside its pause of {pause:?}"
        );
    }
}

#[tokio::test]
async fn server_error_is_retried_then_succeeds() {
    let server = ScriptedServer::start([
        Step::error(500, "server_error", "boom"),
        Step::ok(text_reply("ok")),
    ])
    .await;
    let completion = call(&client(server.settings())).await.unwrap();
    assert_eq!(completion.message.content, "ok");
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn ok_with_empty_choices_is_retried_then_succeeds() {
    let server =
        ScriptedServer::start([Step::ok(json!({"choices": []})), Step::ok(text_reply("ok"))]).await;
    let completion = call(&client(server.settings())).await.unwrap();
    assert_eq!(completion.message.content, "ok");
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn unauthorized_is_permanent_and_not_retried() {
    let server = ScriptedServer::start([
        Step::error(401, "invalid_api_key", "bad key"),
        Step::ok(text_reply("x")),
    ])
    .await;
    let error = call(&client(server.settings())).await.unwrap_err();
    let ModelError::Permanent { class, status, .. } = &error else {
        panic!("expected Permanent, got {error:?}")
    };
    assert_eq!((*class, *status), (ErrorClass::Unauthorized, 401));
    assert_eq!(error.class().as_str(), "unauthorized");
    assert_eq!(server.request_count(), 1);
}

#[tokio::test]
async fn forbidden_is_permanent_and_not_retried() {
    assert_permanent_without_retry(
        Step::error(403, "forbidden", "no access"),
        ErrorClass::Forbidden,
    )
    .await;
}

#[tokio::test]
async fn payment_required_is_permanent_and_not_retried() {
    assert_permanent_without_retry(
        Step::error(402, "payment_required", "add credits"),
        ErrorClass::PaymentRequired,
    )
    .await;
}

#[tokio::test]
async fn rate_limit_for_insufficient_quota_is_permanent_and_not_retried() {
    let step = Step::error(
        429,
        "insufficient_quota",
        "You exceeded your current quota.",
    );
    assert_permanent_without_retry(step, ErrorClass::QuotaExhausted).await;
}

#[tokio::test]
async fn context_length_error_rejects_the_prompt_without_retry() {
    let step = Step::error(
        400,
        "context_length_exceeded",
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.",
    );
    let server = ScriptedServer::start([step]).await;
    let error = call(&client(server.settings())).await.unwrap_err();
    let ModelError::Rejected { class, status, .. } = &error else {
        panic!("expected Rejected, got {error:?}")
    };
    assert_eq!((*class, *status), (ErrorClass::ContextLength, 400));
    assert!(!error.is_permanent());
    assert_eq!(server.request_count(), 1);
}

#[tokio::test]
async fn truncated_json_is_retried_then_succeeds() {
    let truncated =
        br#"{"choices": [{"index": 0, "message": {"role": "assistant", "content": "hel"#.to_vec();
    let server =
        ScriptedServer::start([Step::Raw(200, truncated), Step::ok(text_reply("hello"))]).await;
    let completion = call(&client(server.settings())).await.unwrap();
    assert_eq!(completion.message.content, "hello");
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn malformed_body_is_retried_then_succeeds() {
    let html = b"<html><body>502 Bad Gateway</body></html>".to_vec();
    let server = ScriptedServer::start([
        Step::Raw(200, html),
        Step::ok(json!({"choices": "not a list"})),
        Step::ok(text_reply("hello")),
    ])
    .await;
    let completion = call(&client(server.settings())).await.unwrap();
    assert_eq!(completion.message.content, "hello");
    assert_eq!(server.request_count(), 3);
}

#[tokio::test]
async fn attempts_are_bounded_when_the_server_always_fails() {
    let server =
        ScriptedServer::start_with_default([], Step::error(503, "overloaded", "try later")).await;
    let mut settings = server.settings();
    settings.retry.max_attempts = 3;
    let error = call(&client(settings)).await.unwrap_err();
    let ModelError::Exhausted {
        class, attempts, ..
    } = &error
    else {
        panic!("expected Exhausted, got {error:?}")
    };
    assert_eq!((*class, *attempts), (ErrorClass::ServerError, 3));
    assert!(!error.is_permanent());
    assert_eq!(server.request_count(), 3);
}

#[tokio::test]
async fn total_wait_is_bounded_even_when_attempts_remain() {
    let server = ScriptedServer::start_with_default([], Step::RetryAfterSeconds(429, 1)).await;
    let mut settings = server.settings();
    settings.retry.max_attempts = 10;
    settings.retry.max_total_wait = Duration::from_millis(1500);
    let started = Instant::now();
    let error = call(&client(settings)).await.unwrap_err();
    // 1 s waited after the first 429; a second wait would pass 1.5 s, so the call gives up.
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            error,
            ModelError::Exhausted {
                class: ErrorClass::RateLimited,
                attempts: 2,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn hanging_server_times_out_per_request_and_the_call_is_retried() {
    let server = ScriptedServer::start([Step::Hang, Step::ok(text_reply("late but fine"))]).await;
    let mut settings = server.settings();
    settings.request_timeout = Duration::from_millis(300);
    let started = Instant::now();
    let completion = call(&client(settings)).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(completion.message.content, "late but fine");
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn a_server_that_always_hangs_exhausts_with_class_timeout() {
    let server = ScriptedServer::start_with_default([], Step::Hang).await;
    let mut settings = server.settings();
    settings.request_timeout = Duration::from_millis(100);
    settings.retry.max_attempts = 2;
    let error = call(&client(settings)).await.unwrap_err();
    assert!(
        matches!(
            error,
            ModelError::Exhausted {
                class: ErrorClass::Timeout,
                attempts: 2,
                ..
            }
        ),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_slow_reply_within_the_request_timeout_is_accepted() {
    let slow = Step::Delay(
        Duration::from_millis(200),
        Box::new(Step::ok(text_reply("slow"))),
    );
    let server = ScriptedServer::start([slow]).await;
    let mut settings = server.settings();
    settings.request_timeout = Duration::from_secs(2);
    assert_eq!(
        call(&client(settings)).await.unwrap().message.content,
        "slow"
    );
    assert_eq!(server.request_count(), 1);
}

#[tokio::test]
async fn streaming_produces_the_same_completion_as_non_streaming() {
    let replies = [
        with_reasoning(
            tool_calls_reply(&[
                ("terminal", json!(r#"{"command": "ls -la"}"#)),
                ("read_file", json!(r#"{"path": "ä.txt"}"#)),
            ]),
            ReasoningField::ReasoningContent,
            "I should look around first.",
        ),
        with_reasoning(
            text_reply("The answer is 42 — ünïcödé."),
            ReasoningField::Reasoning,
            "Counting…",
        ),
    ];
    for reply in replies {
        let plain = ScriptedServer::start([Step::ok(reply.clone())]).await;
        let streamed = ScriptedServer::start([Step::Sse(sse_events(&reply))]).await;
        let mut settings = streamed.settings();
        settings.stream = true;
        let mut expected = call(&client(plain.settings())).await.unwrap();
        let mut actual = call(&client(settings)).await.unwrap();
        // Each names the server that answered it; the rest is the same.
        assert_eq!(expected.endpoint.take(), Some(plain.base_url()));
        assert_eq!(actual.endpoint.take(), Some(streamed.base_url()));
        assert_eq!(actual, expected);
        assert_eq!(streamed.requests()[0].body["stream"], true);
        assert_eq!(plain.requests()[0].body.get("stream"), None);
    }
}

/// A test double for one edge case: a stream that ends (with `[DONE]`) before its
/// `finish_reason`, as llama-cpp-python's does when another request waits. Half an answer is not
/// the model's answer: the call is retried and the whole one kept.
#[tokio::test]
async fn a_stream_cut_short_is_retried_not_recorded() {
    let reply = text_reply("A whole answer, not half of one.");
    let cut: Vec<Value> = sse_events(&reply)
        .into_iter()
        .take_while(|event| event["choices"][0]["finish_reason"].is_null())
        .collect();
    assert!(!cut.is_empty() && cut.len() < sse_events(&reply).len());
    let server = ScriptedServer::start([Step::Sse(cut), Step::Sse(sse_events(&reply))]).await;
    let mut settings = server.settings();
    settings.stream = true;
    let completion = call(&client(settings)).await.unwrap();
    assert_eq!(
        completion.message.content,
        "A whole answer, not half of one."
    );
    assert_eq!(server.request_count(), 2);
}

#[tokio::test]
async fn api_key_is_sent_as_bearer_and_never_shown_in_an_error() {
    const KEY: &str = "sk-test-0123456789-very-secret";
    // Some proxies echo the key back in their error body.
    let echo = Step::error(
        401,
        "invalid_api_key",
        &format!("Incorrect API key provided: {KEY}."),
    );
    let server = ScriptedServer::start([Step::ok(text_reply("ok")), echo]).await;
    let mut settings = server.settings();
    settings.api_key = Some(ApiKey::new(KEY));
    let client = client(settings);
    call(&client).await.unwrap();
    let error = call(&client).await.unwrap_err();
    for request in server.requests() {
        assert_eq!(
            request.authorization.as_deref(),
            Some(format!("Bearer {KEY}").as_str())
        );
    }
    assert_eq!(error.class(), ErrorClass::Unauthorized);
    assert!(!error.to_string().contains(KEY), "{error}");
    assert!(!format!("{error:?}").contains(KEY), "{error:?}");
    assert!(!format!("{client:?}").contains(KEY));
}

#[tokio::test]
async fn extra_body_is_merged_into_the_request() {
    let server = ScriptedServer::start([Step::ok(text_reply("ok"))]).await;
    let mut settings = server.settings();
    let extra = json!({"top_k": 5, "provider": {"order": ["a", "b"]}, "temperature": 0.25});
    settings.extra_body = extra.as_object().unwrap().clone();
    settings.temperature = Some(1.0);
    settings.max_tokens = Some(64);
    call(&client(settings)).await.unwrap();
    let body = &server.requests()[0].body;
    assert_eq!(body["top_k"], 5);
    assert_eq!(body["provider"], json!({"order": ["a", "b"]}));
    // extraBody is applied last, so it overrides a field the settings also set.
    assert_eq!(body["temperature"], 0.25);
    assert_eq!(body["max_tokens"], 64);
    assert_eq!(body["model"], "scripted");
    assert_eq!(body["messages"], json!([{"role": "user", "content": "hi"}]));
}

#[tokio::test]
async fn models_endpoint_lists_the_scripted_model() {
    let server = ScriptedServer::start([]).await;
    let models: Value = reqwest::get(format!("{}/models", server.base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "scripted");
}

//! Adaptive concurrency against a server of fixed capacity (issue 25): a real llama.cpp server
//! behind Envoy (`trajectory_testkit::envoy`), whose circuit breaker lets [`THROUGH`] requests
//! reach the server at once, queues [`QUEUED`] more, and sheds the rest with a 503 marked
//! `x-envoy-overloaded`: a capacity of [`CAPACITY`] requests in flight.
//!
//! Twelve conversations ask at once through one client, three times the capacity. The client
//! starts with no limit, is shed, and cuts how many requests it sends at once; from then on its
//! requests in flight follow the capacity, with an occasional shed request as it probes for
//! more. Every completion is asked once more for each time it was shed and no more (the proxy
//! counts both), with one attempt a call: a shed request spends none.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use trajectory_testkit::envoy::SheddingProxy;
use trajectory_testkit::llama_servers::{ChatFormat, LlamaServer};
use trajectory_worker::model::{Message, ModelClient, ModelSettings, RetryPolicy, RoutingSettings};

/// Requests the proxy lets reach the server at once.
const THROUGH: u32 = 2;
/// Requests it holds while those run.
const QUEUED: u32 = 2;
const CAPACITY: u32 = THROUGH + QUEUED;

const CONVERSATIONS: usize = 12;
const TURNS: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_settle_near_what_a_shedding_proxy_lets_through() {
    let state = tempfile::tempdir().unwrap();
    let server = LlamaServer::start(state.path(), 2, None, ChatFormat::FunctionCalling);
    let upstream = server
        .base_url
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_owned();
    let proxy = SheddingProxy::start(&upstream, THROUGH, QUEUED);
    let client = ModelClient::new(ModelSettings {
        base_urls: vec![proxy.base_url.clone()],
        routing: RoutingSettings::default(),
        model: server.model.clone(),
        api_key: None,
        max_tokens: Some(4),
        temperature: Some(0.0),
        reasoning_fields: serde_json::Map::new(),
        extra_body: serde_json::Map::new(),
        request_timeout: Duration::from_secs(300),
        stream: false,
        // One attempt: a request shed by the proxy must not spend it.
        retry: RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        },
        prices: None,
        tokens: None,
        service_tier: None,
        batch: None,
    })
    .unwrap();

    // Samples the client's requests in flight every 20 ms, with the limit it keeps.
    let done = Arc::new(AtomicBool::new(false));
    let sampling = {
        let (client, done) = (client.clone(), Arc::clone(&done));
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while !done.load(Ordering::Relaxed) {
                samples.push(client.admission(0));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            samples
        })
    };
    let conversations = (0..CONVERSATIONS).map(|conversation| {
        let client = client.for_conversation(&format!("admission-{conversation}-0"));
        tokio::spawn(async move {
            for turn in 0..TURNS {
                let body = client.request_body(
                    None,
                    &[Message::User(format!(
                        "Conversation {conversation}, turn {turn}: say one word."
                    ))],
                    None,
                );
                client
                    .complete(&body, turn)
                    .await
                    .unwrap_or_else(|err| panic!("conversation {conversation} turn {turn}: {err}"));
            }
        })
    });
    for conversation in futures::future::join_all(conversations).await {
        conversation.expect("every conversation finishes");
    }
    done.store(true, Ordering::Relaxed);
    let samples = sampling.await.unwrap();

    let counts = proxy.counts();
    let completions = u64::try_from(CONVERSATIONS * TURNS).unwrap();
    assert_eq!(
        counts.answered, completions,
        "every completion was answered by the server once: {counts:?}"
    );
    let limit = samples
        .last()
        .and_then(|sample| sample.limit)
        .expect("being shed taught the client a limit");
    // The second half of the run: past the first cuts.
    let settled = &samples[samples.len() / 2..];
    #[allow(clippy::cast_precision_loss)] // a few thousand samples
    let mean_in_flight = settled
        .iter()
        .map(|sample| sample.in_flight as f64)
        .sum::<f64>()
        / settled.len() as f64;
    let most = settled.iter().map(|sample| sample.in_flight).max().unwrap();
    eprintln!(
        "proxy {counts:?}; limit at the end {limit:.2}; in flight in the second half: mean \
         {mean_in_flight:.2}, most {most} ({} samples)",
        settled.len()
    );
    let capacity = f64::from(CAPACITY);
    assert!(
        (capacity * 0.5..=capacity * 1.5).contains(&mean_in_flight),
        "requests in flight settle near the capacity of {CAPACITY}: mean {mean_in_flight:.2}"
    );
    assert!(
        most <= usize::try_from(CAPACITY * 2).unwrap(),
        "never far above it once learnt: {most}"
    );
    // Without a limit, twelve at once against four would be shed eight times a round.
    assert!(
        counts.shed * 5 <= completions,
        "sheds stay a small share of the requests: {counts:?}"
    );
}

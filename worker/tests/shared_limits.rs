//! Rate limits kept across processes (issue 25, `spec.model.limits.gubernator`): runs that name
//! the same key share one limit through a real Gubernator, in front of a provider made of real
//! parts, Envoy's local rate limit (a token bucket answering 429 with `Retry-After`) before the
//! scripted model server, which records when each request reached it.
//!
//! Two local runs at once, each of which alone may send the whole limit (a local run keeps all
//! of it): together they keep to one limit, because the Gubernator counts for both, and the
//! provider never has to refuse a request. And a run whose spec sets no limit learns the
//! provider's from the headers of its answers.

mod common;

use std::time::{Duration, Instant};

use common::{RunFixture, local_options, no_shutdown};
use serde_json::json;
use trajectory_testkit::envoy::{RateLimit, SheddingProxy};
use trajectory_testkit::gubernator::Gubernator;
use trajectory_worker::run::local::run_local;

/// Requests a minute: the runs' limit, and the provider's.
const LIMIT: usize = 600;

/// The `host:port` of `server`, as Envoy's cluster takes it.
fn upstream_of(server: &trajectory_testkit::scripted_server::ScriptedServer) -> String {
    server.address().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_naming_one_key_keep_to_one_limit_through_a_gubernator() {
    let (server, arrivals) = common::recording_four_turns().await;
    let upstream = upstream_of(&server);
    // The provider: 600 a minute, a tenth of it at once.
    let provider = SheddingProxy::rate_limited(
        &upstream,
        RateLimit {
            max_tokens: 60,
            per_second: 10,
            told: false,
        },
    );
    let gubernator = Gubernator::start("127.0.0.1");
    let run = || {
        RunFixture::new(&provider.base_url, 24)
            .with("/concurrency", json!(24))
            .with("/workers", json!(1))
            .with(
                "/model/limits",
                json!({
                    "requestsPerMinute": LIMIT,
                    "gubernator": {"url": gubernator.url, "key": "provider-key-1"},
                }),
            )
    };
    let (first, second) = (run(), run());
    let (options, shutdown) = (
        [local_options(&first), local_options(&second)],
        no_shutdown(),
    );
    let started = Instant::now();
    let (a, b) = tokio::join!(
        run_local(&options[0], &shutdown),
        run_local(&options[1], &shutdown),
    );
    let elapsed = started.elapsed();
    for (report, fixture) in [(a, &first), (b, &second)] {
        let report = report.expect("the run finishes");
        assert_eq!(
            report.merge.trajectories,
            24,
            "{:?}",
            fixture.lines("failures.jsonl")
        );
    }
    let counts = provider.counts();
    assert_eq!(
        counts.rate_limited, 0,
        "the provider refused none: {counts:?}"
    );
    let mut arrivals = arrivals.lock().unwrap().clone();
    arrivals.sort();
    assert_eq!(arrivals.len(), 192, "every request reached the model once");
    // A burst of 30, then 570 a minute, over both runs together.
    common::assert_within_600_a_minute(&arrivals, &[1, 2, 5, 10]);
    // Each run alone could have sent its 96 within a second and a half of bursting; shared, the
    // 192 take (192 - 30) / 9.5 a second.
    assert!(
        elapsed >= Duration::from_secs(16),
        "192 requests in {elapsed:?}: the runs shared one limit"
    );
}

/// A run whose Gubernator cannot be reached keeps its own share meanwhile (a local run: the
/// whole limit), and finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_gubernator_is_unreachable_keeps_its_share() {
    let (server, arrivals) = common::recording_four_turns().await;
    let nowhere = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let fixture = RunFixture::new(&server.base_url(), 24)
        .with("/concurrency", json!(24))
        .with("/workers", json!(1))
        .with(
            "/model/limits",
            json!({"requestsPerMinute": LIMIT, "gubernator": {"url": nowhere, "key": "k"}}),
        );
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes without its limiter");
    assert_eq!(report.merge.trajectories, 24);
    let mut arrivals = arrivals.lock().unwrap().clone();
    arrivals.sort();
    common::assert_within_600_a_minute(&arrivals, &[2]);
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(
        spread >= Duration::from_secs(6),
        "96 requests over {spread:?}"
    );
}

/// A run whose spec sets no limit, against a provider that tells its limit in every answer
/// (`x-ratelimit-limit-requests: 600`, added by Envoy): it learns the limit from the first answers
/// and keeps to it, so the provider refuses nothing; told not to learn, the same run is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_learns_the_providers_limit_from_its_headers_and_keeps_to_it() {
    let (server, arrivals) = common::recording_four_turns().await;
    let upstream = upstream_of(&server);
    let run = |learn: bool| {
        let provider = SheddingProxy::rate_limited(
            &upstream,
            // A tenth of the limit at once, as above: Envoy refills a second's worth at a time.
            RateLimit {
                max_tokens: 60,
                per_second: 10,
                told: true,
            },
        );
        let fixture = RunFixture::new(&provider.base_url, 24)
            .with("/concurrency", json!(8))
            .with("/workers", json!(1))
            .with("/model/limits", json!({"fromHeaders": learn}));
        (provider, fixture)
    };

    let (provider, fixture) = run(true);
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(report.merge.trajectories, 24);
    let counts = provider.counts();
    assert_eq!(
        counts.rate_limited, 0,
        "the provider refused none: {counts:?}"
    );
    let mut learnt = arrivals.lock().unwrap().clone();
    learnt.sort();
    assert_eq!(learnt.len(), 96);
    common::assert_within_600_a_minute(&learnt, &[2, 5]);

    arrivals.lock().unwrap().clear();
    let (provider, fixture) = run(false);
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes, its refused requests retried");
    let counts = provider.counts();
    // Refused at once past the provider's first burst; how often depends on how soon each
    // refusal's pause comes (7 to 25 times here).
    assert!(
        counts.rate_limited > 0,
        "not learning, the run is refused: {counts:?}"
    );
}

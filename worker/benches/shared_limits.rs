//! Goodput and refusals against one provider limit shared by 1, 4 and 16 processes (issue 25):
//! each process is `trajectory-worker local` (the release binary, as users run it) with its own
//! run of the same key; the provider is real parts, Envoy's local rate limit (a token bucket
//! answering 429 with `Retry-After: 1` past the limit) in front of a scripted model that answers
//! at once and records when each request reached it.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench shared_limits
//! ```
//!
//! For each count of processes it runs them twice: with `spec.model.limits` shared through a real
//! Gubernator (every process names the same key), and with no limit (each sends as fast as its
//! concurrency allows, as runs did before `spec.model.limits`). It reports the goodput, the most
//! requests the model answered in any 60 s as a share of the limit (the limit holds when it is at
//! most 1), and the 429s the provider answered per 1,000 requests it was sent.
//!
//! Knobs (environment): `LIMITS_BENCH_LIMIT` (requests a minute, 600), `LIMITS_BENCH_SECONDS`
//! (how long each run would take at the limit, 75: more than the minute measured),
//! `LIMITS_BENCH_PROCESSES` (`1,4,16`), `LIMITS_BENCH_CONCURRENCY` (conversations at once in
//! each process, 8).

// Its knobs' helpers only, not its scripted server.
#[allow(dead_code)]
mod common;

use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, ensure};
use serde_json::json;
use trajectory_testkit::envoy::{RateLimit, SheddingProxy};
use trajectory_testkit::gubernator::Gubernator;
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply};

struct Outcome {
    answered: usize,
    refused: u64,
    /// The most requests the model answered in any 60 s.
    busiest_minute: usize,
    /// From the first request's arrival to the last one's.
    seconds: f64,
}

fn main() -> anyhow::Result<()> {
    let limit = common::env_number("LIMITS_BENCH_LIMIT", 600)?;
    let seconds = common::env_number("LIMITS_BENCH_SECONDS", 75)?;
    let concurrency = common::env_number("LIMITS_BENCH_CONCURRENCY", 8)?;
    let counts = std::env::var("LIMITS_BENCH_PROCESSES").unwrap_or_else(|_| "1,4,16".into());
    let requests = limit * seconds / 60;
    println!(
        "# shared_limits: a provider limit of {limit} requests a minute (Envoy's token bucket, \
         {} at once), {requests} one-call conversations a run split over its processes, {concurrency} \
         at a time in each; load average at start {}",
        limit / 20,
        common::load_average()
    );
    let executor = common::executor("LIMITS_BENCH_EXECUTOR")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    for processes in counts.split(',').map(str::trim) {
        let processes: u64 = processes
            .parse()
            .with_context(|| format!("LIMITS_BENCH_PROCESSES: {processes:?}"))?;
        for shared in [true, false] {
            let outcome = run(
                &runtime,
                &executor,
                (limit, requests),
                (processes, concurrency),
                shared,
            )?;
            #[allow(clippy::cast_precision_loss)] // a few thousand requests
            let (answered, refused, busiest) = (
                outcome.answered as f64,
                outcome.refused as f64,
                outcome.busiest_minute as f64,
            );
            #[allow(clippy::cast_precision_loss)]
            let goodput = busiest / limit as f64;
            println!(
                "{processes:>3} processes, {:<19} goodput {goodput:>5.3} of the limit (busiest \
                 60 s: {}; {:>5.1} s in all), {:>6.1} 429s per 1,000 requests ({} of {})",
                if shared {
                    "shared (Gubernator)"
                } else {
                    "no limit"
                },
                outcome.busiest_minute,
                outcome.seconds,
                refused * 1000.0 / (answered + refused),
                outcome.refused,
                outcome.answered + usize::try_from(outcome.refused)?,
            );
        }
    }
    Ok(())
}

/// One run of `requests` conversations over `processes` processes against a provider limit of
/// `limit` a minute, the limit shared through a Gubernator when `shared`.
fn run(
    runtime: &tokio::runtime::Runtime,
    executor: &std::path::Path,
    (limit, requests): (u64, u64),
    (processes, concurrency): (u64, u64),
    shared: bool,
) -> anyhow::Result<Outcome> {
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = Arc::clone(&arrivals);
    let model = runtime.block_on(async move {
        ScriptedServer::start_responding(move |_| {
            seen.lock().expect("arrivals").push(Instant::now());
            Step::ok(text_reply("done"))
        })
        .await
    });
    let upstream = model.address().to_string();
    let provider = SheddingProxy::rate_limited(
        &upstream,
        RateLimit {
            max_tokens: u32::try_from(limit / 20)?,
            per_second: u32::try_from(limit / 60)?,
            told: false,
        },
    );
    let gubernator = shared.then(|| Gubernator::start("127.0.0.1"));
    let dir = tempfile::tempdir()?;
    let each = requests / processes;
    let children: Vec<Child> = (0..processes)
        .map(|index| {
            let run_dir = dir.path().join(format!("run-{index}"));
            let limits = gubernator.as_ref().map(|gubernator| {
                json!({
                    "requestsPerMinute": limit,
                    "gubernator": {"url": gubernator.url, "key": "bench-key"},
                })
            });
            spawn_local(
                &run_dir,
                executor,
                (&provider.base_url, limits),
                each,
                concurrency,
            )
        })
        .collect::<anyhow::Result<_>>()?;
    for (index, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        ensure!(
            status.success(),
            "process {index} failed ({status}); see {}",
            dir.path().join(format!("run-{index}/worker.log")).display()
        );
    }
    let mut arrivals = arrivals.lock().expect("arrivals").clone();
    arrivals.sort();
    let (first, last) = (
        *arrivals.first().context("no request arrived")?,
        *arrivals.last().context("no request arrived")?,
    );
    let minute = std::time::Duration::from_secs(60);
    let busiest_minute = (0..arrivals.len())
        .map(|start| arrivals[start..].partition_point(|at| *at < arrivals[start] + minute))
        .max()
        .unwrap_or(0);
    let counts = provider.counts();
    drop(model);
    Ok(Outcome {
        answered: arrivals.len(),
        refused: counts.rate_limited,
        busiest_minute,
        seconds: last.duration_since(first).as_secs_f64(),
    })
}

/// Starts `trajectory-worker local` on a run of `conversations` one-call conversations against
/// `base_url`, with `limits` as `spec.model.limits`.
fn spawn_local(
    run_dir: &std::path::Path,
    executor: &std::path::Path,
    (base_url, limits): (&str, Option<serde_json::Value>),
    conversations: u64,
    concurrency: u64,
) -> anyhow::Result<Child> {
    std::fs::create_dir_all(run_dir.join("datasets"))?;
    let mut dataset = String::new();
    for index in 0..conversations {
        dataset.push_str(&json!({ "prompt": format!("question {index}") }).to_string());
        dataset.push('\n');
    }
    std::fs::write(run_dir.join("datasets/prompts.jsonl"), dataset)?;
    let mut model = json!({
        "baseUrl": base_url, "name": "scripted", "requestTimeoutSeconds": 30, "maxAttempts": 5,
    });
    if let Some(limits) = limits {
        model["limits"] = limits;
    }
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "limits-bench"},
        "spec": {
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": conversations.max(1),
            "workers": 1,
            "concurrency": concurrency,
            "distribution": "terminal_only",
            "model": model,
            "storage": {"outputPath": "out"},
        },
    });
    common::spawn_local(run_dir, &file, executor)
}

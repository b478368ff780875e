//! Batch mode against live (issue 45): the run time and cost of 1,000 five-turn tool loops
//! through a provider's Batch API at several turnarounds, against the same run live.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench batch_mode
//! ```
//!
//! Each run is `trajectory-worker local` (the release binary, the path users run) on `N`
//! conversations, all in flight at once, each four `read_file` calls (of a missing file: no
//! process spawned) and an answer, every call reporting 1,000 prompt and 100 completion tokens,
//! priced at $2 and $8 a million (batch calls half). The model is the scripted server, `LATENCY`
//! a call, and the Batch API the test kit's batch server in front of it, each batch ending no
//! sooner than its turnaround (all its lines run at once, so a batch takes its turnaround or a
//! call's latency, whichever is longer); both in a child process, so that the worker's CPU is
//! its own (the worker is a child too: its CPU is read from its rusage once it has exited).
//! Windows close at `N` turns or 5 s after their first; batches are polled every second for
//! turnarounds under 10 s, else every 5 s. Reported: the run's time, its cost (statistics.json),
//! the share of calls that went live, and the worker's CPU per conversation.
//!
//! Knobs (environment): `BATCH_BENCH_CONVERSATIONS` (1000), `BATCH_BENCH_LATENCY_MS` (2000),
//! `BATCH_BENCH_TURNAROUNDS` (seconds, comma-separated: `1,30,300`), `BATCH_BENCH_EXECUTOR`.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use common::{env_number, load_average, raise_open_files_limit, start_server_process};
use serde_json::{Value, json};
use trajectory_testkit::batch_server::{BatchServer, Behaviour};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};

const SERVER_ENV: &str = "BATCH_BENCH_SERVER";

fn main() -> anyhow::Result<()> {
    let latency = Duration::from_millis(env_number("BATCH_BENCH_LATENCY_MS", 2000)?);
    if let Ok(turnaround) = std::env::var(SERVER_ENV) {
        return serve(latency, Duration::from_secs(turnaround.parse()?));
    }
    let conversations = env_number("BATCH_BENCH_CONVERSATIONS", 1000)?;
    let turnarounds: Vec<u64> = std::env::var("BATCH_BENCH_TURNAROUNDS")
        .unwrap_or_else(|_| "1,30,300".into())
        .split(',')
        .map(|seconds| seconds.trim().parse().context("BATCH_BENCH_TURNAROUNDS"))
        .collect::<anyhow::Result<_>>()?;
    let executor = common::executor("BATCH_BENCH_EXECUTOR")?;
    raise_open_files_limit(conversations * 4 + 200)?;
    println!(
        "{conversations} conversations x 5 turns, {} ms a model call; load {}",
        latency.as_millis(),
        load_average()
    );
    println!(
        "| mode | run time (s) | cost ($) | cost / live | calls live | worker CPU ms per conversation |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let mut live_cost = None;
    for turnaround in std::iter::once(None).chain(turnarounds.into_iter().map(Some)) {
        let outcome = run(conversations, turnaround, &executor)?;
        let live = *live_cost.get_or_insert(outcome.cost);
        let mode = turnaround.map_or_else(
            || "live".to_owned(),
            |seconds| format!("batch, {seconds} s"),
        );
        println!(
            "| {mode} | {:.1} | {:.2} | {:.3} | {:.1} % | {:.2} |",
            outcome.seconds,
            outcome.cost,
            outcome.cost / live,
            100.0 * outcome.live_share,
            outcome.cpu.as_secs_f64() * 1000.0 / ratio_base(conversations),
        );
        std::io::stdout().flush()?;
    }
    Ok(())
}

#[allow(clippy::cast_precision_loss)] // a count of conversations, far below 2^52
fn ratio_base(count: u64) -> f64 {
    count as f64
}

struct Outcome {
    seconds: f64,
    cost: f64,
    live_share: f64,
    cpu: Duration,
}

/// One run: live when `turnaround` is `None`, else through the batch server.
fn run(
    conversations: u64,
    turnaround: Option<u64>,
    executor: &std::path::Path,
) -> anyhow::Result<Outcome> {
    let (mut server, urls) =
        start_server_process(&[(SERVER_ENV, &turnaround.unwrap_or(0).to_string())])?;
    let (model_url, batch_url) = urls
        .split_once(' ')
        .context("the server prints two base URLs")?;
    let dir = tempfile::tempdir()?;
    std::fs::create_dir_all(dir.path().join("datasets"))?;
    let mut dataset = String::new();
    for index in 0..conversations {
        dataset.push_str(&json!({"prompt": format!("task {index}")}).to_string());
        dataset.push('\n');
    }
    std::fs::write(dir.path().join("datasets/prompts.jsonl"), dataset)?;
    let mut model = json!({
        "baseUrl": model_url, "name": trajectory_testkit::scripted_server::MODEL,
        "requestTimeoutSeconds": 600,
        "pricing": {"input": 2.0, "output": 8.0},
    });
    if let Some(seconds) = turnaround {
        let poll = if seconds < 10 { 1 } else { 5 };
        model["batch"] = json!({
            "baseUrl": batch_url, "maxRequests": conversations, "maxWaitSeconds": 5,
            "pollSeconds": poll, "deadlineSeconds": 86_400,
        });
    }
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "batch-bench"},
        "spec": {
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": conversations,
            "workers": 1,
            "concurrency": conversations,
            "distribution": {"file": 100},
            "model": model,
            "agent": {"maxTurns": 6, "promptTimeoutSeconds": 86_400},
            "storage": {"outputPath": "out"},
        },
    });
    let started = Instant::now();
    let mut worker = common::spawn_local(dir.path(), &file, executor)?;
    let (status, cpu) = wait_with_cpu(&mut worker)?;
    let seconds = started.elapsed().as_secs_f64();
    drop(server.stdin.take());
    server.wait()?;
    ensure!(
        status.success(),
        "trajectory-worker local failed ({status}); its log ends: {}",
        log_tail(dir.path())
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("out/statistics.json"))?)?;
    let cost = &statistics["cost"];
    // Every call not answered by a batch went live (`tiers` is absent when all were standard).
    let in_batches = cost["tiers"]["batch"]["calls"].as_f64().unwrap_or(0.0);
    let live_share = 1.0 - in_batches / ratio_base(conversations * 5);
    ensure!(
        turnaround.is_none() || in_batches > 0.0,
        "no call was answered in a batch; the worker's log ends: {}",
        log_tail(dir.path())
    );
    let records = std::fs::read_to_string(dir.path().join("out/trajectories.jsonl"))?;
    ensure!(
        records.lines().count() == usize::try_from(conversations)?,
        "{} records of {conversations}",
        records.lines().count()
    );
    Ok(Outcome {
        seconds,
        cost: cost["total"]
            .as_f64()
            .context("statistics.json's cost.total")?,
        live_share,
        cpu,
    })
}

/// The last 4,000 bytes of the worker's log in `dir` (the directory goes with the run).
fn log_tail(dir: &std::path::Path) -> String {
    let log = std::fs::read(dir.join("worker.log")).unwrap_or_default();
    String::from_utf8_lossy(&log[log.len().saturating_sub(4000)..]).into_owned()
}

/// Waits for `child`, returning its exit status and the CPU it used (its rusage, read as it is
/// reaped).
fn wait_with_cpu(
    child: &mut std::process::Child,
) -> anyhow::Result<(std::process::ExitStatus, Duration)> {
    let before = common::children_cpu_time()?;
    let status = child.wait()?;
    // The server process is not reaped until later: the difference is the worker's.
    Ok((status, common::children_cpu_time()?.saturating_sub(before)))
}

/// The server process: the scripted model (five turns a conversation, `latency` a call) and the
/// batch server in front of it (`turnaround`, every line of a batch at once); prints both base
/// URLs on one line and serves until the bench closes the standard input.
fn serve(latency: Duration, turnaround: Duration) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (model, batches) = runtime.block_on(async {
        let model = ScriptedServer::start_responding(move |body| {
            Step::Delay(latency, Box::new(turn(body)))
        })
        .await;
        let behaviour = Behaviour {
            turnaround,
            parallel_lines: Some(100_000),
            ..Behaviour::default()
        };
        let batches = BatchServer::start(&model.base_url(), behaviour).await;
        (model, batches)
    });
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{} {}", model.base_url(), batches.base_url())?;
    stdout.flush()?;
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())?;
    drop(batches);
    drop(model);
    runtime.shutdown_background();
    Ok(())
}

/// Four `read_file` calls, then an answer; 1,000 prompt and 100 completion tokens each.
fn turn(body: &Value) -> Step {
    let turns = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "assistant").count()
    });
    let mut reply = if turns < 4 {
        tool_call_reply("read_file", &json!({"path": "missing.txt"}))
    } else {
        text_reply("done")
    };
    reply["usage"] = json!({"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100});
    Step::ok(reply)
}

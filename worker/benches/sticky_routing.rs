//! Sticky routing against round robin on real servers (issue 25): `trajectory-worker local` (the
//! release binary, as users run it) over three llama.cpp servers, one thread and a prefix cache
//! each (`trajectory_testkit::llama_servers`), started afresh for every run.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench sticky_routing
//! ```
//!
//! The model is made to call the terminal on every turn (`tool_choice`), so each conversation is
//! `STICKY_BENCH_TURNS` terminal calls and a last answer long under either strategy; the runs
//! differ only in where each request goes. For each case (`plain`: without a system prompt;
//! `system`: with a long one shared by every conversation; `warm`: the same with each server
//! having computed it before the run, as the servers of a long run have) and each strategy it
//! reports the prompt tokens the
//! servers computed (their own count: what they could not take from their caches), the prompt
//! tokens the requests carried (the records' usage), the run's wall time and trajectories per
//! second; then round robin ÷ sticky for both.
//!
//! Knobs (environment): `STICKY_BENCH_PROMPTS` (12), `STICKY_BENCH_TURNS` (6),
//! `STICKY_BENCH_CONCURRENCY` (4), `STICKY_BENCH_CASES` (`plain,system,warm`),
//! `STICKY_BENCH_CHAT_FORMAT` (`model`: the model's own template, which keeps tool results in
//! the prompt as vLLM's and llama-server's do; `function-calling`: llama-cpp-python's
//! `chatml-function-calling`, which leaves them out), `STICKY_BENCH_EXECUTOR` (the executor
//! binary; default: `scripts/executor/build.sh`'s).

// Its knobs' helpers only, not its scripted server.
#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::Instant;

use anyhow::ensure;
use serde_json::{Value, json};
use trajectory_testkit::llama_servers::{ChatFormat, LlamaServer, SYSTEM_PROMPT, TERMINAL_TASKS};

const STRATEGIES: [&str; 2] = ["ConversationHash", "RoundRobin"];

struct Outcome {
    computed: u64,
    sent: u64,
    seconds: f64,
    trajectories: usize,
}

fn main() -> anyhow::Result<()> {
    let prompts = usize::try_from(common::env_number("STICKY_BENCH_PROMPTS", 12)?)?;
    let turns = common::env_number("STICKY_BENCH_TURNS", 6)?;
    let concurrency = common::env_number("STICKY_BENCH_CONCURRENCY", 4)?;
    let cases = std::env::var("STICKY_BENCH_CASES").unwrap_or_else(|_| "plain,system,warm".into());
    let executor = common::executor("STICKY_BENCH_EXECUTOR")?;
    let chat_format = match std::env::var("STICKY_BENCH_CHAT_FORMAT").as_deref() {
        Err(_) | Ok("model") => ChatFormat::ModelTemplate,
        Ok("function-calling") => ChatFormat::FunctionCalling,
        Ok(other) => anyhow::bail!(
            "STICKY_BENCH_CHAT_FORMAT: unknown chat format {other:?} (model, function-calling)"
        ),
    };
    println!(
        "# sticky_routing: {prompts} conversations, {turns} terminal calls and a last answer \
         each, {concurrency} at a time, 3 llama.cpp servers (1 thread, 1 GiB prefix cache \
         each, {chat_format:?}); load average at start {}",
        common::load_average()
    );
    for case in cases.split(',').map(str::trim) {
        ensure!(
            matches!(case, "plain" | "system" | "warm"),
            "unknown case {case:?} (plain, system, warm)"
        );
        let mut outcomes = Vec::new();
        for strategy in STRATEGIES {
            let outcome = run(
                case,
                strategy,
                chat_format,
                (prompts, turns, concurrency),
                &executor,
            )?;
            println!(
                "{case:>6} {strategy:<16} computed {:>6} prompt tokens of {:>6} sent \
                 ({:.0} %), {:>5.1} s, {:.3} trajectories/s ({} records)",
                outcome.computed,
                outcome.sent,
                percent(outcome.computed, outcome.sent),
                outcome.seconds,
                rate(outcome.trajectories, outcome.seconds),
                outcome.trajectories,
            );
            outcomes.push(outcome);
        }
        let (sticky, round_robin) = (&outcomes[0], &outcomes[1]);
        println!(
            "{case:>6} round robin / sticky: {:.2}x the prompt tokens computed, {:.2}x the time",
            ratio(round_robin.computed, sticky.computed),
            round_robin.seconds / sticky.seconds,
        );
    }
    Ok(())
}

fn run(
    case: &str,
    strategy: &str,
    chat_format: ChatFormat,
    (prompts, turns, concurrency): (usize, u64, u64),
    executor: &Path,
) -> anyhow::Result<Outcome> {
    let dir = tempfile::tempdir()?;
    let servers: Vec<LlamaServer> = (0..3)
        .map(|index| {
            LlamaServer::start(
                &dir.path().join(format!("server-{index}")),
                1,
                Some(1 << 30),
                chat_format,
            )
        })
        .collect();
    if case == "warm" {
        let runtime = tokio::runtime::Runtime::new()?;
        for server in &servers {
            runtime.block_on(server.warm(SYSTEM_PROMPT));
        }
    }
    let marks: Vec<_> = servers.iter().map(LlamaServer::mark).collect();
    std::fs::create_dir_all(dir.path().join("datasets"))?;
    let mut dataset = String::new();
    for index in 0..prompts {
        // Each prompt its own: two conversations with the same prompt would share their cached
        // prefixes, whichever server they went to.
        let task = TERMINAL_TASKS[index % TERMINAL_TASKS.len()];
        let prompt = format!("{task} (This is task number {index}.)");
        dataset.push_str(&json!({ "prompt": prompt }).to_string());
        dataset.push('\n');
    }
    std::fs::write(dir.path().join("datasets/prompts.jsonl"), dataset)?;
    let endpoints: Vec<Value> = servers
        .iter()
        .map(|server| json!({"baseUrl": server.base_url}))
        .collect();
    let mut agent = json!({"maxTurns": turns, "promptTimeoutSeconds": 1800});
    if case != "plain" {
        agent["ephemeralSystemPrompt"] = json!(SYSTEM_PROMPT);
    }
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "sticky-bench"},
        "spec": {
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": prompts,
            "workers": 1,
            "concurrency": concurrency,
            "distribution": "terminal_only",
            "model": {
                "endpoints": endpoints, "routing": {"strategy": strategy},
                "name": servers[0].model, "maxTokens": 48, "temperature": 0.0,
                "requestTimeoutSeconds": 600, "maxAttempts": 3,
                "extraBody": {"tool_choice": {"type": "function", "function": {"name": "terminal"}}},
            },
            "agent": agent,
            "tools": {"terminal": {"timeoutSeconds": 10}},
            "storage": {"outputPath": "out"},
        },
    });
    let started = Instant::now();
    let status = common::spawn_local(dir.path(), &file, executor)?.wait()?;
    let seconds = started.elapsed().as_secs_f64();
    ensure!(
        status.success(),
        "trajectory-worker local failed ({status}); see its log"
    );
    let records = std::fs::read_to_string(dir.path().join("out/trajectories.jsonl"))?;
    let mut sent = 0;
    let mut trajectories = 0;
    for line in records.lines() {
        let record: Value = serde_json::from_str(line)?;
        sent += record["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        trajectories += 1;
    }
    let computed = servers
        .iter()
        .zip(&marks)
        .map(|(server, mark)| server.prompt_tokens_computed(*mark))
        .sum();
    Ok(Outcome {
        computed,
        sent,
        seconds,
        trajectories,
    })
}

/// The executor users run (`scripts/executor/build.sh`'s static build), or
/// `STICKY_BENCH_EXECUTOR`.
#[allow(clippy::cast_precision_loss)] // token counts, far below 2^52
fn ratio(numerator: u64, denominator: u64) -> f64 {
    numerator as f64 / denominator.max(1) as f64
}

fn percent(part: u64, whole: u64) -> f64 {
    100.0 * ratio(part, whole)
}

#[allow(clippy::cast_precision_loss)] // a few records
fn rate(records: usize, seconds: f64) -> f64 {
    records as f64 / seconds
}

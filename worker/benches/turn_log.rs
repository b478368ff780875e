//! What the turn log costs (issue 42): `run_batch` on one batch with the log and without it
//! (`Engine::turns`), alternating, on a volume and on a bucket of a real S3 server.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench turn_log
//! ```
//!
//! The scripted server in fixed-latency mode, in a child process, answers every conversation
//! with one `read_file` call of a missing file (one failed `open`, no process spawned), then an
//! answer: each conversation has one logged turn. `N` prompts run with `C` in flight, all
//! started at once; a run ends when `run_batch` returns (every record durable, the `.done`
//! marker written). Reported per run: records per second, the client's CPU per conversation,
//! and, from `/proc/self/io`, the bytes and write calls the process made per conversation: the
//! log's lines on a volume (a group per `writev`, then an `fdatasync` each, not counted there),
//! and on a bucket its parts' PUTs (sent through a socket, so counted too). The target: with ÷
//! without ≥ 0.95.
//!
//! Knobs (environment): `TURN_LOG_BENCH_CONCURRENCY` (1000), `TURN_LOG_BENCH_PROMPTS` (10000),
//! `TURN_LOG_BENCH_LATENCY_MS` (50), `TURN_LOG_BENCH_REPEATS` (3), `TURN_LOG_BENCH_BUCKET` (1; 0
//! skips the bucket).

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{env_number, load_average, raise_open_files_limit, start_server_process};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{MODEL, tool_call_reply};
use trajectory_testkit::versitygw::Versitygw;
use trajectory_worker::run::batch::{Engine, TurnLogging, run_batch, shutdown_channel};
use trajectory_worker::run::manifest::Manifest;
use trajectory_worker::run::{RunFile, RunLocation, plan};
use trajectory_worker::storage::{AccessKeys, Bucket, BucketOptions, ObjectUrl, Store};
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};

const SERVER_ENV: &str = "TURN_LOG_BENCH_SERVER";
const BUCKET: &str = "trajectories";

fn main() -> anyhow::Result<()> {
    let latency = Duration::from_millis(env_number("TURN_LOG_BENCH_LATENCY_MS", 50)?);
    if std::env::var_os(SERVER_ENV).is_some() {
        return common::serve(
            latency,
            tool_call_reply("read_file", &json!({"path": "missing.txt"})),
        );
    }
    let concurrency = usize::try_from(env_number("TURN_LOG_BENCH_CONCURRENCY", 1000)?)?;
    let prompts = usize::try_from(env_number("TURN_LOG_BENCH_PROMPTS", 10_000)?)?;
    let repeats = env_number("TURN_LOG_BENCH_REPEATS", 3)?.max(1);
    let on_bucket = env_number("TURN_LOG_BENCH_BUCKET", 1)? != 0;
    ensure!(
        prompts >= concurrency && concurrency >= 1,
        "needs PROMPTS >= CONCURRENCY >= 1"
    );
    raise_open_files_limit(u64::try_from(concurrency)? * 2 + 100)?;
    println!(
        "# turn_log benchmark: {} CPUs, {prompts} prompts, concurrency {concurrency}, latency {} ms \
         × 2 calls (one logged turn each), load average at start {}",
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        latency.as_millis(),
        load_average()
    );
    let root = tempfile::Builder::new()
        .prefix("turn-log-bench-")
        .tempdir()?;
    let mut dataset = String::new();
    for index in 0..prompts {
        let row =
            json!({"prompt": format!("Benchmark prompt {index}: read the file, then answer.")});
        dataset.push_str(&row.to_string());
        dataset.push('\n');
    }
    let (mut server, base_url) = start_server_process(&[(SERVER_ENV, "1")])?;
    let spec = json!({
        "dataset": {"path": "datasets/prompts.jsonl"},
        "batchSize": prompts,
        "workers": 1,
        "concurrency": concurrency,
        "distribution": {"file": 100},
        "model": {"baseUrl": base_url, "name": MODEL, "maxAttempts": 3, "requestTimeoutSeconds": 60},
        "agent": {"maxTurns": 10, "promptTimeoutSeconds": 300},
        "storage": {"outputPath": "out"},
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;

    let volume = root.path().join("volume");
    fs::create_dir_all(volume.join("datasets"))?;
    fs::write(volume.join("datasets/prompts.jsonl"), &dataset)?;
    let on_volume = run_location(&volume, &spec, Store::Volume, volume.clone())?;
    measure("volume", &runtime, &on_volume, &volume, repeats, prompts)?;

    if on_bucket {
        let s3 = Versitygw::start("127.0.0.1");
        s3.create_bucket(BUCKET);
        let prefix = s3.bucket_dir(BUCKET).join("bench");
        fs::create_dir_all(prefix.join("datasets"))?;
        fs::write(prefix.join("datasets/prompts.jsonl"), &dataset)?;
        let url = ObjectUrl::parse(&format!("s3://{BUCKET}/bench")).map_err(anyhow::Error::msg)?;
        let options = BucketOptions {
            endpoint: Some(s3.endpoint.clone()),
            region: None,
            path_style: true,
            keys: Some(AccessKeys {
                id: trajectory_testkit::versitygw::ACCESS_KEY.into(),
                secret: trajectory_testkit::versitygw::SECRET_KEY.into(),
            }),
        };
        let store = Store::Bucket(Arc::new(Bucket::open(&url, &options)?));
        let on_bucket = run_location(&volume, &spec, store, format!("s3://{BUCKET}/bench").into())?;
        measure("bucket", &runtime, &on_bucket, &volume, repeats, prompts)?;
    }
    drop(runtime);
    drop(server.stdin.take());
    server.wait()?;
    println!("\nload average at end {}", load_average());
    Ok(())
}

/// The run's location: its run file in `dir`, its files in `store` under `storage_root`.
fn run_location(
    dir: &Path,
    spec: &Value,
    store: Store,
    storage_root: std::path::PathBuf,
) -> anyhow::Result<RunLocation> {
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "bench"},
        "spec": spec,
    });
    fs::write(dir.join("run.yaml"), serde_json::to_vec_pretty(&file)?)?;
    Ok(RunLocation {
        storage_root,
        store,
        plan: RunFile::load(&dir.join("run.yaml"))?.to_plan(),
    })
}

/// One run of batch 0 as it went.
struct Measured {
    elapsed: Duration,
    cpu: Duration,
    written: u64,
    writes: u64,
}

/// Runs batch 0 with and without the log, `repeats` times each, alternating which goes first,
/// and prints a table.
fn measure(
    place: &str,
    runtime: &tokio::runtime::Runtime,
    location: &RunLocation,
    workspaces: &Path,
    repeats: u64,
    prompts: usize,
) -> anyhow::Result<()> {
    let (manifest, _) = plan::plan(location)?;
    let mut engine = runtime
        .block_on(async { Engine::new(&location.plan.spec, workspaces.join("workspaces")) })?;
    engine.sandbox = Sandbox::local(LandlockMode::Auto);
    let mut without = engine.clone();
    without.turns = TurnLogging::Off;
    println!(
        "\n## {place}\n\n| round | without the log: records/s | with it: records/s | with ÷ without | client CPU ms per conversation: without; with | bytes written per conversation: without; with | write calls per conversation: without; with |"
    );
    println!("|---:|---:|---:|---:|---|---|---|");
    let mut ratios = Vec::new();
    for round in 0..repeats {
        let mut pair = [None, None];
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for slot in order {
            let engine = if slot == 0 { &without } else { &engine };
            clear_batches(location)?;
            pair[slot] = Some(run_once(runtime, engine, location, &manifest, prompts)?);
        }
        let [Some(off), Some(on)] = pair else {
            unreachable!("both slots ran");
        };
        let rate = |run: &Measured| prompts as f64 / run.elapsed.as_secs_f64();
        let per = |value: f64| value / prompts as f64;
        let ratio = rate(&on) / rate(&off);
        ratios.push(ratio);
        println!(
            "| {} | {:.0} | {:.0} | **{ratio:.3}** | {:.3}; {:.3} | {:.0}; {:.0} | {:.2}; {:.2} |",
            round + 1,
            rate(&off),
            rate(&on),
            per(off.cpu.as_secs_f64() * 1000.0),
            per(on.cpu.as_secs_f64() * 1000.0),
            per(off.written as f64),
            per(on.written as f64),
            per(off.writes as f64),
            per(on.writes as f64),
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "\nmedian with ÷ without: **{:.3}** (target ≥ 0.95)",
        ratios[ratios.len() / 2]
    );
    Ok(())
}

/// Removes the batch's files, so the next run starts it afresh.
fn clear_batches(location: &RunLocation) -> anyhow::Result<()> {
    let run_dir = location.run_dir();
    let store = run_dir.store();
    let done = run_dir.batch_done(0);
    store.remove(&done)?;
    for name in store.list(&run_dir.batch_dir(0))? {
        store.remove(&run_dir.batch_dir(0).join(name))?;
    }
    Ok(())
}

fn run_once(
    runtime: &tokio::runtime::Runtime,
    engine: &Engine,
    location: &RunLocation,
    manifest: &Manifest,
    prompts: usize,
) -> anyhow::Result<Measured> {
    let (_trigger, shutdown) = shutdown_channel();
    let (cpu_before, io_before) = (common::cpu_time()?, io_counts()?);
    let started = Instant::now();
    let summary = runtime.block_on(run_batch(engine, location, manifest, 0, &shutdown, &|_| {}))?;
    let elapsed = started.elapsed();
    let (cpu, io) = (common::cpu_time()?.saturating_sub(cpu_before), io_counts()?);
    ensure!(
        summary.succeeded == prompts as u64,
        "the batch recorded {summary:?}"
    );
    Ok(Measured {
        elapsed,
        cpu,
        written: io.0 - io_before.0,
        writes: io.1 - io_before.1,
    })
}

/// Bytes the process passed to write calls (`wchar`), and its write calls (`syscw`).
fn io_counts() -> anyhow::Result<(u64, u64)> {
    let text = fs::read_to_string("/proc/self/io")?;
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok((field("wchar:"), field("syscw:")))
}

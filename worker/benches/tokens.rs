//! What keeping token ids costs (issue 43): a batch at high concurrency with and without them,
//! the bytes and CPU per call they add, and merge and export against `cat` of the same bytes.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench tokens
//! ```
//!
//! Two scripted servers in fixed-latency mode, each in a child process (this binary re-executed)
//! so that the figures count the worker alone: one answers as today, the other as vLLM does when
//! asked for `return_token_ids` and logprobs (`prompt_token_ids`, the choice's `token_ids` and a
//! logprob per sampled token, as many as its usage counts). Each conversation is two calls: a
//! `read_file` of a missing file (the `file` toolset; it spawns nothing) and a final answer. The
//! same batch (`run_batch`, the path `local` and the pods run) runs at concurrency C with tokens
//! off against the first and with `spec.model.tokens` (`ReturnTokenIds`) against the second,
//! alternating, `REPEATS` times; a run's time ends when its batch's `.done` marker is written.
//! Then merge of the last run with tokens (which writes `trajectories.tokens.jsonl` beside the
//! trajectories) and `export` of it (verl's samples, ATIF documents) are timed against `cat` of
//! the bytes each reads.
//!
//! Knobs (environment): `TOKENS_BENCH_CONCURRENCY` (1000), `TOKENS_BENCH_PROMPTS` (10000),
//! `TOKENS_BENCH_LATENCY_MS` (200), `TOKENS_BENCH_PROMPT_IDS` (1000: the first call's prompt;
//! the second's is it, the first completion and 20 more), `TOKENS_BENCH_COMPLETION_IDS` (50),
//! `TOKENS_BENCH_REPEATS` (3).

mod common;

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{env_number, load_average, raise_open_files_limit, start_server_process};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    FixedLatency, MODEL, ScriptedServer, text_reply, tool_call_reply,
};
use trajectory_worker::export::{ExportFormat, export};
use trajectory_worker::run::batch::{Engine, run_batch, shutdown_channel};
use trajectory_worker::run::{RunFile, RunLocation, merge, plan};
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};

// The allocator of the `trajectory-worker` binary, so that the batch costs what it costs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SERVER_ENV: &str = "TOKENS_BENCH_SERVER";

struct Knobs {
    concurrency: usize,
    prompts: usize,
    latency: Duration,
    prompt_ids: usize,
    completion_ids: usize,
    repeats: usize,
}

impl Knobs {
    fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            concurrency: usize::try_from(env_number("TOKENS_BENCH_CONCURRENCY", 1000)?)?,
            prompts: usize::try_from(env_number("TOKENS_BENCH_PROMPTS", 10_000)?)?,
            latency: Duration::from_millis(env_number("TOKENS_BENCH_LATENCY_MS", 200)?),
            prompt_ids: usize::try_from(env_number("TOKENS_BENCH_PROMPT_IDS", 1000)?)?,
            completion_ids: usize::try_from(env_number("TOKENS_BENCH_COMPLETION_IDS", 50)?)?,
            repeats: usize::try_from(env_number("TOKENS_BENCH_REPEATS", 3)?.max(1))?,
        })
    }
}

/// `count` ids from `from` on, spread over a 49,152-token vocabulary.
fn ids(count: usize, from: usize) -> Vec<usize> {
    (0..count)
        .map(|index| (from + index * 7) % 49_152)
        .collect()
}

/// `reply` as vLLM gives it with `return_token_ids` and logprobs: the `prompt` ids and the
/// `sampled` ids, each with its logprob, counted so in the usage.
fn with_ids(mut reply: Value, prompt: &[usize], sampled: &[usize]) -> Value {
    reply["prompt_token_ids"] = json!(prompt);
    reply["choices"][0]["token_ids"] = json!(sampled);
    let content: Vec<Value> = sampled
        .iter()
        .enumerate()
        .map(|(index, id)| {
            json!({"token": format!("t{id}"), "logprob": -0.001 * index as f64, "bytes": null, "top_logprobs": []})
        })
        .collect();
    reply["choices"][0]["logprobs"] = json!({ "content": content });
    reply["usage"] = json!({"prompt_tokens": prompt.len(), "completion_tokens": sampled.len(), "total_tokens": prompt.len() + sampled.len()});
    reply
}

fn serve(knobs: &Knobs, with_token_ids: bool) -> anyhow::Result<()> {
    let tool_call = tool_call_reply("read_file", &json!({"path": "missing.txt"}));
    let answer = text_reply("done");
    let (tool_call, final_answer) = if with_token_ids {
        // The second prompt extends the first call's prompt and completion, as a chat
        // template's rendering of the history does.
        let first = ids(knobs.prompt_ids, 1);
        let sampled = ids(knobs.completion_ids, 1234);
        let second = [first.as_slice(), &sampled, &ids(20, 4321)].concat();
        (
            with_ids(tool_call, &first, &sampled),
            with_ids(answer, &second, &sampled),
        )
    } else {
        (tool_call, answer)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let server = runtime.block_on(ScriptedServer::start_fixed_latency(FixedLatency {
        latency: knobs.latency,
        tool_call,
        final_answer,
    }));
    common::serve_until_stdin_closes(server, runtime)
}

/// A run under `root` against `base_url`, keeping tokens or not; its plan made.
fn prepare(
    root: &Path,
    base_url: &str,
    tokens: bool,
    knobs: &Knobs,
) -> anyhow::Result<(RunLocation, trajectory_worker::run::manifest::Manifest)> {
    fs::create_dir_all(root.join("datasets"))?;
    let mut dataset = BufWriter::new(File::create(root.join("datasets/prompts.jsonl"))?);
    for index in 0..knobs.prompts {
        writeln!(
            dataset,
            "{}",
            json!({"prompt": format!("Benchmark prompt {index}: read the file, then answer."), "id": index})
        )?;
    }
    dataset.flush()?;
    let mut model =
        json!({"baseUrl": base_url, "name": MODEL, "maxAttempts": 3, "requestTimeoutSeconds": 60});
    if tokens {
        model["tokens"] = json!({"request": "ReturnTokenIds"});
    }
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "bench"},
        "spec": {
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": knobs.prompts,
            "workers": 1,
            "concurrency": knobs.concurrency,
            "distribution": {"file": 100},
            "model": model,
            "agent": {"maxTurns": 10, "promptTimeoutSeconds": 300},
            "storage": {"outputPath": "out"},
        },
    });
    // JSON is YAML.
    fs::write(root.join("run.yaml"), serde_json::to_vec_pretty(&file)?)?;
    let location = RunLocation {
        storage_root: root.to_path_buf(),
        store: trajectory_worker::storage::Store::Volume,
        plan: RunFile::load(&root.join("run.yaml"))?.to_plan(),
    };
    let (manifest, _) = plan::plan(&location)?;
    Ok((location, manifest))
}

/// One batch run: its time, the worker's CPU, and the bytes of its records file.
struct BatchRun {
    elapsed: Duration,
    cpu: Duration,
    bytes: u64,
}

fn run_once(
    runtime: &tokio::runtime::Runtime,
    engine: &Engine,
    location: &RunLocation,
    manifest: &trajectory_worker::run::manifest::Manifest,
    prompts: usize,
) -> anyhow::Result<BatchRun> {
    let _ = fs::remove_dir_all(location.run_dir().batches_dir());
    let (_trigger, shutdown) = shutdown_channel();
    let cpu_before = common::cpu_time()?;
    let started = Instant::now();
    let summary = runtime.block_on(run_batch(engine, location, manifest, 0, &shutdown, &|_| {}))?;
    let elapsed = started.elapsed();
    let cpu = common::cpu_time()?.saturating_sub(cpu_before);
    ensure!(
        summary.succeeded == prompts as u64,
        "the batch recorded {summary:?}"
    );
    let bytes = location
        .run_dir()
        .records_files(0)?
        .iter()
        .map(|files| fs::metadata(&files.records).map_or(0, |meta| meta.len()))
        .sum();
    Ok(BatchRun {
        elapsed,
        cpu,
        bytes,
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The time `cat FILES > out` takes, median of `repeats`.
fn cat(dir: &Path, files: &str, repeats: usize) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..repeats {
        let started = Instant::now();
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!("cat {files} > cat.out"))
            .current_dir(dir)
            .status()?;
        ensure!(status.success(), "cat failed");
        times.push(started.elapsed().as_secs_f64());
    }
    fs::remove_file(dir.join("cat.out"))?;
    Ok(median(times))
}

fn main() -> anyhow::Result<()> {
    let knobs = Knobs::from_env()?;
    if let Some(kind) = std::env::var_os(SERVER_ENV) {
        return serve(&knobs, kind == "ids");
    }
    ensure!(
        knobs.prompts >= knobs.concurrency && knobs.concurrency >= 1,
        "needs PROMPTS >= CONCURRENCY >= 1"
    );
    raise_open_files_limit(u64::try_from(knobs.concurrency)? * 2 + 100)?;
    let dir = tempfile::tempdir()?;
    let (mut plain_server, plain_url) = start_server_process(&[(SERVER_ENV, "plain")])?;
    let (mut ids_server, ids_url) = start_server_process(&[(SERVER_ENV, "ids")])?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for (name, url, tokens) in [("off", &plain_url, false), ("on", &ids_url, true)] {
        let root = dir.path().join(name);
        let (location, manifest) = prepare(&root, url, tokens, &knobs)?;
        let mut engine = runtime
            .block_on(async { Engine::new(&location.plan.spec, root.join("workspaces")) })?;
        engine.sandbox = Sandbox::local(LandlockMode::Auto);
        runs.push((location, manifest, Arc::new(engine)));
    }
    println!(
        "## a batch of {} prompts at concurrency {}, {} ms × 2 calls (ideal {:.0}/s); tokens: {} prompt ids on the first call, {} on the second, {} sampled a call; load average at the start {}",
        knobs.prompts,
        knobs.concurrency,
        knobs.latency.as_millis(),
        knobs.concurrency as f64 / (2.0 * knobs.latency.as_secs_f64()),
        knobs.prompt_ids,
        knobs.prompt_ids + knobs.completion_ids + 20,
        knobs.completion_ids,
        load_average()
    );
    println!(
        "\n| round | off: conv/s | on: conv/s | on ÷ off | CPU ms/conv off | on | record bytes/conv off | on | token data: bytes/call | CPU µs/call |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut ratios = Vec::new();
    let calls = 2.0 * knobs.prompts as f64;
    for round in 0..knobs.repeats {
        let mut results: [Option<BatchRun>; 2] = [None, None];
        // Alternate which goes first, so neither always has the warmer machine.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for index in order {
            let (location, manifest, engine) = &runs[index];
            results[index] = Some(run_once(
                &runtime,
                engine,
                location,
                manifest,
                knobs.prompts,
            )?);
        }
        let [Some(off), Some(on)] = results else {
            unreachable!("both ran")
        };
        let rate = |run: &BatchRun| knobs.prompts as f64 / run.elapsed.as_secs_f64();
        let ratio = rate(&on) / rate(&off);
        ratios.push(ratio);
        let per_conv_ms = |run: &BatchRun| run.cpu.as_secs_f64() * 1e3 / knobs.prompts as f64;
        println!(
            "| {} | {:.0} | {:.0} | **{ratio:.3}** | {:.3} | {:.3} | {} | {} | {:.0} | {:.1} |",
            round + 1,
            rate(&off),
            rate(&on),
            per_conv_ms(&off),
            per_conv_ms(&on),
            off.bytes / knobs.prompts as u64,
            on.bytes / knobs.prompts as u64,
            (on.bytes as f64 - off.bytes as f64) / calls,
            (on.cpu.as_secs_f64() - off.cpu.as_secs_f64()) * 1e6 / calls,
        );
    }
    println!(
        "\nmedian on ÷ off: **{:.3}** (target ≥ 0.95)",
        median(ratios)
    );
    drop(runtime);
    for server in [&mut plain_server, &mut ids_server] {
        drop(server.stdin.take());
        server.wait()?;
    }

    // Merge and export of the last run with tokens, against cat of what each reads.
    let (location, ..) = &runs[1];
    let run_dir = location.run_dir();
    let root = run_dir.root().to_path_buf();
    let batch_bytes: u64 = run_dir
        .records_files(0)?
        .iter()
        .map(|files| fs::metadata(&files.records).map_or(0, |meta| meta.len()))
        .sum();
    let mut merge_times = Vec::new();
    for _ in 0..knobs.repeats {
        let started = Instant::now();
        let summary = merge::merge(location)?;
        merge_times.push(started.elapsed().as_secs_f64());
        ensure!(summary.trajectories == knobs.prompts as u64, "{summary:?}");
    }
    let merge_time = median(merge_times);
    let cat_batches = cat(&root, "batches/*/*.jsonl", knobs.repeats)?;
    let mib = |bytes: u64, seconds: f64| bytes as f64 / f64::from(1 << 20) / seconds;
    println!(
        "\n| step | reads | time | MiB/s | ÷ cat of the same bytes |\n|---|---:|---:|---:|---:|"
    );
    println!(
        "| merge (with report) | {:.1} MiB of batch files | {merge_time:.3} s | {:.0} | **{:.2}** (cat {cat_batches:.3} s) |",
        batch_bytes as f64 / f64::from(1 << 20),
        mib(batch_bytes, merge_time),
        merge_time / cat_batches
    );
    let merged = fs::metadata(root.join("trajectories.jsonl"))?.len()
        + fs::metadata(root.join("trajectories.tokens.jsonl"))?.len();
    let cat_merged = cat(
        &root,
        "trajectories.jsonl trajectories.tokens.jsonl",
        knobs.repeats,
    )?;
    for format in [ExportFormat::Verl, ExportFormat::Atif] {
        let mut times = Vec::new();
        for _ in 0..knobs.repeats {
            let started = Instant::now();
            let mut out = BufWriter::new(File::create(root.join("export.jsonl"))?);
            let summary = export(&root, format, false, &mut out)?;
            out.flush()?;
            times.push(started.elapsed().as_secs_f64());
            ensure!(summary.trajectories == knobs.prompts as u64, "{summary:?}");
        }
        let time = median(times);
        println!(
            "| export --format {format:?} | {:.1} MiB merged | {time:.3} s | {:.0} | **{:.2}** (cat {cat_merged:.3} s) |",
            merged as f64 / f64::from(1 << 20),
            mib(merged, time),
            time / cat_merged
        );
    }
    Ok(())
}

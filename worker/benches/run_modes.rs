//! Run-mode benchmarks (design §12, issue 4): `merge` against `cat`, `plan` against `wc -l`, and a
//! batch's records on disk per second against the engine's own conversations per second.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench run_modes
//! ```
//!
//! Everything is a ratio measured in one run on the same disk, so the machine's speed cancels out:
//!
//! - **merge**: realistic batch files (Hermes records rendered by `hermes::trajectory_record`, in
//!   completion order within each batch, mostly trajectories with some failed and discarded
//!   records) plus a real manifest from `plan`. `merge::merge` is timed against
//!   `cat batches/*/*.jsonl > out` into the same directory, alone and followed by an fsync of the
//!   output (merge fsyncs what it writes). Runs alternate, after a `sync` so that no run pays for
//!   the previous one's writeback; the median of the repeats is reported, with a warm page cache
//!   and (if `/proc/sys/vm/drop_caches` is writable) a cold one.
//! - **plan**: a dataset of JSONL rows of about 1 KiB with a few fields besides the prompt. The
//!   release binary `trajectory-worker plan --run-file … --storage-root …` runs under
//!   `/usr/bin/time -v` (its "Maximum resident set size" is the peak memory) against `wc -l` of the
//!   same file, warm and cold as above.
//! - **local**: the scripted server in fixed-latency mode, in a child process (as in the engine
//!   benchmark), whose tool call is `read_file` of a file that does not exist (answered by one
//!   failed `open`, no process spawned). In this process, first the engine path — `run_conversation`
//!   with the batch engine's own client, tools and agent settings, C conversations in flight, all
//!   started at once — as spawned tasks (A, the engine's own figure) and polled by one task (B, as
//!   `run_batch` drives them); then `run_batch` on one batch of the same prompts with
//!   `concurrency = C`: when each conversation finished (C, its progress callback) and when each
//!   record was durably on disk (D: a watcher thread tails the batch file; the whole run ends when
//!   the `.done` marker is written). All are reported over the whole run and over the steady window
//!   between the 2·C-th and the (N − C)-th completion; the target is D ÷ A ≥ 0.95, and D ÷ C shows
//!   whether the durable writes hold the batch back.
//!
//! - **report**: what `report.html` costs: every merge above is also run without its report (the
//!   merge as it was before reports), alternating; then a run of a million small records is
//!   merged with and without its report, `trajectory-worker report` writes its report again, and
//!   headless Chromium loads it (the page records when it was drawn and laid out).
//!
//!   `largest` opens the largest page a report can be, its sample at its budget.
//!
//! - **object** (not in the default parts): the same plan and merge on a bucket of a real S3
//!   server (versitygw, on this machine), each against copying the same bytes with the AWS CLI
//!   (`aws s3 cp`: the dataset downloaded; the batch objects downloaded and one output of their
//!   size uploaded), median of the repeats, warm; then the S3 requests a `local` run makes per
//!   1,000 trajectories (counted by a proxy in front of the server), by kind, at batch sizes 10
//!   and 100.
//!
//! Knobs (environment): `RUN_MODES_BENCH_PARTS` ("merge,report,largest,plan,local"; add
//! "object" for the bucket's),
//! `RUN_MODES_BENCH_REPORT_RECORDS` (1000000), `RUN_MODES_BENCH_MERGE_MIB`
//! (1024), `RUN_MODES_BENCH_PLAN_MIB` (1024), `RUN_MODES_BENCH_REPEATS` (3), `RUN_MODES_BENCH_COLD`
//! (1; 0 skips the cold-cache runs), `RUN_MODES_BENCH_EXECUTOR` (the executor the object part's
//! local runs use; default: `scripts/executor/build.sh`'s), `RUN_MODES_BENCH_DIR` (the system temp dir; the data and a
//! copy of it must fit), `RUN_MODES_BENCH_LATENCY_MS` (50), `RUN_MODES_BENCH_CONCURRENCY` (256),
//! `RUN_MODES_BENCH_PROMPTS` (10000), `RUN_MODES_BENCH_KEEP` (0; 1 keeps the generated data, for
//! profiling `trajectory-worker merge` or `plan` on it). For a quick run:
//! `RUN_MODES_BENCH_MERGE_MIB=64 RUN_MODES_BENCH_PLAN_MIB=64 RUN_MODES_BENCH_PROMPTS=2000`.

mod common;

use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use chrono::TimeZone;
use common::{env_number, load_average, raise_open_files_limit, start_server_process};
use futures::StreamExt;
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;
use trajectory_testkit::chromium::CHROMIUM;
use trajectory_testkit::s3_faults::{FaultProxy, Kind};
use trajectory_testkit::scripted_server::{MODEL, tool_call_reply};
use trajectory_testkit::versitygw::Versitygw;
use trajectory_worker::agent::{Conversation, run_conversation};
use trajectory_worker::hermes::{RecordContext, timestamp, trajectory_record};
use trajectory_worker::model::types::{parse_arguments, tool_call};
use trajectory_worker::model::{
    AssistantMessage, Message, Reasoning, ReasoningShape, ToolMessage, Usage,
};
use trajectory_worker::report;
use trajectory_worker::run::batch::{Engine, run_batch, shutdown_channel};
use trajectory_worker::run::{RunFile, RunLocation, merge, plan};
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::storage::{RunDir, WriterId};
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{Registry, Tool, ToolContext, Workspace};

const SERVER_ENV: &str = "RUN_MODES_BENCH_SERVER";
// The allocator of the `trajectory-worker` binary, so that both paths cost what they cost there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORKER: &str = env!("CARGO_BIN_EXE_trajectory-worker");
const MIB: u64 = 1 << 20;

#[derive(Debug)]
struct Knobs {
    parts: Vec<String>,
    merge_bytes: u64,
    plan_bytes: u64,
    repeats: usize,
    cold: bool,
    dir: PathBuf,
    latency: Duration,
    concurrency: usize,
    prompts: usize,
    report_records: u64,
    keep: bool,
}

impl Knobs {
    fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            parts: std::env::var("RUN_MODES_BENCH_PARTS")
                .unwrap_or_else(|_| "merge,report,largest,plan,local".into())
                .split(',')
                .map(|part| part.trim().to_owned())
                .collect(),
            merge_bytes: env_number("RUN_MODES_BENCH_MERGE_MIB", 1024)? * MIB,
            plan_bytes: env_number("RUN_MODES_BENCH_PLAN_MIB", 1024)? * MIB,
            repeats: usize::try_from(env_number("RUN_MODES_BENCH_REPEATS", 3)?.max(1))?,
            cold: env_number("RUN_MODES_BENCH_COLD", 1)? != 0,
            dir: std::env::var_os("RUN_MODES_BENCH_DIR")
                .map_or_else(std::env::temp_dir, Into::into),
            latency: Duration::from_millis(env_number("RUN_MODES_BENCH_LATENCY_MS", 50)?),
            concurrency: usize::try_from(env_number("RUN_MODES_BENCH_CONCURRENCY", 256)?)?,
            prompts: usize::try_from(env_number("RUN_MODES_BENCH_PROMPTS", 10_000)?)?,
            report_records: env_number("RUN_MODES_BENCH_REPORT_RECORDS", 1_000_000)?,
            keep: env_number("RUN_MODES_BENCH_KEEP", 0)? != 0,
        })
    }

    fn wants(&self, part: &str) -> bool {
        self.parts.iter().any(|wanted| wanted == part)
    }
}

fn main() -> anyhow::Result<()> {
    let knobs = Knobs::from_env()?;
    if std::env::var_os(SERVER_ENV).is_some() {
        return common::serve(
            knobs.latency,
            tool_call_reply("read_file", &json!({"path": "missing.txt"})),
        );
    }
    fs::create_dir_all(&knobs.dir)?;
    let root = tempfile::Builder::new()
        .prefix("run-modes-bench-")
        .tempdir_in(&knobs.dir)
        .with_context(|| format!("cannot create a temp dir in {}", knobs.dir.display()))?;
    let cold = knobs.cold && drop_caches().is_ok();
    println!(
        "# run_modes benchmark: {} CPUs, data under {}, load average at start {}",
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        root.path().display(),
        load_average()
    );
    if knobs.cold && !cold {
        println!("(cold-cache runs skipped: /proc/sys/vm/drop_caches is not writable)");
    }
    if knobs.wants("merge") {
        merge_bench(&root.path().join("merge"), &knobs, cold)?;
        if !knobs.keep {
            fs::remove_dir_all(root.path().join("merge"))?;
        }
    }
    if knobs.wants("report") {
        report_bench(&root.path().join("report"), &knobs)?;
        if !knobs.keep {
            fs::remove_dir_all(root.path().join("report"))?;
        }
    }
    if knobs.wants("largest") {
        fs::create_dir_all(root.path().join("largest"))?;
        largest_report_bench(&root.path().join("largest"), &knobs)?;
    }
    if knobs.wants("plan") {
        plan_bench(&root.path().join("plan"), &knobs, cold)?;
        if !knobs.keep {
            fs::remove_dir_all(root.path().join("plan"))?;
        }
    }
    if knobs.wants("local") {
        local_bench(&root.path().join("local"), &knobs)?;
    }
    if knobs.wants("object") {
        object_bench(&knobs)?;
    }
    println!("\nload average at end {}", load_average());
    if knobs.keep {
        println!("data kept in {}", root.keep().display());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Shared helpers

/// A small deterministic generator (xorshift64*), so the data is the same on every run.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, bound: usize) -> usize {
        usize::try_from(self.next() % bound as u64).unwrap_or(0)
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for index in (1..items.len()).rev() {
            items.swap(index, self.below(index + 1));
        }
    }
}

const WORDS: [&str; 40] = [
    "the",
    "file",
    "returns",
    "a",
    "list",
    "of",
    "values",
    "when",
    "function",
    "called",
    "with",
    "config.yaml",
    "src/main.rs",
    "error",
    "\"quoted\"",
    "naïve",
    "café",
    "—",
    "test",
    "passes",
    "after",
    "we",
    "fix",
    "import",
    "path",
    "in",
    "module",
    "check",
    "output",
    "line\n",
    "{x: 1}",
    "tab\there",
    "über",
    "value",
    "number",
    "42",
    "3.14",
    "is",
    "not",
    "empty",
];

/// About `length` bytes of text with newlines, quotes, tabs and non-ASCII characters.
fn text(rng: &mut Rng, length: usize) -> String {
    let mut out = String::with_capacity(length + 16);
    while out.len() < length {
        out.push_str(WORDS[rng.below(WORDS.len())]);
        out.push(' ');
    }
    out
}

/// The median of some durations.
fn median(values: &[Duration]) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted[sorted.len() / 2]
}

fn seconds(duration: Duration) -> String {
    format!("{:.3}", duration.as_secs_f64())
}

fn list(values: &[Duration]) -> String {
    values
        .iter()
        .map(|value| seconds(*value))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Flushes every dirty page, then empties the page cache.
fn drop_caches() -> std::io::Result<()> {
    sync()?;
    fs::write("/proc/sys/vm/drop_caches", b"3")
}

/// `sync(1)`: writes every dirty page back, so the next timed run does not pay for this one's.
fn sync() -> std::io::Result<()> {
    let status = Command::new("sync").status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("sync failed: {status}")))
    }
}

fn run_timed(command: &mut Command) -> anyhow::Result<(Duration, String)> {
    let started = Instant::now();
    let output = command.stdout(Stdio::null()).output()?;
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    ensure!(output.status.success(), "{command:?} failed: {stderr}");
    Ok((elapsed, stderr))
}

/// The plan benchmarks' run file under `root`: the dataset of [`write_plan_dataset`], the
/// default batch size (10: the most batches, so the biggest manifest).
fn write_plan_run_file(root: &Path) -> anyhow::Result<RunLocation> {
    write_run_file(
        root,
        &json!({
            "dataset": {"path": "datasets/prompts.jsonl"},
            "distribution": {"file": 100},
            "model": {"baseUrl": "http://127.0.0.1:9/v1", "name": "bench-model"},
            "storage": {"outputPath": "out"},
        }),
    )
}

/// A run file for a run under `root`, `outputPath: out`.
fn write_run_file(root: &Path, spec: &Value) -> anyhow::Result<RunLocation> {
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "bench"},
        "spec": spec,
    });
    // JSON is YAML.
    fs::write(root.join("run.yaml"), serde_json::to_vec_pretty(&file)?)?;
    let run_file = RunFile::load(&root.join("run.yaml"))?;
    Ok(RunLocation {
        storage_root: root.to_path_buf(),
        store: trajectory_worker::storage::Store::Volume,
        plan: run_file.to_plan(),
    })
}

// ---------------------------------------------------------------------------------------------
// merge

/// Trajectory records of several shapes (1-3 tool rounds, tool outputs of 0.3-9 KB, texts and
/// outputs divided by `shrink`), rendered once; each generated record is one of them with its own
/// index, id, prompt and timestamp.
fn record_templates(rng: &mut Rng, shrink: usize) -> Vec<Map<String, Value>> {
    let registry = Registry::builtin(&ToolsSpec::default());
    let toolsets = ["file".to_owned()];
    let tools: Vec<_> = registry
        .tools_for(&toolsets)
        .iter()
        .map(|tool| tool.spec().clone())
        .collect();
    let catalog = registry.catalog(&toolsets);
    let source = json!({"id": "q-1", "category": "coding"})
        .as_object()
        .cloned()
        .unwrap_or_default();
    let started = chrono::Utc.with_ymd_and_hms(2026, 3, 5, 14, 2, 10).unwrap();
    let mut templates = Vec::new();
    for (shape, output) in [300usize, 1000, 2500, 5000, 9000, 1500, 700, 4000]
        .into_iter()
        .enumerate()
    {
        let mut messages = vec![Message::User(text(rng, 200 / shrink))];
        let rounds = 1 + shape % 3;
        for round in 0..rounds {
            let id = format!("call_{round}");
            let arguments = json!({"path": format!("src/module_{round}.py")}).to_string();
            let mut call = tool_call(
                id.clone(),
                "read_file".into(),
                Some(&Value::String(arguments.clone())),
            );
            call.arguments = parse_arguments(&arguments);
            messages.push(Message::Assistant(AssistantMessage {
                content: text(rng, 120 / shrink),
                reasoning: Some(Reasoning {
                    text: text(rng, 400 / shrink),
                    shape: ReasoningShape::ReasoningContent,
                }),
                tool_calls: vec![call],
            }));
            messages.push(Message::Tool(ToolMessage {
                tool_call_id: id,
                name: "read_file".into(),
                content: json!({"content": text(rng, output / rounds / shrink), "total_lines": 40})
                    .to_string(),
            }));
        }
        messages.push(Message::Assistant(AssistantMessage {
            content: text(rng, 600 / shrink),
            reasoning: Some(Reasoning {
                text: text(rng, 300 / shrink),
                shape: ReasoningShape::ReasoningContent,
            }),
            tool_calls: vec![],
        }));
        let conversation = Conversation {
            messages,
            api_calls: u32::try_from(rounds + 1).unwrap_or(2),
            completed: true,
            partial: false,
            usage: Usage {
                prompt_tokens: 1500,
                completion_tokens: 400,
                reasoning_tokens: 120,
                ..Usage::default()
            },
            cost: None,
            model_time: Duration::from_millis(900),
            resume: None,
            replayed: None,
            steps: Vec::new(),
            ..Conversation::new("the prompt is in messages")
        };
        let context = RecordContext {
            id: "abcdef123456-0-0",
            prompt_index: 0,
            sample: 0,
            batch: 0,
            model: "bench-model",
            toolsets_used: &toolsets,
            tools_offered: &tools,
            system_turn: None,
            catalog: &catalog,
            started_at: started,
            finished_at: started + chrono::Duration::milliseconds(1532),
            source: &source,
            verification: None,
            discarded_by: None,
        };
        templates.push(trajectory_record(&conversation, &context));
    }
    templates
}

/// One record line of `prompt_index`: mostly trajectories, 4% failed, 2% discarded.
fn record_line(
    rng: &mut Rng,
    templates: &[Map<String, Value>],
    prompt_index: u64,
    batch: u32,
) -> (u8, String) {
    let id = format!("abcdef123456-{prompt_index}-0");
    let stamp = timestamp(
        chrono::Utc.with_ymd_and_hms(2026, 3, 5, 14, 2, 10).unwrap()
            + chrono::Duration::milliseconds(i64::try_from(prompt_index).unwrap_or(0) * 37),
    );
    let roll = rng.below(100);
    let (kind, value) = if roll < 4 {
        let mut record = Map::new();
        record.insert("prompt_index".into(), prompt_index.into());
        record.insert("sample".into(), 0.into());
        record.insert("id".into(), id.into());
        record.insert("status".into(), "failed".into());
        record.insert(
            "error_class".into(),
            ["timeout", "model_error"][rng.below(2)].into(),
        );
        record.insert(
            "error".into(),
            "conversation exceeded its budget of 600s".into(),
        );
        record.insert("batch_num".into(), batch.into());
        record.insert("duration_ms".into(), 600_000.into());
        record.insert("timestamp".into(), stamp.into());
        (2, Value::Object(record))
    } else if roll < 6 {
        (
            1,
            json!({
                "prompt_index": prompt_index, "sample": 0, "id": id, "status": "discarded",
                "filter": "require_reasoning", "batch_num": batch, "api_calls": 2,
                "timestamp": stamp,
            }),
        )
    } else {
        let mut record = templates[rng.below(templates.len())].clone();
        record.insert("prompt_index".into(), prompt_index.into());
        record.insert("id".into(), id.into());
        record.insert("duration_ms".into(), (800 + rng.below(5000)).into());
        if let Some(Value::Array(turns)) = record.get_mut("conversations") {
            let length = turns[1]["value"].as_str().map_or(0, str::len);
            turns[1]["value"] =
                Value::String(format!("Task {prompt_index}: {}", text(rng, length)));
        }
        if let Some(metadata) = record.get_mut("metadata") {
            metadata["batch_num"] = batch.into();
            metadata["timestamp"] = stamp.into();
        }
        (0, Value::Object(record))
    };
    (kind, trajectory_worker::pyjson::to_string(&value))
}

#[derive(Debug, Default)]
struct MergeTimes {
    merge: Vec<Duration>,
    /// Merge as it was before reports: no report gathered or written.
    without_report: Vec<Duration>,
    cat: Vec<Duration>,
    cat_fsync: Vec<Duration>,
}

/// One records file per batch, as one writer of it leaves it, and its `.done` marker; returns the
/// bytes of all the records files and the counts of trajectories, discarded and failed records.
fn write_batch_files(
    run_dir: &RunDir,
    manifest: &trajectory_worker::run::manifest::Manifest,
    rng: &mut Rng,
    templates: &[Map<String, Value>],
) -> anyhow::Result<(u64, [u64; 3])> {
    let (mut batch_bytes, mut counts) = (0u64, [0u64; 3]);
    for batch in 0..manifest.batch_count() {
        let first = manifest.first_prompt(batch);
        let mut lines: Vec<(u8, String)> = (first..first + manifest.prompts_in(batch))
            .map(|index| record_line(rng, templates, index, batch))
            .collect();
        // Records are appended in completion order, not dataset order.
        rng.shuffle(&mut lines);
        // One writer per batch, in the directory of its own that every batch's records get.
        let path = run_dir.batch_records_of(batch, &WriterId::random());
        fs::create_dir_all(run_dir.batch_dir(batch))?;
        let mut out = BufWriter::new(File::create(path)?);
        let mut marker = [0u64; 3];
        for (kind, line) in &lines {
            out.write_all(line.as_bytes())?;
            out.write_all(b"\n")?;
            batch_bytes += line.len() as u64 + 1;
            marker[usize::from(*kind)] += 1;
        }
        out.flush()?;
        for (total, count) in counts.iter_mut().zip(marker) {
            *total += count;
        }
        fs::write(
            run_dir.batch_done(batch),
            json!({"batch": batch, "succeeded": marker[0], "discarded": marker[1], "failed": marker[2],
                   "finishedAt": "2026-03-05T14:02:10.000000Z"})
            .to_string(),
        )?;
    }
    Ok((batch_bytes, counts))
}

/// The merge benchmark's table: medians and every run, warm and (if measured) cold.
fn print_merge_table(warm: &MergeTimes, cold: &MergeTimes) {
    println!(
        "\n| page cache | merge s | cat s | cat + fsync s | merge ÷ cat | merge ÷ (cat + fsync) | runs (merge; cat; cat + fsync) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|");
    for (label, times) in [("warm", warm), ("cold", cold)] {
        if times.merge.is_empty() {
            continue;
        }
        let (m, c, cf) = (
            median(&times.merge),
            median(&times.cat),
            median(&times.cat_fsync),
        );
        println!(
            "| {label} | {} | {} | {} | **{:.2}** | **{:.2}** | {}; {}; {} |",
            seconds(m),
            seconds(c),
            seconds(cf),
            m.as_secs_f64() / c.as_secs_f64(),
            m.as_secs_f64() / cf.as_secs_f64(),
            list(&times.merge),
            list(&times.cat),
            list(&times.cat_fsync),
        );
    }
    print_report_cost(warm, cold);
}

/// What writing `report.html` adds to a merge: merge against merge without the report.
fn print_report_cost(warm: &MergeTimes, cold: &MergeTimes) {
    println!(
        "\n| page cache | merge s | merge without report s | report adds | runs (merge; without) |"
    );
    println!("|---|---:|---:|---:|---|");
    for (label, times) in [("warm", warm), ("cold", cold)] {
        if times.merge.is_empty() || times.without_report.is_empty() {
            continue;
        }
        let (with, without) = (median(&times.merge), median(&times.without_report));
        println!(
            "| {label} | {} | {} | **{:+.1} %** | {}; {} |",
            seconds(with),
            seconds(without),
            (with.as_secs_f64() / without.as_secs_f64() - 1.0) * 100.0,
            list(&times.merge),
            list(&times.without_report),
        );
    }
    println!("target: the report adds at most 5 % to the merge");
}

/// The merge benchmark's run: `prompts` prompts in batches of `batch_size`, planned.
fn plan_merge_run(
    dir: &Path,
    prompts: u64,
    batch_size: u64,
) -> anyhow::Result<(RunLocation, trajectory_worker::run::manifest::Manifest)> {
    let mut dataset = BufWriter::new(File::create(dir.join("datasets/prompts.jsonl"))?);
    for index in 0..prompts {
        writeln!(
            dataset,
            "{}",
            json!({"prompt": format!("Task {index}"), "id": index})
        )?;
    }
    dataset.into_inner()?.sync_all()?;
    let location = write_run_file(
        dir,
        &json!({
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": batch_size,
            "distribution": {"file": 100},
            "model": {"baseUrl": "http://127.0.0.1:9/v1", "name": "bench-model"},
            "storage": {"outputPath": "out"},
        }),
    )?;
    let (manifest, _) = plan::plan(&location)?;
    Ok((location, manifest))
}

/// A planned run whose batches are all done: its location, its records' bytes and the counts of
/// trajectories, discarded and failed records.
struct MergeRun {
    location: RunLocation,
    batch_bytes: u64,
    counts: [u64; 3],
}

/// Generates a run of about `bytes` of records shaped like `templates` (all its batches done),
/// or of `records` records when given, in batches of 100; prints what it made.
fn generate_merge_run(
    dir: &Path,
    rng: &mut Rng,
    templates: &[Map<String, Value>],
    size: RunSize,
) -> anyhow::Result<MergeRun> {
    const BATCH_SIZE: u64 = 100;
    fs::create_dir_all(dir.join("datasets"))?;
    let sample: Vec<usize> = (0..200)
        .map(|index| record_line(rng, templates, index, 0).1.len() + 1)
        .collect();
    let average = sample.iter().sum::<usize>() / sample.len();
    let prompts = match size {
        RunSize::Bytes(bytes) => (bytes / average as u64).max(BATCH_SIZE),
        RunSize::Records(records) => records,
    };
    let generating = Instant::now();
    let (location, manifest) = plan_merge_run(dir, prompts, BATCH_SIZE)?;
    let (batch_bytes, counts) = write_batch_files(&location.run_dir(), &manifest, rng, templates)?;
    println!(
        "\n## merge: {} batch files of {BATCH_SIZE} records, {:.0} MiB ({} records: {} trajectories, \
         {} discarded, {} failed; mean {} bytes), generated in {:.0} s",
        manifest.batch_count(),
        batch_bytes as f64 / MIB as f64,
        prompts,
        counts[0],
        counts[1],
        counts[2],
        average,
        generating.elapsed().as_secs_f64()
    );
    Ok(MergeRun {
        location,
        batch_bytes,
        counts,
    })
}

/// What a merge writes in `run_dir`.
fn merge_outputs(run_dir: &RunDir) -> [PathBuf; 4] {
    [
        run_dir.trajectories(),
        run_dir.failures(),
        run_dir.statistics(),
        run_dir.report(),
    ]
}

/// Removes `paths` (those that are there), then syncs, so that no run pays for another's
/// writeback.
fn remove_files(paths: &[PathBuf]) -> anyhow::Result<()> {
    for path in paths {
        match fs::remove_file(path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err.into()),
            _ => {}
        }
    }
    sync()?;
    Ok(())
}

/// Reads every batch file once, so that a merge finds them in the page cache.
fn warm_page_cache(run_dir: &RunDir) -> anyhow::Result<()> {
    run_timed(
        Command::new("sh")
            .arg("-c")
            .arg("cat batches/*/*.jsonl >/dev/null")
            .current_dir(run_dir.root()),
    )?;
    Ok(())
}

/// How big a generated run is.
#[derive(Debug, Clone, Copy)]
enum RunSize {
    Bytes(u64),
    Records(u64),
}

fn merge_bench(dir: &Path, knobs: &Knobs, cold: bool) -> anyhow::Result<()> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let templates = record_templates(&mut rng, 1);
    let MergeRun {
        location,
        batch_bytes,
        counts,
    } = generate_merge_run(dir, &mut rng, &templates, RunSize::Bytes(knobs.merge_bytes))?;
    let run_dir = location.run_dir();

    let cat_out = run_dir.root().join("cat.jsonl");
    let mut outputs = merge_outputs(&run_dir).to_vec();
    outputs.push(cat_out.clone());
    let clean = || remove_files(&outputs);
    let mut cat = Command::new("sh");
    cat.arg("-c")
        .arg("cat batches/*/*.jsonl > cat.jsonl")
        .current_dir(run_dir.root());
    let mut check = None;
    let mut measure = |times: &mut MergeTimes, cache_cold: bool| -> anyhow::Result<()> {
        for round in 0..knobs.repeats {
            for step in 0..3 {
                clean()?;
                if cache_cold {
                    drop_caches()?;
                } else {
                    warm_page_cache(&run_dir)?;
                }
                match (round + step) % 3 {
                    0 => {
                        let started = Instant::now();
                        let summary = merge::merge(&location)?;
                        times.merge.push(started.elapsed());
                        check = Some(summary);
                    }
                    1 => {
                        let started = Instant::now();
                        merge::merge_without_report(&location)?;
                        times.without_report.push(started.elapsed());
                    }
                    _ => {
                        let (elapsed, _) = run_timed(&mut cat)?;
                        let started = Instant::now();
                        File::open(&cat_out)?.sync_all()?;
                        times.cat.push(elapsed);
                        times.cat_fsync.push(elapsed + started.elapsed());
                        ensure!(
                            fs::metadata(&cat_out)?.len() == batch_bytes,
                            "cat wrote the wrong size"
                        );
                    }
                }
            }
        }
        Ok(())
    };
    let mut warm = MergeTimes::default();
    measure(&mut warm, false)?;
    let mut cold_times = MergeTimes::default();
    if cold {
        measure(&mut cold_times, true)?;
    }
    clean()?;
    let summary = check.context("merge never ran")?;
    ensure!(
        summary.trajectories == counts[0]
            && summary.discarded == counts[1]
            && summary.failed == counts[2]
            && summary.skipped_lines == 0,
        "merge kept the wrong records: {summary:?}"
    );

    print_merge_table(&warm, &cold_times);
    println!(
        "target: merge ÷ cat ≤ 2; median of {} runs each",
        knobs.repeats
    );
    // This run's report, as a user of a 1 GiB run opens it.
    merge::merge(&location)?;
    print_opening(&run_dir.report(), dir, knobs.repeats)
}

// ---------------------------------------------------------------------------------------------
// report

/// A run of `RUN_MODES_BENCH_REPORT_RECORDS` small records (the merge's shapes with texts an
/// eighth as long and a system prompt of one line, about 1.5 KB): what the report adds to its merge, the report's size, the time
/// `trajectory-worker report` takes to write it again, and how long Chromium takes to load and
/// draw it.
fn report_bench(dir: &Path, knobs: &Knobs) -> anyhow::Result<()> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut templates = record_templates(&mut rng, 8);
    for template in &mut templates {
        if let Some(Value::Array(turns)) = template.get_mut("conversations") {
            turns[0]["value"] = "You are a function calling AI model.".into();
        }
    }
    let MergeRun {
        location, counts, ..
    } = generate_merge_run(
        dir,
        &mut rng,
        &templates,
        RunSize::Records(knobs.report_records),
    )?;
    let run_dir = location.run_dir();
    let report = run_dir.report();
    let outputs = merge_outputs(&run_dir);
    let mut times = MergeTimes::default();
    for round in 0..knobs.repeats {
        for step in 0..2 {
            remove_files(&outputs)?;
            warm_page_cache(&run_dir)?;
            let started = Instant::now();
            let summary = if (round + step) % 2 == 0 {
                let summary = merge::merge(&location)?;
                times.merge.push(started.elapsed());
                summary
            } else {
                let summary = merge::merge_without_report(&location)?;
                times.without_report.push(started.elapsed());
                summary
            };
            ensure!(
                [summary.trajectories, summary.discarded, summary.failed] == counts,
                "merge kept the wrong records: {summary:?}"
            );
        }
    }
    print_report_cost(&times, &MergeTimes::default());

    // `trajectory-worker report`, the release binary: reads the outputs back and writes the page.
    let mut rewrites = Vec::new();
    for _ in 0..knobs.repeats {
        let (elapsed, _) = run_timed(Command::new(WORKER).arg("report").arg(run_dir.root()))?;
        rewrites.push(elapsed);
    }
    let size = fs::metadata(&report)?.len();
    println!(
        "\nreport.html of {} records: {:.2} MiB; `trajectory-worker report` {} s (runs {})",
        knobs.report_records,
        size as f64 / MIB as f64,
        seconds(median(&rewrites)),
        list(&rewrites)
    );

    print_opening(&report, dir, knobs.repeats)
}

/// The largest page a report can be: forty outcomes (failure classes) of long conversations, so
/// that the sample fills its whole budget ([`report::SAMPLE_BYTES`]); how long Chromium takes to
/// load and draw it.
fn largest_report_bench(dir: &Path, knobs: &Knobs) -> anyhow::Result<()> {
    let mut rng = Rng(0x6a09_e667_f3bc_c908);
    let mut collected = report::Collector::default();
    let classes: Vec<String> = (0..40).map(|class| format!("class_{class}")).collect();
    for prompt_index in 0..40 * report::PER_STRATUM as u64 {
        let class = &classes[usize::try_from(prompt_index % 40)?];
        let turns: Vec<Value> = (0..6)
            .map(|turn| {
                let from = ["human", "gpt", "tool"][turn % 3];
                json!({"from": from, "value": text(&mut rng, 3_000)})
            })
            .collect();
        let line = json!({
            "prompt_index": prompt_index, "sample": 0, "id": format!("r-{prompt_index}"),
            "status": "failed", "error_class": class, "error": text(&mut rng, 500),
            "conversations": turns,
        })
        .to_string();
        let facts = report::RecordFacts {
            prompt_index,
            sample: 0,
            outcome: report::Outcome::Failed { class },
            api_calls: 3,
            tokens: 2_000,
            duration_ms: 5_000,
            tool_calls: 2,
            tool_failures: 0,
        };
        collected.add(&facts, ["terminal"], line.as_bytes());
    }
    let page = dir.join("report.html");
    fs::write(
        &page,
        report::render(&json!({"run_name": "largest"}), collected),
    )?;
    println!("\n## the largest report");
    print_opening(&page, dir, knobs.repeats)
}

/// How long headless Chromium takes to load and draw `report` (median of `repeats`), against a
/// blank page.
fn print_opening(report: &Path, dir: &Path, repeats: usize) -> anyhow::Result<()> {
    let profile = tempfile::tempdir()?;
    let blank = dir.join("blank.html");
    fs::write(&blank, "<!doctype html><title>blank</title>")?;
    let mut opens = Vec::new();
    let mut blanks = Vec::new();
    for _ in 0..repeats {
        blanks.push(open_in_chromium(&blank, profile.path())?.0);
        opens.push(open_in_chromium(report, profile.path())?);
    }
    let drawn: Vec<Duration> = opens
        .iter()
        .map(|(_, drawn)| drawn.context("the report did not say when it was drawn"))
        .collect::<anyhow::Result<_>>()?;
    let process: Vec<Duration> = opens.iter().map(|(process, _)| *process).collect();
    println!(
        "Chromium: the report ({:.2} MiB) loaded, drawn and laid out **{} s** after navigation began \
         (runs {}); the whole headless process {} s against {} s for a blank page (runs {}; {})",
        fs::metadata(report)?.len() as f64 / MIB as f64,
        seconds(median(&drawn)),
        list(&drawn),
        seconds(median(&process)),
        seconds(median(&blanks)),
        list(&process),
        list(&blanks)
    );
    println!("target: the page opens in under 2 s");
    Ok(())
}

/// Loads `page` in headless Chromium (`--dump-dom`, which returns once the page has loaded);
/// returns how long the process ran and when the page says it was drawn (`data-drawn-ms`).
fn open_in_chromium(page: &Path, profile: &Path) -> anyhow::Result<(Duration, Option<Duration>)> {
    let started = Instant::now();
    let output = trajectory_testkit::chromium::headless(profile)
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .stderr(Stdio::null())
        .output()
        .with_context(|| {
            format!("cannot run {CHROMIUM}: scripts/browser/install.sh installs it")
        })?;
    let elapsed = started.elapsed();
    ensure!(
        output.status.success(),
        "chromium failed on {}",
        page.display()
    );
    let dom = String::from_utf8_lossy(&output.stdout);
    let drawn = dom
        .split_once("data-drawn-ms=\"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .and_then(|(ms, _)| ms.parse().ok())
        .map(Duration::from_millis);
    Ok((elapsed, drawn))
}

// ---------------------------------------------------------------------------------------------
// plan

/// A synthetic dataset of at least `target_bytes`, rows of about 1 kB; returns its bytes and rows.
fn write_plan_dataset(path: &Path, target_bytes: u64) -> anyhow::Result<(u64, u64)> {
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let mut dataset = BufWriter::new(File::create(path)?);
    let (mut bytes, mut rows) = (0u64, 0u64);
    while bytes < target_bytes {
        let length = 700 + rng.below(300);
        let row = json!({
            "id": format!("q-{rows:09}"),
            "source": "synthetic-coding",
            "difficulty": rng.below(5),
            "tags": ["python", "files", "debugging"],
            "prompt": text(&mut rng, length),
            "reference_answer": text(&mut rng, 100),
        });
        let line = serde_json::to_string(&row)?;
        dataset.write_all(line.as_bytes())?;
        dataset.write_all(b"\n")?;
        bytes += line.len() as u64 + 1;
        rows += 1;
    }
    dataset.into_inner()?.sync_all()?;
    Ok((bytes, rows))
}

fn plan_bench(dir: &Path, knobs: &Knobs, cold: bool) -> anyhow::Result<()> {
    fs::create_dir_all(dir.join("datasets"))?;
    let dataset_path = dir.join("datasets/prompts.jsonl");
    let generating = Instant::now();
    let (bytes, rows) = write_plan_dataset(&dataset_path, knobs.plan_bytes)?;
    write_plan_run_file(dir)?;
    println!(
        "\n## plan: dataset of {rows} rows, {:.0} MiB (mean {} bytes a row), batch size 10, generated in {:.0} s",
        bytes as f64 / MIB as f64,
        bytes / rows,
        generating.elapsed().as_secs_f64()
    );

    let mut wc = Command::new("/usr/bin/time");
    wc.args(["-v", "wc", "-l"]).arg(&dataset_path);
    let mut worker = Command::new("/usr/bin/time");
    worker
        .arg("-v")
        .arg(WORKER)
        .args(["--log-format", "json", "plan", "--run-file"])
        .arg(dir.join("run.yaml"))
        .arg("--storage-root")
        .arg(dir);
    let mut rss_kib = Vec::new();
    // CPU seconds (user + system) of each plan and each wc -l: what the run costs whatever else
    // the machine is doing.
    let (mut plan_cpu, mut wc_cpu) = (Vec::new(), Vec::new());
    let mut measure = |cache_cold: bool| -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
        let (mut plans, mut wcs) = (Vec::new(), Vec::new());
        for round in 0..knobs.repeats {
            for step in 0..2 {
                let plan_turn = (round + step) % 2 == 0;
                if plan_turn {
                    let _ = fs::remove_dir_all(dir.join("out"));
                }
                if cache_cold {
                    drop_caches()?;
                } else {
                    run_timed(&mut wc)?;
                    sync()?;
                }
                if plan_turn {
                    let (elapsed, stderr) = run_timed(&mut worker)?;
                    let rss = stderr
                        .lines()
                        .find_map(|line| {
                            line.trim()
                                .strip_prefix("Maximum resident set size (kbytes): ")
                        })
                        .context("no maximum resident set size from /usr/bin/time -v")?;
                    rss_kib.push(rss.trim().parse::<u64>()?);
                    plan_cpu.push(cpu_seconds(&stderr)?);
                    plans.push(elapsed);
                } else {
                    let (elapsed, stderr) = run_timed(&mut wc)?;
                    wc_cpu.push(cpu_seconds(&stderr)?);
                    wcs.push(elapsed);
                }
            }
        }
        Ok((plans, wcs))
    };
    let warm = measure(false)?;
    let cold_times = if cold { Some(measure(true)?) } else { None };
    let manifest: Value = serde_json::from_slice(&fs::read(dir.join("out/manifest.json"))?)?;
    ensure!(
        manifest["dataset"]["prompts"] == json!(rows),
        "plan counted the wrong prompts"
    );

    let (warm_plan, warm_wc) = (median(&warm.0), median(&warm.1));
    print_plan_table(warm, cold_times);
    println!(
        "plan peak RSS (/usr/bin/time -v, max over runs): **{:.1} MiB**; plan throughput warm {:.0} MiB/s",
        rss_kib.iter().copied().max().unwrap_or(0) as f64 / 1024.0,
        bytes as f64 / MIB as f64 / warm_plan.as_secs_f64()
    );
    let median_cpu = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "CPU seconds (user + system, median over all runs): plan {:.2}, wc -l {:.2}",
        median_cpu(&mut plan_cpu),
        median_cpu(&mut wc_cpu)
    );
    print_digest_floor(&dataset_path, knobs.repeats, warm_wc)?;
    println!("targets: plan ÷ wc -l ≤ 2, peak RSS < 50 MB");
    Ok(())
}

/// The plan table: median times of plan and `wc -l` with a warm page cache, and a cold one if
/// measured.
fn print_plan_table(
    warm: (Vec<Duration>, Vec<Duration>),
    cold: Option<(Vec<Duration>, Vec<Duration>)>,
) {
    println!("\n| page cache | plan s | wc -l s | plan ÷ wc -l | runs (plan; wc -l) |");
    println!("|---|---:|---:|---:|---|");
    for (label, times) in [("warm", Some(warm)), ("cold", cold)] {
        let Some((plans, wcs)) = times else { continue };
        let (p, w) = (median(&plans), median(&wcs));
        println!(
            "| {label} | {} | {} | **{:.2}** | {}; {} |",
            seconds(p),
            seconds(w),
            p.as_secs_f64() / w.as_secs_f64(),
            list(&plans),
            list(&wcs),
        );
    }
}

/// What any plan costs besides checking JSON ([`digest_floor`], median of `repeats` runs),
/// against `wc -l` with a warm page cache.
fn print_digest_floor(path: &Path, repeats: usize, warm_wc: Duration) -> anyhow::Result<()> {
    let floor = median(
        &(0..repeats)
            .map(|_| digest_floor(path))
            .collect::<std::io::Result<Vec<_>>>()?,
    );
    println!(
        "floor, warm: reading the file, BLAKE3 and the UTF-8 check alone (no JSON), one thread: {} s = \
         {:.2}× wc -l (even split over both cores: {:.2}×)",
        seconds(floor),
        floor.as_secs_f64() / warm_wc.as_secs_f64(),
        floor.as_secs_f64() / 2.0 / warm_wc.as_secs_f64(),
    );
    Ok(())
}

/// The work any plan does besides checking JSON, timed alone: read the file in the plan's block
/// size, hash it with BLAKE3 and check its UTF-8.
fn digest_floor(path: &Path) -> std::io::Result<Duration> {
    let start = Instant::now();
    let mut file = File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut valid = true;
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
        // Blocks may cut a character in two; only the time matters here.
        valid &= simdutf8::basic::from_utf8(&buffer[..read]).is_ok();
    }
    std::hint::black_box((hasher.finalize(), valid));
    Ok(start.elapsed())
}

/// User plus system seconds from the report of `/usr/bin/time -v`.
fn cpu_seconds(report: &str) -> anyhow::Result<f64> {
    let field = |name: &str| -> anyhow::Result<f64> {
        let value = report
            .lines()
            .find_map(|line| line.trim().strip_prefix(name))
            .with_context(|| format!("no {name:?} from /usr/bin/time -v"))?;
        Ok(value.trim().parse::<f64>()?)
    };
    Ok(field("User time (seconds): ")? + field("System time (seconds): ")?)
}

// ---------------------------------------------------------------------------------------------
// local: run_batch against the engine path

/// One measured path: completion times since its start.
#[derive(Debug)]
struct PathRun {
    /// When each conversation finished (engine) or each record was seen on disk (batch).
    completions: Vec<Duration>,
    /// Start to end (the last completion; for the batch, its `.done` marker).
    elapsed: Duration,
    cpu: Duration,
}

impl PathRun {
    fn whole_rate(&self) -> f64 {
        self.completions.len() as f64 / self.elapsed.as_secs_f64()
    }

    /// Completions per second between the 2·C-th and the (N − C)-th.
    fn window_rate(&self, concurrency: usize) -> Option<f64> {
        let (first, last) = (
            2 * concurrency,
            self.completions.len().checked_sub(concurrency)?,
        );
        (last > first + concurrency).then(|| {
            (last - first) as f64
                / self.completions[last - 1]
                    .saturating_sub(self.completions[first - 1])
                    .as_secs_f64()
        })
    }
}

/// The local table: each round's rates of the four paths (A, B: the engine; C, D: the batch),
/// D against the others, and the client's CPU per conversation; then the median ratios.
fn print_local_rounds(rounds: &[Vec<PathRun>], concurrency: usize) {
    println!(
        "| round | A: engine, spawned tasks (conv/s) | B: engine, one task (conv/s) | C: batch, conversations finished/s | D: batch, records on disk/s | D ÷ A | D ÷ B | D ÷ C | client CPU ms per conversation: A; B; D |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut ratios = vec![Vec::new(); 6];
    for (index, round) in rounds.iter().enumerate() {
        let rate = |run: &PathRun| {
            let window = run
                .window_rate(concurrency)
                .map_or_else(String::new, |rate| format!(" ({rate:.0})"));
            format!("{:.0}{window}", run.whole_rate())
        };
        let mut line = format!("| {} |", index + 1);
        for run in round {
            let _ = write!(line, " {} |", rate(run));
        }
        for (slot, base) in [0, 1, 2].into_iter().enumerate() {
            let whole = round[3].whole_rate() / round[base].whole_rate();
            ratios[slot].push(whole);
            let window = match (
                round[3].window_rate(concurrency),
                round[base].window_rate(concurrency),
            ) {
                (Some(disk), Some(other)) => {
                    ratios[slot + 3].push(disk / other);
                    format!(" ({:.3})", disk / other)
                }
                _ => String::new(),
            };
            let _ = write!(line, " **{whole:.3}**{window} |");
        }
        let per = |run: &PathRun| run.cpu.as_secs_f64() * 1000.0 / run.completions.len() as f64;
        let _ = write!(
            line,
            " {:.3}; {:.3}; {:.3} |",
            per(&round[0]),
            per(&round[1]),
            per(&round[3])
        );
        println!("{line}");
    }
    let middle = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied()
    };
    let show = |value: Option<f64>| value.map_or_else(|| "–".into(), |ratio| format!("{ratio:.3}"));
    println!(
        "median D ÷ A (records on disk ÷ the engine's own figure): whole run **{}**, steady window **{}**; \
         D ÷ B: {} ({}); D ÷ C: {} ({}); target D ÷ A ≥ 0.95",
        show(middle(&mut ratios[0])),
        show(middle(&mut ratios[3])),
        show(middle(&mut ratios[1])),
        show(middle(&mut ratios[4])),
        show(middle(&mut ratios[2])),
        show(middle(&mut ratios[5])),
    );
}

fn local_bench(dir: &Path, knobs: &Knobs) -> anyhow::Result<()> {
    let (concurrency, prompts) = (knobs.concurrency, knobs.prompts);
    ensure!(
        concurrency >= 1 && prompts >= concurrency,
        "needs PROMPTS >= CONCURRENCY >= 1"
    );
    raise_open_files_limit(u64::try_from(concurrency)? * 2 + 100)?;
    fs::create_dir_all(dir.join("datasets"))?;
    let texts: Vec<String> = (0..prompts)
        .map(|index| format!("Benchmark prompt {index}: read the file, then answer."))
        .collect();
    let mut dataset = BufWriter::new(File::create(dir.join("datasets/prompts.jsonl"))?);
    for (index, text) in texts.iter().enumerate() {
        writeln!(dataset, "{}", json!({"prompt": text, "id": index}))?;
    }
    dataset.flush()?;

    let (mut server, base_url) = start_server_process(&[(SERVER_ENV, "1")])?;

    let location = write_run_file(
        dir,
        &json!({
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": prompts,
            "workers": 1,
            "concurrency": concurrency,
            "distribution": {"file": 100},
            "model": {"baseUrl": base_url, "name": MODEL, "maxAttempts": 3, "requestTimeoutSeconds": 60},
            "agent": {"maxTurns": 10, "promptTimeoutSeconds": 120},
            "storage": {"outputPath": "out"},
        }),
    )?;
    let (manifest, _) = plan::plan(&location)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut engine =
        runtime.block_on(async { Engine::new(&location.plan.spec, dir.join("workspaces")) })?;
    engine.sandbox = Sandbox::local(LandlockMode::Auto);
    let engine = Arc::new(engine);
    let texts = Arc::new(texts);
    let mut rounds = Vec::new();
    for _ in 0..knobs.repeats {
        let mut round = Vec::new();
        for drive in [Drive::Spawned, Drive::OneTask] {
            round.push(runtime.block_on(engine_path(
                Arc::clone(&engine),
                Arc::clone(&texts),
                concurrency,
                &dir.join("engine-workspace"),
                drive,
            ))?);
        }
        let _ = fs::remove_dir_all(location.run_dir().batches_dir());
        let (finished, on_disk) = batch_path(&runtime, &engine, &location, &manifest, prompts)?;
        round.extend([finished, on_disk]);
        rounds.push(round);
    }
    drop(runtime);
    drop(server.stdin.take());
    server.wait()?;

    let ideal = concurrency as f64 / (2.0 * knobs.latency.as_secs_f64());
    println!(
        "\n## local: one batch of {prompts} prompts, concurrency {concurrency}, latency {} ms × 2 calls \
         (ideal {ideal:.0}/s); tool call: read_file of a missing file",
        knobs.latency.as_millis()
    );
    println!(
        "\nPer second over the whole run (in brackets: over the steady window from the {}-th to the {}-th):\n",
        2 * concurrency,
        prompts.saturating_sub(concurrency)
    );
    print_local_rounds(&rounds, concurrency);
    Ok(())
}

/// How the engine path drives its conversations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drive {
    /// Each conversation a spawned task (as the engine benchmark does).
    Spawned,
    /// All of them polled by one task through `buffer_unordered` (as `run_batch` does).
    OneTask,
}

/// The engine's own figure: `run_conversation` with the batch engine's client, tools and agent
/// settings, `concurrency` conversations in flight, all started at once.
async fn engine_path(
    engine: Arc<Engine>,
    texts: Arc<Vec<String>>,
    concurrency: usize,
    workspace: &Path,
    drive: Drive,
) -> anyhow::Result<PathRun> {
    fs::create_dir_all(workspace)?;
    let tools: Arc<Vec<Arc<dyn Tool>>> = Arc::new(engine.registry.tools_for(&["file".to_owned()]));
    let context = Arc::new(ToolContext {
        workspace: Workspace::new(workspace)?,
        limits: engine.limits.clone(),
        sandbox: Sandbox::local(LandlockMode::Auto),
        browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    });
    let completions = Arc::new(Mutex::new(Vec::with_capacity(texts.len())));
    let failed = Arc::new(AtomicBool::new(false));
    let permits = Arc::new(Semaphore::new(concurrency));
    let cpu_before = common::cpu_time()?;
    let started = Instant::now();
    if drive == Drive::OneTask {
        let mut finished = futures::stream::iter(0..texts.len())
            .map(|index| {
                run_conversation(
                    &engine.client,
                    &tools,
                    &context,
                    &texts[index],
                    &engine.agent,
                )
            })
            .buffer_unordered(concurrency);
        let mut times = Vec::with_capacity(texts.len());
        while let Some(result) = finished.next().await {
            ensure!(
                result.is_ok_and(|conversation| conversation.completed),
                "an engine-path conversation failed"
            );
            times.push(started.elapsed());
        }
        return Ok(PathRun {
            elapsed: times.last().copied().unwrap_or_default(),
            completions: times,
            cpu: common::cpu_time()?.saturating_sub(cpu_before),
        });
    }
    for index in 0..texts.len() {
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let (engine, texts, tools, context) = (
            Arc::clone(&engine),
            Arc::clone(&texts),
            Arc::clone(&tools),
            Arc::clone(&context),
        );
        let (completions, failed) = (Arc::clone(&completions), Arc::clone(&failed));
        tokio::spawn(async move {
            let result = run_conversation(
                &engine.client,
                &tools,
                &context,
                &texts[index],
                &engine.agent,
            )
            .await;
            match result {
                Ok(conversation) if conversation.completed => completions
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(started.elapsed()),
                _ => failed.store(true, Ordering::SeqCst),
            }
            drop(permit);
        });
    }
    let _all = permits.acquire_many(u32::try_from(concurrency)?).await?;
    let cpu = common::cpu_time()?.saturating_sub(cpu_before);
    ensure!(
        !failed.load(Ordering::SeqCst),
        "an engine-path conversation failed"
    );
    let completions =
        std::mem::take(&mut *completions.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(PathRun {
        elapsed: completions.last().copied().unwrap_or_default(),
        completions,
        cpu,
    })
}

/// `run_batch` on batch 0: when each conversation finished (its progress callback), and when each
/// record reached the file (a watcher thread tails it; the whole run ends with the `.done`
/// marker). The CPU time includes the watcher's, which is small.
fn batch_path(
    runtime: &tokio::runtime::Runtime,
    engine: &Engine,
    location: &RunLocation,
    manifest: &trajectory_worker::run::manifest::Manifest,
    prompts: usize,
) -> anyhow::Result<(PathRun, PathRun)> {
    let run_dir = location.run_dir();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let watcher = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || tail_lines(&run_dir, &stop, started))
    };
    let (_trigger, shutdown) = shutdown_channel();
    let finished = Mutex::new(Vec::with_capacity(prompts));
    let progress = |_| {
        finished
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(started.elapsed());
    };
    let cpu_before = common::cpu_time()?;
    let summary = runtime.block_on(run_batch(
        engine, location, manifest, 0, &shutdown, &progress,
    ))?;
    let elapsed = started.elapsed();
    let cpu = common::cpu_time()?.saturating_sub(cpu_before);
    stop.store(true, Ordering::SeqCst);
    let on_disk = watcher
        .join()
        .map_err(|_| anyhow::anyhow!("the watcher panicked"))??;
    ensure!(
        summary.succeeded == prompts as u64 && on_disk.len() == prompts,
        "the batch recorded {summary:?}, {} lines seen",
        on_disk.len()
    );
    let finished = finished
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    Ok((
        PathRun {
            elapsed: finished.last().copied().unwrap_or_default(),
            completions: finished,
            cpu,
        },
        PathRun {
            completions: on_disk,
            elapsed,
            cpu,
        },
    ))
}

/// Follows batch 0's records file (once its writer has created it), noting the time each line was
/// first seen, until told to stop.
fn tail_lines(
    run_dir: &RunDir,
    stop: &AtomicBool,
    started: Instant,
) -> anyhow::Result<Vec<Duration>> {
    let mut seen = Vec::new();
    let mut file = None;
    let mut offset = 0u64;
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let stopping = stop.load(Ordering::SeqCst);
        // The batch's one writer names its file when it starts.
        if file.is_none()
            && let Some(records) = run_dir.records_files(0)?.first()
        {
            file = File::open(&records.records).ok();
        }
        if let Some(file) = file.as_mut() {
            file.seek(SeekFrom::Start(offset))?;
            loop {
                let read = file.read(&mut buffer)?;
                if read == 0 {
                    break;
                }
                offset += read as u64;
                let now = started.elapsed();
                let lines = memchr::memchr_iter(b'\n', &buffer[..read]).count();
                seen.extend(std::iter::repeat_n(now, lines));
            }
        }
        if stopping {
            return Ok(seen);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ---------------------------------------------------------------------------------------------
// object: plan and merge on a bucket, and the requests a run makes

/// A command of the worker, or of the AWS CLI, reaching `server` with its keys.
fn against(server: &Versitygw, program: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .envs(server.credentials())
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .stdin(Stdio::null());
    command
}

fn worker_on(server: &Versitygw, endpoint: &str, args: &[&str]) -> Command {
    let mut command = against(server, Path::new(WORKER));
    command.args(["--log-format", "json"]).args(args).args([
        "--s3-endpoint",
        endpoint,
        "--s3-path-style",
    ]);
    command
}

fn aws_s3(server: &Versitygw, aws: &Path, args: &[&str]) -> Command {
    let mut command = against(server, aws);
    command
        .args([
            "--endpoint-url",
            &server.endpoint,
            "s3",
            "cp",
            "--only-show-errors",
        ])
        .args(args);
    command
}

/// Medians of `repeats` alternating runs of `ours` and `theirs` (each after `before`).
fn alternate(
    repeats: usize,
    mut before: impl FnMut() -> anyhow::Result<()>,
    mut ours: impl FnMut() -> anyhow::Result<Duration>,
    mut theirs: impl FnMut() -> anyhow::Result<Duration>,
) -> anyhow::Result<(Duration, Duration)> {
    let (mut our_times, mut their_times) = (Vec::new(), Vec::new());
    for round in 0..repeats {
        for step in 0..2 {
            before()?;
            if (round + step) % 2 == 0 {
                our_times.push(ours()?);
            } else {
                their_times.push(theirs()?);
            }
        }
    }
    println!("  ours {}; aws {}", list(&our_times), list(&their_times));
    Ok((median(&our_times), median(&their_times)))
}

fn object_bench(knobs: &Knobs) -> anyhow::Result<()> {
    let aws = PathBuf::from(
        String::from_utf8(
            Command::new(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../scripts/awscli/install.sh"
            ))
            .arg("--print-path")
            .output()?
            .stdout,
        )?
        .trim(),
    );
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket("bench");
    let bucket = server.bucket_dir("bench");
    println!(
        "\n## object storage: versitygw {} (POSIX backend under {})",
        server.endpoint,
        bucket.display()
    );
    object_plan(&server, &aws, knobs)?;
    object_merge(&server, &aws, knobs)?;
    object_requests(&server, knobs)
}

/// The plan of a dataset in the bucket against downloading it.
fn object_plan(server: &Versitygw, aws: &Path, knobs: &Knobs) -> anyhow::Result<()> {
    let dir = server.bucket_dir("bench").join("plan");
    fs::create_dir_all(dir.join("datasets"))?;
    let (bytes, rows) = write_plan_dataset(&dir.join("datasets/prompts.jsonl"), knobs.plan_bytes)?;
    write_plan_run_file(&dir)?;
    let run_file = dir.join("run.yaml");
    let run_file = run_file.to_str().context("a UTF-8 path")?;
    println!(
        "\nplan: {rows} rows, {:.0} MiB in the bucket",
        bytes as f64 / MIB as f64
    );
    let (plan, download) = alternate(
        knobs.repeats,
        || {
            let _ = fs::remove_dir_all(dir.join("out"));
            Ok(())
        },
        || {
            run_timed(&mut worker_on(
                server,
                &server.endpoint,
                &[
                    "plan",
                    "--run-file",
                    run_file,
                    "--storage-root",
                    "s3://bench/plan",
                ],
            ))
            .map(|(elapsed, _)| elapsed)
        },
        || {
            run_timed(&mut aws_s3(
                server,
                aws,
                &["s3://bench/plan/datasets/prompts.jsonl", "-"],
            ))
            .map(|(elapsed, _)| elapsed)
        },
    )?;
    println!(
        "plan on the bucket {}, aws s3 cp (download) {}: **{:.2}x**",
        seconds(plan),
        seconds(download),
        plan.as_secs_f64() / download.as_secs_f64()
    );
    fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The merge of the batches in the bucket against downloading them and uploading as much.
fn object_merge(server: &Versitygw, aws: &Path, knobs: &Knobs) -> anyhow::Result<()> {
    let bucket = server.bucket_dir("bench");
    let dir = bucket.join("merge");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let templates = record_templates(&mut rng, 1);
    let MergeRun {
        location,
        batch_bytes,
        ..
    } = generate_merge_run(
        &dir,
        &mut rng,
        &templates,
        RunSize::Bytes(knobs.merge_bytes),
    )?;
    let run_dir = location.run_dir();
    let outputs = merge_outputs(&run_dir);
    let run_file = dir.join("run.yaml");
    let run_file = run_file.to_str().context("a UTF-8 path")?;
    let scratch = tempfile::tempdir_in(&knobs.dir)?;
    let upload = scratch.path().join("upload.jsonl");
    {
        // One file of the batches' size, for the upload.
        let mut file = BufWriter::new(File::create(&upload)?);
        let chunk = vec![b'x'; 1 << 20];
        let mut left = batch_bytes;
        while left > 0 {
            let size = usize::try_from(left.min(1 << 20))?;
            file.write_all(&chunk[..size])?;
            left -= size as u64;
        }
        file.into_inner()?.sync_all()?;
    }
    let download_dir = scratch.path().join("download");
    let (merge, copy) = alternate(
        knobs.repeats,
        || {
            remove_files(&outputs)?;
            let _ = fs::remove_dir_all(&download_dir);
            let _ = fs::remove_dir_all(bucket.join("copy"));
            Ok(())
        },
        || {
            run_timed(&mut worker_on(
                server,
                &server.endpoint,
                &[
                    "merge",
                    "--run-file",
                    run_file,
                    "--storage-root",
                    "s3://bench/merge",
                ],
            ))
            .map(|(elapsed, _)| elapsed)
        },
        || {
            let started = Instant::now();
            let target = download_dir.to_str().context("a UTF-8 path")?;
            run_timed(&mut aws_s3(
                server,
                aws,
                &["--recursive", "s3://bench/merge/out/batches/", target],
            ))?;
            let file = upload.to_str().context("a UTF-8 path")?;
            run_timed(&mut aws_s3(
                server,
                aws,
                &[file, "s3://bench/copy/upload.jsonl"],
            ))?;
            Ok(started.elapsed())
        },
    )?;
    println!(
        "merge of {:.0} MiB on the bucket {}, aws s3 cp (download the batches, upload as much) {}: **{:.2}x**",
        batch_bytes as f64 / MIB as f64,
        seconds(merge),
        seconds(copy),
        merge.as_secs_f64() / copy.as_secs_f64()
    );
    fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The S3 requests of a `local` run of `knobs.prompts` prompts (at most 1,000 per batch size)
/// through a counting proxy, per 1,000 trajectories.
fn object_requests(server: &Versitygw, knobs: &Knobs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let proxy = runtime.block_on(FaultProxy::start(&server.endpoint));
    let (mut model, base_url) = start_server_process(&[(SERVER_ENV, "1")])?;
    let prompts = knobs.prompts.min(1_000);
    let executor = common::executor("RUN_MODES_BENCH_EXECUTOR")?;
    let executor = executor.to_str().context("a UTF-8 path")?;
    println!("\nS3 requests of a local run of {prompts} prompts, per 1,000 trajectories:");
    println!("| batch size | list | get | head | put | delete | all |");
    println!("|---|---|---|---|---|---|---|");
    for batch_size in [10, 100] {
        let dir = server
            .bucket_dir("bench")
            .join(format!("requests-{batch_size}"));
        fs::create_dir_all(dir.join("datasets"))?;
        let mut dataset = String::new();
        for index in 0..prompts {
            dataset.push_str(&json!({"prompt": format!("Task {index}")}).to_string());
            dataset.push('\n');
        }
        fs::write(dir.join("datasets/prompts.jsonl"), dataset)?;
        write_run_file(
            &dir,
            &json!({
                "dataset": {"path": "datasets/prompts.jsonl"},
                "batchSize": batch_size,
                "workers": 4,
                "concurrency": 16,
                "distribution": {"file": 100},
                "model": {"baseUrl": base_url, "name": MODEL},
                "storage": {"outputPath": "out"},
            }),
        )?;
        let before = proxy.counts();
        let storage = format!("s3://bench/requests-{batch_size}");
        let run_file = dir.join("run.yaml");
        let run_file = run_file.to_str().context("a UTF-8 path")?;
        let workspaces = tempfile::tempdir_in(&knobs.dir)?;
        let workspace_root = workspaces.path().to_str().context("a UTF-8 path")?;
        run_timed(&mut worker_on(
            server,
            &proxy.endpoint,
            &[
                "local",
                run_file,
                "--storage",
                &storage,
                "--no-progress-bar",
                "--workspace-root",
                workspace_root,
                "--executor",
                executor,
            ],
        ))?;
        let after = proxy.counts();
        let count = |kind: Kind| {
            let made =
                after.get(&kind).copied().unwrap_or(0) - before.get(&kind).copied().unwrap_or(0);
            made as f64 * 1000.0 / prompts as f64
        };
        let kinds = [Kind::List, Kind::Get, Kind::Head, Kind::Put, Kind::Delete];
        let all: f64 = kinds.iter().map(|kind| count(*kind)).sum();
        println!(
            "| {batch_size} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {all:.0} |",
            count(Kind::List),
            count(Kind::Get),
            count(Kind::Head),
            count(Kind::Put),
            count(Kind::Delete)
        );
    }
    drop(model.stdin.take());
    let _ = model.wait();
    Ok(())
}

//! The sandboxed terminal path (issue 13): `trajectory-worker local` as a whole process, whose
//! scripted model calls `terminal` with `true` once per conversation, against a fixed-latency
//! server.
//!
//! ```text
//! cargo build --release -p trajectory-sandbox     # the executor: this bench does not build it
//! cargo bench -p trajectory-worker --bench sandboxed_terminal
//! ```
//!
//! Every terminal command runs under `trajectory-executor run` (Landlock `auto`, which this bench
//! checks is enforced; no capabilities, `no_new_privs`, a child subreaper, a cleared
//! environment), so each conversation costs the worker one executor and one `bash -c true`. The
//! executor is the release `trajectory-executor` next to the release `trajectory-worker` (cargo's
//! `target/release/`); a bench of the worker package does not build it, and **the bench fails if
//! it is missing** rather than measure something else.
//!
//! For each C (in flight; `concurrency: C`, one batch, one worker), the run has 7·C prompts. The
//! scripted server (this bench re-executed, so its CPU is not the client's) answers every call
//! after the latency; a conversation's first call gets the tool call and its second the final
//! answer, so the ideal is C ÷ (2 × latency) conversations per second. A thread tails the batch's
//! records file and samples `/proc/<worker>/stat` whenever records appear; the figures are over
//! the steady window from the 2·C-th to the 6·C-th record (4·C conversations: neither the start,
//! the plan and the first lockstep rounds, nor the drain and the merge):
//!
//! - **throughput ratio**: records per second in the window ÷ C ÷ (2 × latency); target ≥ 0.95;
//! - **client CPU per conversation**: in the window, the worker's own user + system time plus that
//!   of its reaped children (each executor, with the `bash` it reaped), from the worker's
//!   `utime + stime + cutime + cstime`, ÷ records; the whole run's figure comes from
//!   `getrusage(RUSAGE_CHILDREN)` around the wait for the worker (plan, start-up and merge
//!   included);
//! - **the command's own cost**: in the same run, before and after each worker run, this bench
//!   spawns `bash -c true` 500 times the way the executor spawns it (cleared environment with
//!   `PATH`, `HOME`, `TMPDIR`, `TERM`; in a workspace; output on a pipe), one at a time, and takes
//!   the mean child CPU (`RUSAGE_CHILDREN`) per spawn. **Beyond the command's own** = client CPU
//!   per conversation − that mean; target ≤ 0.001 s.
//!
//! With `TERMINAL_BENCH_BASELINE=1` (the default) each C is also run with the `file` toolset's
//! `read_file` of a missing file instead (no process spawned), the engine benchmark's kind of
//! tool, for comparison.
//!
//! Knobs (environment): `TERMINAL_BENCH_CONCURRENCY` (`256,1000`), `TERMINAL_BENCH_LATENCY_MS`
//! (1000), `TERMINAL_BENCH_ROUNDS` (7, prompts per C), `TERMINAL_BENCH_BASELINE` (1),
//! `TERMINAL_BENCH_KEEP` (0; 1 keeps each run's directory), `TERMINAL_BENCH_DIR` (the system temp
//! dir), `TERMINAL_BENCH_EXECUTOR` (another executor binary, e.g. the static one that
//! `scripts/images/build.sh` builds for pods).

mod common;

use std::fs::{self, File};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{env_number, load_average, raise_open_files_limit, start_server_process};
use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::time::{TimeVal, TimeValLike};
use serde_json::json;
use trajectory_testkit::scripted_server::{MODEL, tool_call_reply};
use trajectory_worker::run::{RunFile, RunLocation};
use trajectory_worker::storage::RunDir;
use trajectory_worker::tools::sandbox::EXECUTOR_BINARY;

const SERVER_ENV: &str = "TERMINAL_BENCH_SERVER";
const TOOL_ENV: &str = "TERMINAL_BENCH_SERVER_TOOL";
const WORKER: &str = env!("CARGO_BIN_EXE_trajectory-worker");
/// Spawns of `bash -c true` per measurement of the command's own cost.
const OWN_COST_SPAWNS: u32 = 500;

#[derive(Debug)]
struct Knobs {
    concurrencies: Vec<usize>,
    latency: Duration,
    rounds: usize,
    baseline: bool,
    keep: bool,
    dir: PathBuf,
}

impl Knobs {
    fn from_env() -> anyhow::Result<Self> {
        let concurrencies = std::env::var("TERMINAL_BENCH_CONCURRENCY")
            .unwrap_or_else(|_| "256,1000".into())
            .split(',')
            .map(|text| text.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .context("TERMINAL_BENCH_CONCURRENCY must be numbers separated by commas")?;
        let rounds = usize::try_from(env_number("TERMINAL_BENCH_ROUNDS", 7)?)?;
        ensure!(rounds >= 4, "TERMINAL_BENCH_ROUNDS must be at least 4");
        ensure!(
            concurrencies.iter().all(|&c| c >= 1),
            "every concurrency must be at least 1"
        );
        Ok(Self {
            concurrencies,
            latency: Duration::from_millis(env_number("TERMINAL_BENCH_LATENCY_MS", 1000)?),
            rounds,
            baseline: env_number("TERMINAL_BENCH_BASELINE", 1)? != 0,
            keep: env_number("TERMINAL_BENCH_KEEP", 0)? != 0,
            dir: std::env::var_os("TERMINAL_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into),
        })
    }
}

/// What the scripted model's tool call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    /// `terminal` with `true`: one executor and one `bash` per conversation.
    Terminal,
    /// `read_file` of a missing file: no process spawned (the engine benchmark's kind of tool).
    ReadFile,
}

impl Tool {
    fn name(self) -> &'static str {
        match self {
            Self::Terminal => "terminal",
            Self::ReadFile => "read_file",
        }
    }

    fn toolset(self) -> &'static str {
        match self {
            Self::Terminal => "terminal",
            Self::ReadFile => "file",
        }
    }

    fn call(self) -> serde_json::Value {
        match self {
            Self::Terminal => tool_call_reply("terminal", &json!({"command": "true"})),
            Self::ReadFile => tool_call_reply("read_file", &json!({"path": "missing.txt"})),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let knobs = Knobs::from_env()?;
    if std::env::var_os(SERVER_ENV).is_some() {
        let tool = match std::env::var(TOOL_ENV).as_deref() {
            Ok("read_file") => Tool::ReadFile,
            _ => Tool::Terminal,
        };
        return common::serve(knobs.latency, tool.call());
    }
    let executor = executor()?;
    // Per conversation: its connection, the output pipe and the executor's pidfd, with room.
    let most = knobs.concurrencies.iter().copied().max().unwrap_or(1);
    raise_open_files_limit(u64::try_from(most)? * 4 + 100)?;
    fs::create_dir_all(&knobs.dir)?;
    let root = tempfile::Builder::new()
        .prefix("terminal-bench-")
        .tempdir_in(&knobs.dir)
        .with_context(|| format!("cannot create a temp dir in {}", knobs.dir.display()))?;
    let probe = root.path().join("probe");
    fs::create_dir_all(&probe)?;
    ensure!(
        trajectory_sandbox::run::landlock_enforced(&executor, &probe)?,
        "Landlock is not enforced on this kernel: the bench measures the confined path only"
    );
    println!(
        "# sandboxed terminal benchmark: {} CPUs, executor {}, Landlock enforced, latency {} ms, load average at start {}",
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        executor.display(),
        knobs.latency.as_millis(),
        load_average()
    );
    let mut rows = Vec::new();
    for &concurrency in &knobs.concurrencies {
        let mut tools = vec![Tool::Terminal];
        if knobs.baseline {
            tools.push(Tool::ReadFile);
        }
        for tool in tools {
            let dir = root.path().join(format!("{}-c{concurrency}", tool.name()));
            let before = own_cost(&probe)?;
            let run = run_local(&dir, &executor, &knobs, concurrency, tool)?;
            let after = own_cost(&probe)?;
            rows.push((tool, concurrency, run, f64::midpoint(before, after)));
            if !knobs.keep {
                fs::remove_dir_all(&dir)?;
            }
        }
    }
    print_table(&rows, knobs.latency);
    println!("\nload average at end {}", load_average());
    if knobs.keep {
        println!("runs kept in {}", root.keep().display());
    }
    Ok(())
}

/// The release executor next to the release worker (or `TERMINAL_BENCH_EXECUTOR`); a missing one
/// fails the bench.
fn executor() -> anyhow::Result<PathBuf> {
    let executor = std::env::var_os("TERMINAL_BENCH_EXECUTOR").map_or_else(
        || Path::new(WORKER).with_file_name(EXECUTOR_BINARY),
        PathBuf::from,
    );
    if !executor.is_file() {
        bail!(
            "{} is missing: build it first with `cargo build --release -p trajectory-sandbox` \
             (a bench of the worker package does not build the executor)",
            executor.display()
        );
    }
    Ok(executor)
}

/// One `trajectory-worker local` run's figures.
#[derive(Debug)]
struct LocalRun {
    prompts: usize,
    /// Records per second in the steady window.
    window_rate: f64,
    /// Records ÷ the worker's whole life.
    whole_rate: f64,
    /// Per record in the window: the worker's own CPU, and its reaped children's.
    window_self: f64,
    window_children: f64,
    /// Per record over the whole run (`RUSAGE_CHILDREN` around the wait).
    whole_cpu: f64,
}

fn run_local(
    dir: &Path,
    executor: &Path,
    knobs: &Knobs,
    concurrency: usize,
    tool: Tool,
) -> anyhow::Result<LocalRun> {
    let prompts = concurrency * knobs.rounds;
    fs::create_dir_all(dir.join("datasets"))?;
    let mut dataset = BufWriter::new(File::create(dir.join("datasets/prompts.jsonl"))?);
    for index in 0..prompts {
        writeln!(
            dataset,
            "{}",
            json!({"prompt": format!("Benchmark prompt {index}: run a command, then answer."), "id": index})
        )?;
    }
    dataset.flush()?;
    let (mut server, base_url) =
        start_server_process(&[(SERVER_ENV, "1"), (TOOL_ENV, tool.name())])?;
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "terminal-bench"},
        "spec": {
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": prompts,
            "workers": 1,
            "concurrency": concurrency,
            "distribution": {tool.toolset(): 100},
            "model": {"baseUrl": base_url, "name": MODEL, "maxAttempts": 3, "requestTimeoutSeconds": 120},
            "agent": {"maxTurns": 10, "promptTimeoutSeconds": 600},
            "sandbox": {"landlock": "auto"},
            "storage": {"outputPath": "out"},
        },
    });
    // JSON is YAML.
    fs::write(dir.join("run.yaml"), serde_json::to_vec_pretty(&file)?)?;
    let location = RunLocation {
        storage_root: dir.to_path_buf(),
        plan: RunFile::load(&dir.join("run.yaml"))?.to_plan(),
    };

    let children_before = children_cpu()?;
    let started = Instant::now();
    let mut worker = Command::new(WORKER)
        .arg("local")
        .arg(dir.join("run.yaml"))
        .arg("--workspace-root")
        .arg(dir.join("workspaces"))
        .arg("--executor")
        .arg(executor)
        .arg("--no-progress-bar")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(File::create(dir.join("worker.log"))?)
        .spawn()
        .context("cannot start trajectory-worker local")?;
    let pid = worker.id();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (stop, run_dir) = (Arc::clone(&stop), location.run_dir());
        std::thread::spawn(move || tail(&run_dir, pid, &stop, started))
    };
    let status = worker.wait()?;
    let elapsed = started.elapsed();
    let whole_cpu = children_cpu()?.saturating_sub(children_before);
    stop.store(true, Ordering::SeqCst);
    let samples = watcher
        .join()
        .map_err(|_| anyhow::anyhow!("the watcher panicked"))??;
    drop(server.stdin.take());
    server.wait()?;
    let log = fs::read_to_string(dir.join("worker.log")).unwrap_or_default();
    ensure!(
        status.success(),
        "trajectory-worker local failed: {status}\n{log}"
    );
    check_records(&location.run_dir(), prompts, tool)?;

    let at = |count: usize| {
        samples
            .iter()
            .find(|sample| sample.records >= count)
            .with_context(|| format!("the watcher never saw {count} records"))
    };
    let (first, last) = (at(2 * concurrency)?, at(prompts - concurrency)?);
    let records = (last.records - first.records) as f64;
    ensure!(records > 0.0, "no records in the steady window");
    let ticks = |value: u64| value as f64 / clock_ticks();
    Ok(LocalRun {
        prompts,
        window_rate: records / last.time.saturating_sub(first.time).as_secs_f64(),
        whole_rate: prompts as f64 / elapsed.as_secs_f64(),
        window_self: ticks(last.own - first.own) / records,
        window_children: ticks(last.children - first.children) / records,
        whole_cpu: whole_cpu.as_secs_f64() / prompts as f64,
    })
}

/// Every prompt has a record, and (for the terminal) every record ran `true` to exit code 0.
fn check_records(run_dir: &RunDir, prompts: usize, tool: Tool) -> anyhow::Result<()> {
    let text = fs::read_to_string(run_dir.trajectories())?;
    let lines = text.lines().count();
    ensure!(
        lines == prompts,
        "{lines} trajectories for {prompts} prompts"
    );
    if tool == Tool::Terminal {
        // The tool result is JSON inside the record's JSON string.
        let ran = text.matches(r#"\"exit_code\": 0"#).count();
        let first = text.lines().next().unwrap_or_default();
        ensure!(
            ran == prompts,
            "{ran} of {prompts} terminal calls exited 0; the first record's tool turn: {}",
            first
                .find("tool_response")
                .map_or(first, |at| &first[at..first.len().min(at + 400)])
        );
    }
    Ok(())
}

/// What the watcher saw at one moment: records on disk, and the worker's CPU clock ticks (its own,
/// and its reaped children's).
#[derive(Debug, Clone, Copy)]
struct Sample {
    time: Duration,
    records: usize,
    own: u64,
    children: u64,
}

/// Follows batch 0's records files and samples `/proc/<pid>/stat` whenever new records appear,
/// until told to stop.
fn tail(
    run_dir: &RunDir,
    pid: u32,
    stop: &AtomicBool,
    started: Instant,
) -> anyhow::Result<Vec<Sample>> {
    let mut samples = Vec::new();
    let mut file = None;
    let (mut offset, mut records) = (0u64, 0usize);
    let mut buffer = vec![0u8; 1 << 20];
    let stat = format!("/proc/{pid}/stat");
    loop {
        let stopping = stop.load(Ordering::SeqCst);
        if file.is_none()
            && let Some(found) = run_dir.records_files(0)?.first()
        {
            file = File::open(&found.records).ok();
        }
        if let Some(file) = file.as_mut() {
            file.seek(SeekFrom::Start(offset))?;
            let mut grew = false;
            loop {
                let read = file.read(&mut buffer)?;
                if read == 0 {
                    break;
                }
                offset += read as u64;
                records += memchr::memchr_iter(b'\n', &buffer[..read]).count();
                grew = true;
            }
            if grew && let Some((own, children)) = cpu_ticks(&stat) {
                samples.push(Sample {
                    time: started.elapsed(),
                    records,
                    own,
                    children,
                });
            }
        }
        if stopping {
            return Ok(samples);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `utime + stime` and `cutime + cstime` of `/proc/<pid>/stat`, in clock ticks.
fn cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let text = fs::read_to_string(stat).ok()?;
    // The command name (field 2) may hold spaces; the fields after it are plain.
    let fields: Vec<u64> = text[text.rfind(')')? + 2..]
        .split_whitespace()
        .skip(11) // state .. cmajflt: fields 3-13
        .take(4)
        .map(|field| field.parse().ok())
        .collect::<Option<_>>()?;
    Some((fields[0] + fields[1], fields[2] + fields[3]))
}

fn clock_ticks() -> f64 {
    // Linux reports USER_HZ = 100 on every architecture this runs on.
    100.0
}

/// Mean child CPU seconds of one `bash -c true`, spawned as the executor spawns the command.
fn own_cost(workspace: &Path) -> anyhow::Result<f64> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    let before = children_cpu()?;
    for _ in 0..OWN_COST_SPAWNS {
        let (reader, writer) = std::io::pipe()?;
        let status = Command::new("bash")
            .arg("-c")
            .arg("true")
            .current_dir(workspace)
            .env_clear()
            .env("HOME", workspace)
            .env("TMPDIR", workspace)
            .env("TERM", "dumb")
            .env("PATH", &path)
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .status()?;
        drop(reader);
        ensure!(status.success(), "bash -c true failed: {status}");
    }
    Ok(children_cpu()?.saturating_sub(before).as_secs_f64() / f64::from(OWN_COST_SPAWNS))
}

fn print_table(rows: &[(Tool, usize, LocalRun, f64)], latency: Duration) {
    println!(
        "\n| tool | C | prompts | ideal conv/s | steady conv/s | ratio | whole-run conv/s | client CPU ms/conv: worker; children (executor + bash); total | `bash -c true` alone ms | beyond the command ms/conv | whole run CPU ms/conv |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|");
    for (tool, concurrency, run, own) in rows {
        let ideal = *concurrency as f64 / (2.0 * latency.as_secs_f64());
        let total = run.window_self + run.window_children;
        let beyond = if *tool == Tool::Terminal {
            format!("**{:.3}**", (total - own) * 1000.0)
        } else {
            "–".to_owned()
        };
        println!(
            "| {} | {concurrency} | {} | {ideal:.0} | {:.1} | **{:.3}** | {:.1} | {:.3}; {:.3}; {:.3} | {:.3} | {beyond} | {:.3} |",
            tool.name(),
            run.prompts,
            run.window_rate,
            run.window_rate / ideal,
            run.whole_rate,
            run.window_self * 1000.0,
            run.window_children * 1000.0,
            total * 1000.0,
            own * 1000.0,
            run.whole_cpu * 1000.0,
        );
    }
    println!(
        "targets (terminal): ratio ≥ 0.95; beyond the command (client CPU − `bash -c true` alone) ≤ 1.000 ms"
    );
}

/// CPU of this process's reaped children (user + system).
fn children_cpu() -> anyhow::Result<Duration> {
    let usage = getrusage(UsageWho::RUSAGE_CHILDREN)?;
    let micros = |time: TimeVal| u64::try_from(time.num_microseconds()).unwrap_or(0);
    Ok(Duration::from_micros(
        micros(usage.user_time()) + micros(usage.system_time()),
    ))
}

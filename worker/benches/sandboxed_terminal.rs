//! The sandboxed terminal path (issues 13 and 22): `trajectory-worker local` as a whole process,
//! whose scripted model calls `terminal` with `true` once (or `TERMINAL_BENCH_COMMANDS` times) per
//! conversation, against a fixed-latency server.
//!
//! ```text
//! cargo build --release -p trajectory-worker
//! cargo bench -p trajectory-worker --bench sandboxed_terminal
//! ```
//!
//! Each conversation has one shell (issue 22): one `bash --noprofile --norc` under one
//! `trajectory-executor session` (Landlock `auto`, which this bench checks is enforced; no
//! capabilities, `no_new_privs`, a child subreaper, a cleared environment), started at the
//! conversation's first terminal call and stopped at its end. Each command goes to the shell's
//! standard input as a small script ending in a marker line, and is followed by a limit check (a
//! round trip to the executor). The executor is the one users run: the static musl build that
//! `scripts/quickstart.sh` and the pods use, which this bench builds with
//! `scripts/executor/build.sh` (or `TERMINAL_BENCH_EXECUTOR`).
//!
//! For each C (in flight; `concurrency: C`, one batch, one worker) and each number of commands N,
//! the run has 7·C prompts. The scripted server (this bench re-executed, so its CPU is not the
//! client's) answers every call after the latency; a conversation's first N calls get a
//! `terminal` call each and the next the final answer, so the ideal is C ÷ ((N + 1) × latency)
//! conversations per second. A thread tails the batch's records file and samples
//! `/proc/<worker>/stat` whenever records appear; the figures are over the steady window from the
//! 2·C-th to the 6·C-th record (4·C conversations: neither the start, the plan and the first
//! lockstep rounds, nor the drain and the merge):
//!
//! - **throughput ratio**: records per second in the window ÷ the ideal; target ≥ 0.95;
//! - **client CPU per conversation**: in the window, the worker's own user + system time plus that
//!   of its reaped children (each executor, with the shell it reaped), from the worker's
//!   `utime + stime + cutime + cstime`, ÷ records; the whole run's figure comes from
//!   `getrusage(RUSAGE_CHILDREN)` around the wait for the worker (plan, start-up and merge
//!   included);
//! - **the command's own cost**: what running N `true`s in one conversation-long shell needs at
//!   the least, one shell's start and end plus N builtins. In the same run, before and after each
//!   worker run, this bench spawns `bash --noprofile --norc` 500 times the way the executor spawns
//!   the shell (cleared environment with `PATH`, `HOME`, `TMPDIR`, `TERM=dumb`; in a workspace;
//!   input and output on pipes), writes `true` N times to its standard input and closes it, and
//!   takes the mean child CPU (`RUSAGE_CHILDREN`) per shell. **Beyond the command's own** =
//!   client CPU per conversation − that mean; target ≤ 0.001 s.
//! - **the shell with the worker's scripts**, for the breakdown of "beyond": the same shells fed
//!   the worker's own start script and N command scripts (`trajectory_worker::tools::terminal`'s
//!   `start_script` and `command_script`: the command in a here-document, `eval`, the marker
//!   line); what it costs more than the command's own is the shell's share of the
//!   worker's protocol, the rest of "beyond" is the executor's and the worker's.
//!
//! With `TERMINAL_BENCH_BASELINE=1` (the default) each C is also run with the `file` toolset's
//! `read_file` of a missing file instead (no process spawned; one call per conversation), the
//! engine benchmark's kind of tool, for comparison.
//!
//! Knobs (environment): `TERMINAL_BENCH_CONCURRENCY` (`256,1000`), `TERMINAL_BENCH_COMMANDS`
//! (`1,5`: terminal commands per conversation, one row each), `TERMINAL_BENCH_LATENCY_MS` (1000),
//! `TERMINAL_BENCH_ROUNDS` (7, prompts per C), `TERMINAL_BENCH_BASELINE` (1),
//! `TERMINAL_BENCH_KEEP` (0; 1 keeps each run's directory), `TERMINAL_BENCH_DIR` (the system temp
//! dir), `TERMINAL_BENCH_EXECUTOR` (another executor binary, e.g. cargo's dynamic one beside the
//! worker).

mod common;

use std::fs::{self, File};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use common::{env_number, load_average, raise_open_files_limit, start_server_process};
use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::time::{TimeVal, TimeValLike};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    MODEL, ScriptedServer, Step, text_reply, tool_call_reply,
};
use trajectory_worker::run::{RunFile, RunLocation};
use trajectory_worker::storage::RunDir;
use trajectory_worker::tools::terminal::{Flavour, command_script, start_script};

const SERVER_ENV: &str = "TERMINAL_BENCH_SERVER";
const TOOL_ENV: &str = "TERMINAL_BENCH_SERVER_TOOL";
const CALLS_ENV: &str = "TERMINAL_BENCH_SERVER_CALLS";
/// Shells spawned per measurement of the command's own cost.
const OWN_COST_SPAWNS: u32 = 500;

#[derive(Debug)]
struct Knobs {
    concurrencies: Vec<usize>,
    commands: Vec<usize>,
    latency: Duration,
    rounds: usize,
    baseline: bool,
    keep: bool,
    dir: PathBuf,
}

fn number_list(name: &str, default: &str) -> anyhow::Result<Vec<usize>> {
    let list = std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|text| text.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{name} must be numbers separated by commas"))?;
    ensure!(
        list.iter().all(|&n| n >= 1),
        "every number of {name} must be at least 1"
    );
    Ok(list)
}

impl Knobs {
    fn from_env() -> anyhow::Result<Self> {
        let rounds = usize::try_from(env_number("TERMINAL_BENCH_ROUNDS", 7)?)?;
        ensure!(rounds >= 4, "TERMINAL_BENCH_ROUNDS must be at least 4");
        Ok(Self {
            concurrencies: number_list("TERMINAL_BENCH_CONCURRENCY", "256,1000")?,
            commands: number_list("TERMINAL_BENCH_COMMANDS", "1,5")?,
            latency: Duration::from_millis(env_number("TERMINAL_BENCH_LATENCY_MS", 1000)?),
            rounds,
            baseline: env_number("TERMINAL_BENCH_BASELINE", 1)? != 0,
            keep: env_number("TERMINAL_BENCH_KEEP", 0)? != 0,
            dir: std::env::var_os("TERMINAL_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into),
        })
    }
}

/// What the scripted model's tool calls are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    /// `terminal` with `true`, this many times: one shell (one executor, one `bash`) per
    /// conversation.
    Terminal(usize),
    /// `read_file` of a missing file, once: no process spawned (the engine benchmark's kind of
    /// tool).
    ReadFile,
}

impl Tool {
    fn name(self) -> &'static str {
        match self {
            Self::Terminal(_) => "terminal",
            Self::ReadFile => "read_file",
        }
    }

    fn toolset(self) -> &'static str {
        match self {
            Self::Terminal(_) => "terminal",
            Self::ReadFile => "file",
        }
    }

    /// Tool calls per conversation.
    fn calls(self) -> usize {
        match self {
            Self::Terminal(commands) => commands,
            Self::ReadFile => 1,
        }
    }

    fn call(self) -> Value {
        match self {
            Self::Terminal(_) => tool_call_reply("terminal", &json!({"command": "true"})),
            Self::ReadFile => tool_call_reply("read_file", &json!({"path": "missing.txt"})),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let knobs = Knobs::from_env()?;
    if std::env::var_os(SERVER_ENV).is_some() {
        let calls = usize::try_from(env_number(CALLS_ENV, 1)?)?;
        let tool = match std::env::var(TOOL_ENV).as_deref() {
            Ok("read_file") => Tool::ReadFile,
            _ => Tool::Terminal(calls),
        };
        return if calls == 1 {
            common::serve(knobs.latency, tool.call())
        } else {
            serve_calls(knobs.latency, tool, calls)
        };
    }
    let executor = executor()?;
    // Per conversation: its connection to the server, the one to its executor, with room.
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
        let mut tools: Vec<Tool> = knobs.commands.iter().map(|&n| Tool::Terminal(n)).collect();
        if knobs.baseline {
            tools.push(Tool::ReadFile);
        }
        for tool in tools {
            let dir = root
                .path()
                .join(format!("{}{}-c{concurrency}", tool.name(), tool.calls()));
            let before = own_cost(&probe, tool)?;
            let load_before = load_average();
            let run = run_local(&dir, &executor, &knobs, concurrency, tool)?;
            let after = own_cost(&probe, tool)?;
            println!(
                "  done: {} × {} at C = {concurrency}, load average before {load_before}, after {}",
                tool.name(),
                tool.calls(),
                load_average()
            );
            rows.push(Row {
                tool,
                concurrency,
                run,
                own: before.mean(after),
            });
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

/// The server process for conversations of `calls` tool calls: every call answered after
/// `latency`, with the next tool call while the request holds fewer than `calls` tool results,
/// then with a final answer; serves until the parent closes stdin.
fn serve_calls(latency: Duration, tool: Tool, calls: usize) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // A distinct tool call id for each turn of a conversation.
    let replies: Vec<Value> = (0..calls).map(|_| tool.call()).collect();
    let answer = text_reply("done");
    let server = runtime.block_on(ScriptedServer::start_responding(move |request| {
        let results = request["messages"].as_array().map_or(0, |messages| {
            messages
                .iter()
                .filter(|message| message["role"] == "tool")
                .count()
        });
        let reply = replies.get(results).unwrap_or(&answer).clone();
        Step::Delay(latency, Box::new(Step::ok(reply)))
    }));
    common::serve_until_stdin_closes(server, runtime)
}

/// The executor users run: the static musl build of `scripts/executor/build.sh`, which the pods
/// and `scripts/quickstart.sh` use (built, or found built, by that script), or
/// `TERMINAL_BENCH_EXECUTOR`; a missing one fails the bench.
fn executor() -> anyhow::Result<PathBuf> {
    common::executor("TERMINAL_BENCH_EXECUTOR")
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    tool: Tool,
    concurrency: usize,
    run: LocalRun,
    own: OwnCost,
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
    let calls = tool.calls().to_string();
    let (mut server, base_url) = start_server_process(&[
        (SERVER_ENV, "1"),
        (TOOL_ENV, tool.name()),
        (CALLS_ENV, &calls),
    ])?;
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
    let children_before = children_cpu()?;
    let started = Instant::now();
    let mut worker = common::spawn_local(dir, &file, executor)?;
    let location = RunLocation {
        storage_root: dir.to_path_buf(),
        store: trajectory_worker::storage::Store::Volume,
        plan: RunFile::load(&dir.join("run.yaml"))?.to_plan(),
    };
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

/// Every prompt has a record, and (for the terminal) every conversation ran `true` as often as
/// scripted, each to exit code 0.
fn check_records(run_dir: &RunDir, prompts: usize, tool: Tool) -> anyhow::Result<()> {
    let text = fs::read_to_string(run_dir.trajectories())?;
    let lines = text.lines().count();
    ensure!(
        lines == prompts,
        "{lines} trajectories for {prompts} prompts"
    );
    if let Tool::Terminal(commands) = tool {
        // The tool result is JSON inside the record's JSON string.
        let ran = text.matches(r#"\"exit_code\": 0"#).count();
        let first = text.lines().next().unwrap_or_default();
        ensure!(
            ran == prompts * commands,
            "{ran} of {} terminal calls exited 0; the first record's tool turn: {}",
            prompts * commands,
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

/// Mean child CPU seconds of one conversation's shell outside the sandbox: the command's own
/// (`true` N times), and the same with the worker's scripts around each.
#[derive(Debug, Clone, Copy)]
struct OwnCost {
    own: f64,
    scripted: f64,
}

impl OwnCost {
    fn mean(self, other: Self) -> Self {
        Self {
            own: f64::midpoint(self.own, other.own),
            scripted: f64::midpoint(self.scripted, other.scripted),
        }
    }
}

/// [`OwnCost`] of `tool`'s conversation (nothing for one that runs no command).
fn own_cost(workspace: &Path, tool: Tool) -> anyhow::Result<OwnCost> {
    let Tool::Terminal(commands) = tool else {
        return Ok(OwnCost {
            own: 0.0,
            scripted: 0.0,
        });
    };
    let plain = "true\n".repeat(commands);
    let mut scripted = start_script(Flavour::Bash, &nonce());
    for _ in 0..commands {
        scripted.push_str(&command_script(Flavour::Bash, &nonce(), "true", None));
    }
    Ok(OwnCost {
        own: shell_cost(workspace, plain.as_bytes(), 0)?,
        // The start script's ready marker, then one per command.
        scripted: shell_cost(workspace, scripted.as_bytes(), commands + 1)?,
    })
}

/// A fresh marker nonce, as the worker makes one per command.
fn nonce() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Mean child CPU seconds of one `bash --noprofile --norc`, spawned as the executor spawns the
/// conversation's shell, that reads `input` from a pipe and exits at its end, having printed
/// `markers` markers of commands that exited 0.
fn shell_cost(workspace: &Path, input: &[u8], markers: usize) -> anyhow::Result<f64> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    let before = children_cpu()?;
    for _ in 0..OWN_COST_SPAWNS {
        let (reader, writer) = std::io::pipe()?;
        let mut shell = Command::new("bash")
            .args(["--noprofile", "--norc"])
            .current_dir(workspace)
            .env_clear()
            .env("HOME", workspace)
            .env("TMPDIR", workspace)
            .env("TERM", "dumb")
            .env("PATH", &path)
            .stdin(Stdio::piped())
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .spawn()?;
        let mut stdin = shell.stdin.take().context("stdin is piped")?;
        stdin.write_all(input)?;
        drop(stdin);
        // Our copies of the output pipe went with the `Command`: this ends when the shell exits.
        let mut output = Vec::new();
        let mut reader = reader;
        reader.read_to_end(&mut output)?;
        let status = shell.wait()?;
        ensure!(status.success(), "the shell failed: {status}");
        let seen = memchr::memmem::find_iter(&output, b"_END 0 ").count();
        ensure!(
            seen == markers,
            "the shell printed {seen} markers of exit code 0, not {markers}: {}",
            String::from_utf8_lossy(&output)
        );
    }
    Ok(children_cpu()?.saturating_sub(before).as_secs_f64() / f64::from(OWN_COST_SPAWNS))
}

fn print_table(rows: &[Row], latency: Duration) {
    println!(
        "\n| tool | commands/conv | C | prompts | ideal conv/s | steady conv/s | ratio | whole-run conv/s | client CPU ms/conv: worker; children (executor + bash); total | command's own ms (bash start + N × `true`) | bash with the worker's scripts ms | beyond the command ms/conv | whole run CPU ms/conv |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|");
    for Row {
        tool,
        concurrency,
        run,
        own,
    } in rows
    {
        let ideal = *concurrency as f64 / ((tool.calls() + 1) as f64 * latency.as_secs_f64());
        let total = run.window_self + run.window_children;
        let (own_text, scripted_text, beyond) = if let Tool::Terminal(_) = tool {
            (
                format!("{:.3}", own.own * 1000.0),
                format!("{:.3}", own.scripted * 1000.0),
                format!("**{:.3}**", (total - own.own) * 1000.0),
            )
        } else {
            ("–".to_owned(), "–".to_owned(), "–".to_owned())
        };
        println!(
            "| {} | {} | {concurrency} | {} | {ideal:.1} | {:.1} | **{:.3}** | {:.1} | {:.3}; {:.3}; {:.3} | {own_text} | {scripted_text} | {beyond} | {:.3} |",
            tool.name(),
            tool.calls(),
            run.prompts,
            run.window_rate,
            run.window_rate / ideal,
            run.whole_rate,
            run.window_self * 1000.0,
            run.window_children * 1000.0,
            total * 1000.0,
            run.whole_cpu * 1000.0,
        );
    }
    println!(
        "targets (terminal): ratio ≥ 0.95; beyond the command (client CPU − the command's own) ≤ 1.000 ms"
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

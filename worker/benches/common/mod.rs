//! What the benches share: their knobs, the machine's load, the open-files limit, the sandbox's
//! executor, `trajectory-worker local` on a run file, and the scripted server in a process of its
//! own.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use serde_json::Value;
use trajectory_testkit::scripted_server::{FixedLatency, ScriptedServer, text_reply};

/// The number in environment variable `name`, or `default` when it is unset.
pub fn env_number(name: &str, default: u64) -> anyhow::Result<u64> {
    match std::env::var(name) {
        Ok(value) => value
            .trim()
            .parse()
            .with_context(|| format!("{name} must be a number, got {value:?}")),
        Err(_) => Ok(default),
    }
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` has them.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Raises the soft open-files limit to the hard one; fails when that is below `needed`.
pub fn raise_open_files_limit(needed: u64) -> anyhow::Result<()> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < needed {
        bail!("the open-files limit is {soft}; the bench needs about {needed}");
    }
    Ok(())
}

/// The scripted server in fixed-latency mode in a child process (this bench re-executed with
/// `envs`, which make it call [`serve`]), so that its CPU is not counted as the client's; returns
/// the child and the base URL it printed.
pub fn start_server_process(envs: &[(&str, &str)]) -> anyhow::Result<(Child, String)> {
    let mut server = Command::new(std::env::current_exe()?)
        .envs(envs.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the server process")?;
    let mut base_url = String::new();
    BufReader::new(server.stdout.take().context("server stdout is piped")?)
        .read_line(&mut base_url)?;
    let base_url = base_url.trim().to_owned();
    ensure!(
        base_url.starts_with("http://"),
        "the server printed {base_url:?}"
    );
    Ok((server, base_url))
}

/// The server process: every call answered after `latency`, a conversation's first with
/// `tool_call` and its second with a final answer; serves until the parent closes stdin.
#[allow(
    dead_code,
    reason = "the benches with servers of their own do not call it"
)]
pub fn serve(latency: Duration, tool_call: Value) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let server = runtime.block_on(ScriptedServer::start_fixed_latency(FixedLatency {
        latency,
        tool_call,
        final_answer: text_reply("done"),
    }));
    serve_until_stdin_closes(server, runtime)
}

/// The server process's life: prints the server's address for the bench, serves until the bench
/// closes the standard input, then stops.
pub fn serve_until_stdin_closes(
    server: ScriptedServer,
    runtime: tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", server.base_url())?;
    stdout.flush()?;
    std::io::stdin().read_to_end(&mut Vec::new())?;
    drop(server);
    runtime.shutdown_background();
    Ok(())
}

/// The sandbox's executor binary: the one environment variable `name` names, or the one
/// `scripts/executor/build.sh` builds (and prints); a missing one fails the bench.
#[allow(dead_code, reason = "the benches that run no sandbox do not call it")]
pub fn executor(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let executor: std::path::PathBuf = if let Some(path) = std::env::var_os(name) {
        path.into()
    } else {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/executor/build.sh");
        let built = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("cannot run {}", script.display()))?;
        ensure!(built.status.success(), "{} failed", script.display());
        String::from_utf8(built.stdout)?.trim().into()
    };
    ensure!(executor.is_file(), "{} is missing", executor.display());
    Ok(executor)
}

/// Writes `file` as `dir/run.yaml` (JSON is YAML) and starts `trajectory-worker local` (the
/// release binary) on it, workspaces under `dir/workspaces`, its log in `dir/worker.log`.
#[allow(dead_code, reason = "the benches that run no local run do not call it")]
pub fn spawn_local(
    dir: &std::path::Path,
    file: &Value,
    executor: &std::path::Path,
) -> anyhow::Result<Child> {
    std::fs::write(dir.join("run.yaml"), serde_json::to_vec_pretty(file)?)?;
    Command::new(env!("CARGO_BIN_EXE_trajectory-worker"))
        .arg("local")
        .arg(dir.join("run.yaml"))
        .arg("--workspace-root")
        .arg(dir.join("workspaces"))
        .arg("--executor")
        .arg(executor)
        .arg("--no-progress-bar")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("worker.log"))?)
        .spawn()
        .context("cannot start trajectory-worker local")
}

/// The CPU time (user and system) this process has used so far.
#[allow(
    dead_code,
    reason = "the benches that measure CPU otherwise do not call it"
)]
pub fn cpu_time() -> anyhow::Result<Duration> {
    rusage_time(nix::sys::resource::UsageWho::RUSAGE_SELF)
}

/// The CPU time (user and system) of this process's children that have ended and been waited
/// for.
#[allow(
    dead_code,
    reason = "the benches that measure no child's CPU do not call it"
)]
pub fn children_cpu_time() -> anyhow::Result<Duration> {
    rusage_time(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
}

#[allow(dead_code, reason = "used by the CPU measures above only")]
fn rusage_time(who: nix::sys::resource::UsageWho) -> anyhow::Result<Duration> {
    let usage = nix::sys::resource::getrusage(who)?;
    let micros = |time: nix::sys::time::TimeVal| {
        u64::try_from(nix::sys::time::TimeValLike::num_microseconds(&time)).unwrap_or(0)
    };
    Ok(Duration::from_micros(
        micros(usage.user_time()) + micros(usage.system_time()),
    ))
}

//! What the benches share: their knobs, the machine's load, the open-files limit, the sandbox's
//! executor, and the scripted server in a process of its own.

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
/// `scripts/executor/build.sh` builds (and prints).
#[allow(dead_code, reason = "the benches that run no sandbox do not call it")]
pub fn executor(name: &str) -> anyhow::Result<std::path::PathBuf> {
    if let Some(path) = std::env::var_os(name) {
        return Ok(path.into());
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/executor/build.sh");
    let built = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    ensure!(built.status.success(), "{} failed", script.display());
    Ok(String::from_utf8(built.stdout)?.trim().into())
}

//! What the benches of single tool calls share: this process's CPU time, the loop that times a
//! tool's calls one after another, and backend processes on local ports.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};

use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::time::TimeValLike;
use trajectory_worker::tools::browser::ConversationBrowser;
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{ToolContext, ToolLimits, ToolOutcome, Workspace};

/// Untimed calls first (the first opens the session or connection).
const WARMUP: usize = 50;

/// CPU time of this process so far (user and system).
pub fn cpu_now() -> anyhow::Result<Duration> {
    let usage = getrusage(UsageWho::RUSAGE_SELF)?;
    let micros = usage.user_time().num_microseconds() + usage.system_time().num_microseconds();
    Ok(Duration::from_micros(u64::try_from(micros)?))
}

/// Runs `call` `WARMUP` + `calls` times; prints wall time and client CPU (by `cpu_now`) per timed
/// call. A call that fails stops the bench.
pub async fn measure<F, Fut>(
    label: &str,
    calls: usize,
    cpu_now: fn() -> anyhow::Result<Duration>,
    mut call: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ToolOutcome>,
{
    for _ in 0..WARMUP {
        if let ToolOutcome::Err(error) = call().await {
            anyhow::bail!("{label}: {error}");
        }
    }
    let (started, cpu_started) = (Instant::now(), cpu_now()?);
    for _ in 0..calls {
        if let ToolOutcome::Err(error) = call().await {
            anyhow::bail!("{label}: {error}");
        }
    }
    let (wall, cpu) = (started.elapsed(), cpu_now()?.saturating_sub(cpu_started));
    let per_call = |total: Duration| total.as_secs_f64() * 1e6 / calls as f64;
    println!(
        "{label:<28} {calls:>6} calls   wall {:>8.1} µs/call   client CPU {:>7.1} µs/call",
        per_call(wall),
        per_call(cpu)
    );
    Ok(())
}

/// A backend process, killed when dropped.
pub struct Stop(pub Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something listens on 127.0.0.1:`port` (at most a minute).
pub fn wait_for_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        ensure!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A port free right now on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Python's `http.server` over `dir` on a free port, and that port.
pub fn http_server(dir: &Path) -> anyhow::Result<(Stop, u16)> {
    let port = free_port()?;
    let server = Stop(
        Command::new("python3")
            .args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting python3 -m http.server")?,
    );
    wait_for_port(port)?;
    Ok((server, port))
}

/// The tool context of a conversation in `workspace`, with the executor cargo builds beside the
/// worker.
pub fn tool_context(workspace: &Path) -> anyhow::Result<ToolContext> {
    Ok(ToolContext {
        workspace: Workspace::new(workspace)?,
        limits: ToolLimits::default(),
        sandbox: Sandbox::new(env!("CARGO_BIN_EXE_trajectory-worker"), LandlockMode::Auto),
        browser: ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    })
}

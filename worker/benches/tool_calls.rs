//! Client CPU of one call of a declared toolset's tool: an MCP tool (server-everything's `echo`,
//! over stdio and over streamable HTTP) and a declared HTTP tool (a GET of a small JSON file
//! served by python's `http.server`). The issue's target: at most 1 ms of client CPU per call
//! beyond the backend's own time.
//!
//! ```text
//! cargo bench -p trajectory-worker --bench tool_calls
//! ```
//!
//! Every backend is a separate process, so `getrusage(RUSAGE_SELF)` of this one counts the
//! client alone. Calls run one after another: after `WARMUP` calls (the first starts the session),
//! `CALLS` are timed. Knobs (environment): `TOOL_BENCH_CALLS` (2000). The MCP servers come from
//! `scripts/mcp/install.sh` (or `TRAJ_MCP_DIR`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::time::TimeValLike;
use serde_json::{Map, Value, json};
use trajectory_worker::spec::{McpServerSpec, ToolsSpec};
use trajectory_worker::tools::mcp::McpServer;
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{Registry, ToolContext, ToolLimits, ToolOutcome, Workspace};

const WARMUP: usize = 50;

fn cpu_now() -> anyhow::Result<Duration> {
    let usage = getrusage(UsageWho::RUSAGE_SELF)?;
    let micros = usage.user_time().num_microseconds() + usage.system_time().num_microseconds();
    Ok(Duration::from_micros(u64::try_from(micros)?))
}

fn servers_dir() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("TRAJ_MCP_DIR") {
        return Ok(dir.into());
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/mcp/install.sh");
    let output = Command::new(&script)
        .arg("--print-dir")
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(output.status.success(), "{} failed", script.display());
    Ok(String::from_utf8(output.stdout)?.trim().into())
}

struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        ensure!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Runs `call` WARMUP + CALLS times; prints wall and client CPU per timed call.
async fn measure<F, Fut>(label: &str, calls: usize, mut call: F) -> anyhow::Result<()>
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let calls: usize = std::env::var("TOOL_BENCH_CALLS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(2000);
    let dir = servers_dir()?;
    let everything =
        dir.join("node/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    let echo = || {
        let mut args = Map::new();
        args.insert("message".into(), Value::from("benchmark"));
        args
    };

    let stdio: McpServerSpec = serde_json::from_value(json!({
        "name": "everything", "stdio": {"command": "node", "args": [&everything, "stdio"]},
        "connectTimeoutSeconds": 60,
    }))?;
    let server = McpServer::new(stdio);
    measure("MCP stdio (echo)", calls, || server.call("echo", echo())).await?;
    server.close().await;

    let port = free_port()?;
    let _http_server = Stop(
        Command::new("node")
            .arg(&everything)
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting server-everything over HTTP")?,
    );
    wait_for_port(port)?;
    let http: McpServerSpec = serde_json::from_value(json!({
        "name": "everything", "streamableHttp": {"url": format!("http://127.0.0.1:{port}/mcp")},
    }))?;
    let server = McpServer::new(http);
    measure("MCP streamable HTTP (echo)", calls, || {
        server.call("echo", echo())
    })
    .await?;
    server.close().await;

    let files = tempfile::tempdir()?;
    std::fs::write(
        files.path().join("item.json"),
        r#"{"id": 7, "name": "frobnicator"}"#,
    )?;
    let port = free_port()?;
    let _files_server = Stop(
        Command::new("python3")
            .args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .current_dir(files.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting python3 -m http.server")?,
    );
    wait_for_port(port)?;
    let tools: ToolsSpec = serde_json::from_value(json!({"http": [{"toolset": "team", "tools": [{
        "name": "get_item", "description": "d",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        "url": format!("http://127.0.0.1:{port}/{{id}}.json"),
    }]}]}))?;
    let registry = Registry::builtin(&tools);
    let tool = registry
        .tools_for(&["team".to_owned()])
        .pop()
        .context("the HTTP tool")?;
    let workspace = tempfile::tempdir()?;
    let ctx = ToolContext {
        workspace: Workspace::new(workspace.path())?,
        limits: ToolLimits::default(),
        sandbox: Sandbox::new(env!("CARGO_BIN_EXE_trajectory-worker"), LandlockMode::Auto),
        browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
    };
    let mut item = Map::new();
    item.insert("id".into(), Value::from("item"));
    measure("HTTP tool (GET, JSON)", calls, || {
        tool.call(item.clone(), &ctx)
    })
    .await?;
    Ok(())
}

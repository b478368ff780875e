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

mod per_call;

use std::path::PathBuf;
use std::process::{Command, Stdio};

use per_call::{Stop, free_port, measure, wait_for_port};

use anyhow::{Context, ensure};
use serde_json::{Map, Value, json};
use trajectory_worker::spec::{McpServerSpec, ToolsSpec};
use trajectory_worker::tools::Registry;
use trajectory_worker::tools::mcp::McpServer;

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
    measure("MCP stdio (echo)", calls, per_call::cpu_now, || {
        server.call("echo", echo())
    })
    .await?;
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
    measure(
        "MCP streamable HTTP (echo)",
        calls,
        per_call::cpu_now,
        || server.call("echo", echo()),
    )
    .await?;
    server.close().await;

    let files = tempfile::tempdir()?;
    std::fs::write(
        files.path().join("item.json"),
        r#"{"id": 7, "name": "frobnicator"}"#,
    )?;
    let (_files_server, port) = per_call::http_server(files.path())?;
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
    let ctx = per_call::tool_context(workspace.path())?;
    let mut item = Map::new();
    item.insert("id".into(), Value::from("item"));
    measure("HTTP tool (GET, JSON)", calls, per_call::cpu_now, || {
        tool.call(item.clone(), &ctx)
    })
    .await?;
    Ok(())
}

//! MCP toolsets against real servers from the registries, installed by `scripts/mcp/install.sh`:
//! npm's `@modelcontextprotocol/server-everything` (over stdio and streamable HTTP) and the
//! `PyPI` packages `mcp-server-time` and `mcp-server-fetch`. Discovery, calls and results; a call
//! that outlasts its limit, a server that dies midway, garbage instead of MCP; and a whole local
//! run against the scripted model whose record holds a real MCP result.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use trajectory_testkit::free_port;
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};
use trajectory_worker::run::batch::shutdown_channel;
use trajectory_worker::run::local::run_local;
use trajectory_worker::spec::{McpServerSpec, ToolsSpec};
use trajectory_worker::tools::mcp::{McpServer, discover_all};
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{Registry, ToolContext, ToolLimits, ToolOutcome, Workspace};

/// The install directory of the servers (installed on first use; warm, it takes milliseconds).
fn servers_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Ok(dir) = std::env::var("TRAJ_MCP_DIR") {
            return PathBuf::from(dir);
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/mcp/install.sh");
        let output = Command::new(&script)
            .arg("--print-dir")
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
        assert!(
            output.status.success(),
            "{} failed: the MCP servers are not installed",
            script.display()
        );
        PathBuf::from(String::from_utf8(output.stdout).unwrap().trim())
    })
}

fn everything_js() -> PathBuf {
    servers_dir().join("node/node_modules/@modelcontextprotocol/server-everything/dist/index.js")
}

fn server(spec: Value) -> McpServerSpec {
    serde_json::from_value(spec).unwrap()
}

/// server-everything over stdio, with `extra` merged into its spec.
fn everything_stdio(extra: Value) -> McpServerSpec {
    let Value::Object(extra) = extra else {
        panic!("extra settings are an object")
    };
    let mut spec = json!({
        "name": "everything",
        "stdio": {"command": "node", "args": [everything_js(), "stdio"]},
        "timeoutSeconds": 20,
        "connectTimeoutSeconds": 60,
    });
    for (key, value) in extra {
        spec[key] = value;
    }
    server(spec)
}

fn args(value: Value) -> Map<String, Value> {
    let Value::Object(map) = value else {
        panic!("arguments are an object")
    };
    map
}

fn result_text(outcome: &ToolOutcome) -> String {
    match outcome {
        ToolOutcome::Ok(value) => value["result"].as_str().unwrap_or_default().to_owned(),
        ToolOutcome::Err(message) => panic!("a tool error: {message}"),
    }
}

fn error_text(outcome: ToolOutcome) -> String {
    match outcome {
        ToolOutcome::Err(message) => message,
        ToolOutcome::Ok(value) => panic!("expected a tool error, got {value}"),
    }
}

/// server-everything over streamable HTTP on a port of its own, stopped on drop.
struct HttpEverything {
    child: Child,
    port: u16,
}

impl HttpEverything {
    fn start(port: u16) -> Self {
        let child = Command::new("node")
            .arg(everything_js())
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("node starts server-everything");
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "server-everything did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { child, port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HttpEverything {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Pids of this process's children whose environment holds `marker`.
fn children_with(marker: &str) -> Vec<i32> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let parent = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').nth(1))
            .unwrap_or_default();
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if parent == me && String::from_utf8_lossy(&environ).contains(marker) {
            found.push(pid);
        }
    }
    found
}

/// Pids of every process whose environment holds `marker`.
fn processes_with(marker: &str) -> Vec<i32> {
    common::processes_with_env(|var| String::from_utf8_lossy(var).contains(marker))
        .into_iter()
        .map(|(pid, _)| pid)
        .collect()
}

/// A `trajectory-executor serve` of the test's own, as a pod's sandbox container, and the
/// sandbox that starts stdio servers in it. Landlock is off here: the servers are installed
/// under the cache in the home directory, which Landlock keeps a session out of (in a pod they
/// are in `spec.sandbox.image`'s system directories; `sandbox_sessions.rs` tests the rules).
fn pod_sandbox() -> (common::SandboxServer, Sandbox, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let server = common::SandboxServer::start(root.path());
    let sandbox = server.sandbox(LandlockMode::Off);
    (server, sandbox, root)
}

#[tokio::test]
async fn stdio_servers_run_in_the_sandbox_container_with_only_the_listed_environment() {
    let (pod, sandbox, _root) = pod_sandbox();
    let marker = format!("MCP_SANDBOX_MARKER_{}", std::process::id());
    let server = McpServer::in_sandbox(
        everything_stdio(json!({
            "stdio": {"command": "node", "args": [everything_js(), "stdio"],
                      "env": [{"name": &marker, "value": "1"}]},
        })),
        Some(sandbox),
    );
    let frozen = server
        .discover()
        .await
        .expect("discovery through the sandbox");
    assert!(frozen.tools.iter().any(|tool| tool.name == "echo"));
    assert_eq!(
        result_text(
            &server
                .call("echo", args(json!({"message": "inside"})))
                .await
        ),
        "Echo: inside"
    );
    let text = result_text(&server.call("get-env", Map::new()).await);
    assert!(text.contains(&marker), "{text}");
    assert!(!text.contains("CARGO_MANIFEST_DIR"), "{text}");
    // Its home is the session's private directory, made by the sandbox server.
    let sessions = pod.sessions().display().to_string();
    assert!(text.contains(&sessions), "{text}");
    // Not a child of the worker: the sandbox server's executor started it.
    assert!(children_with(&marker).is_empty());
    let running = processes_with(&marker);
    assert!(!running.is_empty());
    server.close().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_with(&marker).is_empty()
        || std::fs::read_dir(pod.sessions()).unwrap().count() > 0
    {
        assert!(
            Instant::now() < deadline,
            "the server and its private directory outlived the session"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn discovery_goes_through_the_sandbox_and_a_command_missing_there_says_so() {
    let (_pod, sandbox, _root) = pod_sandbox();
    let frozen = discover_all(&[everything_stdio(json!({}))], Some(&sandbox))
        .await
        .expect("discovery");
    assert!(frozen[0].tools.iter().any(|tool| tool.name == "get-sum"));
    let missing = server(json!({
        "name": "absent", "stdio": {"command": "no-such-mcp-server"},
        "connectTimeoutSeconds": 20,
    }));
    let error = discover_all(&[missing], Some(&sandbox))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("absent") && error.contains("sandbox: cannot start no-such-mcp-server"),
        "{error}"
    );
}

#[tokio::test]
async fn stdio_server_everything_is_discovered_and_its_tools_answer_in_hermes_shape() {
    let server = McpServer::new(everything_stdio(json!({})));
    let frozen = server.discover().await.expect("discovery");
    let names: Vec<&str> = frozen.tools.iter().map(|tool| tool.name.as_str()).collect();
    for expected in [
        "echo",
        "get-sum",
        "get-structured-content",
        "trigger-long-running-operation",
    ] {
        assert!(names.contains(&expected), "{names:?}");
    }
    let echo = frozen
        .tools
        .iter()
        .find(|tool| tool.name == "echo")
        .unwrap();
    assert_eq!(echo.input_schema["type"], "object");
    assert!(
        echo.input_schema["properties"]["message"].is_object(),
        "{}",
        echo.input_schema
    );

    let outcome = server.call("echo", args(json!({"message": "héllo"}))).await;
    assert_eq!(result_text(&outcome), "Echo: héllo");
    let sum = server.call("get-sum", args(json!({"a": 2, "b": 40}))).await;
    assert!(result_text(&sum).contains("42"), "{sum:?}");
    let ToolOutcome::Ok(structured) = server
        .call(
            "get-structured-content",
            args(json!({"location": "New York"})),
        )
        .await
    else {
        panic!("get-structured-content failed")
    };
    assert!(
        structured["structuredContent"].is_object() || structured["result"].is_object(),
        "{structured}"
    );
    // Arguments the server's schema refuses, and a tool it does not have: its errors, as tool errors.
    let wrong = error_text(server.call("get-sum", args(json!({"a": "two"}))).await);
    assert!(!wrong.is_empty());
    let missing = error_text(server.call("no-such-tool", Map::new()).await);
    assert!(missing.contains("no-such-tool"), "{missing}");
    // The session still works after both.
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "again"}))).await),
        "Echo: again"
    );
    server.close().await;
}

#[tokio::test]
async fn a_stdio_server_gets_only_the_environment_the_spec_lists() {
    let server = McpServer::new(everything_stdio(json!({
        "stdio": {"command": "node", "args": [everything_js(), "stdio"],
                  "env": [{"name": "LISTED", "value": "yes"},
                          {"name": "FROM_HOME", "valueFrom": {"env": "HOME"}}]},
    })));
    let outcome = server.call("get-env", Map::new()).await;
    let text = result_text(&outcome);
    assert!(text.contains("LISTED"), "{text}");
    assert!(text.contains("FROM_HOME"), "{text}");
    // The worker's own environment (cargo's variables here, the model's API key in a run) stays out.
    assert!(!text.contains("CARGO_MANIFEST_DIR"), "{text}");
    assert!(!text.contains("\"HOME\""), "{text}");
    server.close().await;
}

#[tokio::test]
async fn a_call_that_outlasts_its_limit_is_a_tool_error_and_the_session_goes_on() {
    let server = McpServer::new(everything_stdio(json!({"timeoutSeconds": 1})));
    // The first call also starts the server; give it its own call first.
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "up"}))).await),
        "Echo: up"
    );
    let started = Instant::now();
    let error = error_text(
        server
            .call(
                "trigger-long-running-operation",
                args(json!({"duration": 30, "steps": 2})),
            )
            .await,
    );
    assert!(error.contains("did not answer within 1 seconds"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "still"}))).await),
        "Echo: still"
    );
    server.close().await;
}

#[tokio::test]
async fn a_stdio_server_that_dies_is_started_again_by_the_next_call() {
    let marker = format!("MCP_TEST_MARKER_{}", std::process::id());
    let server = McpServer::new(everything_stdio(json!({
        "stdio": {"command": "node", "args": [everything_js(), "stdio"],
                  "env": [{"name": &marker, "value": "1"}]},
    })));
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "one"}))).await),
        "Echo: one"
    );
    let pids = children_with(&marker);
    assert_eq!(pids.len(), 1, "{pids:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The dead session is noticed and a new server started, within the same call.
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "two"}))).await),
        "Echo: two"
    );
    let now = children_with(&marker);
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now, pids);
    server.close().await;
}

#[tokio::test]
async fn an_http_server_that_dies_is_a_tool_error_and_is_reconnected_when_it_is_back() {
    let port = free_port();
    let mut everything = HttpEverything::start(port);
    let server = McpServer::new(server(json!({
        "name": "remote",
        "streamableHttp": {"url": everything.url(),
                           "headers": [{"name": "X-Team", "value": "data"}]},
        "timeoutSeconds": 10,
        "connectTimeoutSeconds": 10,
    })));
    let frozen = server.discover().await.expect("discovery over HTTP");
    assert!(frozen.tools.iter().any(|tool| tool.name == "echo"));
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "http"}))).await),
        "Echo: http"
    );

    everything.stop();
    let started = Instant::now();
    let error = error_text(server.call("echo", args(json!({"message": "gone"}))).await);
    assert!(error.contains("remote"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    let _back = HttpEverything::start(port);
    assert_eq!(
        result_text(&server.call("echo", args(json!({"message": "back"}))).await),
        "Echo: back"
    );
    server.close().await;
}

#[tokio::test]
async fn garbage_instead_of_mcp_is_an_error_not_a_hang() {
    let started = Instant::now();
    for command in [
        json!({"command": "sh", "args": ["-c", "while true; do echo 'not json {'; sleep 0.01; done"]}),
        json!({"command": "sh", "args": ["-c", "exit 3"]}),
        json!({"command": "/nonexistent/mcp-server"}),
    ] {
        let server = McpServer::new(server(json!({
            "name": "garbage", "stdio": command, "connectTimeoutSeconds": 3, "timeoutSeconds": 3,
        })));
        let error = server
            .discover()
            .await
            .expect_err("garbage is no MCP server");
        assert!(error.to_string().contains("\"garbage\""), "{error}");
        let call = error_text(server.call("echo", Map::new()).await);
        assert!(call.contains("garbage"), "{call}");
        server.close().await;
    }
    // An HTTP endpoint that answers, but not MCP.
    let page = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = page.local_addr().unwrap();
    tokio::spawn(async move {
        let app = axum::Router::new().fallback(|| async { "<html>not an MCP server</html>" });
        axum::serve(page, app).await.unwrap();
    });
    let server = McpServer::new(server(json!({
        "name": "html", "streamableHttp": {"url": format!("http://{address}/mcp")},
        "connectTimeoutSeconds": 3,
    })));
    assert!(server.discover().await.is_err());
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn the_pypi_time_and_fetch_servers_answer_through_the_registry_from_the_sandbox() {
    let page = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = page.local_addr().unwrap();
    tokio::spawn(async move {
        let app = axum::Router::new().route(
            "/page",
            axum::routing::get(|| async {
                axum::response::Html(
                    "<html><body><h1>Release notes</h1><p>The frobnicator is fixed.</p></body></html>",
                )
            }),
        );
        axum::serve(page, app).await.unwrap();
    });
    let venv = servers_dir().join("venv/bin");
    let tools: ToolsSpec = serde_json::from_value(json!({"mcp": [
        {"name": "time", "stdio": {"command": venv.join("mcp-server-time"),
                                   "args": ["--local-timezone", "UTC"]},
         "connectTimeoutSeconds": 60},
        {"name": "fetch", "stdio": {"command": venv.join("mcp-server-fetch"),
                                    "args": ["--ignore-robots-txt", "--allow-private-ips"]},
         "connectTimeoutSeconds": 60},
    ]}))
    .unwrap();
    // As in a pod: the servers run in the sandbox container.
    let (_pod, sandbox, _root) = pod_sandbox();
    let registry = Registry::builtin_with(&tools, Some(&sandbox));
    let frozen = registry.discover_mcp().await.expect("discovery");
    let registry = registry.with_frozen_mcp(&frozen);
    let catalog = registry.catalog(&["time".to_owned(), "fetch".to_owned()]);
    assert!(
        catalog.contains(&"mcp__time__get_current_time".to_owned()),
        "{catalog:?}"
    );
    assert!(
        catalog.contains(&"mcp__fetch__fetch".to_owned()),
        "{catalog:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let ctx = ToolContext {
        workspace: Workspace::new(dir.path()).unwrap(),
        limits: ToolLimits::default(),
        sandbox: common::sandbox(),
        browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    };
    let tools = registry.tools_for(&["time".to_owned(), "fetch".to_owned()]);
    let tool = |name: &str| Arc::clone(tools.iter().find(|tool| tool.spec().name == name).unwrap());
    let now = tool("mcp__time__get_current_time")
        .call(args(json!({"timezone": "UTC"})), &ctx)
        .await;
    let now: Value =
        serde_json::from_str(&result_text(&now)).expect("the time server answers JSON");
    assert_eq!(now["timezone"], "UTC", "{now}");
    let fetched = tool("mcp__fetch__fetch")
        .call(args(json!({"url": format!("http://{address}/page")})), &ctx)
        .await;
    assert!(
        result_text(&fetched).contains("frobnicator is fixed"),
        "{fetched:?}"
    );
    let bad = tool("mcp__time__get_current_time")
        .call(args(json!({"timezone": "Not/AZone"})), &ctx)
        .await;
    assert!(matches!(bad, ToolOutcome::Err(_)), "{bad:?}");
}

#[tokio::test]
async fn a_local_run_freezes_the_mcp_tools_and_its_record_holds_the_real_result() {
    let server = ScriptedServer::start_with_default(
        [
            Step::ok(tool_call_reply(
                "mcp__everything__echo",
                &json!({"message": "from the model"}),
            )),
            Step::ok(text_reply("The server echoed it.")),
        ],
        Step::ok(text_reply("done")),
    )
    .await;
    let fixture = common::RunFixture::new(&server.base_url(), 1)
        .with("/distribution", json!({"everything": 100}))
        .with(
            "/tools",
            json!({"mcp": [{"name": "everything",
                            "stdio": {"command": "node", "args": [everything_js(), "stdio"]},
                            "connectTimeoutSeconds": 60}]}),
        );
    let (_trigger, shutdown) = shutdown_channel();
    run_local(&common::local_options(&fixture), &shutdown)
        .await
        .expect("the local run");

    let manifest: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("manifest.json")).unwrap())
            .unwrap();
    let frozen = &manifest["mcpTools"][0];
    assert_eq!(frozen["server"], "everything");
    assert!(
        frozen["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|tool| tool["name"] == "echo"),
        "{frozen}"
    );
    let catalog = manifest["toolCatalog"].as_array().unwrap();
    assert!(
        catalog.contains(&json!("mcp__everything__echo")),
        "{catalog:?}"
    );

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 1);
    let record = &records[0];
    let turns = record["conversations"].as_array().unwrap();
    let tool_turn = turns
        .iter()
        .find(|turn| turn["from"] == "tool")
        .expect("a tool turn");
    let value = tool_turn["value"].as_str().unwrap();
    assert!(value.contains("Echo: from the model"), "{value}");
    assert!(value.contains("mcp__everything__echo"), "{value}");
    assert_eq!(record["tool_stats"]["mcp__everything__echo"]["success"], 1);
    // Every catalog tool is a key of tool_stats, called or not.
    for name in catalog {
        assert!(
            record["tool_stats"].get(name.as_str().unwrap()).is_some(),
            "{name}"
        );
    }
}

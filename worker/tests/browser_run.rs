//! Local runs whose conversations draw the `browser` toolset, against the scripted model and a
//! real headless Chromium (scripts/browser/install.sh) loading a page from a local server: the
//! record holds the real snapshot the browser made, and `browser_vision` shows the scripted vision
//! endpoint a real screenshot.

mod common;

use axum::Router;
use axum::response::Html;
use axum::routing::get;
use common::{RunFixture, local_options, no_shutdown};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};
use trajectory_worker::run::local::run_local;
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{Registry, Tool, ToolContext, ToolLimits, ToolOutcome, Workspace};

const PAGE: &str = "<!doctype html><title>Browser fixture</title><h1>Glossary</h1>\
    <p>A <a href=\"/bdfl\">BDFL</a> is a benevolent dictator for life.</p>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_conversation_records_the_real_snapshot() {
    let site = serve_page().await;

    let server = ScriptedServer::start([
        Step::ok(tool_call_reply("browser_navigate", &json!({"url": site}))),
        Step::ok(tool_call_reply("browser_snapshot", &json!({}))),
        Step::ok(text_reply("A BDFL is a benevolent dictator for life.")),
    ])
    .await;
    let fixture = RunFixture::new(&server.base_url(), 1)
        .with("/distribution", json!("browser_only"))
        .with("/concurrency", json!(1))
        .with("/tools", json!({"browser": {}}));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!(report.merge.trajectories, 1);

    let record = &fixture.lines("trajectories.jsonl")[0];
    assert_eq!(record["toolsets_used"], json!(["browser"]));
    let turns = record["conversations"].as_array().unwrap();
    let tool_turns: Vec<&str> = turns
        .iter()
        .filter(|turn| turn["from"] == "tool")
        .map(|turn| turn["value"].as_str().unwrap())
        .collect();
    assert_eq!(tool_turns.len(), 2, "{turns:?}");
    assert!(
        tool_turns[0].contains(r#""title": "Browser fixture""#),
        "{}",
        tool_turns[0]
    );
    // The snapshot as Chromium's accessibility tree gave it, refs and all.
    for expected in [
        r#"- document \"Browser fixture\"\n"#,
        r#"- heading \"Glossary\" [ref=e1] [level=1]"#,
        r#"- link \"BDFL\" [ref=e2]"#,
        "- text: is a benevolent dictator for life.",
        r#""element_count": 2"#,
    ] {
        assert!(
            tool_turns[1].contains(expected),
            "{expected} in {}",
            tool_turns[1]
        );
    }
    assert_eq!(
        record["tool_stats"]["browser_snapshot"],
        json!({"count": 1, "success": 1, "failure": 0})
    );
    assert_eq!(
        record["tool_stats"]["browser_click"],
        json!({"count": 0, "success": 0, "failure": 0})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_vision_shows_a_png_screenshot_of_the_page_to_the_vision_model() {
    let site = serve_page().await;

    let vision = ScriptedServer::start([Step::ok(text_reply("A page headed Glossary."))]).await;
    let model = ScriptedServer::start([
        Step::ok(tool_call_reply("browser_navigate", &json!({"url": site}))),
        Step::ok(tool_call_reply(
            "browser_vision",
            &json!({"question": "What does the heading say?"}),
        )),
        Step::ok(text_reply("It says Glossary.")),
    ])
    .await;
    let fixture = RunFixture::new(&model.base_url(), 1)
        .with("/distribution", json!("browser_only"))
        .with("/concurrency", json!(1))
        .with(
            "/tools",
            json!({"browser": {}, "vision": {"baseUrl": vision.base_url(), "model": "scripted-vl"}}),
        );
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!(report.merge.trajectories, 1);

    let record = &fixture.lines("trajectories.jsonl")[0];
    let responses = common::tool_responses(record);
    assert_eq!(responses.len(), 2, "{record}");
    assert_eq!(responses[1]["name"], "browser_vision");
    assert_eq!(
        responses[1]["content"],
        json!({"success": true, "analysis": "A page headed Glossary."})
    );
    // The catalog holds browser_vision because the spec configures a vision model.
    assert_eq!(
        record["tool_stats"]["browser_vision"],
        json!({"count": 1, "success": 1, "failure": 0})
    );
    assert_eq!(record["tool_stats"].as_object().unwrap().len(), 10);

    let requests = vision.requests();
    assert_eq!(requests.len(), 1);
    let prompt = requests[0].body["messages"][0]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(
        prompt.starts_with(
            "You are analyzing a screenshot of a web browser.\n\nUser's question: What does the heading say?\n\n"
        ),
        "{prompt}"
    );
    let (mime, png) = common::sent_image(&requests[0]);
    assert_eq!(mime, "image/png");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    // IHDR: the viewport's width and height, big-endian, at bytes 16..24.
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert!(width >= 300 && height >= 200, "{width}x{height}");
}

/// The processes whose `HOME` lies under `dir` (a sandbox server's sessions).
fn processes_at_home_under(dir: &std::path::Path) -> Vec<(i32, String)> {
    let prefix = format!("HOME={}", dir.display());
    common::processes_with_env(|var| var.starts_with(prefix.as_bytes()))
}

/// Serves [`PAGE`] on an ephemeral loopback port; returns its URL.
async fn serve_page() -> String {
    let app = Router::new().route("/", get(|| async { Html(PAGE) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let site = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    site
}

/// The browser tools of a registry whose long-lived programs run in `sandbox`, and a
/// conversation's tool context in `workspace`.
fn browser_in(
    sandbox: &Sandbox,
    tools: serde_json::Value,
    workspace: &std::path::Path,
) -> (Vec<Arc<dyn Tool>>, ToolContext) {
    let tools: ToolsSpec = serde_json::from_value(tools).unwrap();
    let registry = Registry::builtin_with(&tools, Some(sandbox));
    std::fs::create_dir_all(workspace).unwrap();
    let ctx = ToolContext {
        workspace: Workspace::new(workspace).unwrap(),
        limits: ToolLimits::default(),
        sandbox: sandbox.clone(),
        browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    };
    (registry.tools_for(&["browser".to_owned()]), ctx)
}

async fn call(tools: &[Arc<dyn Tool>], ctx: &ToolContext, name: &str, args: Value) -> ToolOutcome {
    let tool = tools.iter().find(|tool| tool.spec().name == name).unwrap();
    tool.call(args.as_object().unwrap().clone(), ctx).await
}

/// As in a pod: Chromium runs in the sandbox container (a `trajectory-executor serve` of the
/// test's own, Landlock required), started through a session on `--remote-debugging-pipe`, and
/// the tools drive it through the worker's bridge; it ends with the tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_pod_chromium_runs_in_the_sandbox_on_a_devtools_pipe() {
    let site = serve_page().await;
    let root = tempfile::tempdir().unwrap();
    let pod = common::SandboxServer::start(root.path());
    let sandbox = pod.sandbox(LandlockMode::Required);
    let (tools, ctx) = browser_in(&sandbox, json!({"browser": {}}), &root.path().join("c1"));
    let navigated = call(&tools, &ctx, "browser_navigate", json!({"url": site})).await;
    assert!(
        matches!(&navigated, ToolOutcome::Ok(value) if value["title"] == "Browser fixture"),
        "{navigated:?}"
    );
    let snapshot = call(&tools, &ctx, "browser_snapshot", json!({})).await;
    let ToolOutcome::Ok(snapshot) = snapshot else {
        panic!("{snapshot:?}")
    };
    assert!(
        snapshot.to_string().contains(r#"link \"BDFL\""#),
        "{snapshot}"
    );

    // Chromium is the sandbox server's, at home in a session's private directory, on a pipe.
    let chromium = processes_at_home_under(&pod.sessions());
    assert!(
        chromium
            .iter()
            .any(|(_, cmdline)| cmdline.contains("--remote-debugging-pipe")),
        "{chromium:?}"
    );
    assert!(
        chromium
            .iter()
            .all(|(_, cmdline)| !cmdline.contains("--remote-debugging-port")),
        "{chromium:?}"
    );
    let me = std::process::id().to_string();
    for (pid, _) in &chromium {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let parent = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').nth(1));
        assert_ne!(parent, Some(me.as_str()), "not the worker's child");
    }

    // The conversation ends, then the tools with their pool: Chromium and its directory go.
    drop((ctx, tools));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !processes_at_home_under(&pod.sessions()).is_empty()
        || std::fs::read_dir(pod.sessions()).unwrap().count() > 0
    {
        assert!(
            Instant::now() < deadline,
            "Chromium outlived its tools: {:?}",
            processes_at_home_under(&pod.sessions())
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Chromium the sandbox image lacks is a tool error naming the cause.
#[tokio::test]
async fn a_chromium_missing_in_the_sandbox_is_a_tool_error_saying_so() {
    let root = tempfile::tempdir().unwrap();
    let pod = common::SandboxServer::start(root.path());
    let settings = json!({"browser": {"chromiumPath": "/usr/bin/no-such-chromium",
                                      "launchTimeoutSeconds": 10}});
    let (tools, ctx) = browser_in(
        &pod.sandbox(LandlockMode::Auto),
        settings,
        &root.path().join("c1"),
    );
    let outcome = call(
        &tools,
        &ctx,
        "browser_navigate",
        json!({"url": "http://x.test/"}),
    )
    .await;
    let ToolOutcome::Err(error) = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        error.contains("could not be started") && error.contains("no-such-chromium"),
        "{error}"
    );
}

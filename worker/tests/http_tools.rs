//! Declared HTTP tools against a real HTTP service (an axum server in the test, standing in for
//! a team's own service): templates substituted, headers from the environment, and every way the
//! service can fail (down, 500, a huge body, bad JSON, a redirect loop, a hang) a tool error.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, RawQuery};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Redirect;
use axum::routing::{get, post};
use serde_json::{Value, json};
use trajectory_worker::spec::{RunSpec, ToolsSpec};
use trajectory_worker::tools::{Registry, Tool, ToolContext, ToolLimits, ToolOutcome, Workspace};

/// The team's service: it echoes what it received, or misbehaves on purpose.
async fn start_service() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route(
            "/items/{id}",
            post(
                |Path(id): Path<String>,
                 RawQuery(query): RawQuery,
                 headers: HeaderMap,
                 Json(body): Json<Value>| async move {
                    Json(json!({
                        "id": id,
                        "query": query,
                        "body": body,
                        "home": headers.get("x-home").and_then(|v| v.to_str().ok()),
                    }))
                },
            ),
        )
        .route("/text", get(|| async { "plain words" }))
        .route(
            "/fail",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "database on fire") }),
        )
        .route("/huge", get(|| async { "x".repeat(4 << 20) }))
        .route(
            "/bad-json",
            get(|| async { ([(header::CONTENT_TYPE, "application/json")], "{\"a\": ") }),
        )
        .route("/loop", get(|| async { Redirect::temporary("/loop") }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                "late"
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

fn tool_spec(name: &str, method: &str, url: &str, extra: &Value) -> Value {
    let mut spec = json!({
        "name": name,
        "description": format!("test tool {name}"),
        "parameters": {"type": "object",
                       "properties": {"id": {"type": "string"}, "q": {"type": "string"},
                                      "count": {"type": "integer"}, "tags": {"type": "array"}},
                       "required": ["id"]},
        "method": method,
        "url": url,
        "timeoutSeconds": 2,
        "maxResponseBytes": 1 << 20,
    });
    for (key, value) in extra.as_object().unwrap() {
        spec[key] = value.clone();
    }
    spec
}

struct Fixture {
    tools: Vec<Arc<dyn Tool>>,
    ctx: ToolContext,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new(base: &str) -> Self {
        let none = json!({});
        let tools: ToolsSpec =
            serde_json::from_value(json!({"http": [{"toolset": "team", "tools": [
                tool_spec("create_item", "POST", &format!("{base}/items/{{id}}?q={{q}}"), &json!({
                    "body": {"count": "{count}", "tags": "{tags}", "note": "item {id}"},
                    "headers": [{"name": "X-Home", "valueFrom": {"env": "HOME"}}],
                })),
                tool_spec("text", "GET", &format!("{base}/text"), &none),
                tool_spec("fail", "GET", &format!("{base}/fail"), &none),
                tool_spec("huge", "GET", &format!("{base}/huge"), &none),
                tool_spec("bad_json", "GET", &format!("{base}/bad-json"), &none),
                tool_spec("redirect_loop", "GET", &format!("{base}/loop"), &none),
                tool_spec("slow", "GET", &format!("{base}/slow"), &none),
                tool_spec("down", "GET", "http://127.0.0.1:9/nothing", &none),
            ]}]}))
            .unwrap();
        let registry = Registry::builtin(&tools);
        let dir = tempfile::tempdir().unwrap();
        Self {
            tools: registry.tools_for(&["team".to_owned()]),
            ctx: ToolContext {
                workspace: Workspace::new(dir.path()).unwrap(),
                limits: ToolLimits::default(),
                sandbox: common::sandbox(),
                browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
                terminal: trajectory_worker::tools::terminal::Terminal::default(),
            },
            _dir: dir,
        }
    }

    async fn call(&self, name: &str, args: Value) -> ToolOutcome {
        let tool = self
            .tools
            .iter()
            .find(|tool| tool.spec().name == name)
            .unwrap_or_else(|| panic!("no tool {name}"));
        tool.call(args.as_object().unwrap().clone(), &self.ctx)
            .await
    }

    async fn error(&self, name: &str) -> String {
        match self.call(name, json!({"id": "1"})).await {
            ToolOutcome::Err(message) => message,
            ToolOutcome::Ok(value) => panic!("{name}: expected a tool error, got {value}"),
        }
    }
}

#[tokio::test]
async fn arguments_are_substituted_encoded_in_the_url_and_typed_in_the_body() {
    let address = start_service().await;
    let fixture = Fixture::new(&format!("http://{address}"));
    let outcome = fixture
        .call(
            "create_item",
            json!({"id": "a b/c", "q": "x&y=z", "count": 3, "tags": ["t1", "t2"]}),
        )
        .await;
    let ToolOutcome::Ok(value) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(value["status"], 200);
    let echoed = &value["result"];
    assert_eq!(echoed["id"], "a b/c", "{echoed}");
    assert_eq!(echoed["query"], "q=x%26y%3Dz", "{echoed}");
    assert_eq!(
        echoed["body"],
        json!({"count": 3, "tags": ["t1", "t2"], "note": "item a b/c"})
    );
    assert_eq!(echoed["home"], std::env::var("HOME").unwrap());

    let text = fixture.call("text", json!({"id": "1"})).await;
    assert_eq!(
        text,
        ToolOutcome::Ok(json!({"status": 200, "result": "plain words"}))
    );
}

#[tokio::test]
async fn a_missing_required_argument_is_a_tool_error() {
    let address = start_service().await;
    let fixture = Fixture::new(&format!("http://{address}"));
    let outcome = fixture.call("create_item", json!({"q": "x"})).await;
    assert_eq!(
        outcome,
        ToolOutcome::Err("create_item: missing required argument `id`".to_owned())
    );
}

#[tokio::test]
async fn every_failure_of_the_service_is_a_tool_error() {
    let address = start_service().await;
    let fixture = Fixture::new(&format!("http://{address}"));
    let fail = fixture.error("fail").await;
    assert_eq!(
        fail,
        "fail: the service answered HTTP 500: database on fire"
    );
    let huge = fixture.error("huge").await;
    assert!(
        huge.contains("larger than maxResponseBytes (1048576 bytes)"),
        "{huge}"
    );
    let bad = fixture.error("bad_json").await;
    assert!(
        bad.starts_with("bad_json: the service answered invalid JSON"),
        "{bad}"
    );
    let redirects = fixture.error("redirect_loop").await;
    assert!(redirects.contains("did not answer"), "{redirects}");
    let down = fixture.error("down").await;
    assert!(
        down.starts_with("down: the service did not answer"),
        "{down}"
    );
    assert!(
        !down.contains("127.0.0.1:9"),
        "errors leave the URL out: {down}"
    );
    let started = Instant::now();
    let slow = fixture.error("slow").await;
    assert!(slow.contains("did not answer"), "{slow}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_spec_whose_template_names_an_undeclared_argument_is_refused_at_validation() {
    let spec: RunSpec = serde_json::from_value(json!({
        "dataset": {"path": "d.jsonl"},
        "model": {"baseUrl": "http://m/v1", "name": "m"},
        "distribution": {"team": 50, "other_mcp": 50},
        "tools": {"http": [{"toolset": "team", "tools": [
            tool_spec("t", "GET", "http://svc/{id}/{nope}", &json!({})),
        ]}]},
    }))
    .unwrap();
    let messages: Vec<String> = spec.validate().iter().map(ToString::to_string).collect();
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert!(
        messages[0].starts_with("spec.distribution.other_mcp: unknown toolset \"other_mcp\""),
        "{messages:?}"
    );
    assert!(messages[0].ends_with(", team"), "{messages:?}");
    assert_eq!(
        messages[1],
        "spec.tools.http[0].tools[0].url: refers to the argument {nope}, which \
         `parameters.properties` does not declare"
    );
}

#[test]
fn the_mcp_example_run_file_is_valid() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mcp/run.yaml");
    let run = trajectory_worker::run::RunFile::load(&path).expect("examples/mcp/run.yaml loads");
    let declared: Vec<&str> = run.spec.tools.declared_toolsets().collect();
    assert_eq!(declared, ["time", "everything", "team"]);
}

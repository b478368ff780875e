//! A local run whose conversations draw the `browser` toolset, against the scripted model and a
//! real headless Chromium (scripts/browser/install.sh) loading a page from a local server: the
//! record holds the real snapshot the browser made.

mod common;

use axum::Router;
use axum::response::Html;
use axum::routing::get;
use common::{RunFixture, local_options, no_shutdown};
use serde_json::json;
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};
use trajectory_worker::run::local::run_local;

const PAGE: &str = "<!doctype html><title>Browser fixture</title><h1>Glossary</h1>\
    <p>A <a href=\"/bdfl\">BDFL</a> is a benevolent dictator for life.</p>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_conversation_records_the_real_snapshot() {
    let app = Router::new().route("/", get(|| async { Html(PAGE) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let site = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

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
    let app = Router::new().route("/", get(|| async { Html(PAGE) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let site = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

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

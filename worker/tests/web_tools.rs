//! The `web` toolset against real servers: Debian's searx with an offline engine over the
//! `python3-doc` pages, and Python's `http.server` serving those pages (`local_servers`). Every bad
//! backend or page ends as a tool error the model reads, or a capped result.

mod common;
mod local_servers;
mod web_servers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use local_servers::{DocsServer, PYTHON_DOCS, RedirectLoop, free_port, served_files};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_call_reply};
use trajectory_worker::run::plan;
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::{Tool, ToolContext, ToolOutcome, web};
use web_servers::Searx;

/// The page the searches below find first, and its path on the docs server.
const SUBPROCESS_PAGE: &str = "library/asyncio-subprocess.html";

/// The web tools with this `spec.tools.web`, local pages allowed.
fn web_tools(web: Value) -> (Arc<dyn Tool>, Arc<dyn Tool>) {
    let mut web = web;
    web["extract"]["allowPrivateAddresses"] = json!(true);
    tools_exactly(&web)
}

/// The web tools with exactly this `spec.tools.web`.
fn tools_exactly(web: &Value) -> (Arc<dyn Tool>, Arc<dyn Tool>) {
    let tools: ToolsSpec =
        serde_json::from_value(json!({ "web": web.clone() })).expect("tools spec");
    let mut tools = web::tools(&tools).expect("the web toolset builds");
    assert_eq!(tools.len(), 2);
    let extract = tools.pop().unwrap();
    let search = tools.pop().unwrap();
    (search, extract)
}

fn searxng(url: &str) -> Value {
    json!({"search": {"backend": "searxng", "url": url, "timeoutSeconds": 5}})
}

struct Context {
    ctx: ToolContext,
    _dir: tempfile::TempDir,
}

fn context() -> Context {
    let dir = tempfile::tempdir().unwrap();
    Context {
        ctx: common::tool_context(dir.path()),
        _dir: dir,
    }
}

async fn call(tool: &Arc<dyn Tool>, args: Value) -> ToolOutcome {
    let Value::Object(args) = args else {
        panic!("arguments are an object")
    };
    let context = context();
    tool.call(args, &context.ctx).await
}

/// The JSON of a successful call (the tools answer the reference's indented JSON text).
async fn ok(tool: &Arc<dyn Tool>, args: Value) -> Value {
    match call(tool, args).await {
        ToolOutcome::Ok(Value::String(text)) => {
            assert!(
                text.starts_with("{\n  \""),
                "not the reference's indented JSON: {text}"
            );
            serde_json::from_str(&text).expect("the result is JSON")
        }
        other => panic!("expected a result, got {other:?}"),
    }
}

async fn err(tool: &Arc<dyn Tool>, args: Value) -> String {
    match call(tool, args).await {
        ToolOutcome::Err(message) => message,
        other @ ToolOutcome::Ok(_) => panic!("expected a tool error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_search_returns_real_results_from_searx_in_the_reference_shape() {
    let docs = DocsServer::start(PYTHON_DOCS.as_ref());
    let searx = Searx::start(&docs);
    let (search, _) = web_tools(searxng(&searx.base_url()));
    let answer = ok(&search, json!({"query": "asyncio subprocess"})).await;
    assert_eq!(answer["success"], true);
    let web = answer["data"]["web"].as_array().unwrap();
    assert!((1..=5).contains(&web.len()), "{answer}");
    assert_eq!(web[0]["url"], docs.url(SUBPROCESS_PAGE), "{answer}");
    assert!(
        web[0]["title"]
            .as_str()
            .unwrap()
            .starts_with("Subprocesses"),
        "{answer}"
    );
    assert!(
        web[0]["description"]
            .as_str()
            .unwrap()
            .contains("create_subprocess_exec")
    );
    let positions: Vec<u64> = web
        .iter()
        .map(|r| r["position"].as_u64().unwrap())
        .collect();
    assert_eq!(positions, (1..=web.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        web[0].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["title", "url", "description", "position"]
    );

    // The same searx through the generic JSON backend, its fields found by the default pointers;
    // and a result count limit.
    let template = format!("{}/search?q={{query}}&format=json", searx.base_url());
    let (generic, _) =
        web_tools(json!({"search": {"backend": "json", "url": template, "maxResults": 2}}));
    let answer = ok(&generic, json!({"query": "asyncio subprocess"})).await;
    let web = answer["data"]["web"].as_array().unwrap();
    assert_eq!(web.len(), 2, "{answer}");
    assert_eq!(web[0]["url"], docs.url(SUBPROCESS_PAGE));

    // A query with search syntax the engine chokes on is an empty list, not a failure.
    let odd = ok(&search, json!({"query": "\"unbalanced AND ("})).await;
    assert_eq!(odd["success"], true);
    assert!(
        err(&search, json!({"query": ""}))
            .await
            .contains("`query` is empty")
    );
}

#[tokio::test]
async fn an_extraction_is_the_markdown_main_text_of_a_real_page() {
    let docs = DocsServer::start(PYTHON_DOCS.as_ref());
    let (_, extract) = web_tools(json!({"search": {"url": "http://127.0.0.1:9"}}));
    let answer = ok(&extract, json!({"urls": [docs.url(SUBPROCESS_PAGE)]})).await;
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 1);
    let page = &results[0];
    assert_eq!(page["error"], Value::Null, "{page}");
    assert_eq!(page["url"], docs.url(SUBPROCESS_PAGE));
    assert!(
        page["title"].as_str().unwrap().starts_with("Subprocesses"),
        "{page}"
    );
    let content = page["content"].as_str().unwrap();
    assert!(content.contains("create_subprocess_exec"), "{content}");
    // Markdown, not HTML: no tags left, and the code and headings marked up.
    assert!(
        !content.contains("<div") && !content.contains("<a "),
        "{content}"
    );
    assert!(content.contains('`') || content.contains("# "), "{content}");
    // The page is longer than the reference's budget: cut, and the model is told.
    assert!(
        content.chars().count() < 5200,
        "{}",
        content.chars().count()
    );
    assert!(
        content.ends_with("characters for context management ...]"),
        "{content}"
    );
    assert_eq!(
        page.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["url", "title", "content", "error"]
    );
}

#[tokio::test]
async fn plain_text_passes_through_and_one_bad_url_of_several_is_an_error_entry() {
    let text = "Plain notes.\nSecond line, kept as it is: <not a tag>.\n";
    let (_dir, files) = served_files(&[("notes.txt", text.as_bytes())]);
    let (_, extract) = web_tools(json!({"search": {"url": "http://127.0.0.1:9"}}));
    let missing = files.url("missing.html");
    let answer = ok(&extract, json!({"urls": [files.url("notes.txt"), missing]})).await;
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results[0]["content"], text);
    assert_eq!(results[0]["error"], Value::Null);
    assert_eq!(results[1]["url"], missing);
    assert_eq!(results[1]["content"], "");
    assert!(
        results[1]["error"].as_str().unwrap().contains("404"),
        "{answer}"
    );
}

#[tokio::test]
async fn a_search_backend_that_is_down_or_answers_garbage_is_a_tool_error() {
    let down = format!("http://127.0.0.1:{}", free_port());
    let (search, _) = web_tools(searxng(&down));
    let message = err(&search, json!({"query": "python"})).await;
    assert!(message.starts_with("Error searching web: "), "{message}");
    assert!(message.to_lowercase().contains("connect"), "{message}");

    let (_dir, files) = served_files(&[
        ("garbage.txt", b"<html>this is no JSON</html>"),
        ("wrong.json", br#"{"items": [{"title": "x"}]}"#),
    ]);
    // A searxng URL that is no searx: /search is 404 on a plain file server.
    let (search, _) = web_tools(searxng(&files.url("")));
    let message = err(&search, json!({"query": "python"})).await;
    assert!(message.contains("HTTP 404"), "{message}");

    let garbage = format!("{}?q={{query}}", files.url("garbage.txt"));
    let (search, _) = web_tools(json!({"search": {"backend": "json", "url": garbage}}));
    let message = err(&search, json!({"query": "python"})).await;
    assert!(message.contains("is not JSON"), "{message}");

    let wrong = format!("{}?q={{query}}", files.url("wrong.json"));
    let (search, _) = web_tools(json!({"search": {"backend": "json", "url": wrong}}));
    let message = err(&search, json!({"query": "python"})).await;
    assert!(
        message.contains("no result list at \"/results\""),
        "{message}"
    );
}

#[tokio::test]
async fn a_huge_page_is_read_up_to_the_byte_limit_and_capped() {
    let paragraph = "<p>Lorem ipsum dolor sit amet, a sentence that repeats for ever.</p>\n";
    let huge = format!(
        "<html><head><title>Huge</title></head><body><article>{}</article></body></html>",
        paragraph.repeat(200_000)
    );
    assert!(huge.len() > 12 * 1024 * 1024);
    let (_dir, files) = served_files(&[("huge.html", huge.as_bytes())]);
    let (_, extract) = web_tools(json!({
        "search": {"url": "http://127.0.0.1:9"},
        "extract": {"maxPageBytes": 1_048_576},
    }));
    let started = Instant::now();
    let answer = ok(&extract, json!({"urls": [files.url("huge.html")]})).await;
    let content = answer["results"][0]["content"].as_str().unwrap();
    assert!(content.starts_with("Lorem ipsum"), "{content}");
    assert!(content.chars().count() < 5200);
    assert!(content.ends_with("characters for context management ...]"));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_redirect_loop_a_binary_page_a_pdf_and_an_internal_address_are_tool_errors() {
    let (_, extract) = web_tools(json!({"search": {"url": "http://127.0.0.1:9"}}));
    let redirects = RedirectLoop::start().await;
    let message = err(&extract, json!({"urls": [redirects.url()]})).await;
    assert!(
        message.starts_with("Error extracting content: "),
        "{message}"
    );
    assert!(message.contains("redirect loop"), "{message}");

    let png =
        std::fs::read(format!("{PYTHON_DOCS}/_static/og-image.png")).expect("a PNG of python3-doc");
    let pdf = b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n";
    let (_dir, files) = served_files(&[("logo.png", &png), ("paper.pdf", pdf)]);
    let message = err(&extract, json!({"urls": [files.url("logo.png")]})).await;
    assert!(
        message.contains("cannot extract a binary page (image/png)"),
        "{message}"
    );
    let message = err(&extract, json!({"urls": files.url("paper.pdf")})).await;
    assert!(message.contains("cannot extract PDF"), "{message}");

    // By default the model cannot reach loopback, private or metadata addresses.
    let (_, guarded) = tools_exactly(&json!({"search": {"url": "http://127.0.0.1:9"}}));
    for url in [
        files.url("logo.png"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        "http://localhost:1/".to_owned(),
    ] {
        let message = err(&guarded, json!({ "urls": [url] })).await;
        assert!(
            message.contains("Blocked: URL targets a private or internal network address"),
            "{message}"
        );
    }
    let message = err(&guarded, json!({"urls": ["file:///etc/passwd"]})).await;
    assert!(message.contains("only http:// and https://"), "{message}");
}

#[tokio::test]
async fn a_conversation_searches_then_extracts_and_its_record_holds_the_real_results() {
    let docs = DocsServer::start(PYTHON_DOCS.as_ref());
    let searx = Searx::start(&docs);
    let page = docs.url(SUBPROCESS_PAGE);
    let server = ScriptedServer::start([
        Step::ok(tool_call_reply(
            "web_search",
            &json!({"query": "asyncio subprocess"}),
        )),
        Step::ok(tool_call_reply("web_extract", &json!({"urls": [page]}))),
        Step::ok(text_reply("Use asyncio.create_subprocess_exec.")),
    ])
    .await;
    let fixture = common::RunFixture::new(&server.base_url(), 1)
        .with("/distribution", json!({"web": 100}))
        .with(
            "/tools",
            json!({"web": {
                "search": {"url": searx.base_url()},
                "extract": {"allowPrivateAddresses": true},
            }}),
        );
    let (manifest, _) = plan::plan(&fixture.location()).unwrap();
    assert_eq!(manifest.tool_catalog, ["web_search", "web_extract"]);
    let summary = common::batch_zero(&fixture, &fixture.engine())
        .await
        .unwrap();
    assert_eq!(summary.succeeded, 1, "{summary:?}");

    let records = fixture.batch_lines(0);
    let record = &records[0];
    assert_eq!(record["toolsets_used"], json!(["web"]), "{record}");
    for tool in ["web_search", "web_extract"] {
        assert_eq!(
            record["tool_stats"][tool],
            json!({"count": 1, "success": 1, "failure": 0}),
            "{record}"
        );
    }
    let tool_turns: Vec<&str> = record["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|turn| turn["from"] == "tool")
        .map(|turn| turn["value"].as_str().unwrap())
        .collect();
    assert_eq!(tool_turns.len(), 2, "{record}");
    assert!(
        tool_turns[0].contains(&page) && tool_turns[0].contains("\"position\": 1"),
        "{}",
        tool_turns[0]
    );
    assert!(
        tool_turns[1].contains("create_subprocess_exec"),
        "{}",
        tool_turns[1]
    );
}

/// Client CPU of the tools, beyond the backends' own (searx and the page server are other
/// processes, so this process's CPU time is the client's). The figure in docs/benchmarks.md is
/// this test alone in a release build; in a debug build beside other tests the bound is loose.
#[tokio::test]
async fn client_cpu_per_call_is_small() {
    let docs = DocsServer::start(PYTHON_DOCS.as_ref());
    let searx = Searx::start(&docs);
    let (search, extract) = web_tools(searxng(&searx.base_url()));
    let calls = 40;
    let _ = ok(&search, json!({"query": "warm up"})).await;
    let (search_cpu, search_wall) = measure(calls, || {
        ok(&search, json!({"query": "asyncio subprocess"}))
    })
    .await;
    let page = docs.url(SUBPROCESS_PAGE);
    let (extract_cpu, extract_wall) =
        measure(calls, || ok(&extract, json!({"urls": [page.clone()]}))).await;
    eprintln!(
        "web_search: {search_cpu:?} client CPU per call ({search_wall:?} wall); \
         web_extract of a {} KB page: {extract_cpu:?} client CPU per call ({extract_wall:?} wall)",
        std::fs::metadata(format!("{PYTHON_DOCS}/{SUBPROCESS_PAGE}"))
            .unwrap()
            .len()
            / 1024
    );
    assert!(search_cpu < Duration::from_millis(20), "{search_cpu:?}");
    assert!(extract_cpu < Duration::from_millis(200), "{extract_cpu:?}");
}

/// CPU time (user + system) of this process and wall time per call of `calls` sequential calls.
async fn measure<F, Fut>(calls: u32, mut call: F) -> (Duration, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Value>,
{
    let cpu = || {
        let usage =
            nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).unwrap();
        let time = |t: nix::sys::time::TimeVal| {
            Duration::new(
                u64::try_from(t.tv_sec()).unwrap(),
                u32::try_from(t.tv_usec()).unwrap() * 1000,
            )
        };
        time(usage.user_time()) + time(usage.system_time())
    };
    let (cpu_before, wall_before) = (cpu(), Instant::now());
    for _ in 0..calls {
        std::hint::black_box(call().await);
    }
    (
        cpu().saturating_sub(cpu_before) / calls,
        wall_before.elapsed() / calls,
    )
}

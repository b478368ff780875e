//! The browser tools against a real headless Chromium (Debian's `chromium`, installed by
//! `scripts/browser/install.sh`) loading a small local site served by axum: pages with a link,
//! a search form, an image, a cookie, and one that never answers. Without Chromium these tests
//! fail, naming the launch error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, Uri, header};
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use serde_json::{Value, json};

use super::pool::Pool;
use super::{Settings, tools_on};
use crate::spec::BrowserSpec;
use crate::tools::sandbox::{LandlockMode, Sandbox};
use crate::tools::{Tool, ToolContext, ToolLimits, ToolOutcome, Workspace};

const HOME: &str = r#"<!doctype html><html><head><title>Fixture home</title></head><body>
<h1>Fixture home</h1>
<p>Read the <a href="/tutorial.html">Python tutorial</a> first.</p>
<form action="/search" method="get" role="search">
  <label for="q">Search the docs</label> <input id="q" name="q" type="search">
  <button type="submit">Go</button>
</form>
<img src="/logo.png" alt="Project logo" width="10" height="10">
<div style="height: 3000px">tall</div>
</body></html>"#;

const TUTORIAL: &str = r#"<!doctype html><html><head><title>Tutorial</title></head><body>
<h1>An informal introduction</h1><p>In the following examples, input and output are
distinguished by the presence or absence of prompts.</p>
<a href="/">Back home</a></body></html>"#;

/// A one-pixel PNG.
const PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0x15, 0xc4,
    0x89, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0xf0,
    0x1f, 0x00, 0x05, 0x00, 0x01, 0xff, 0x89, 0x99, 0x3d, 0x1d, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

fn query_value(uri: &Uri, name: &str) -> String {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.replace('+', " "))
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect()
}

/// Serves the site on an ephemeral loopback port; returns its base URL.
async fn site() -> String {
    let app = Router::new()
        .route("/", get(|| async { Html(HOME) }))
        .route("/tutorial.html", get(|| async { Html(TUTORIAL) }))
        .route(
            "/logo.png",
            get(|| async { ([(header::CONTENT_TYPE, "image/png")], PNG) }),
        )
        .route(
            "/search",
            get(|uri: Uri| async move {
                let q = query_value(&uri, "q");
                Html(format!(
                    "<!doctype html><title>Search results</title><h1>Results for {q}</h1>"
                ))
            }),
        )
        .route(
            "/set-cookie",
            get(|uri: Uri| async move {
                let value = query_value(&uri, "v");
                (
                    [(header::SET_COOKIE, format!("token={value}; Path=/"))],
                    Html(format!(
                        "<!doctype html><title>Set</title><p>set {value}</p>"
                    )),
                )
                    .into_response()
            }),
        )
        .route(
            "/show-cookie",
            get(|headers: HeaderMap| async move {
                let cookie = headers
                    .get(header::COOKIE)
                    .and_then(|value| value.to_str().ok())
                    .unwrap_or("none")
                    .to_owned();
                Html(format!(
                    "<!doctype html><title>Cookies</title><p>cookies: {cookie}</p>"
                ))
            }),
        )
        .route("/hang", get(std::future::pending::<Html<&'static str>>));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}")
}

struct Browser {
    pool: Arc<Pool>,
    tools: Vec<Arc<dyn Tool>>,
    dir: tempfile::TempDir,
}

impl Browser {
    fn new(spec: &BrowserSpec) -> Self {
        let pool = Arc::new(Pool::new(Settings::from(spec), None));
        Self {
            tools: tools_on(&pool, None),
            pool,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn conversation(&self) -> ToolContext {
        ToolContext {
            workspace: Workspace::new(self.dir.path()).unwrap(),
            limits: ToolLimits::default(),
            sandbox: Sandbox::local(LandlockMode::Auto),
            browser: super::ConversationBrowser::default(),
            terminal: crate::tools::terminal::Terminal::default(),
        }
    }

    async fn call(&self, ctx: &ToolContext, name: &str, args: Value) -> ToolOutcome {
        let tool = self
            .tools
            .iter()
            .find(|tool| tool.spec().name == name)
            .unwrap_or_else(|| panic!("no tool {name}"));
        let Value::Object(args) = args else {
            panic!("arguments must be an object")
        };
        tool.call(args, ctx).await
    }

    async fn ok(&self, ctx: &ToolContext, name: &str, args: Value) -> Value {
        match self.call(ctx, name, args.clone()).await {
            ToolOutcome::Ok(value) => {
                assert_eq!(value["success"], true, "{name} {args}: {value}");
                value
            }
            ToolOutcome::Err(message) => panic!("{name} {args} failed: {message}"),
        }
    }

    async fn err(&self, ctx: &ToolContext, name: &str, args: Value) -> String {
        match self.call(ctx, name, args.clone()).await {
            ToolOutcome::Ok(value) => panic!("{name} {args} should fail, answered {value}"),
            ToolOutcome::Err(message) => message,
        }
    }

    async fn navigate(&self, ctx: &ToolContext, url: impl Into<String>) -> Value {
        self.ok(ctx, "browser_navigate", json!({"url": url.into()}))
            .await
    }

    async fn snapshot(&self, ctx: &ToolContext) -> String {
        let value = self.ok(ctx, "browser_snapshot", json!({})).await;
        value["snapshot"].as_str().unwrap().to_owned()
    }

    /// Browser contexts Chromium has open besides its default one.
    async fn open_contexts(&self) -> usize {
        let chromium = self.pool.chromium().await.unwrap();
        let contexts = chromium
            .browser
            .execute(
                chromiumoxide::cdp::browser_protocol::target::GetBrowserContextsParams::default(),
            )
            .await
            .unwrap();
        contexts.result.browser_context_ids.len()
    }
}

#[test]
fn browser_vision_is_offered_exactly_when_a_vision_model_is_configured() {
    let names = |tools: serde_json::Value| -> Vec<String> {
        let tools: crate::spec::ToolsSpec = serde_json::from_value(tools).unwrap();
        super::tools(&tools, None)
            .unwrap()
            .iter()
            .map(|tool| tool.spec().name.clone())
            .collect()
    };
    let without = names(json!({"browser": {}}));
    assert_eq!(without.len(), 9);
    assert!(!without.contains(&"browser_vision".to_owned()));
    let with =
        names(json!({"browser": {}, "vision": {"baseUrl": "http://vl:8000/v1", "model": "vl"}}));
    assert_eq!(with.last().map(String::as_str), Some("browser_vision"));
    assert_eq!(with[..9], without[..]);
}

/// The ref of the snapshot line that contains `needle` (`@e3`).
fn ref_of(snapshot: &str, needle: &str) -> String {
    let line = snapshot
        .lines()
        .find(|line| line.contains(needle) && line.contains("[ref="))
        .unwrap_or_else(|| panic!("no ref for {needle:?} in\n{snapshot}"));
    let start = line.find("[ref=").unwrap() + 5;
    let end = start + line[start..].find(']').unwrap();
    format!("@{}", &line[start..end])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn navigate_snapshot_click_type_submit_back_and_images_on_real_pages() {
    let site = site().await;
    let browser = Browser::new(&BrowserSpec::default());
    let ctx = browser.conversation();

    let before = browser.err(&ctx, "browser_snapshot", json!({})).await;
    assert_eq!(before, "no page is open; call browser_navigate first");

    let navigated = browser.navigate(&ctx, format!("{site}/")).await;
    assert_eq!(
        navigated,
        json!({"success": true, "url": format!("{site}/"), "title": "Fixture home"})
    );

    let home = browser.snapshot(&ctx).await;
    assert!(home.starts_with("- document \"Fixture home\"\n"), "{home}");
    assert!(
        home.contains("heading \"Fixture home\" [ref=e1] [level=1]"),
        "{home}"
    );
    let link = ref_of(&home, "link \"Python tutorial\"");
    let clicked = browser
        .ok(
            &ctx,
            "browser_click",
            json!({"ref": link.trim_start_matches('@')}),
        )
        .await;
    assert_eq!(clicked, json!({"success": true, "clicked": link}));
    let tutorial = browser.snapshot(&ctx).await;
    assert!(
        tutorial.contains("heading \"An informal introduction\""),
        "{tutorial}"
    );
    // The old page's refs are gone with it.
    let stale = browser
        .err(&ctx, "browser_click", json!({"ref": "@e9"}))
        .await;
    assert!(stale.contains("not in the last snapshot"), "{stale}");

    let back = browser.ok(&ctx, "browser_back", json!({})).await;
    assert_eq!(back, json!({"success": true, "url": format!("{site}/")}));
    let home = browser.snapshot(&ctx).await;
    let search = ref_of(&home, "searchbox \"Search the docs\"");
    let typed = browser
        .ok(
            &ctx,
            "browser_type",
            json!({"ref": search, "text": "lambda"}),
        )
        .await;
    assert_eq!(
        typed,
        json!({"success": true, "typed": "lambda", "element": search})
    );
    assert!(
        browser
            .snapshot(&ctx)
            .await
            .contains("searchbox \"Search the docs\"")
    );
    let pressed = browser
        .ok(&ctx, "browser_press", json!({"key": "Enter"}))
        .await;
    assert_eq!(pressed, json!({"success": true, "pressed": "Enter"}));
    let results = browser.snapshot(&ctx).await;
    assert!(
        results.contains("heading \"Results for lambda\""),
        "{results}"
    );

    browser.ok(&ctx, "browser_back", json!({})).await;
    let images = browser.ok(&ctx, "browser_get_images", json!({})).await;
    assert_eq!(
        images,
        json!({"success": true, "count": 1, "images": [
            {"src": format!("{site}/logo.png"), "alt": "Project logo", "width": 1, "height": 1}
        ]})
    );
    let scrolled = browser
        .ok(&ctx, "browser_scroll", json!({"direction": "down"}))
        .await;
    assert_eq!(scrolled, json!({"success": true, "scrolled": "down"}));
    let sideways = browser
        .err(&ctx, "browser_scroll", json!({"direction": "left"}))
        .await;
    assert_eq!(sideways, "Invalid direction 'left'. Use 'up' or 'down'.");
    let unknown = browser
        .err(&ctx, "browser_press", json!({"key": "Hyper"}))
        .await;
    assert!(unknown.starts_with("unknown key \"Hyper\""), "{unknown}");
    let not_a_ref = browser
        .err(&ctx, "browser_type", json!({"ref": "the box", "text": "x"}))
        .await;
    assert!(not_a_ref.contains("is not a ref"), "{not_a_ref}");

    assert_eq!(
        browser.ok(&ctx, "browser_close", json!({})).await,
        json!({"success": true, "closed": true})
    );
    assert_eq!(
        browser.err(&ctx, "browser_back", json!({})).await,
        "no page is open; call browser_navigate first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_hangs_is_a_tool_error_and_the_page_stays_usable() {
    let site = site().await;
    let browser = Browser::new(&BrowserSpec {
        navigation_timeout_seconds: 2,
        ..BrowserSpec::default()
    });
    let ctx = browser.conversation();
    // Chromium's start-up is not the page's time.
    browser.pool.chromium().await.unwrap();
    let started = Instant::now();
    let hung = browser
        .err(
            &ctx,
            "browser_navigate",
            json!({"url": format!("{site}/hang")}),
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(hung.contains("timed out after 2 s"), "{hung}");
    let home = browser.navigate(&ctx, format!("{site}/")).await;
    assert_eq!(home["title"], "Fixture home");
    // A port that was just free: a refused connection is an error too.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let refused = browser
        .err(
            &ctx,
            "browser_navigate",
            json!({"url": format!("http://{closed}/")}),
        )
        .await;
    assert!(refused.contains("ERR_CONNECTION_REFUSED"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_and_chrome_urls_are_refused_before_the_browser_sees_them() {
    let browser = Browser::new(&BrowserSpec::default());
    let ctx = browser.conversation();
    for url in [
        "file:///etc/passwd",
        "FILE:///etc/passwd",
        " chrome://version",
        "view-source:file:///etc/passwd",
        "javascript:alert(1)",
    ] {
        let refused = browser
            .err(&ctx, "browser_navigate", json!({"url": url}))
            .await;
        assert!(
            refused.starts_with("URLs with the scheme"),
            "{url}: {refused}"
        );
        assert!(
            refused.ends_with("allowed: http, https (tools.browser.allowedSchemes)"),
            "{refused}"
        );
    }
    // Nothing was started for them.
    assert!(!browser.pool.started().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_do_not_share_cookies_and_their_contexts_close_with_them() {
    let site = site().await;
    let browser = Browser::new(&BrowserSpec::default());
    let first = browser.conversation();
    let second = browser.conversation();
    browser
        .navigate(&first, format!("{site}/set-cookie?v=first"))
        .await;
    browser
        .navigate(&first, format!("{site}/show-cookie"))
        .await;
    assert!(
        browser
            .snapshot(&first)
            .await
            .contains("cookies: token=first")
    );
    browser
        .navigate(&second, format!("{site}/show-cookie"))
        .await;
    let seen = browser.snapshot(&second).await;
    assert!(seen.contains("cookies: none"), "{seen}");
    assert_eq!(browser.open_contexts().await, 2);

    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    while browser.open_contexts().await != 1 {
        assert!(
            Instant::now() < deadline,
            "the first conversation's context is still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new conversation starts without the first one's cookie, on the same Chromium.
    let third = browser.conversation();
    browser
        .navigate(&third, format!("{site}/show-cookie"))
        .await;
    assert!(browser.snapshot(&third).await.contains("cookies: none"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_runs_with_an_empty_environment_and_its_profile_is_removed_with_it() {
    // The test process has a full environment (PATH at least); Chromium gets none of it.
    let site = site().await;
    let browser = Browser::new(&BrowserSpec::default());
    let ctx = browser.conversation();
    browser.navigate(&ctx, format!("{site}/")).await;
    let chromium = browser.pool.chromium().await.unwrap();
    let pid = chromium.pid();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let names: Vec<String> = environ
        .split(|byte| *byte == 0)
        .filter_map(|entry| std::str::from_utf8(entry).ok())
        .filter_map(|entry| entry.split_once('=').map(|(name, _)| name.to_owned()))
        .collect();
    // Debian's wrapper script adds its own (CHROMIUM_FLAGS, its public GOOGLE_API_KEY, ...);
    // none of the test process's variables may get through but the two the pool sets.
    assert!(
        names.iter().any(|name| name == "CHROMIUM_FLAGS"),
        "{names:?}"
    );
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        assert!(
            !names.contains(&name) || ["PATH", "HOME", "PWD"].contains(&name.as_str()),
            "Chromium's environment holds the worker's {name}: {names:?}"
        );
    }
    let pwd = environ
        .split(|byte| *byte == 0)
        .find_map(|entry| entry.strip_prefix(b"PWD="))
        .map(|pwd| String::from_utf8_lossy(pwd).into_owned());
    assert_eq!(
        pwd.as_deref().map(std::path::Path::new),
        chromium.profile_dir().as_deref()
    );
    let profile = chromium.profile_dir().unwrap();
    assert!(profile.join("profile").is_dir());
    drop(chromium);
    drop(ctx);
    drop(browser);
    let deadline = Instant::now() + Duration::from_secs(5);
    while profile.exists() || std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "Chromium or its profile outlived the pool"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chromium_that_died_is_a_tool_error_and_the_next_navigation_starts_a_new_one() {
    let site = site().await;
    let browser = Browser::new(&BrowserSpec::default());
    let ctx = browser.conversation();
    browser.navigate(&ctx, format!("{site}/")).await;
    let first = browser.pool.chromium().await.unwrap();
    let pid = first.pid();
    drop(first);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let gone = browser.err(&ctx, "browser_snapshot", json!({})).await;
    assert!(gone.starts_with("the browser failed"), "{gone}");
    let again = browser.navigate(&ctx, format!("{site}/")).await;
    assert_eq!(again["title"], "Fixture home");
    assert_ne!(browser.pool.chromium().await.unwrap().pid(), pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chromium_that_cannot_start_is_a_tool_error_naming_it() {
    let browser = Browser::new(&BrowserSpec {
        chromium_path: "/nonexistent/chromium".to_owned(),
        ..BrowserSpec::default()
    });
    let ctx = browser.conversation();
    let failed = browser
        .err(
            &ctx,
            "browser_navigate",
            json!({"url": "http://127.0.0.1:9/"}),
        )
        .await;
    assert!(
        failed.starts_with("the browser could not be started: cannot start /nonexistent/chromium:"),
        "{failed}"
    );
}

/// The figures of docs/benchmarks.md: Chromium's start-up (once per worker), a conversation's
/// context (once per conversation), and the worker's own CPU per call (Chromium is another
/// process, so the worker's CPU time is the client's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run it with --ignored --nocapture (see docs/benchmarks.md)"]
async fn measure_start_up_and_client_cpu_per_call() {
    let site = site().await;
    let browser = Browser::new(&BrowserSpec::default());
    let started = Instant::now();
    browser.pool.chromium().await.unwrap();
    let launch = started.elapsed();
    let mut opens = Vec::new();
    for _ in 0..10 {
        let chromium = browser.pool.chromium().await.unwrap();
        let started = Instant::now();
        let session = super::session::Session::open(chromium).await.unwrap();
        opens.push(started.elapsed());
        drop(session);
    }
    let mut contexts = Vec::new();
    for _ in 0..10 {
        let ctx = browser.conversation();
        let started = Instant::now();
        browser
            .navigate(&ctx, format!("{site}/tutorial.html"))
            .await;
        contexts.push(started.elapsed());
    }
    let ctx = browser.conversation();
    browser.navigate(&ctx, format!("{site}/")).await;
    let calls = 200;
    for (name, args) in [
        ("browser_snapshot", json!({})),
        ("browser_scroll", json!({"direction": "down"})),
        ("browser_get_images", json!({})),
        (
            "browser_navigate",
            json!({"url": format!("{site}/tutorial.html")}),
        ),
    ] {
        let cpu_before = cpu_time();
        let wall = Instant::now();
        for _ in 0..calls {
            browser.ok(&ctx, name, args.clone()).await;
        }
        let per_call_cpu = cpu_time().saturating_sub(cpu_before) / calls;
        let per_call_wall = wall.elapsed() / calls;
        println!("{name}: worker CPU {per_call_cpu:?} per call, wall {per_call_wall:?} per call");
    }
    contexts.sort();
    opens.sort();
    println!(
        "a conversation's context and page: median {:?}",
        opens[opens.len() / 2]
    );
    println!(
        "Chromium start-up {launch:?}; first navigation of a conversation (new context + page + load) median {:?}",
        contexts[contexts.len() / 2]
    );
}

fn cpu_time() -> Duration {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).unwrap();
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(u64::try_from(t.tv_sec()).unwrap())
            + Duration::from_micros(u64::try_from(t.tv_usec()).unwrap())
    };
    time(usage.user_time()) + time(usage.system_time())
}

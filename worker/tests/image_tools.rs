//! The `vision` and `image_gen` toolsets on the wire. No vision or image model ships in any
//! registry reachable here, so both endpoints are the scripted OpenAI-compatible server (testkit),
//! which records what it was sent; the images are real files: PNGs of Debian's `python3-doc`, a GIF
//! of Debian's `searx` (both installed by scripts/web/install.sh), and a JPEG made by the
//! `jpeg-encoder` crate. Images given by URL come from Python's `http.server` (`local_servers`).
//!
//! Each test asserts what the endpoint received (the model, the question, the key as a Bearer
//! token, a data URL whose bytes are exactly the file's) and what the model was shown; every bad
//! input is a tool error and the endpoint is not asked. The last test is a `local` run whose
//! record holds a real `image_generate` and `vision_analyze` result.

mod common;
mod local_servers;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use local_servers::{PYTHON_DOCS, RedirectLoop, served_files as served};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    ScriptedServer, Step, images_b64_reply, images_url_reply, text_reply, tool_call_reply,
};
use trajectory_worker::run::local::run_local;
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::{Tool, ToolContext, ToolOutcome, image_gen, vision};

/// A real PNG of `python3-doc` (33 KB, 8-bit RGBA).
const STAR_PNG: &str = "_images/turtle-star.png";
/// A real SVG of `python3-doc`, which the vision model cannot read.
const PY_SVG: &str = "_static/py.svg";
/// A real GIF of `searx` (a dependency of the `searx` package).
const LOADER_GIF: &str = "/usr/share/python3-searx/static/themes/oscar/img/loader.gif";

/// The key the tools read: `CARGO_PKG_NAME`, which cargo sets for every test process (tests
/// cannot set variables: the workspace forbids `unsafe`).
const KEY_ENV: &str = "CARGO_PKG_NAME";
const BEARER: &str = "Bearer trajectory-worker";

fn python_doc(path: &str) -> Vec<u8> {
    let path = Path::new(PYTHON_DOCS).join(path);
    std::fs::read(&path).unwrap_or_else(|err| {
        panic!(
            "{}: {err}; run scripts/web/install.sh (python3-doc)",
            path.display()
        )
    })
}

/// A real baseline JPEG: a 64×48 colour gradient.
fn jpeg() -> Vec<u8> {
    let (width, height) = (64u16, 48u16);
    let pixels: Vec<u8> = (0..height)
        .flat_map(|y| {
            (0..width).flat_map(move |x| {
                let x = u8::try_from(x * 4).unwrap();
                let y = u8::try_from(y * 5).unwrap();
                [x, y, 128]
            })
        })
        .collect();
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 85)
        .encode(&pixels, width, height, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// The one tool of a toolset built from `tools`.
fn only_tool(tools: Vec<Arc<dyn Tool>>) -> Arc<dyn Tool> {
    assert_eq!(tools.len(), 1);
    tools.into_iter().next().unwrap()
}

/// `vision_analyze` against `server`, local image URLs allowed, with `extra` settings.
fn vision_tool(server: &ScriptedServer, extra: &Value) -> Arc<dyn Tool> {
    let mut vision = json!({
        "baseUrl": server.base_url(),
        "model": "scripted-vl",
        "apiKey": {"env": KEY_ENV},
        "allowPrivateAddresses": true,
        "timeoutSeconds": 5,
        "downloadTimeoutSeconds": 5,
    });
    vision
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let tools: ToolsSpec = serde_json::from_value(json!({ "vision": vision })).unwrap();
    only_tool(vision::tools(&tools).expect("the vision toolset builds"))
}

/// `image_generate` against `server`, with `extra` settings.
fn image_tool(server: &ScriptedServer, extra: &Value) -> Arc<dyn Tool> {
    let mut image_gen = json!({
        "baseUrl": server.base_url(),
        "model": "scripted-image",
        "apiKey": {"env": KEY_ENV},
        "timeoutSeconds": 5,
    });
    image_gen
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let tools: ToolsSpec = serde_json::from_value(json!({ "imageGen": image_gen })).unwrap();
    only_tool(image_gen::tools(&tools).expect("the image_gen toolset builds"))
}

struct Conversation {
    ctx: ToolContext,
    dir: tempfile::TempDir,
}

impl Conversation {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self {
            ctx: common::tool_context(dir.path()),
            dir,
        }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    async fn call(&self, tool: &Arc<dyn Tool>, args: Value) -> ToolOutcome {
        let Value::Object(args) = args else {
            panic!("arguments are an object")
        };
        tool.call(args, &self.ctx).await
    }

    /// The JSON of a successful call, which must be the reference's indented JSON text.
    async fn ok(&self, tool: &Arc<dyn Tool>, args: Value) -> Value {
        match self.call(tool, args).await {
            ToolOutcome::Ok(Value::String(text)) => {
                assert!(text.starts_with("{\n  \"success\": true"), "{text}");
                serde_json::from_str(&text).expect("the result is JSON")
            }
            other => panic!("expected a result, got {other:?}"),
        }
    }

    async fn err(&self, tool: &Arc<dyn Tool>, args: Value) -> String {
        match self.call(tool, args).await {
            ToolOutcome::Err(message) => message,
            other @ ToolOutcome::Ok(_) => panic!("expected a tool error, got {other:?}"),
        }
    }
}

fn analyze(image_url: &str) -> Value {
    json!({"image_url": image_url, "question": "How many points has the star?"})
}

#[tokio::test]
async fn a_workspace_png_reaches_the_model_as_a_data_url_with_the_question_model_and_key() {
    let server =
        ScriptedServer::start([Step::ok(text_reply(" A yellow star with 36 points. "))]).await;
    let tool = vision_tool(&server, &json!({}));
    let conversation = Conversation::new();
    let png = python_doc(STAR_PNG);
    std::fs::create_dir(conversation.root().join("pics")).unwrap();
    std::fs::write(conversation.root().join("pics/star.png"), &png).unwrap();

    let result = conversation.ok(&tool, analyze("pics/star.png")).await;
    assert_eq!(
        result,
        json!({"success": true, "analysis": "A yellow star with 36 points."})
    );

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert_eq!(request.path, "/v1/chat/completions");
    assert_eq!(request.authorization.as_deref(), Some(BEARER));
    assert_eq!(request.body["model"], "scripted-vl");
    assert_eq!(request.body["temperature"], 0.1);
    assert_eq!(request.body["max_tokens"], 2000);
    let messages = request.body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0]["role"], "user");
    assert_eq!(
        messages[0]["content"][0],
        json!({"type": "text", "text": "Fully describe and explain everything about this image, then answer the following question:\n\nHow many points has the star?"})
    );
    assert_eq!(common::sent_image(request), ("image/png".to_owned(), png));
}

#[tokio::test]
async fn image_urls_are_fetched_from_a_real_server_and_each_format_is_told_by_its_bytes() {
    let png = python_doc(STAR_PNG);
    let gif = std::fs::read(LOADER_GIF).expect("searx's loader.gif (scripts/web/install.sh)");
    let jpeg = jpeg();
    // Names that lie about the format: the bytes decide.
    let (_dir, site) = served(&[("star.jpg", &png), ("loader.png", &gif), ("photo", &jpeg)]);
    let server = ScriptedServer::start_with_default([], Step::ok(text_reply("seen"))).await;
    let tool = vision_tool(&server, &json!({}));
    let conversation = Conversation::new();
    for (name, mime, bytes) in [
        ("star.jpg", "image/png", &png),
        ("loader.png", "image/gif", &gif),
        ("photo", "image/jpeg", &jpeg),
    ] {
        let result = conversation.ok(&tool, analyze(&site.url(name))).await;
        assert_eq!(result["analysis"], "seen");
        let requests = server.requests();
        let sent = common::sent_image(requests.last().unwrap());
        assert_eq!(sent, (mime.to_owned(), bytes.clone()), "{name}");
    }
    assert_eq!(server.request_count(), 3);
}

#[tokio::test]
async fn images_that_cannot_be_read_are_tool_errors_and_the_model_is_never_asked() {
    let png = python_doc(STAR_PNG);
    let svg = python_doc(PY_SVG);
    let page = python_doc("tutorial/index.html");
    let (_dir, site) = served(&[("star.png", &png), ("py.svg", &svg), ("page.html", &page)]);
    let loop_server = RedirectLoop::start().await;
    let server = ScriptedServer::start([]).await;
    let tool = vision_tool(&server, &json!({}));
    let small = vision_tool(&server, &json!({"maxImageBytes": 1024}));
    let guarded = vision_tool(&server, &json!({"allowPrivateAddresses": false}));
    let conversation = Conversation::new();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret.png"), &png).unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("secret.png"),
        conversation.root().join("link.png"),
    )
    .unwrap();
    std::fs::write(conversation.root().join("big.png"), &png).unwrap();
    std::fs::write(conversation.root().join("notes.txt"), "not an image").unwrap();

    let cases: Vec<(&Arc<dyn Tool>, String, &str)> = vec![
        (
            &tool,
            site.url("page.html"),
            "it is an HTML page (served as text/html",
        ),
        (&tool, site.url("py.svg"), "it is an SVG drawing"),
        (&tool, site.url("missing.png"), "HTTP 404"),
        (&tool, loop_server.url(), "redirect loop"),
        (&small, site.url("star.png"), "is larger than 1024 bytes"),
        (
            &small,
            "big.png".to_owned(),
            "big.png is larger than 1024 bytes",
        ),
        (
            &guarded,
            site.url("star.png"),
            "private or internal network address",
        ),
        (
            &tool,
            "notes.txt".to_owned(),
            "notes.txt is not a PNG, JPEG, GIF or WebP image: it is text",
        ),
        (
            &tool,
            "../outside.png".to_owned(),
            "path escapes the workspace",
        ),
        (
            &tool,
            "/etc/passwd".to_owned(),
            "absolute paths are not allowed",
        ),
        (&tool, "link.png".to_owned(), "escapes the workspace"),
        (
            &tool,
            "missing.png".to_owned(),
            "file not found: missing.png",
        ),
        (
            &tool,
            "file:///etc/passwd".to_owned(),
            "file: URLs are not supported",
        ),
        (&tool, String::new(), "image_url is required"),
    ];
    for (tool, image_url, expected) in cases {
        let message = conversation.err(tool, analyze(&image_url)).await;
        assert!(
            message.starts_with("Error analyzing image: ") && message.contains(expected),
            "{image_url:?}: {message}"
        );
    }
    let message = conversation
        .err(&tool, json!({"image_url": "big.png"}))
        .await;
    assert!(
        message.contains("missing required argument `question`"),
        "{message}"
    );
    assert_eq!(server.request_count(), 0);
}

#[tokio::test]
async fn a_vision_endpoint_that_fails_is_a_tool_error_naming_what_it_answered() {
    let server = ScriptedServer::start([
        Step::error(500, "server_error", "the GPU fell over"),
        Step::error(401, "invalid_api_key", "Incorrect API key provided"),
        Step::error(
            400,
            "invalid_request_error",
            "model scripted-vl does not support images",
        ),
        Step::Raw(200, b"<html>proxy error</html>".to_vec()),
        Step::ok(json!({"object": "list", "data": []})),
        Step::ok(text_reply("")),
        Step::Hang,
    ])
    .await;
    let tool = vision_tool(&server, &json!({"timeoutSeconds": 1}));
    let conversation = Conversation::new();
    std::fs::write(conversation.root().join("star.png"), python_doc(STAR_PNG)).unwrap();
    for expected in [
        "the endpoint answered HTTP 500 Internal Server Error: the GPU fell over",
        "the endpoint answered HTTP 401 Unauthorized: Incorrect API key provided",
        "HTTP 400 Bad Request: model scripted-vl does not support images",
        "the endpoint's answer is not JSON",
        "the vision model's answer holds no choices[0].message.content",
    ] {
        let message = conversation.err(&tool, analyze("star.png")).await;
        assert!(message.contains(expected), "{expected}: {message}");
    }
    // An empty answer is the reference's "could not be analyzed", as a result.
    let empty = conversation.ok(&tool, analyze("star.png")).await;
    assert_eq!(
        empty["analysis"],
        "There was a problem with the request and the image could not be analyzed."
    );
    let started = std::time::Instant::now();
    let slow = conversation.err(&tool, analyze("star.png")).await;
    assert!(slow.contains("the endpoint did not answer"), "{slow}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );

    // An endpoint that is down.
    let port = local_servers::free_port();
    let down: ToolsSpec = serde_json::from_value(json!({"vision": {
        "baseUrl": format!("http://127.0.0.1:{port}/v1"), "model": "m"}}))
    .unwrap();
    let down = only_tool(vision::tools(&down).unwrap());
    let message = conversation.err(&down, analyze("star.png")).await;
    assert!(message.contains("the endpoint did not answer"), "{message}");
    assert!(message.to_lowercase().contains("connect"), "{message}");
}

#[tokio::test]
async fn image_generate_saves_a_b64_image_in_the_workspace_and_answers_with_its_path() {
    let png = python_doc(STAR_PNG);
    let server = ScriptedServer::start([
        Step::ok(images_b64_reply(&png)),
        Step::ok(images_b64_reply(&png)),
    ])
    .await;
    let tool = image_tool(
        &server,
        &json!({"responseFormat": "b64_json", "extraBody": {"quality": "low"}}),
    );
    let conversation = Conversation::new();
    let result = conversation
        .ok(
            &tool,
            json!({"prompt": " A turtle drawing a star ", "aspect_ratio": "portrait"}),
        )
        .await;
    assert_eq!(
        result,
        json!({"success": true, "image": "generated_images/image_1.png"})
    );
    assert_eq!(
        std::fs::read(conversation.root().join("generated_images/image_1.png")).unwrap(),
        png
    );
    // An unknown ratio is the reference's default, landscape; the next image gets a new name.
    let second = conversation
        .ok(
            &tool,
            json!({"prompt": "again", "aspect_ratio": "panorama"}),
        )
        .await;
    assert_eq!(second["image"], "generated_images/image_2.png");

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].path, "/v1/images/generations");
    assert_eq!(requests[0].authorization.as_deref(), Some(BEARER));
    assert_eq!(
        requests[0].body,
        json!({"model": "scripted-image", "prompt": "A turtle drawing a star", "n": 1,
               "size": "1024x1536", "response_format": "b64_json", "quality": "low"})
    );
    assert_eq!(requests[1].body["size"], "1536x1024");
}

#[tokio::test]
async fn an_image_answered_by_url_is_downloaded_and_the_result_names_the_url() {
    let jpeg = jpeg();
    let (_dir, site) = served(&[("generated.jpg", &jpeg)]);
    let url = site.url("generated.jpg");
    let server = ScriptedServer::start([Step::ok(images_url_reply(&url))]).await;
    let tool = image_tool(&server, &json!({}));
    let conversation = Conversation::new();
    let result = conversation
        .ok(
            &tool,
            json!({"prompt": "a gradient", "aspect_ratio": "square"}),
        )
        .await;
    assert_eq!(
        result,
        json!({"success": true, "image": "generated_images/image_1.jpg", "url": url})
    );
    assert_eq!(
        std::fs::read(conversation.root().join("generated_images/image_1.jpg")).unwrap(),
        jpeg
    );
    let body = &server.requests()[0].body;
    assert_eq!(body["size"], "1024x1024");
    // No response_format unless configured (gpt-image-1 refuses the parameter).
    assert!(body.get("response_format").is_none(), "{body}");
}

#[tokio::test]
async fn an_image_endpoint_that_fails_is_a_tool_error_and_nothing_is_saved() {
    let png = python_doc(STAR_PNG);
    let page = b"<!doctype html><html><title>Not found</title></html>";
    let (_dir, site) = served(&[("page.html", page)]);
    let server = ScriptedServer::start([
        Step::error(500, "server_error", "out of GPU memory"),
        Step::error(400, "content_policy_violation", "Your request was rejected"),
        Step::Raw(200, b"not json at all".to_vec()),
        Step::ok(json!({"created": 0, "data": []})),
        Step::ok(json!({"created": 0, "data": [{"b64_json": "@@not base64@@"}]})),
        Step::ok(images_b64_reply(page)),
        Step::ok(images_url_reply(&site.url("missing.png"))),
        Step::ok(images_url_reply(&site.url("page.html"))),
        Step::ok(images_b64_reply(&png)),
    ])
    .await;
    let tool = image_tool(&server, &json!({"maxImageBytes": 2048}));
    let conversation = Conversation::new();
    for expected in [
        "HTTP 500 Internal Server Error: out of GPU memory",
        "HTTP 400 Bad Request: Your request was rejected",
        "the endpoint's answer is not JSON",
        "holds no image (no data[0])",
        "data[0].b64_json is not base64",
        "the generated image is not a PNG, JPEG, GIF or WebP image: it is an HTML page",
        "HTTP 404",
        "it is an HTML page",
        "larger than 2048 bytes",
    ] {
        let message = conversation.err(&tool, json!({"prompt": "a star"})).await;
        assert!(
            message.starts_with("Error generating image: ") && message.contains(expected),
            "{expected}: {message}"
        );
    }
    let message = conversation.err(&tool, json!({"prompt": "  "})).await;
    assert_eq!(
        message,
        "Error generating image: prompt is required for image generation"
    );
    assert_eq!(server.request_count(), 9);
    assert!(!conversation.root().join("generated_images").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_run_generates_an_image_and_shows_the_saved_file_to_the_vision_model() {
    let png = python_doc(STAR_PNG);
    let images = ScriptedServer::start([Step::ok(images_b64_reply(&png))]).await;
    let vision = ScriptedServer::start([Step::ok(text_reply("A yellow star on white."))]).await;
    let model = ScriptedServer::start([
        Step::ok(tool_call_reply(
            "image_generate",
            &json!({"prompt": "a yellow star", "aspect_ratio": "square"}),
        )),
        Step::ok(tool_call_reply(
            "vision_analyze",
            &json!({"image_url": "generated_images/image_1.png", "question": "What is drawn?"}),
        )),
        Step::ok(text_reply("I drew a yellow star.")),
    ])
    .await;
    let fixture = common::RunFixture::new(&model.base_url(), 1)
        .with("/distribution", json!({"vision": 100, "image_gen": 100}))
        .with("/concurrency", json!(1))
        .with(
            "/tools",
            json!({
                "vision": {"baseUrl": vision.base_url(), "model": "scripted-vl",
                           "apiKey": {"env": KEY_ENV}},
                "imageGen": {"baseUrl": images.base_url(), "model": "scripted-image",
                             "apiKey": {"env": KEY_ENV}},
            }),
        );
    let report = run_local(&common::local_options(&fixture), &common::no_shutdown())
        .await
        .unwrap();
    assert_eq!(report.merge.trajectories, 1);

    let record = &fixture.lines("trajectories.jsonl")[0];
    assert_eq!(record["toolsets_used"], json!(["image_gen", "vision"]));
    let responses = common::tool_responses(record);
    assert_eq!(responses.len(), 2, "{record}");
    assert_eq!(responses[0]["name"], "image_generate");
    assert_eq!(
        responses[0]["content"],
        json!({"success": true, "image": "generated_images/image_1.png"})
    );
    assert_eq!(responses[1]["name"], "vision_analyze");
    assert_eq!(
        responses[1]["content"],
        json!({"success": true, "analysis": "A yellow star on white."})
    );
    for tool in ["image_generate", "vision_analyze"] {
        assert_eq!(
            record["tool_stats"][tool],
            json!({"count": 1, "success": 1, "failure": 0}),
            "{tool}"
        );
    }
    // The vision model was shown exactly the generated image: the file was in the workspace
    // while the conversation ran.
    let requests = vision.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].authorization.as_deref(), Some(BEARER));
    assert_eq!(
        common::sent_image(&requests[0]),
        ("image/png".to_owned(), png)
    );
    assert_eq!(images.request_count(), 1);
    // ... and went with the workspace when the conversation ended.
    let left = std::fs::read_dir(fixture.workspaces()).map_or(0, Iterator::count);
    assert_eq!(
        left, 0,
        "workspaces are removed unless tools.keepWorkspaces"
    );
}

//! Client CPU of one call of `vision_analyze` (an image from the workspace, and one fetched from
//! Python's `http.server`) and of `image_generate` (a `b64_json` answer decoded and saved), against
//! the scripted OpenAI-compatible server answering at once. The target: at most 1 ms of client
//! CPU per call beyond the backend's own time. The image is a real one, `python3-doc`'s
//! `turtle-star.png` (33 KB; scripts/web/install.sh installs it).
//!
//! ```text
//! cargo bench -p trajectory-worker --bench image_tools
//! ```
//!
//! The scripted server runs in this process, on a runtime of its own whose threads are named
//! `bench-server`; the client's CPU is this process's (`getrusage`) less those threads' (their
//! `schedstat`, in nanoseconds). The client runs on a current-thread runtime, its file work on
//! tokio's blocking threads, all counted. `http.server` is a process of its own. Calls run one
//! after another; knob (environment): `TOOL_BENCH_CALLS` (1000).

mod per_call;

use std::time::Duration;

use anyhow::Context;
use serde_json::{Map, Value, json};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, images_b64_reply, text_reply};
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::Registry;

const SERVER_THREADS: &str = "bench-server";
const STAR_PNG: &str = "/usr/share/doc/python3-doc/html/_images/turtle-star.png";

/// CPU time of the scripted server's threads so far.
fn server_cpu() -> anyhow::Result<Duration> {
    let mut nanos = 0u64;
    for task in std::fs::read_dir("/proc/self/task")? {
        let task = task?.path();
        // A thread may end between listing and reading: it is then not the server's (its
        // runtime lives to the end).
        let Ok(name) = std::fs::read_to_string(task.join("comm")) else {
            continue;
        };
        if name.trim_end() != SERVER_THREADS {
            continue;
        }
        let stat = std::fs::read_to_string(task.join("schedstat"))?;
        nanos += stat
            .split_whitespace()
            .next()
            .and_then(|on_cpu| on_cpu.parse::<u64>().ok())
            .context("schedstat starts with the time on CPU")?;
    }
    Ok(Duration::from_nanos(nanos))
}

/// The client's CPU: the process's less the server's.
fn client_cpu() -> anyhow::Result<Duration> {
    Ok(per_call::cpu_now()?.saturating_sub(server_cpu()?))
}

fn args(value: &Value) -> Map<String, Value> {
    value.as_object().cloned().unwrap_or_default()
}

fn main() -> anyhow::Result<()> {
    let calls = std::env::var("TOOL_BENCH_CALLS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(1000);
    let png = std::fs::read(STAR_PNG).context("python3-doc (scripts/web/install.sh)")?;
    let server_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(SERVER_THREADS)
        .enable_all()
        .build()?;
    let vision = server_runtime.block_on(ScriptedServer::start_with_default(
        [],
        Step::ok(text_reply("A yellow star with 36 points.")),
    ));
    let images = server_runtime.block_on(ScriptedServer::start_with_default(
        [],
        Step::ok(images_b64_reply(&png)),
    ));

    let site = tempfile::tempdir()?;
    std::fs::write(site.path().join("star.png"), &png)?;
    let (_site_server, port) = per_call::http_server(site.path())?;

    let tools: ToolsSpec = serde_json::from_value(json!({
        "vision": {"baseUrl": vision.base_url(), "model": "bench-vl", "allowPrivateAddresses": true},
        "imageGen": {"baseUrl": images.base_url(), "model": "bench-image"},
    }))?;
    let registry = Registry::builtin(&tools);
    let tool = |toolset: &str| {
        registry
            .tools_for(&[toolset.to_owned()])
            .pop()
            .with_context(|| format!("the {toolset} tool"))
    };
    let (analyze, generate) = (tool("vision")?, tool("image_gen")?);
    let workspace = tempfile::tempdir()?;
    std::fs::write(workspace.path().join("star.png"), &png)?;
    let ctx = per_call::tool_context(workspace.path())?;
    let saved = workspace.path().join("generated_images/image_1.png");

    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "image: {STAR_PNG} ({} bytes); backend answers at once",
        png.len()
    );
    client.block_on(async {
        let workspace_image = args(&json!({"image_url": "star.png", "question": "Points?"}));
        per_call::measure("vision_analyze (workspace)", calls, client_cpu, || {
            analyze.call(workspace_image.clone(), &ctx)
        })
        .await?;
        let url = format!("http://127.0.0.1:{port}/star.png");
        let url_image = args(&json!({"image_url": url, "question": "Points?"}));
        per_call::measure("vision_analyze (URL)", calls, client_cpu, || {
            analyze.call(url_image.clone(), &ctx)
        })
        .await?;
        let prompt = args(&json!({"prompt": "a yellow star", "aspect_ratio": "square"}));
        per_call::measure("image_generate (b64_json)", calls, client_cpu, || async {
            let outcome = generate.call(prompt.clone(), &ctx).await;
            // The next call saves under the same name (a conversation makes a few images).
            let _ = std::fs::remove_file(&saved);
            outcome
        })
        .await
    })?;
    drop((vision, images));
    server_runtime.shutdown_background();
    Ok(())
}

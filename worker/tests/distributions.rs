//! Every built-in distribution, with its backends configured, passes validation and runs: a
//! `local` run of each against the scripted model, whose conversations call one tool (two for
//! `web` and `browser`) of every toolset they were offered, on the real backends: Debian's searx
//! over the `python3-doc` pages and those pages served over HTTP (`web`, and `search`, which
//! `browser_tasks` draws with `browser` as one entry), Debian's headless
//! Chromium (`browser`), real processes and files in the workspace (`terminal`, `file`), and the
//! scripted server's multimodal and Images endpoints for `vision` and `image_gen`, for which no
//! model ships here (docs/tools/vision.md), with the docs' real PNG logo as the image. Every record must be valid, every call a success,
//! and the model must have been asked exactly as often as the offered toolsets imply (a tool two
//! offered toolsets share, `web_search`, once); the members of a grouped entry come together.

mod common;
mod local_servers;
mod web_servers;

use std::collections::BTreeSet;

use common::{RunFixture, local_options, no_shutdown};
use local_servers::{DocsServer, PYTHON_DOCS};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    ScriptedServer, Step, images_b64_reply, text_reply, tool_call_reply,
};
use trajectory_worker::run::local::run_local;
use trajectory_worker::spec::RunSpec;
use trajectory_worker::toolsets::{BUILTIN_DISTRIBUTIONS, entry_members};
use trajectory_worker::validate::distribution_violations;
use web_servers::Searx;

/// The page the probes extract and browse.
const PAGE: &str = "library/asyncio-subprocess.html";
/// A real image of the docs, for `vision_analyze`.
const IMAGE: &str = "_static/py.png";
/// Prompts per distribution: enough that most toolsets of each are drawn at least once.
const PROMPTS: usize = 6;

/// The calls a conversation makes for each toolset it is offered, in this order.
fn probes(docs: &DocsServer) -> Vec<(&'static str, &'static str, Value)> {
    vec![
        (
            "terminal",
            "terminal",
            json!({"command": "echo probe-terminal"}),
        ),
        (
            "file",
            "write_file",
            json!({"path": "probe.txt", "content": "probe-file"}),
        ),
        ("web", "web_search", json!({"query": "subprocess"})),
        ("web", "web_extract", json!({"urls": [docs.url(PAGE)]})),
        ("search", "web_search", json!({"query": "subprocess"})),
        (
            "browser",
            "browser_navigate",
            json!({"url": docs.url(PAGE)}),
        ),
        ("browser", "browser_snapshot", json!({})),
        (
            "vision",
            "vision_analyze",
            json!({"image_url": docs.url(IMAGE), "question": "What does this logo show?"}),
        ),
        (
            "image_gen",
            "image_generate",
            json!({"prompt": "a lighthouse at dusk", "aspect_ratio": "square"}),
        ),
    ]
}

/// The model: the next probe whose tool the request offers and no earlier turn called, then a
/// final answer. A request with a prompt and no messages is an Images request: it gets the
/// docs' real PNG. A request without tools is a vision request: it gets a description.
fn model(probes: Vec<(&'static str, &'static str, Value)>) -> impl Fn(&Value) -> Step {
    let png =
        std::fs::read(std::path::Path::new(PYTHON_DOCS).join(IMAGE)).expect("python3-doc's logo");
    move |body| {
        if body.get("prompt").is_some() && body.get("messages").is_none() {
            return Step::ok(images_b64_reply(&png));
        }
        let Some(tools) = body["tools"].as_array() else {
            return Step::ok(text_reply("A blue and yellow snake logo."));
        };
        let offered: BTreeSet<&str> = tools
            .iter()
            .filter_map(|tool| tool["function"]["name"].as_str())
            .collect();
        let called: BTreeSet<&str> = body["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|message| message["tool_calls"].as_array().into_iter().flatten())
            .filter_map(|call| call["function"]["name"].as_str())
            .collect();
        probes
            .iter()
            .find(|(_, tool, _)| offered.contains(tool) && !called.contains(tool))
            .map_or_else(
                || Step::ok(text_reply("done")),
                |(_, tool, args)| Step::ok(tool_call_reply(tool, args)),
            )
    }
}

/// Every toolset's backend, configured.
fn tools(searx: &Searx, scripted: &ScriptedServer) -> Value {
    json!({
        "web": {
            "search": {"backend": "searxng", "url": searx.base_url(), "timeoutSeconds": 10},
            "extract": {"allowPrivateAddresses": true},
        },
        "browser": {},
        "vision": {"baseUrl": scripted.base_url(), "model": "scripted-vision", "allowPrivateAddresses": true},
        "imageGen": {"baseUrl": scripted.base_url(), "model": "scripted-images"},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_builtin_distribution_validates_and_runs_on_real_backends() {
    let docs = DocsServer::start(PYTHON_DOCS.as_ref());
    let searx = Searx::start(&docs);
    let probes = probes(&docs);
    let model = ScriptedServer::start_responding(model(probes.clone())).await;
    let tools = tools(&searx, &model);
    assert_eq!(BUILTIN_DISTRIBUTIONS.len(), 17);

    let mut exercised = BTreeSet::new();
    for distribution in BUILTIN_DISTRIBUTIONS {
        let name = distribution.name;
        let fixture = RunFixture::new(&model.base_url(), PROMPTS)
            .with("/distribution", json!(name))
            .with("/tools", tools.clone())
            .with("/agent/maxTurns", json!(probes.len() + 1));
        let spec: RunSpec = serde_json::from_value(fixture.spec.clone()).unwrap();
        let violations = distribution_violations(&spec.distribution, &spec.tools);
        assert!(violations.is_empty(), "{name}: {violations:?}");

        let requests_before = model.request_count();
        let report = run_local(&local_options(&fixture), &no_shutdown())
            .await
            .unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(
            usize::try_from(report.merge.trajectories).unwrap(),
            PROMPTS,
            "{name}"
        );
        let records = fixture.lines("trajectories.jsonl");
        assert_eq!(records.len(), PROMPTS, "{name}");
        assert!(fixture.lines("failures.jsonl").is_empty(), "{name}");

        let drawable: BTreeSet<&str> = distribution
            .entries
            .iter()
            .filter(|(_, percent)| *percent > 0.0)
            .flat_map(|(entry, _)| entry_members(entry))
            .collect();
        let catalog: BTreeSet<&str> = probes
            .iter()
            .filter(|(toolset, ..)| drawable.contains(toolset))
            .map(|(_, tool, _)| *tool)
            .collect();
        let mut expected_requests = 0;
        let mut stats_keys = None;
        for record in &records {
            let used = check_record(name, record, &probes, &drawable);
            expected_requests += 1 + called_probes(&probes, &used)
                .iter()
                .map(|(toolset, ..)| 1 + usize::from(matches!(*toolset, "vision" | "image_gen")))
                .sum::<usize>();
            for (entry, _) in distribution.entries {
                let members: Vec<&str> = entry_members(entry).collect();
                let offered = members
                    .iter()
                    .filter(|toolset| used.contains(*toolset))
                    .count();
                assert!(
                    offered == 0 || offered == members.len(),
                    "{name}: {entry} is one draw, but {used:?} holds only some of it"
                );
            }
            exercised.extend(used);
            let keys: BTreeSet<String> = record["tool_stats"]
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect();
            // The catalog is frozen for the run: every record has the same keys, those of every
            // toolset the distribution can draw.
            for tool in &catalog {
                assert!(keys.contains(*tool), "{name}: no {tool} in {keys:?}");
            }
            assert_eq!(
                stats_keys.get_or_insert_with(|| keys.clone()),
                &keys,
                "{name}"
            );
        }
        assert_eq!(
            model.request_count() - requests_before,
            expected_requests,
            "{name}: a conversation asked the model more or less often than its toolsets imply"
        );
    }
    let all: BTreeSet<&str> = probes.iter().map(|(toolset, ..)| *toolset).collect();
    assert_eq!(
        exercised, all,
        "some toolset was never drawn by any distribution"
    );
}

/// Checks one record's shape and that every probe of each toolset it used succeeded; returns
/// the toolsets it used.
fn check_record<'a>(
    distribution: &str,
    record: &Value,
    probes: &[(&'a str, &'a str, Value)],
    drawable: &BTreeSet<&str>,
) -> BTreeSet<&'a str> {
    let turns = record["conversations"].as_array().expect("conversations");
    let roles: Vec<&str> = turns
        .iter()
        .map(|turn| turn["from"].as_str().unwrap())
        .collect();
    assert_eq!(roles.first(), Some(&"system"), "{distribution}: {roles:?}");
    assert_eq!(roles.get(1), Some(&"human"), "{distribution}: {roles:?}");
    assert_eq!(roles.last(), Some(&"gpt"), "{distribution}: {roles:?}");
    assert_eq!(record["completed"], json!(true), "{distribution}");
    let used: BTreeSet<&str> = record["toolsets_used"]
        .as_array()
        .expect("toolsets_used")
        .iter()
        .map(|toolset| toolset.as_str().unwrap())
        .collect();
    assert!(
        !used.is_empty() && used.iter().all(|toolset| drawable.contains(toolset)),
        "{distribution}: drew {used:?} of {drawable:?}"
    );
    let called = called_probes(probes, &used);
    for (_, tool, _) in &called {
        assert_eq!(
            record["tool_stats"][tool],
            json!({"count": 1, "success": 1, "failure": 0}),
            "{distribution}: {tool} in {}",
            serde_json::to_string_pretty(turns).unwrap()
        );
    }
    let expected_tool_turns = called.len();
    assert_eq!(
        roles.iter().filter(|role| **role == "tool").count(),
        expected_tool_turns,
        "{distribution}: {roles:?}"
    );
    let stats = record["tool_stats"].as_object().unwrap();
    let calls: u64 = stats.values().map(|s| s["count"].as_u64().unwrap()).sum();
    assert_eq!(
        calls, expected_tool_turns as u64,
        "{distribution}: {stats:?}"
    );
    probes
        .iter()
        .map(|(toolset, ..)| *toolset)
        .filter(|toolset| used.contains(toolset))
        .collect()
}

/// The probes the model calls in a conversation offered `used`: the first probe of each tool
/// those toolsets offer (`web` and `search` share `web_search`, called once).
fn called_probes<'p, 'a>(
    probes: &'p [(&'a str, &'a str, Value)],
    used: &BTreeSet<&str>,
) -> Vec<&'p (&'a str, &'a str, Value)> {
    let mut tools = BTreeSet::new();
    probes
        .iter()
        .filter(|(toolset, tool, _)| used.contains(toolset) && tools.insert(*tool))
        .collect()
}

//! Tests against the real model server: llama.cpp serving SmolLM2-135M through its
//! OpenAI-compatible API (scripts/model-server). `scripts/test.sh` starts it and exports
//! `MODEL_BASE_URL`; without it these tests fail and say how to start it.
//!
//! The model is small and erratic, so the assertions are about structure (a tool call made, its
//! result returned, the record valid), never about what the model says.

mod common;
mod local_servers;
mod web_servers;

use std::path::Path;

use serde_json::Value;
use trajectory_worker::agent::{AgentConfig, run_conversation};
use trajectory_worker::hermes::{RecordContext, trajectory_record};
use trajectory_worker::model::{Message, ModelClient, ModelSettings, RetryPolicy};
use trajectory_worker::run::local::{LocalOptions, ProgressMode, run_local};
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::sandbox::LandlockMode;
use trajectory_worker::tools::{Registry, ToolContext, ToolLimits, Workspace};

#[tokio::test]
async fn a_real_model_calls_a_tool_and_gets_its_result_back() {
    let client = ModelClient::new(ModelSettings {
        base_urls: vec![common::model_server()],
        routing: trajectory_worker::model::RoutingSettings::default(),
        model: common::model_name(),
        api_key: None,
        max_tokens: Some(128),
        temperature: Some(0.0),
        reasoning_fields: serde_json::Map::new(),
        extra_body: serde_json::Map::new(),
        request_timeout: std::time::Duration::from_secs(120),
        stream: false,
        retry: RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        },
        prices: None,
        tokens: None,
        service_tier: None,
        batch: None,
    })
    .unwrap();
    let registry = Registry::builtin(&ToolsSpec::default());
    let toolsets = ["terminal".to_owned(), "file".to_owned()];
    let tools = registry.tools_for(&toolsets);
    let dir = tempfile::tempdir().unwrap();
    let context = ToolContext {
        workspace: Workspace::new(dir.path()).unwrap(),
        limits: ToolLimits::default(),
        sandbox: common::local_sandbox(LandlockMode::Auto),
        browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    };
    let config = AgentConfig {
        max_turns: 2,
        prompt_timeout: std::time::Duration::from_secs(600),
        ephemeral_system_prompt: None,
    };
    let prompt = "Create a file named hello.txt containing the word hello, then read it back.";

    let conversation = run_conversation(&client, &tools, &context, prompt, &config)
        .await
        .expect("the conversation finishes");

    let (position, call) = conversation
        .messages
        .iter()
        .enumerate()
        .find_map(|(i, m)| match m {
            Message::Assistant(a) if !a.tool_calls.is_empty() => Some((i, a.tool_calls[0].clone())),
            _ => None,
        })
        .expect("the model made a tool call");
    let Some(Message::Tool(result)) = conversation.messages.get(position + 1) else {
        panic!(
            "the tool call's result follows it: {:?}",
            conversation.messages
        );
    };
    assert_eq!(result.tool_call_id, call.id);
    assert!(!result.content.is_empty());
    assert!(
        conversation.usage.completion_tokens > 0,
        "usage is captured"
    );

    let offered: Vec<_> = tools.iter().map(|tool| tool.spec().clone()).collect();
    let catalog = registry.catalog(&toolsets);
    let source = serde_json::Map::new();
    let now = chrono::Utc::now();
    let record = trajectory_record(
        &conversation,
        &RecordContext {
            id: "real-0-0",
            prompt_index: 0,
            sample: 0,
            batch: 0,
            model: &common::model_name(),
            toolsets_used: &toolsets,
            tools_offered: &offered,
            system_turn: None,
            catalog: &catalog,
            started_at: now,
            finished_at: now,
            source: &source,
            verification: None,
            discarded_by: None,
        },
    );
    assert_valid_record(&Value::Object(record));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_quickstart_runs_end_to_end_on_the_real_model() {
    let storage = tempfile::tempdir().unwrap();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart");
    std::fs::create_dir_all(storage.path().join("datasets")).unwrap();
    std::fs::copy(example.join("run.yaml"), storage.path().join("run.yaml")).unwrap();
    std::fs::copy(
        example.join("datasets/quickstart.jsonl"),
        storage.path().join("datasets/quickstart.jsonl"),
    )
    .unwrap();
    let options = LocalOptions {
        run_file: storage.path().join("run.yaml"),
        storage: None,
        bucket: trajectory_worker::storage::BucketOptions::default(),
        base_url: Some(common::model_server()),
        oracle: false,
        workspace_root: storage.path().join("workspaces"),
        sandbox: common::sandbox(),
        path_dropped: Vec::new(),
        progress: ProgressMode::Lines,
    };
    let report = run_local(&options, &common::no_shutdown())
        .await
        .expect("the quickstart run finishes");
    assert_eq!(report.plan.prompts, 8);
    assert_eq!(
        report.merge.trajectories + report.merge.failed,
        8,
        "every prompt has exactly one record"
    );
    assert!(
        report.merge.trajectories >= 6,
        "most prompts succeed: {:?}",
        report.merge
    );
    let text = std::fs::read_to_string(report.run_dir.join("trajectories.jsonl")).unwrap();
    let mut indexes = Vec::new();
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        assert_valid_record(&record);
        assert_eq!(
            record["toolsets_used"],
            serde_json::json!(["terminal", "file"])
        );
        indexes.push(record["prompt_index"].as_u64().unwrap());
    }
    assert!(
        indexes.windows(2).all(|pair| pair[0] < pair[1]),
        "dataset order: {indexes:?}"
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(report.run_dir.join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["counts"]["records"], 8);
}

/// The whole loop with `web` offered: the small model searches (the `minimal` distribution offers
/// `web_search` and `web_extract` only), and its record holds what Debian's searx really found
/// in the `python3-doc` index, links to the docs server and all.
///
/// SmolLM2-135M seldom calls a tool unasked, and writes URLs as search queries (which searx's
/// full-text engine cannot parse), so the run does what a user of so small a model would:
/// `spec.model.extraBody` forces the `web_search` call (`tool_choice`, which llama.cpp turns into
/// a grammar), and the ephemeral system prompt asks for keywords. The arguments are still the
/// model's own; greedy decoding (temperature 0) makes them the same on every run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_model_searches_the_web_and_its_record_holds_a_real_searx_result() {
    let docs = local_servers::DocsServer::start(local_servers::PYTHON_DOCS.as_ref());
    let searx = web_servers::Searx::start(&docs);
    let fixture = fixture_calling(
        "web_search",
        "minimal",
        &[serde_json::json!({ "prompt": "subprocess" }).to_string()],
        1,
    )
    .with(
        "/agent",
        serde_json::json!({
            "maxTurns": 1, "promptTimeoutSeconds": 900,
            "ephemeralSystemPrompt": "Search queries are plain keywords, never URLs.",
        }),
    )
    .with(
        "/tools",
        serde_json::json!({"web": {"search": {"url": searx.base_url(), "timeoutSeconds": 30, "maxResults": 2}}}),
    );
    let report = run_local(&common::local_options(&fixture), &common::no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(
        report.merge.trajectories,
        1,
        "{:?}",
        fixture.lines("failures.jsonl")
    );

    let record = &fixture.lines("trajectories.jsonl")[0];
    assert_valid_record(record);
    assert_eq!(record["toolsets_used"], serde_json::json!(["web"]));
    let turns = record["conversations"].as_array().unwrap();
    let search = turns
        .iter()
        .filter(|turn| turn["from"] == "tool")
        .filter_map(|turn| turn["value"].as_str())
        .find(|value| value.contains(r#""name": "web_search""#))
        .unwrap_or_else(|| {
            panic!(
                "no web_search result among the turns: {}",
                serde_json::to_string_pretty(turns).unwrap()
            )
        });
    // A result only searx can have given: a page of the docs server's python3-doc tree.
    assert!(
        search.contains(&format!("http://127.0.0.1:{}/", docs.port)),
        "{}",
        serde_json::to_string_pretty(turns).unwrap()
    );
    assert_eq!(
        record["tool_stats"]["web_search"]["success"], 1,
        "{}",
        record["tool_stats"]
    );
}

/// The structure every Hermes record has, whatever the model said.
fn assert_valid_record(record: &Value) {
    let turns = record["conversations"].as_array().expect("conversations");
    assert_eq!(turns[0]["from"], "system");
    assert!(
        turns[0]["value"]
            .as_str()
            .unwrap()
            .contains("<tools>\n[{\"name\": ")
    );
    assert_eq!(turns[1]["from"], "human");
    let mut previous = "human";
    for turn in &turns[2..] {
        let from = turn["from"].as_str().unwrap();
        let value = turn["value"].as_str().unwrap();
        match from {
            "gpt" => assert!(
                value.starts_with("<think>"),
                "gpt turns open with a think block: {value:?}"
            ),
            "tool" => {
                assert_eq!(previous, "gpt", "a tool turn follows a gpt turn");
                assert!(
                    value.starts_with("<tool_response>\n{\"tool_call_id\": "),
                    "{value:?}"
                );
            }
            "human" => {}
            other => panic!("unexpected role {other}"),
        }
        previous = from;
    }
    for key in [
        "metadata",
        "completed",
        "partial",
        "api_calls",
        "tool_stats",
        "tool_error_counts",
        "id",
        "usage",
    ] {
        assert!(record.get(key).is_some(), "record has {key}");
    }
}

/// The terminal toolset end to end on the real model: a `local` run of the `terminal_only`
/// distribution (the `terminal` and `file` toolsets), its commands run by the conversation's shell under the real executor. The
/// record must be valid, its system turn must offer `terminal` and `process` with our schemas,
/// and every terminal or process call's result must have one of the reference's shapes (hermes-agent 0.19.0,
/// `golden/hermes-0.19.0/`); what the model runs is its own choice and is not asserted.
///
/// As in the web test above, `spec.model.extraBody` makes the small model call `terminal`
/// (`tool_choice`, a grammar in llama.cpp): unasked, it seldom calls a tool at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_model_uses_the_terminal_and_its_results_have_the_references_shapes() {
    let tools_spec = serde_json::json!({"terminal": {"timeoutSeconds": 30}});
    let fixture = fixture_calling(
        "terminal",
        "terminal_only",
        &[serde_json::json!({
            "prompt": "Make a directory named work, change into it, and print the working directory."
        })
        .to_string()],
        3,
    )
    .with("/tools", tools_spec.clone());
    let report = run_local(&common::local_options(&fixture), &common::no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(
        report.merge.trajectories,
        1,
        "{:?}",
        fixture.lines("failures.jsonl")
    );

    let record = &fixture.lines("trajectories.jsonl")[0];
    assert_valid_record(record);
    // `terminal_only` is the reference's: the terminal and the file tools.
    assert_eq!(
        record["toolsets_used"],
        serde_json::json!(["terminal", "file"])
    );
    let turns = record["conversations"].as_array().unwrap();
    let pretty = || serde_json::to_string_pretty(turns).unwrap();

    // The system turn offers `terminal` and `process` first, exactly as the toolset builds them
    // for this spec (the file tools follow).
    let system = turns[0]["value"].as_str().unwrap();
    let listed = system
        .split_once("<tools>\n")
        .and_then(|(_, rest)| rest.split_once("\n</tools>"))
        .map(|(tools, _)| tools)
        .expect("a <tools> block");
    let listed: Value = serde_json::from_str(listed).expect("the tools are JSON");
    let spec: ToolsSpec = serde_json::from_value(tools_spec).unwrap();
    let ours: Vec<Value> = trajectory_worker::tools::terminal::tools(&spec)
        .iter()
        .map(|tool| {
            let spec = tool.spec();
            serde_json::json!({
                "name": spec.name, "description": spec.description,
                "parameters": spec.parameters, "required": null,
            })
        })
        .collect();
    assert_eq!(listed.as_array().unwrap()[..2], ours[..]);

    // Every tool result has the reference's shape for its tool.
    let mut results = 0;
    for turn in turns.iter().filter(|turn| turn["from"] == "tool") {
        let value = turn["value"].as_str().unwrap();
        for response in value.split("<tool_response>\n").skip(1) {
            let payload = response
                .split_once("\n</tool_response>")
                .map(|(payload, _)| payload)
                .expect("a closed tool response");
            let payload: Value = serde_json::from_str(payload).expect("a JSON tool response");
            let name = payload["name"].as_str().unwrap();
            if matches!(name, "terminal" | "process") {
                assert_reference_shape(name, &payload["content"]);
                results += 1;
            }
        }
    }
    assert!(results > 0, "the model called the terminal: {}", pretty());
    assert!(
        record["tool_stats"]["terminal"]["count"].as_u64() > Some(0),
        "{}",
        record["tool_stats"]
    );
}

/// A run of `lines` on the real model with `distribution`, one conversation at a time, at most
/// `max_turns` tool-calling turns, in which `spec.model.extraBody` makes the small model call
/// `tool` (`tool_choice`, a grammar in llama.cpp): unasked, it seldom calls a tool at all.
fn fixture_calling(
    tool: &str,
    distribution: &str,
    lines: &[String],
    max_turns: u32,
) -> common::RunFixture {
    common::RunFixture::with_lines(&common::model_server(), lines)
        .with("/distribution", serde_json::json!(distribution))
        .with("/concurrency", serde_json::json!(1))
        .with(
            "/model",
            serde_json::json!({
                "baseUrl": common::model_server(), "name": common::model_name(), "maxTokens": 128,
                "temperature": 0.0, "requestTimeoutSeconds": 300,
                "extraBody": {"tool_choice": {"type": "function", "function": {"name": tool}}},
            }),
        )
        .with(
            "/agent",
            serde_json::json!({"maxTurns": max_turns, "promptTimeoutSeconds": 900}),
        )
}

/// A verified run end to end on the real model: two rows, one with a plain `test` command and
/// one in terminal-bench's form (`tests_tar` and `test_sh`), each verified in the workspace its
/// conversation left. The small model will seldom solve them, so the rewards are not asserted:
/// that each record carries a reward its verifier gave, and the statistics count both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_model_run_is_verified_end_to_end() {
    use base64::Engine as _;
    let tests = tempfile::tempdir().unwrap();
    std::fs::write(
        tests.path().join("test.sh"),
        "test -d work && echo 1 > \"$REWARD_FILE\" || echo 0 > \"$REWARD_FILE\"",
    )
    .unwrap();
    let tar = std::process::Command::new("tar")
        .arg("-czf")
        .arg("-")
        .arg("-C")
        .arg(tests.path())
        .arg("test.sh")
        .output()
        .expect("tar runs");
    assert!(tar.status.success(), "{tar:?}");
    let rows = [
        serde_json::json!({"prompt": "Create a file named hello.txt that contains hello.",
                           "test": "grep -q hello hello.txt"}),
        serde_json::json!({"prompt": "Make a directory named work.",
                           "tests_tar": base64::engine::general_purpose::STANDARD.encode(tar.stdout)}),
    ];
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    let fixture = fixture_calling("terminal", "terminal_only", &lines, 2)
        .with("/verifier", serde_json::json!({"timeoutSeconds": 30}));
    let report = run_local(&common::local_options(&fixture), &common::no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(
        report.merge.trajectories,
        2,
        "{:?}",
        fixture.lines("failures.jsonl")
    );
    for record in fixture.lines("trajectories.jsonl") {
        assert_valid_record(&record);
        // The rewards these verifiers give: 1 from exit 0 or the script's `1`, 0 otherwise.
        let passed = match record["reward"].as_f64() {
            Some(reward) if reward >= 1.0 => true,
            Some(reward) if reward <= 0.0 => false,
            _ => panic!("a reward of 0 or 1: {record}"),
        };
        let verification = &record["verification"];
        assert_eq!(verification["error"], Value::Null, "{verification}");
        assert!(verification["exit_code"].is_i64(), "{verification}");
        assert_eq!(verification["passed"], passed);
    }
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["verification"]["verified"], 2, "{statistics}");
}

/// Whether `content`, the result of `tool`, has one of the shapes hermes-agent 0.19.0's tool
/// returns: the keys of one of them (the optional ones aside), with their types.
fn assert_reference_shape(tool: &str, content: &Value) {
    use serde_json::Value::{Array, Null, Number, String as Text};
    let Value::Object(map) = content else {
        panic!("{tool}: a result is an object: {content}");
    };
    let has = |key: &str, check: fn(&Value) -> bool| map.get(key).is_some_and(check);
    let text: fn(&Value) -> bool = |v| matches!(v, Text(_));
    let int: fn(&Value) -> bool = |v| matches!(v, Number(n) if n.is_i64());
    let text_or_null: fn(&Value) -> bool = |v| matches!(v, Text(_) | Null);
    let int_or_null: fn(&Value) -> bool = |v| matches!(v, Number(_) | Null);
    let keys: std::collections::BTreeSet<&str> = map.keys().map(String::as_str).collect();
    let shapes = reference_shapes(tool);
    let fits = shapes.iter().any(|(required, optional)| {
        required.iter().all(|key| keys.contains(key))
            && keys
                .iter()
                .all(|key| required.contains(key) || optional.contains(key))
    });
    assert!(fits, "{tool}: not one of the reference's shapes: {content}");
    // The types of the keys that are there.
    for (key, check) in [
        ("output", text),
        ("error", text_or_null),
        ("exit_code", int_or_null),
        ("session_id", text),
        ("pid", int),
        ("status", text),
        ("command", text),
        ("uptime_seconds", int),
        ("output_preview", text),
        ("total_lines", int),
        ("showing", text),
        ("bytes_written", int),
        ("exit_code_meaning", text),
    ] {
        if map.contains_key(key) {
            assert!(
                has(key, check),
                "{tool}: {key} has the wrong type: {content}"
            );
        }
    }
    if let Some(processes) = map.get("processes") {
        assert!(matches!(processes, Array(_)), "{content}");
    }
    if tool == "terminal" && map.contains_key("output") {
        assert!(has("exit_code", int), "{content}");
    }
}

/// The shapes of hermes-agent 0.19.0's results of `tool`: each shape's keys, then its optional
/// ones.
fn reference_shapes(tool: &str) -> &'static [(&'static [&'static str], &'static [&'static str])] {
    match tool {
        "terminal" => &[
            // A foreground command (blocked ones add `status`).
            (
                &["output", "exit_code", "error"],
                &["exit_code_meaning", "status"],
            ),
            // A background start.
            (&["output", "session_id", "pid", "exit_code", "error"], &[]),
            // A refusal (bad arguments, a timeout over the maximum).
            (&["error"], &[]),
        ],
        "process" => &[
            (&["processes"], &[]),
            (&["error"], &[]),
            (&["status", "error"], &[]),
            (
                &[
                    "session_id",
                    "command",
                    "status",
                    "pid",
                    "uptime_seconds",
                    "output_preview",
                ],
                &[
                    "exit_code",
                    "completion_reason",
                    "termination_source",
                    "stopped_reason",
                ],
            ),
            (
                &[
                    "session_id",
                    "command",
                    "status",
                    "output",
                    "total_lines",
                    "showing",
                ],
                &[],
            ),
            (
                &[
                    "status",
                    "command",
                    "exit_code",
                    "completion_reason",
                    "termination_source",
                    "output",
                ],
                &["timeout_note", "stopped_reason"],
            ),
            (&["status", "command", "output", "timeout_note"], &[]),
            (
                &[
                    "status",
                    "session_id",
                    "completion_reason",
                    "termination_source",
                    "output",
                ],
                &[],
            ),
            (&["status", "bytes_written"], &[]),
            (&["status", "message"], &[]),
        ],
        other => panic!("the terminal_only distribution offers no {other}"),
    }
}

/// Workers share one model server, so their streamed answers overlap. llama-cpp-python by default
/// ends a stream early (a `[DONE]` with no `finish_reason`) as soon as another request waits; the
/// test's server is started with `--interrupt_requests False`, and the client refuses a stream cut
/// short. Two streams at once, no retry: both must come back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streamed_answers_at_once_both_arrive_whole() {
    let client = ModelClient::new(ModelSettings {
        base_urls: vec![common::model_server()],
        routing: trajectory_worker::model::RoutingSettings::default(),
        model: common::model_name(),
        api_key: None,
        max_tokens: Some(48),
        temperature: Some(0.0),
        reasoning_fields: serde_json::Map::new(),
        extra_body: serde_json::Map::new(),
        request_timeout: std::time::Duration::from_secs(300),
        stream: true,
        retry: RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        },
        prices: None,
        tokens: None,
        service_tier: None,
        batch: None,
    })
    .unwrap();
    let ask = |topic: &str| {
        client.request_body(
            None,
            &[Message::User(format!(
                "Write three sentences about {topic}."
            ))],
            None,
        )
    };
    let (first, second) = (ask("rivers"), ask("mountains"));
    let (first, second) = tokio::join!(client.complete(&first, 0), client.complete(&second, 0));
    for (topic, completion) in [("rivers", first), ("mountains", second)] {
        let completion = completion.unwrap_or_else(|err| panic!("the answer on {topic}: {err}"));
        assert!(
            completion.finish_reason.is_some(),
            "the answer on {topic} ends with a finish_reason: {completion:?}"
        );
        assert!(
            !completion.message.content.is_empty(),
            "the answer on {topic} has text: {completion:?}"
        );
    }
}

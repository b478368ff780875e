//! The run modes on real files on real disk: plan, batch, merge and local, with a scripted
//! OpenAI-compatible server standing in for the model (the real model server's tests are in
//! `real_model.rs`). Processes are killed for real where the test is about being killed.

mod common;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{
    RunFixture, WORKER, assert_batch_whole_lines, assert_whole_lines, keys, kill_batch_until_done,
    local_options, no_shutdown, signal_after, spawn_worker, terminal_server, wait, worker,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    FixedLatency, ScriptedServer, Step, text_reply, tool_call_reply,
};
use trajectory_worker::contract::{
    BatchSummary, PlanSummary, TERMINATION_MESSAGE_LIMIT, WorkerFailure, env, exit, format_ranges,
    parse_ranges,
};
use trajectory_worker::run::batch::run_batch;
use trajectory_worker::run::local::run_local;
use trajectory_worker::run::manifest::Manifest;
use trajectory_worker::run::{RunError, merge, plan};

#[test]
fn plan_records_every_kind_of_bad_line_and_goes_on() {
    let long = format!("{{\"prompt\": \"{}\"}}", "x".repeat(1024 * 1024 + 10));
    let lines = [
        r#"{"prompt": "first"}"#.to_owned(),
        r#"{"prompt": "broken"#.to_owned(),
        r#"{"text": "no prompt"}"#.to_owned(),
        r#"{"prompt": 7}"#.to_owned(),
        String::new(),
        long,
        r#"["an", "array"]"#.to_owned(),
        r#"{"prompt": "second", "label": 1}"#.to_owned(),
        r#"{"prompt": ""}"#.to_owned(),
        r#"{"messages": [{"role": "user", "content": "third"}]}"#.to_owned(),
    ];
    let fixture = RunFixture::with_lines("http://127.0.0.1:9/v1", &lines);
    // Invalid UTF-8 cannot live in a Rust string: append it as bytes (line 11).
    let mut data = std::fs::read(fixture.dataset()).unwrap();
    data.extend_from_slice(b"{\"prompt\": \"\xff\xfe\"}\n");
    std::fs::write(fixture.dataset(), data).unwrap();

    let (manifest, summary) = plan::plan(&fixture.location()).unwrap();

    let invalid: Vec<(u64, String)> = fixture
        .lines("invalid.jsonl")
        .iter()
        .map(|entry| {
            (
                entry["line"].as_u64().unwrap(),
                entry["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected: Vec<(u64, String)> = [
        (2, "invalid_json"),
        (3, "missing_prompt"),
        (4, "prompt_not_string"),
        (5, "empty_line"),
        (6, "too_long"),
        (7, "not_an_object"),
        (9, "empty_prompt"),
        (11, "invalid_utf8"),
    ]
    .into_iter()
    .map(|(line, reason)| (line, reason.to_owned()))
    .collect();
    assert_eq!(invalid, expected);
    assert_eq!(
        (summary.prompts, summary.invalid, summary.batches),
        (3, 8, 1)
    );
    assert_eq!(manifest.dataset.lines, 11);
    assert!(summary.dataset_digest.starts_with("blake3:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_order_mark_at_the_start_of_the_dataset_is_accepted_by_plan_and_batch() {
    let server = terminal_server(Duration::ZERO).await;
    let lines = [
        "\u{feff}{\"prompt\": \"first\", \"row\": 0}".to_owned(),
        r#"{"prompt": "second", "row": 1}"#.to_owned(),
        // Only the file's first line may start with one: elsewhere it is not JSON.
        "\u{feff}{\"prompt\": \"third\", \"row\": 2}".to_owned(),
    ];
    let fixture = RunFixture::with_lines(&server.base_url(), &lines);
    let data = std::fs::read(fixture.dataset()).unwrap();
    assert!(data.starts_with(b"\xEF\xBB\xBF"));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!((report.plan.prompts, report.plan.invalid), (2, 1));
    let invalid = fixture.lines("invalid.jsonl");
    assert_eq!(invalid[0]["line"], 3);
    assert_eq!(invalid[0]["reason"], "invalid_json");
    // The mark stays part of the digested bytes and of batch 0's range.
    let manifest = Manifest::require(&fixture.location().run_dir()).unwrap();
    assert_eq!(
        manifest.dataset.digest,
        format!("blake3:{}", blake3::hash(&data).to_hex())
    );
    assert_eq!(manifest.batches[0].start(), 0);
    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(keys(&records), [(0, 0), (1, 0)]);
    assert_eq!(records[0]["conversations"][1]["value"], "first");
    assert_eq!(records[0]["source"], json!({"row": 0}));
}

#[test]
fn a_dataset_without_any_valid_line_fails_the_plan_and_names_the_file() {
    let fixture = RunFixture::with_lines(
        "http://127.0.0.1:9/v1",
        &["{}".to_owned(), "nope".to_owned()],
    );
    let error = plan::plan(&fixture.location()).unwrap_err();
    assert!(matches!(error, RunError::InvalidDataset(_)), "{error}");
    assert!(error.to_string().contains("prompts.jsonl"), "{error}");
    assert_eq!(error.exit_code(), exit::PERMANENT_CONFIG);
}

#[test]
fn changing_the_dataset_or_a_generating_field_under_an_existing_output_is_refused() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 6);
    let (first, _) = plan::plan(&fixture.location()).unwrap();

    // Operational fields may change.
    let fixture = fixture
        .with("/workers", json!(9))
        .with("/concurrency", json!(1));
    let (again, _) = plan::plan(&fixture.location()).unwrap();
    assert_eq!(first, again);

    let fixture = fixture.with("/seed", json!(8));
    let error = plan::plan(&fixture.location()).unwrap_err().to_string();
    assert!(
        error.contains(&first.spec_hash) && error.contains("spec.storage.outputPath"),
        "{error}"
    );

    let fixture = fixture.with("/seed", json!(7));
    let mut data = std::fs::read_to_string(fixture.dataset()).unwrap();
    data.push_str("{\"prompt\": \"an edit\"}\n");
    std::fs::write(fixture.dataset(), data).unwrap();
    let error = plan::plan(&fixture.location()).unwrap_err();
    assert!(matches!(error, RunError::OutputMismatch(_)));
    assert!(error.to_string().contains(&first.dataset.digest), "{error}");
    // The refused plan left the existing manifest alone.
    assert_eq!(
        Manifest::require(&fixture.location().run_dir()).unwrap(),
        first
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_dataset_lines_changed_since_the_plan_is_bad_input() {
    let server = terminal_server(Duration::ZERO).await;
    // Eight rows of 20 KB, batch size 4: batch 0 spans bytes 0..80 K, batch 1 80..160 K, so the
    // last 64 KiB segment of the dataset holds batch 1's lines only.
    let lines: Vec<String> = (0..8)
        .map(|i| {
            json!({"prompt": format!("task number {i}"), "pad": "x".repeat(20_000)}).to_string()
        })
        .collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines);
    let (manifest, _) = plan::plan(&fixture.location()).unwrap();
    assert_eq!(manifest.dataset.segment_digests.len(), 3);
    // Lines added at the end change no planned byte.
    let mut data = std::fs::read_to_string(fixture.dataset()).unwrap();
    data.push_str("{\"prompt\": \"added later\"}\n");
    let data = data.replace("task number 7", "task number X");
    std::fs::write(fixture.dataset(), data).unwrap();
    let engine = fixture.engine();
    let error = run_batch(
        &engine,
        &fixture.location(),
        &manifest,
        1,
        &no_shutdown(),
        &|_| {},
    )
    .await
    .unwrap_err();
    assert_eq!(error.exit_code(), exit::BAD_BATCH_INPUT, "{error}");
    let message = error.to_string();
    assert!(
        message.contains("the dataset changed since the plan: segment 2 (bytes 131072..")
            && message.contains(&manifest.dataset.segment_digests[2]),
        "{message}"
    );
    // Batch 0's segments are untouched, so it still runs.
    run_batch(
        &engine,
        &fixture.location(),
        &manifest,
        0,
        &no_shutdown(),
        &|_| {},
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_left_empty_by_read_only_tools_serve_later_conversations_and_all_go_at_the_end()
{
    // Every conversation reads a file that exists in no fresh workspace: it is not found every
    // time, whichever workspace (reused or new) the conversation got.
    let tool_call = tool_call_reply("read_file", &json!({"path": "notes.txt"}));
    for tool_turn in batch_of_40(tool_call, json!({"file": 100})).await {
        assert!(
            tool_turn.contains("not found") || tool_turn.contains("No such file"),
            "{tool_turn}"
        );
    }
}

/// Runs one batch of 40 conversations (concurrency 4) whose one tool call is `tool_call`, checks
/// that all succeeded and no workspace is left behind, and returns each one's tool turn.
async fn batch_of_40(tool_call: Value, distribution: Value) -> Vec<String> {
    let server = ScriptedServer::start_fixed_latency(FixedLatency {
        latency: Duration::from_millis(5),
        tool_call,
        final_answer: text_reply("done"),
    })
    .await;
    let fixture = RunFixture::new(&server.base_url(), 40)
        .with("/batchSize", json!(40))
        .with("/distribution", distribution);
    let location = fixture.location();
    let (manifest, _) = plan::plan(&location).unwrap();
    let summary = run_batch(
        &fixture.engine(),
        &location,
        &manifest,
        0,
        &no_shutdown(),
        &|_| {},
    )
    .await
    .unwrap();
    assert_eq!(summary.succeeded, 40);
    assert_eq!(
        std::fs::read_dir(fixture.workspaces()).unwrap().count(),
        0,
        "workspaces left behind"
    );
    let records = fixture.batch_lines(0);
    assert_eq!(records.len(), 40);
    records
        .iter()
        .map(|record| {
            record["conversations"][3]["value"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

/// Runs 40 conversations (concurrency 4) whose one terminal call is `pwd; <then>`, and returns
/// how many distinct workspaces they ran in and each call's output without its first line.
async fn terminal_workspaces(then: &str) -> (usize, Vec<String>) {
    let tool_call = tool_call_reply("terminal", &json!({"command": format!("pwd; {then}")}));
    let mut dirs = HashSet::new();
    let mut rest = Vec::new();
    for tool_turn in batch_of_40(tool_call, json!("terminal_only")).await {
        let start = tool_turn.find('{').unwrap();
        let end = tool_turn.rfind('}').unwrap();
        let response: Value = serde_json::from_str(&tool_turn[start..=end]).unwrap();
        let output = response["content"]["output"].as_str().unwrap().to_owned();
        assert_eq!(response["content"]["exit_code"], 0, "{then}: {output}");
        // The output is trimmed, as the reference's: a command that printed nothing after `pwd`
        // leaves no newline.
        let (dir, after) = output.split_once('\n').unwrap_or((output.as_str(), ""));
        dirs.insert(dir.to_owned());
        rest.push(after.to_owned());
    }
    (dirs.len(), rest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_commands_left_as_made_serve_later_conversations_and_changed_ones_never_do() {
    // `true` changes nothing: the batch reuses the workspaces (at most a few more than the 4 in
    // flight, instead of 40).
    let (dirs, _) = terminal_workspaces("true").await;
    assert!(
        dirs < 40,
        "{dirs} workspaces for 40 conversations: none was reused"
    );
    // A file left behind, a file made and removed again, a changed mode, an extended attribute:
    // every conversation sees a fresh, empty workspace.
    for then in [
        "ls -A; echo left > \"left-$$\"",
        "ls -A; touch gone; rm gone",
        "ls -A; chmod 755 .",
        "ls -A; /usr/bin/python3 -c \"import os; os.setxattr('.', 'user.note', b'left')\"",
    ] {
        let (dirs, listings) = terminal_workspaces(then).await;
        assert_eq!(dirs, 40, "{then}: a changed workspace was handed on");
        assert!(
            listings.iter().all(String::is_empty),
            "{then}: {listings:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_writes_dataset_order_across_batches_past_9_and_99() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 103)
        .with("/batchSize", json!(1))
        .with("/concurrency", json!(1));
    let location = fixture.location();
    let (manifest, _) = plan::plan(&location).unwrap();
    assert_eq!(manifest.batch_count(), 103);
    let engine = fixture.engine();
    // Batches finish in reverse order, so completion order and name order both differ from
    // dataset order.
    run_batches(&engine, &location, &manifest, (0..103).rev()).await;
    // Every batch removed the workspaces its conversations used before it returned.
    assert_eq!(
        std::fs::read_dir(fixture.workspaces()).unwrap().count(),
        0,
        "workspaces left behind"
    );
    let summary = merge::merge(&location).unwrap();
    assert_eq!(summary.trajectories, 103);
    let order: Vec<u64> = keys(&fixture.lines("trajectories.jsonl"))
        .into_iter()
        .map(|(index, _)| index)
        .collect();
    assert_eq!(order, (0..103).collect::<Vec<_>>());
    assert!(fixture.out().join("batches/batch-000102.done").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intentional_duplicate_prompts_and_samples_are_each_generated_once() {
    let server = terminal_server(Duration::ZERO).await;
    let lines: Vec<String> = ["same", "same", "other", "same"]
        .iter()
        .map(|p| json!({"prompt": p}).to_string())
        .collect();
    let fixture =
        RunFixture::with_lines(&server.base_url(), &lines).with("/samplesPerPrompt", json!(2));
    let options = local_options(&fixture);
    run_local(&options, &no_shutdown()).await.unwrap();
    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(
        keys(&records),
        [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (2, 0),
            (2, 1),
            (3, 0),
            (3, 1)
        ]
    );
    let ids: std::collections::HashSet<_> = records
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 8);
    // Running the same command again finds everything done and changes nothing.
    let before = std::fs::read(fixture.out().join("trajectories.jsonl")).unwrap();
    run_local(&options, &no_shutdown()).await.unwrap();
    assert_eq!(
        std::fs::read(fixture.out().join("trajectories.jsonl")).unwrap(),
        before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_run_writes_hermes_records_failures_and_statistics() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 3)
        .with("/batchSize", json!(10))
        .with("/concurrency", json!(1));
    let options = local_options(&fixture);
    let report = run_local(&options, &no_shutdown()).await.unwrap();
    assert_eq!(report.merge.trajectories, 3);
    let record = &fixture.lines("trajectories.jsonl")[0];
    let keys_in_order: Vec<&str> = record
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        &keys_in_order[..9],
        [
            "prompt_index",
            "conversations",
            "metadata",
            "completed",
            "partial",
            "api_calls",
            "toolsets_used",
            "tool_stats",
            "tool_error_counts"
        ]
    );
    let roles: Vec<&str> = record["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["from"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "human", "gpt", "tool", "gpt"]);
    assert_eq!(record["source"], json!({"row": 0}));
    assert_eq!(
        record["tool_stats"]["terminal"],
        json!({"count": 1, "success": 1, "failure": 0})
    );
    assert_eq!(
        record["tool_stats"]["read_file"],
        json!({"count": 0, "success": 0, "failure": 0})
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["counts"]["succeeded"], 3);
    assert_eq!(statistics["tool_statistics"]["terminal"]["count"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_prompts_are_recorded_with_their_error_class() {
    let server = ScriptedServer::start_with_default(
        [],
        Step::error(
            400,
            "context_length_exceeded",
            "maximum context length is 10 tokens",
        ),
    )
    .await;
    let fixture = RunFixture::new(&server.base_url(), 2);
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert!(fixture.lines("trajectories.jsonl").is_empty());
    let failures = fixture.lines("failures.jsonl");
    assert_eq!(keys(&failures), [(0, 0), (1, 0)]);
    assert_eq!(failures[0]["error_class"], "context_length");
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["error_classes"], json!({"context_length": 2}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_stops_the_batch_with_the_permanent_exit_code_and_writes_no_record() {
    let server =
        ScriptedServer::start_with_default([], Step::error(401, "invalid_api_key", "bad key"))
            .await;
    let fixture = RunFixture::new(&server.base_url(), 4);
    let status = worker(&fixture, &["plan"]).await;
    assert!(status.success());
    let status = worker(&fixture, &["batch", "0"]).await;
    assert_eq!(status.code(), Some(exit::PERMANENT_CONFIG));
    assert_eq!(
        fixture.records_files(0),
        [],
        "no record, and no empty file of the writer left behind"
    );
    // The same number of requests as prompts in flight at most: no retries of a 401.
    assert!(server.request_count() <= 4, "{}", server.request_count());
    let message: Value =
        serde_json::from_slice(&std::fs::read(fixture.root().join("termination-log")).unwrap())
            .unwrap();
    assert_eq!(message["reason"], "ModelUnauthorized");
}

/// A conversation of the terminal server's shape: one tool call, then a final answer.
fn conversation_steps() -> [Step; 2] {
    [
        Step::ok(tool_call_reply("terminal", &json!({"command": "echo hi"}))),
        Step::ok(text_reply("done")),
    ]
}

fn overloaded() -> Step {
    Step::error(503, "overloaded", "the server is overloaded")
}

/// Runs batch 0 of the fixture in this process, with fast retries.
async fn batch_zero_fast(fixture: &RunFixture) -> Result<BatchSummary, RunError> {
    common::batch_zero(fixture, &fixture.engine_with_fast_retries()).await
}

/// The batch file's records: all distinct, none failed; returns their keys.
fn distinct_unfailed_records(fixture: &RunFixture) -> Vec<(u64, u64)> {
    let records = fixture.batch_lines(0);
    assert!(
        records.iter().all(|record| record.get("status").is_none()),
        "an outage caused a failed record: {records:?}"
    );
    let mut found = keys(&records);
    found.sort_unstable();
    let before = found.len();
    found.dedup();
    assert_eq!(found.len(), before, "a finished conversation was redone");
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_stretch_stops_the_batch_as_transient_and_a_rerun_finishes_it_without_redoing_work() {
    // One conversation at a time: two finish, the third meets three 503s (all its attempts),
    // then the server is back (the default: a final answer at once).
    let mut script = Vec::new();
    script.extend(conversation_steps());
    script.extend(conversation_steps());
    script.extend([overloaded(), overloaded(), overloaded()]);
    let server = ScriptedServer::start_with_default(script, Step::ok(text_reply("done"))).await;
    let fixture = RunFixture::new(&server.base_url(), 6)
        .with("/batchSize", json!(6))
        .with("/concurrency", json!(1));
    plan::plan(&fixture.location()).unwrap();

    let error = batch_zero_fast(&fixture).await.unwrap_err();
    assert!(matches!(error, RunError::ModelUnavailable(_)), "{error}");
    assert_eq!(error.exit_code(), exit::TRANSIENT);
    assert_eq!(distinct_unfailed_records(&fixture), [(0, 0), (1, 0)]);
    assert!(!fixture.out().join("batches/batch-000000.done").exists());
    assert_eq!(server.request_count(), 2 * 2 + 3);

    let summary = batch_zero_fast(&fixture).await.unwrap();
    assert_eq!(
        (summary.resumed, summary.succeeded, summary.failed),
        (2, 6, 0)
    );
    assert_eq!(
        distinct_unfailed_records(&fixture),
        (0..6).map(|i| (i, 0)).collect::<Vec<_>>()
    );
    // The four prompts left, one call each: nothing finished was asked again.
    assert_eq!(server.request_count(), 2 * 2 + 3 + 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_failures_across_conversations_open_the_circuit_and_no_conversation_starts() {
    // Two conversations in flight share eight 503s (the circuit's threshold), then both succeed;
    // no third conversation starts, though each still had retries left.
    let server = ScriptedServer::start_with_default(
        std::iter::repeat_with(overloaded).take(8),
        Step::ok(text_reply("done")),
    )
    .await;
    let fixture = RunFixture::new(&server.base_url(), 8)
        .with("/batchSize", json!(8))
        .with("/concurrency", json!(2))
        .with("/model/maxAttempts", json!(10));
    plan::plan(&fixture.location()).unwrap();

    let error = batch_zero_fast(&fixture).await.unwrap_err();
    assert!(
        matches!(&error, RunError::ModelUnavailable(message) if message.contains("6 not started")),
        "{error}"
    );
    assert_eq!(error.exit_code(), exit::TRANSIENT);
    assert_eq!(distinct_unfailed_records(&fixture).len(), 2);
    assert_eq!(server.request_count(), 8 + 2);

    batch_zero_fast(&fixture).await.unwrap();
    assert_eq!(
        distinct_unfailed_records(&fixture),
        (0..8).map(|i| (i, 0)).collect::<Vec<_>>()
    );
    assert_eq!(server.request_count(), 8 + 2 + 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_on_the_model_path_stops_the_batch_with_the_permanent_exit_code() {
    let server =
        ScriptedServer::start_with_default([], Step::error(404, "not_found", "Not Found")).await;
    let fixture = RunFixture::new(&server.base_url(), 8);
    assert!(worker(&fixture, &["plan"]).await.success());
    let status = worker(&fixture, &["batch", "0"]).await;
    assert_eq!(status.code(), Some(exit::PERMANENT_CONFIG));
    assert_eq!(
        fixture.records_files(0),
        [],
        "a wrong path is not the prompts' failure"
    );
    // One request per conversation in flight (4) at most: a 404 is not retried.
    assert!(server.request_count() <= 4, "{}", server.request_count());
    let message: Value =
        serde_json::from_slice(&std::fs::read(fixture.root().join("termination-log")).unwrap())
            .unwrap();
    assert_eq!(message["reason"], "ModelNotFound");
    assert_eq!(message["exitCode"], exit::PERMANENT_CONFIG);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_killed_at_random_points_ends_with_every_prompt_exactly_once() {
    let server = terminal_server(Duration::from_millis(40)).await;
    let fixture = RunFixture::new(&server.base_url(), 40)
        .with("/batchSize", json!(40))
        .with("/concurrency", json!(6));
    assert!(worker(&fixture, &["plan"]).await.success());
    let mut rng = Lcg::from_time();
    eprintln!("kill schedule seed: {}", rng.0);
    let delays = std::iter::repeat_with(|| Duration::from_millis(50 + rng.next() % 300));
    let kills = kill_batch_until_done(&fixture, delays, Duration::from_secs(120)).await;
    assert!(
        kills >= 3,
        "only {kills} kills: the schedule did not exercise resume"
    );
    assert!(worker(&fixture, &["merge"]).await.success());
    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(keys(&records), (0..40).map(|i| (i, 0)).collect::<Vec<_>>());
    assert_whole_lines(&fixture.out().join("trajectories.jsonl"), false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_whole_lines_and_the_same_command_resumes() {
    let server = terminal_server(Duration::from_millis(100)).await;
    let fixture = RunFixture::new(&server.base_url(), 24)
        .with("/batchSize", json!(24))
        .with("/concurrency", json!(2));
    assert!(worker(&fixture, &["plan"]).await.success());
    let child = spawn_worker(&fixture, &["batch", "0"]);
    let output = signal_after(child, Duration::from_millis(700), Signal::SIGTERM).await;
    assert_eq!(
        output.status.code(),
        Some(exit::INTERRUPTED),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let partial = assert_batch_whole_lines(&fixture, 0, false);
    assert!(
        partial > 0 && partial < 24,
        "{partial} records after SIGTERM"
    );
    assert!(!fixture.out().join("batches/batch-000000.done").exists());
    assert!(worker(&fixture, &["batch", "0"]).await.success());
    assert!(worker(&fixture, &["merge"]).await.success());
    assert_eq!(
        keys(&fixture.lines("trajectories.jsonl")),
        (0..24).map(|i| (i, 0)).collect::<Vec<_>>()
    );
}

/// A tiny deterministic generator for kill schedules (the seed is printed for replay).
struct Lcg(u64);

impl Lcg {
    fn from_time() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        Self(u64::from(nanos))
    }
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_model_server_stops_the_batch_without_burning_prompts() {
    // Nothing listens on the discard port: every connection is refused.
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 6).with("/model/maxAttempts", json!(2));
    let (manifest, _) = plan::plan(&fixture.location()).unwrap();
    let error = run_batch(
        &fixture.engine(),
        &fixture.location(),
        &manifest,
        0,
        &no_shutdown(),
        &|_| {},
    )
    .await
    .unwrap_err();
    assert!(matches!(error, RunError::ModelUnavailable(_)), "{error}");
    assert_eq!(error.exit_code(), exit::TRANSIENT);
    assert_eq!(
        fixture.records_files(0),
        [],
        "no prompt may be recorded as failed because the server was down"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_form_is_written_beside_the_hermes_form_in_the_same_order() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 6).with("/openaiFormat", json!(true));
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    let hermes = fixture.lines("trajectories.jsonl");
    let openai = fixture.lines("trajectories.openai.jsonl");
    assert_eq!(keys(&hermes), keys(&openai));
    let first = &openai[0];
    let roles: Vec<&str> = first["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(
        first["messages"][1]["tool_calls"][0]["function"]["name"],
        "terminal"
    );
    assert_eq!(first["tools"][0]["type"], "function");
    assert_eq!(first["id"], hermes[0]["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_keeps_the_openai_line_of_the_very_trajectory_it_keeps() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 2).with("/openaiFormat", json!(true));
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    let requests = server.request_count();
    let files = fixture.records_files(0);
    assert_eq!(files.len(), 1, "one writer: {files:?}");
    let (main, openai) = (fixture.batch_lines(0), fixture.batch_openai_lines(0));
    let stamp = |line: &Value| line["finished_at"].as_str().unwrap().to_owned();
    assert_eq!(stamp(&main[0]), stamp(&openai[0]));
    let altered = |line: &Value, finished_at: &str| {
        let mut line = line.clone();
        line["finished_at"] = json!(finished_at);
        line["messages"] = json!([{"role": "user", "content": "from another attempt"}]);
        line.to_string()
    };
    // Prompt 0: the writer's OpenAI file holds an orphan (its trajectory never reached the main
    // file) before the line of the trajectory that did. Prompt 1: a second writer, whose files sort
    // after the first's (a writer id is hex), wrote another trajectory, and its OpenAI line.
    let openai_lines = [
        altered(&openai[0], "2001-01-01T00:00:00.000000Z"),
        openai[0].to_string(),
        openai[1].to_string(),
    ];
    std::fs::write(&files[0].openai, openai_lines.join("\n") + "\n").unwrap();
    let mut second = main[1].clone();
    second["finished_at"] = json!("2001-01-01T00:00:01.000000Z");
    let second_writer = fixture.out().join("batches/batch-000000/w-zz-second");
    std::fs::write(
        second_writer.with_extension("jsonl"),
        second.to_string() + "\n",
    )
    .unwrap();
    std::fs::write(
        second_writer.with_extension("openai.jsonl"),
        altered(&openai[1], "2001-01-01T00:00:01.000000Z") + "\n",
    )
    .unwrap();
    assert_eq!(fixture.records_files(0).len(), 2);

    let summary = merge::merge(&fixture.location()).unwrap();
    assert_eq!((summary.trajectories, summary.skipped_lines), (2, 1));
    let hermes = fixture.lines("trajectories.jsonl");
    let paired = fixture.lines("trajectories.openai.jsonl");
    assert_eq!(keys(&hermes), keys(&paired));
    for (hermes, paired) in hermes.iter().zip(&paired) {
        assert_eq!(stamp(hermes), stamp(paired));
        let prompt = format!("task number {}", hermes["prompt_index"]);
        assert_eq!(paired["messages"][0]["content"], json!(prompt));
    }
    assert_eq!(
        server.request_count(),
        requests,
        "merge asks the model nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_local_run_on_the_same_directory_is_refused_with_a_clear_message() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 3);
    // What a first `local` holds while it runs.
    let held = fixture.location().run_dir().lock().unwrap();
    let error = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap_err();
    assert!(matches!(error, RunError::OutputInUse(_)), "{error}");
    assert!(
        error
            .to_string()
            .contains("another `trajectory-worker local`"),
        "{error}"
    );
    assert_eq!(error.exit_code(), exit::PERMANENT_CONFIG);
    assert_eq!(server.request_count(), 0);
    drop(held);
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!(fixture.lines("trajectories.jsonl").len(), 3);
}

/// A row naming its own image needs that image's filesystem (a SWE-style repository at
/// `/testbed`); a local run has no container to give it, so the run is refused at plan time,
/// naming the rows and images, before any request and without writing anything, even for rows
/// naming the run's `spec.sandbox.image` (a local run does not use it). Without those fields the
/// same command then runs in the same output directory: nothing of the refused plan stands in
/// its way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_run_refuses_rows_with_an_image_of_their_own_before_anything_runs() {
    let server = terminal_server(Duration::ZERO).await;
    let row = |i: usize, extra: Value| {
        let mut row = json!({"prompt": format!("task number {i}")});
        row.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        row
    };
    let extras = [
        json!({}),
        json!({"image": "sweb.eval.x86_64.django__django-11333", "cwd": "/testbed"}),
        json!({"cwd": "/srv"}),
        json!({"docker_image": "alexgshaw/fix-git:20251031"}),
        json!({}),
        json!({"image": "task:latest", "docker_image": "ignored/when-image-is-set"}),
    ];
    let rows: Vec<Value> = extras
        .iter()
        .enumerate()
        .map(|(i, extra)| row(i, extra.clone()))
        .collect();
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/sandbox", json!({"image": "task:latest"}));

    let error = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap_err();
    assert!(matches!(error, RunError::NeedsContainers(_)), "{error}");
    assert_eq!(error.exit_code(), exit::PERMANENT_CONFIG);
    let message = error.to_string();
    for expected in [
        "prompts.jsonl",
        "3 rows name a container image",
        "lines 2, 4, 6;",
        "`sweb.eval.x86_64.django__django-11333`",
        "`alexgshaw/fix-git:20251031`",
        "`task:latest`",
        "remove the `image` and `docker_image` fields of those rows",
        "scripts/demo-cluster.sh",
    ] {
        assert!(message.contains(expected), "{expected:?} in: {message}");
    }
    assert!(!message.contains("ignored/when-image-is-set"), "{message}");
    assert_eq!(server.request_count(), 0, "no prompt ran");
    // Only the lock a local run holds while it runs.
    let written: Vec<_> = std::fs::read_dir(fixture.out())
        .map(|entries| entries.map(|entry| entry.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert_eq!(written, [".lock"], "nothing written");

    let without_images: Vec<String> = rows
        .iter()
        .map(|row| {
            let mut row = row.clone();
            let fields = row.as_object_mut().unwrap();
            fields.remove("image");
            fields.remove("docker_image");
            row.to_string()
        })
        .collect();
    std::fs::write(fixture.dataset(), without_images.join("\n") + "\n").unwrap();
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!(report.merge.trajectories, 6);
    assert_eq!(report.plan.images, None);
}

#[test]
fn a_missing_api_key_file_or_variable_is_refused_before_any_request() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1)
        .with("/model/apiKeyEnv", json!("TRAJ_TEST_KEY_THAT_IS_NOT_SET"));
    let error = trajectory_worker::run::batch::Engine::new(
        &fixture.location().plan.spec,
        fixture.workspaces(),
    )
    .unwrap_err();
    assert!(
        error.to_string().contains("TRAJ_TEST_KEY_THAT_IS_NOT_SET"),
        "{error}"
    );
    let missing = trajectory_worker::model::ApiKey::from_file(&fixture.root().join("no-such-key"))
        .unwrap_err();
    assert!(missing.contains("no-such-key"), "{missing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_a_local_run_and_the_same_command_finishes_it() {
    let server = terminal_server(Duration::from_millis(100)).await;
    let fixture = RunFixture::new(&server.base_url(), 30)
        .with("/batchSize", json!(5))
        .with("/concurrency", json!(2));
    let local = || {
        Command::new(WORKER)
            .arg("local")
            .arg(fixture.run_file())
            .arg("--no-progress-bar")
            .arg("--workspace-root")
            .arg(fixture.workspaces())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the worker binary starts")
    };
    let child = local();
    let output = signal_after(child, Duration::from_millis(900), Signal::SIGINT).await;
    assert_eq!(
        output.status.code(),
        Some(exit::INTERRUPTED),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !fixture.out().join("trajectories.jsonl").exists(),
        "an interrupted run does not merge"
    );

    let output = wait(local()).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("trajectories.jsonl"));
    assert_eq!(
        keys(&fixture.lines("trajectories.jsonl")),
        (0..30).map(|i| (i, 0)).collect::<Vec<_>>()
    );
}

/// A batch marked done holds every (prompt, sample) of its prompts: merge fails on one that lost
/// a record after it finished, naming the batches and the first keys, instead of leaving a silent
/// hole. It checks every batch first and removes the markers of exactly the incomplete ones, so a
/// new plan sees them pending, and running them generates the lost keys alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_reopens_every_done_batch_that_lost_a_record_and_a_rerun_fills_only_those() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 16).with("/samplesPerPrompt", json!(2));
    let location = fixture.location();
    let (manifest, _) = plan::plan(&location).unwrap();
    assert_eq!(manifest.batch_count(), 4);
    let engine = fixture.engine();
    run_batches(&engine, &location, &manifest, 0..manifest.batch_count()).await;
    let requests = server.request_count();
    assert_eq!(requests, 16 * 2 * 2, "16 prompts, 2 samples, 2 calls each");

    // Batch 1 (prompts 4-7) loses the record of prompt 6, sample 1; batch 2 (prompts 8-11) those
    // of prompt 8, sample 0 and prompt 9, sample 1.
    let lost = [(6, 1), (8, 0), (9, 1)];
    for batch in [1, 2] {
        let files = fixture.records_files(batch);
        assert_eq!(files.len(), 1, "{files:?}");
        let text = std::fs::read_to_string(&files[0].records).unwrap();
        let kept: Vec<&str> = text
            .lines()
            .filter(|line| {
                let record: Value = serde_json::from_str(line).unwrap();
                let key = (
                    record["prompt_index"].as_u64().unwrap(),
                    record["sample"].as_u64().unwrap(),
                );
                !lost.contains(&key)
            })
            .collect();
        assert_eq!(
            kept.len(),
            8 - usize::try_from(batch).unwrap(),
            "records removed"
        );
        std::fs::write(&files[0].records, kept.join("\n") + "\n").unwrap();
    }

    let log = fixture.root().join("merge-termination-log");
    let output = common::worker_command(&fixture, &fixture.run_file(), &log, &["merge"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(exit::PERMANENT_CONFIG));
    let message: Value = serde_json::from_slice(&std::fs::read(&log).unwrap()).unwrap();
    assert_eq!(message["reason"], "IncompleteBatch");
    assert_eq!(message["exitCode"], exit::PERMANENT_CONFIG);
    let error = message["error"].as_str().unwrap();
    assert!(
        error.starts_with(
            "incomplete batch: 2 batches (1-2) were marked done but lack records; their .done \
             markers were removed, so that a new plan sees them pending and their next run \
             generates only the missing keys: "
        ) && error.contains(
            "batch 1 holds no record for 1 of its 8 (prompt, sample) keys (prompt 6 sample 1); \
             batch 2 holds no record for 2 of its 8 (prompt, sample) keys (prompt 8 sample 0, \
             prompt 9 sample 1)"
        ),
        "{error}"
    );
    let run_dir = location.run_dir();
    assert_eq!(
        run_dir.done_batches().unwrap(),
        [0, 3],
        "exactly those markers go"
    );
    let outputs: Vec<_> = std::fs::read_dir(fixture.out())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.contains("trajectories") || name.contains("failures"))
        .collect();
    assert_eq!(
        outputs,
        Vec::<String>::new(),
        "no output, and no temp file, from an incomplete merge"
    );

    let (_, summary) = plan::plan(&location).unwrap();
    assert_eq!(
        format_ranges(&summary.done),
        "0,3",
        "a new plan sees 1-2 pending"
    );
    run_batches(&engine, &location, &manifest, [1, 2].into_iter()).await;
    assert_eq!(
        server.request_count() - requests,
        2 * lost.len(),
        "only the lost conversations are generated again"
    );
    let summary = merge::merge(&location).unwrap();
    assert_eq!((summary.trajectories, summary.skipped_lines), (32, 0));
    let merged = keys(&fixture.lines("trajectories.jsonl"));
    let every: Vec<(u64, u64)> = (0..16).flat_map(|p| [(p, 0), (p, 1)]).collect();
    assert_eq!(merged, every, "every key once, in dataset order");
}

/// A resume whose done batches are too scattered for the plan's summary (every other one of
/// 400): `plan` writes the batches not done to storage and names the file in its termination
/// message, and a batch pod whose run plan points at that list works the batch at its index's
/// slot of it, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scattered_resume_hands_its_pending_list_to_the_batch_pods_through_storage() {
    const BATCHES: u32 = 400;
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 800).with("/batchSize", json!(2));
    let location = fixture.location();
    let (manifest, _) = plan::plan(&location).unwrap();
    assert_eq!(manifest.batch_count(), BATCHES);
    // An earlier run finished the even batches.
    let engine = fixture.engine();
    run_batches(&engine, &location, &manifest, (0..BATCHES).step_by(2)).await;
    let earlier = server.request_count();
    assert_eq!(
        earlier,
        200 * 2 * 2,
        "200 batches of 2 conversations of 2 calls"
    );

    assert!(worker(&fixture, &["plan"]).await.success());
    let message = std::fs::read_to_string(fixture.root().join("termination-log")).unwrap();
    assert!(
        message.len() <= TERMINATION_MESSAGE_LIMIT,
        "{} bytes",
        message.len()
    );
    let summary: PlanSummary = serde_json::from_str(&message).unwrap();
    assert!(
        summary.done_truncated && summary.done.len() < 200,
        "{message}"
    );
    assert_eq!((summary.done_count, summary.pending_count()), (200, 200));
    let list = summary.pending_list.expect("a pending list");
    let text = std::fs::read_to_string(fixture.out().join(&list)).unwrap();
    let odd: Vec<u32> = (1..BATCHES).step_by(2).collect();
    assert_eq!(parse_ranges(&text).unwrap(), odd);

    // A shard working slots 100-199 of the list: its index 7 is slot 107, batch 215.
    let plan = location.plan.clone().with_pending_slots(&list, 100..200);
    let batch = worked_batch(&fixture, &plan, 7).await;
    assert_eq!((batch.batch, batch.succeeded, batch.resumed), (215, 2, 0));
    // Its prompts 430 and 431, in the order their conversations ended.
    let mut records = keys(&fixture.batch_lines(215));
    records.sort_unstable();
    assert_eq!(records, [(430, 0), (431, 0)]);
    assert_eq!(
        server.request_count() - earlier,
        2 * 2,
        "batch 215's two conversations"
    );
    let mut written: Vec<u32> = std::fs::read_dir(fixture.out().join("batches"))
        .unwrap()
        .filter_map(|entry| {
            // A batch's records are in its directory `batch-NNNNNN/`, one file per writer.
            let name = entry.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("batch-")?.parse().ok()
        })
        .filter(|&batch| !fixture.batch_lines(batch).is_empty())
        .collect();
    written.sort_unstable();
    let mut expected: Vec<u32> = (0..BATCHES).step_by(2).collect();
    expected.push(215);
    expected.sort_unstable();
    assert_eq!(written, expected, "no other batch was worked");

    // Without batch ranges, index i is slot i.
    let plan = location.plan.clone().with_pending_slots(&list, 0..200);
    let identity = trajectory_worker::contract::RunPlan {
        batch_ranges: None,
        ..plan
    };
    assert_eq!(worked_batch(&fixture, &identity, 0).await.batch, 1);
}

/// A pending list that is not there, is not ranges, or is shorter than the slot an index works
/// fails only that index (exit 65, bad batch input), naming the list, before any conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_list_missing_garbled_or_too_short_fails_only_the_index() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 40);
    let location = fixture.location();
    plan::plan(&location).unwrap();
    std::fs::create_dir_all(fixture.out().join("plan")).unwrap();
    std::fs::write(fixture.out().join("plan/pending-short.ranges"), "1,3-4\n").unwrap();
    std::fs::write(
        fixture.out().join("plan/pending-garbled.ranges"),
        "1,3,x-9\n",
    )
    .unwrap();
    let with_list = |list: &str, slots| location.plan.clone().with_pending_slots(list, slots);
    let past = with_list("plan/pending-short.ranges", 1..5);
    let cases = [
        (
            &past,
            2,
            "pending-short.ranges: completion index 2 works slot 3, past the end",
        ),
        (
            &with_list("plan/pending-0000000000000000.ranges", 0..1),
            0,
            "pending-0000000000000000.ranges: cannot read it",
        ),
        (
            &with_list("plan/pending-garbled.ranges", 0..3),
            2,
            "pending-garbled.ranges: bad index range \"x-9\"",
        ),
        // Past the end of the slots themselves: as for any plan.
        (&past, 4, "completion index 4 has no batch in the run plan"),
    ];
    for (plan, index, named) in cases {
        let (code, message) = batch_pod(&fixture, plan, index).await;
        assert_eq!(code, Some(exit::BAD_BATCH_INPUT), "{message}");
        let failure: WorkerFailure = serde_json::from_str(&message).unwrap();
        assert_eq!(failure.reason, "BadBatchInput");
        assert!(failure.error.contains(named), "{}", failure.error);
    }
    assert_eq!(
        server.request_count(),
        0,
        "no conversation for a failed index"
    );
    // The list's slot 2 is batch 4, which the same plan works.
    assert_eq!(worked_batch(&fixture, &past, 1).await.batch, 4);
}

/// [`batch_pod`] for an index that must succeed: its summary.
async fn worked_batch(
    fixture: &RunFixture,
    plan: &trajectory_worker::contract::RunPlan,
    index: u32,
) -> BatchSummary {
    let (code, message) = batch_pod(fixture, plan, index).await;
    assert_eq!(code, Some(0), "index {index}: {message}");
    serde_json::from_str(&message).unwrap()
}

/// Runs `trajectory-worker batch` as a pod of a generation Job does: the run plan mounted at
/// `TRAJ_PLAN_PATH`, the index in `JOB_COMPLETION_INDEX`. Returns the exit code and the
/// termination message.
async fn batch_pod(
    fixture: &RunFixture,
    plan: &trajectory_worker::contract::RunPlan,
    index: u32,
) -> (Option<i32>, String) {
    let pod = tempfile::tempdir().unwrap();
    let plan_path = pod.path().join("plan.json");
    std::fs::write(&plan_path, serde_json::to_string(plan).unwrap()).unwrap();
    let termination_log = pod.path().join("termination-log");
    let child = Command::new(WORKER)
        .arg("batch")
        .env(env::PLAN_PATH, &plan_path)
        .env(env::JOB_COMPLETION_INDEX, index.to_string())
        .env(env::STORAGE_ROOT, fixture.root())
        .env(env::TERMINATION_LOG, &termination_log)
        .env(env::WORKSPACE_ROOT, fixture.workspaces())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the worker binary starts");
    let output = wait(child).await;
    let message = std::fs::read_to_string(&termination_log).unwrap_or_else(|_| {
        format!(
            "no termination message; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code(), message)
}

/// Runs `batches` to completion, one after the other.
async fn run_batches(
    engine: &trajectory_worker::run::batch::Engine,
    location: &trajectory_worker::run::RunLocation,
    manifest: &Manifest,
    batches: impl Iterator<Item = u32>,
) {
    for batch in batches {
        run_batch(engine, location, manifest, batch, &no_shutdown(), &|_| {})
            .await
            .unwrap();
    }
}

#[test]
fn distributions_checks_a_run_file_and_fails_naming_what_its_distribution_lacks() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 1);
    let distributions = |run_file: &std::path::Path| {
        let output = Command::new(WORKER)
            .arg("distributions")
            .arg(run_file)
            .env("RUST_LOG", "warn")
            .output()
            .expect("run the worker");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, listing, _) = distributions(&fixture.run_file());
    assert_eq!(code, Some(0), "{listing}");
    assert!(
        listing.contains("its distribution (terminal_only) can run"),
        "{listing}"
    );
    assert!(
        listing
            .lines()
            .any(|line| line.starts_with("terminal_only ") && line.ends_with("[ready]")),
        "{listing}"
    );

    let browser = fixture.variant_run_file("browser.yaml", "/distribution", json!("browser_only"));
    let (code, listing, stderr) = distributions(&browser);
    assert_eq!(code, Some(exit::PERMANENT_CONFIG), "{listing}{stderr}");
    assert!(
        listing.contains("[lacks spec.tools.browser]"),
        "the listing is printed before the refusal: {listing}"
    );
    assert!(
        stderr.contains(
            "browser.yaml: spec.tools.browser: required because distribution \"browser_only\" draws toolset browser"
        ),
        "{stderr}"
    );
}

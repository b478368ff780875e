//! `spec.replay.from` (issue 42, item 3): a run regenerated from an earlier run's output takes
//! the recorded outputs of the calls its model makes the same, in the same positions, until
//! its first call that differs; from there its tools run. The commands append to a log in the
//! workspace (kept), so every execution is counted there, and each answers with the log's
//! length, so an output shows whether the environment held what the recorded calls left.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use common::{RunFixture, tool_responses, worker};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_calls_reply};

/// Tool turns of every conversation.
const TURNS: usize = 4;
/// The calls the regenerating model makes as the original did.
const SHARED: usize = 2;

/// Which model answers: the original, one that goes its own way after [`SHARED`] calls, or one
/// that makes every call the original made.
const ORIGINAL: u8 = 0;
const DIVERGING: u8 = 1;
const SAME: u8 = 2;

fn append(tag: &str) -> String {
    format!("echo {tag} >> runs.log && wc -l < runs.log")
}

async fn model(mode: Arc<AtomicU8>) -> ScriptedServer {
    ScriptedServer::start_responding(move |body| {
        let turn = body["messages"].as_array().map_or(0, |messages| {
            messages
                .iter()
                .filter(|message| message["role"] == "assistant")
                .count()
        });
        if turn >= TURNS {
            return Step::ok(text_reply("done"));
        }
        let command = match mode.load(Ordering::SeqCst) {
            DIVERGING if turn >= SHARED => append(&format!("b{turn}")),
            _ => append(&format!("a{turn}")),
        };
        let arguments = json!({"command": command}).to_string();
        Step::ok(tool_calls_reply(&[("terminal", Value::String(arguments))]))
    })
    .await
}

/// The kept workspace of prompt 0's conversation.
fn workspace(fixture: &RunFixture) -> PathBuf {
    std::fs::read_dir(fixture.workspaces())
        .unwrap()
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .is_some_and(|name| name.to_string_lossy().starts_with("p0-s0-"))
        })
        .expect("the conversation's workspace is kept")
}

/// Runs plan, batch 0 and merge of the fixture as it stands, after removing the workspaces of
/// the run before.
async fn run(fixture: &RunFixture) {
    let _ = std::fs::remove_dir_all(fixture.workspaces());
    for step in [&["plan"][..], &["batch", "0"], &["merge"]] {
        assert!(worker(fixture, step).await.success(), "{step:?}");
    }
}

fn outputs(record: &Value) -> Vec<String> {
    tool_responses(record)
        .iter()
        .map(|response| response["content"]["output"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regenerated_run_takes_the_shared_calls_from_the_recording_and_runs_the_rest() {
    let mode = Arc::new(AtomicU8::new(ORIGINAL));
    let server = model(Arc::clone(&mode)).await;
    let fixture = RunFixture::new(&server.base_url(), 1)
        .with("/batchSize", json!(1))
        .with("/agent/maxTurns", json!(TURNS + 2))
        .with("/tools", json!({"keepWorkspaces": true}));
    run(&fixture).await;
    let original = &fixture.batch_lines(0)[0];
    assert_eq!(outputs(original), ["1", "2", "3", "4"], "{original}");
    assert!(original.get("replay").is_none(), "{original}");

    // Another model: the same first two calls, then its own.
    mode.store(DIVERGING, Ordering::SeqCst);
    let fixture = fixture
        .with("/storage", json!({"outputPath": "out-b"}))
        .with("/replay", json!({"from": "out"}));
    run(&fixture).await;
    let regenerated = &fixture.batch_lines(0)[0];
    assert_eq!(
        regenerated["replay"],
        json!({"calls": SHARED, "ran_for_state": SHARED}),
        "{regenerated}"
    );
    // Its own calls found the log the two recorded calls left: they ran once each, for state,
    // just before the first of its own.
    assert_eq!(outputs(regenerated), ["1", "2", "3", "4"], "{regenerated}");
    let log = std::fs::read_to_string(workspace(&fixture).join("runs.log")).unwrap();
    assert_eq!(log, "a0\na1\nb2\nb3\n", "every execution, in order");

    // A model that makes every call the original made runs no tool at all.
    mode.store(SAME, Ordering::SeqCst);
    let fixture = fixture.with("/storage", json!({"outputPath": "out-c"}));
    run(&fixture).await;
    let replayed = &fixture.batch_lines(0)[0];
    assert_eq!(
        replayed["replay"],
        json!({"calls": TURNS, "ran_for_state": 0}),
        "{replayed}"
    );
    assert_eq!(outputs(replayed), ["1", "2", "3", "4"], "{replayed}");
    assert!(
        !workspace(&fixture).join("runs.log").exists(),
        "a tool ran though every call was the recording's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_source_that_does_not_exist_is_refused_by_the_plan_naming_the_field() {
    let server = model(Arc::new(AtomicU8::new(ORIGINAL))).await;
    let fixture = RunFixture::new(&server.base_url(), 1)
        .with("/batchSize", json!(1))
        .with("/replay", json!({"from": "runs/never-ran"}));
    let output = common::wait(common::spawn_worker(&fixture, &["plan"])).await;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("spec.replay.from") && stderr.contains("runs/never-ran/trajectories.jsonl"),
        "{stderr}"
    );
    assert_eq!(server.request_count(), 0, "a token was spent");
}

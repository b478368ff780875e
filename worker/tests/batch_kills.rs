//! Batch mode across kills (issue 45): the worker binary is `SIGKILL`ed at the two moments that
//! matter, each held open by the test kit's batch server (a test double of a provider's Batch
//! API, its lines run on a scripted model for exact counts):
//!
//! 1. between submitting a window and recording it: the provider created the batch, the worker
//!    never heard back, so its journal has the window's intent and no batch id;
//! 2. after a window's batch ended and before its results were applied: the journal has the
//!    batch id, the conversations wait for the answers.
//!
//! Each successor adopts the windows (the first by the window's name in the batches' metadata,
//! the second by its journaled id) instead of sending their turns again. What is counted: every
//! line the batch server executed, by `custom_id` (each turn paid once), the model's requests
//! (none live), and the tools: every tool call appends its turn to a file in the conversation's
//! workspace, which the row's verifier reads at the end (each tool run once, in order).

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::{RunFixture, spawn_worker, worker};
use serde_json::{Value, json};
use trajectory_testkit::batch_server::{BatchServer, Behaviour};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_calls_reply};

const CONVERSATIONS: usize = 8;

/// Four tool calls appending their turn to `ran.log`, then an answer: five turns.
fn appending_turns(body: &Value) -> Step {
    let turns = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "assistant").count()
    });
    let mut reply = if turns < 4 {
        let (name, arguments) = common::terminal(&format!("echo {turns} >> ran.log"));
        tool_calls_reply(&[(name, Value::String(arguments.to_string()))])
    } else {
        text_reply("done")
    };
    reply["usage"] = json!({"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100});
    Step::ok(reply)
}

/// Kills `child` once `held` says the batch server holds the moment; fails if it ends before.
async fn kill_when(mut child: Child, held: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(120);
    while !held() {
        if let Some(status) = child.try_wait().unwrap() {
            let output = common::wait(child).await;
            panic!(
                "the worker ended ({status}) before the moment to kill it: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        assert!(Instant::now() < until, "the moment to kill never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    common::wait(child).await;
}

/// The entries of every windows journal of batch 0, by file name.
fn journals(fixture: &RunFixture) -> Vec<(String, Vec<Value>)> {
    let dir = fixture.out().join("batches/batch-000000");
    let mut found: Vec<(String, Vec<Value>)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".windows.jsonl"))
        .map(|name| {
            let path = fixture.out().join("batches/batch-000000").join(&name);
            (name, common::parse_lines(&path))
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_a_window_is_submitted_and_while_its_results_wait_no_turn_is_paid_or_run_twice()
 {
    let model = ScriptedServer::start_responding(appending_turns).await;
    let holds = Behaviour {
        hold_create_of: Some(1),
        hold_results_of: Some(2),
        ..Behaviour::default()
    };
    let batches = BatchServer::start(&model.base_url(), holds).await;
    let lines: Vec<String> = (0..CONVERSATIONS)
        .map(|row| {
            json!({"prompt": format!("task {row}"),
                   "test": "test \"$(tr '\\n' ' ' < ran.log)\" = '0 1 2 3 '"})
            .to_string()
        })
        .collect();
    let fixture = RunFixture::with_lines(&model.base_url(), &lines)
        .with("/batchSize", json!(CONVERSATIONS))
        .with("/concurrency", json!(CONVERSATIONS))
        .with(
            "/model/batch",
            json!({"baseUrl": batches.base_url(), "maxRequests": CONVERSATIONS,
                   "maxWaitSeconds": 5, "pollSeconds": 1}),
        )
        .with("/model/pricing", json!({"input": 2.0, "output": 8.0}))
        .with(
            "/agent",
            json!({"maxTurns": 6, "promptTimeoutSeconds": 600}),
        )
        .with("/verifier", json!({"passesPerPrompt": 1}));
    assert!(worker(&fixture, &["plan"]).await.success());

    // 1. The first window's batch is created; the worker never hears its id.
    kill_when(spawn_worker(&fixture, &["batch", "0"]), || {
        batches.counts().held == 1
    })
    .await;
    assert_eq!(batches.counts().batches, 1);
    let killed = journals(&fixture);
    assert_eq!(killed.len(), 1, "{killed:?}");
    assert_eq!(killed[0].1.len(), 1, "an intent, no creation: {killed:?}");
    assert_eq!(killed[0].1[0]["entry"], "intent");
    assert_eq!(
        killed[0].1[0]["lines"].as_array().unwrap().len(),
        CONVERSATIONS
    );

    // 2. The successor adopts that batch, runs the tools, and its own window's batch ends; the
    //    worker is killed while it reads the results.
    kill_when(spawn_worker(&fixture, &["batch", "0"]), || {
        batches.counts().held == 2
    })
    .await;
    assert_eq!(
        batches.counts().batches,
        2,
        "the first window adopted, not sent again"
    );
    // The first writer's journal is as it was; the second recorded the batch it found for the
    // first window, then its own window's intent and batch.
    let killed = journals(&fixture);
    let kinds = |entries: &[Value]| -> Vec<String> {
        entries
            .iter()
            .map(|entry| entry["entry"].as_str().unwrap().to_owned())
            .collect()
    };
    let (first, second): (Vec<_>, Vec<_>) = killed
        .iter()
        .map(|(_, entries)| entries)
        .partition(|entries| entries.len() == 1);
    assert_eq!((first.len(), second.len()), (1, 1), "{killed:?}");
    assert_eq!(kinds(second[0]), ["created", "intent", "created"]);
    assert_eq!(second[0][0]["window"], first[0][0]["window"]);
    assert_eq!(second[0][0]["batch_id"], batches.batches()[0]["id"]);

    // 3. The last adopts the second window and finishes.
    assert!(worker(&fixture, &["batch", "0"]).await.success());
    assert!(worker(&fixture, &["merge"]).await.success());

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(
        records.len(),
        CONVERSATIONS,
        "{:?}",
        fixture.lines("failures.jsonl")
    );
    let counts = batches.counts();
    assert_eq!(counts.executed, 5 * CONVERSATIONS, "five turns each, once");
    assert!(
        counts.executed_ids.values().all(|runs| *runs == 1),
        "no turn paid twice: {:?}",
        counts.executed_ids
    );
    assert_eq!(
        model.request_count(),
        5 * CONVERSATIONS,
        "no turn went live"
    );
    for record in &records {
        assert_eq!(record["api_calls"], 5, "{record}");
        assert_eq!(record["tool_stats"]["terminal"]["count"], 4, "{record}");
        // Each tool ran once, in order: the workspace's log is the four turns.
        assert_eq!(record["verification"]["passed"], true, "{record}");
        assert_eq!(record["cost"]["tiers"]["batch"]["calls"], 5, "{record}");
        // The waits of turns taken up from the turn log are kept too.
        assert_eq!(record["batch_waits_ms"].as_array().unwrap().len(), 5);
    }
}

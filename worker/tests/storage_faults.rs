//! Storage faults on real filesystems: a full tmpfs before and during a batch, a read-only bind
//! mount, a storage root that is not there. Mounting needs root, as the test suite runs; a test
//! that cannot mount fails. (A read error of the disk, EIO or ESTALE, cannot be made on demand
//! here: the batch's unit tests inject it, named as a test double.)

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Mount, RunFixture, WORKER, keys, terminal_server};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    FixedLatency, ScriptedServer, text_reply, tool_call_reply,
};
use trajectory_worker::contract::exit;
use trajectory_worker::run::{RunError, plan};

async fn batch_zero(fixture: &RunFixture) -> Result<(), RunError> {
    common::batch_zero(fixture, &fixture.engine())
        .await
        .map(|_| ())
}

/// Runs the worker binary on the fixture; returns its exit code and termination message.
fn worker(fixture: &RunFixture, storage_root: &std::path::Path, args: &[&str]) -> (i32, Value) {
    let log = fixture.root().join("termination-log");
    let output = Command::new(WORKER)
        .args(args)
        .arg("--run-file")
        .arg(fixture.run_file())
        .arg("--storage-root")
        .arg(storage_root)
        .env("TRAJ_TERMINATION_LOG", &log)
        .env("TRAJ_WORKSPACE_ROOT", fixture.workspaces())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("the worker binary runs");
    let message =
        serde_json::from_slice(&std::fs::read(&log).unwrap_or_default()).unwrap_or(Value::Null);
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    (output.status.code().unwrap_or(-1), message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_without_room_for_the_batch_stops_it_before_any_model_request() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 8).with("/batchSize", json!(8));
    // 128 KiB: room for the plan's files, not for eight records of 16 KiB with the margin.
    let _mount = Mount::tmpfs(&fixture.out(), 128 << 10);
    plan::plan(&fixture.location()).unwrap();
    let error = batch_zero(&fixture).await.unwrap_err();
    assert_eq!(error.reason(), "StorageFull", "{error}");
    assert_eq!(error.exit_code(), exit::TRANSIENT);
    assert!(error.to_string().contains("bytes free"), "{error}");
    assert_eq!(server.request_count(), 0, "a token was spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_that_fills_midway_stops_the_batch_at_once_and_loses_nothing() {
    // Records of about 100 KB (far above the estimate), on 1 MiB: the volume fills after a few.
    let server = ScriptedServer::start_fixed_latency(FixedLatency {
        latency: Duration::from_millis(30),
        tool_call: tool_call_reply("terminal", &json!({"command": "echo hi"})),
        final_answer: text_reply(&"x".repeat(100_000)),
    })
    .await;
    let (prompts, concurrency) = (20, 2);
    let fixture = RunFixture::new(&server.base_url(), prompts)
        .with("/batchSize", json!(prompts))
        .with("/concurrency", json!(concurrency));
    let mount = Mount::tmpfs(&fixture.out(), 1 << 20);
    plan::plan(&fixture.location()).unwrap();
    let error = batch_zero(&fixture).await.unwrap_err();
    assert_eq!(error.reason(), "StorageFull", "{error}");
    assert_eq!(error.exit_code(), exit::TRANSIENT);
    let written = keys(&whole_lines(&fixture)).len();
    assert!(written > 0 && written < prompts, "{written} records");
    // Two calls a conversation; besides the saved ones, at most the group that could not be
    // written and the conversations in flight were started.
    let started = server.request_count().div_ceil(2);
    assert!(
        started <= written + 2 * concurrency,
        "{started} conversations started for {written} saved: the batch went on after ENOSPC"
    );

    // Space is freed: the retry resumes, and every prompt ends with exactly one record.
    assert!(mount.remount("remount,size=16m"));
    let before = server.request_count();
    batch_zero(&fixture).await.unwrap();
    let mut found = keys(&whole_lines(&fixture));
    found.sort_unstable();
    assert_eq!(
        found,
        (0..prompts as u64).map(|i| (i, 0)).collect::<Vec<_>>()
    );
    // A conversation whose tool turn reached the turn log before the volume filled is taken up
    // from it: only its answer is asked again.
    let taken_up = whole_lines(&fixture)
        .iter()
        .filter(|record| record["resumed_from_turn"].as_u64() == Some(1))
        .count();
    assert_eq!(
        server.request_count() - before,
        2 * (prompts - written) - taken_up,
        "the retry redid saved work"
    );
}

/// The whole record lines of batch 0, in every records file (a torn tail, which ENOSPC may leave,
/// is not a record).
fn whole_lines(fixture: &RunFixture) -> Vec<Value> {
    let mut records = Vec::new();
    for file in fixture.records_files(0) {
        let (data, lines) = trajectory_worker::storage::read_whole_lines(&file.records).unwrap();
        records.extend(
            lines
                .iter()
                .map(|&(start, end)| serde_json::from_slice::<Value>(&data[start..end]).unwrap()),
        );
    }
    records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_volume_fails_with_the_permanent_exit_code_before_any_request() {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), 4);
    plan::plan(&fixture.location()).unwrap();
    let _mount = Mount::read_only(&fixture.out());
    let (code, message) = worker(&fixture, fixture.root(), &["batch", "0"]);
    assert_eq!(code, exit::PERMANENT_CONFIG);
    assert_eq!(message["reason"], "StorageReadOnly");
    assert!(
        message["error"]
            .as_str()
            .unwrap()
            .contains("Read-only file system"),
        "{message}"
    );
    assert_eq!(server.request_count(), 0);
}

#[test]
fn a_storage_root_that_is_not_there_fails_with_the_permanent_exit_code() {
    let fixture = RunFixture::new("http://127.0.0.1:9/v1", 4);
    let missing = fixture.root().join("not-mounted");
    for step in ["plan", "batch", "merge"] {
        let args: &[&str] = if step == "batch" {
            &[step, "0"]
        } else {
            &[step]
        };
        let (code, message) = worker(&fixture, &missing, args);
        assert_eq!(code, exit::PERMANENT_CONFIG, "{step}");
        assert_eq!(message["reason"], "StorageMissing", "{step}");
        assert!(
            message["error"].as_str().unwrap().contains("not-mounted"),
            "{message}"
        );
    }
}

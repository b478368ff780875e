//! Two writers of one batch (issue 14, "exactly once"): real worker processes run the same batch of
//! one run directory at once, in every order of overlap, against the scripted model server, which
//! counts their requests. Each writer appends to files of its own; resume and merge union them by
//! (`prompt_index`, sample).
//!
//! Every conversation of the terminal server is two requests (a tool call, then a final answer).
//! A writer runs every key that had no record in any file when it started, and nothing else, so
//! the requests of writers that ran to their end are exactly `2 × Σ (N − resumed)` over them (ideal
//! `2N`, plus `2 × (N − resumed)` for each later writer that overlapped: at most `4N` for two). A
//! writer killed midway made at most `2 × (N − resumed)` of its own.

mod common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::{
    RunFixture, assert_batch_whole_lines, assert_whole_lines, keys, no_shutdown, parse_lines,
    terminal_server, wait, worker, worker_command,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::ScriptedServer;
use trajectory_worker::contract::BatchSummary;
use trajectory_worker::run::batch::run_batch;
use trajectory_worker::run::merge;

/// Prompts of the one batch.
const N: u64 = 24;

/// A planned run of one batch of [`N`] prompts, `concurrency` conversations per writer.
async fn one_batch_run(latency: Duration, concurrency: u32) -> (ScriptedServer, RunFixture) {
    let server = terminal_server(latency).await;
    let fixture = RunFixture::new(&server.base_url(), usize::try_from(N).unwrap())
        .with("/batchSize", json!(N))
        .with("/concurrency", json!(concurrency));
    assert!(worker(&fixture, &["plan"]).await.success());
    (server, fixture)
}

/// A `batch 0` process with run file `run_file`, reporting to its own termination log.
struct Writer {
    child: Child,
    log: PathBuf,
}

impl Writer {
    fn start(fixture: &RunFixture, run_file: &Path, name: &str) -> Self {
        let log = fixture.root().join(format!("termination-log-{name}"));
        let child = worker_command(fixture, run_file, &log, &["batch", "0"])
            .spawn()
            .expect("the worker binary starts");
        Self { child, log }
    }

    /// Waits for a clean end; returns the batch summary it reported.
    async fn finish(self) -> BatchSummary {
        let output = wait(self.child).await;
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&std::fs::read(&self.log).unwrap()).unwrap()
    }
}

/// Waits until the batch has `writers` records files of at least `lines` whole lines each.
async fn wait_for_lines(fixture: &RunFixture, writers: usize, lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let files = fixture.records_files(0);
        let counts = files
            .iter()
            .map(|file| assert_whole_lines(&file.records, true));
        if counts.filter(|count| *count >= lines).count() >= writers {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {writers} files of {lines} records"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The conversations a writer that ran to its end started: those without a record at its start.
/// The turns the writers' conversations took up from another writer's turn log rather than
/// asking the model again: a writer that starts while another runs a conversation it has no
/// record of takes up the turns the other committed (issue 42).
fn turns_taken_up(fixture: &RunFixture) -> u64 {
    fixture
        .batch_lines(0)
        .iter()
        .filter_map(|record| record["resumed_from_turn"].as_u64())
        .sum()
}

fn started(summary: &BatchSummary) -> u64 {
    assert_eq!(summary.succeeded, N, "{summary:?}");
    N - summary.resumed
}

/// What every overlap must end in: merge keeps every (prompt, sample) exactly once, from files
/// of whole lines only, with statistics of the kept records; another run of the batch finds it
/// done, and one without its marker finds every key recorded: neither asks the model anything.
async fn assert_exactly_once(server: &ScriptedServer, fixture: &RunFixture) {
    let files = fixture.records_files(0);
    let lines = assert_batch_whole_lines(fixture, 0, true);
    let summary = merge::merge(&fixture.location()).unwrap();
    assert_eq!(
        (summary.trajectories, summary.discarded, summary.failed),
        (N, 0, 0)
    );
    assert_eq!(
        summary.skipped_lines,
        lines as u64 - N,
        "every whole line beyond one per key is a duplicate of another writer's"
    );
    let trajectories = fixture.out().join("trajectories.jsonl");
    assert_eq!(
        assert_whole_lines(&trajectories, false),
        usize::try_from(N).unwrap()
    );
    assert_eq!(
        keys(&fixture.lines("trajectories.jsonl")),
        (0..N).map(|i| (i, 0)).collect::<Vec<_>>()
    );
    assert_whole_lines(&fixture.out().join("failures.jsonl"), false);
    assert!(fixture.lines("failures.jsonl").is_empty());
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["counts"]["records"], N);
    assert_eq!(statistics["counts"]["succeeded"], N);
    assert_eq!(statistics["api_calls"]["total"], 2 * N, "kept records only");
    assert_eq!(statistics["tool_statistics"]["terminal"]["count"], N);
    // The same files merge to the same bytes.
    let first = std::fs::read(&trajectories).unwrap();
    merge::merge(&fixture.location()).unwrap();
    assert_eq!(std::fs::read(&trajectories).unwrap(), first);

    let requests = server.request_count();
    let third = Writer::start(fixture, &fixture.run_file(), "third")
        .finish()
        .await;
    assert_eq!((third.resumed, third.succeeded), (N, N));
    std::fs::remove_file(fixture.out().join("batches/batch-000000.done")).unwrap();
    let fourth = Writer::start(fixture, &fixture.run_file(), "fourth")
        .finish()
        .await;
    assert_eq!((fourth.resumed, fourth.succeeded), (N, N));
    assert!(fixture.out().join("batches/batch-000000.done").exists());
    assert_eq!(
        server.request_count(),
        requests,
        "a done batch asks nothing"
    );
    assert_eq!(
        fixture.records_files(0),
        files,
        "a writer that recorded nothing leaves no file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_started_together_each_write_their_own_file_and_merge_keeps_each_key_once() {
    let (server, fixture) = one_batch_run(Duration::from_millis(30), 2).await;
    let a = Writer::start(&fixture, &fixture.run_file(), "a");
    let b = Writer::start(&fixture, &fixture.run_file(), "b");
    let (a, b) = (a.finish().await, b.finish().await);
    assert_eq!(
        fixture.records_files(0).len(),
        2,
        "both wrote: they overlapped"
    );
    let requests = server.request_count() as u64;
    eprintln!(
        "resumed: a {}, b {}; {requests} requests",
        a.resumed, b.resumed
    );
    assert_eq!(
        requests,
        2 * (started(&a) + started(&b)) - turns_taken_up(&fixture)
    );
    assert!(requests <= 4 * N, "{requests}");
    assert_exactly_once(&server, &fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_started_midway_that_finishes_first_leaves_the_first_writer_to_finish_too() {
    // A runs one conversation at a time; B, started once A has three records, runs eight.
    let (server, fixture) = one_batch_run(Duration::from_millis(40), 1).await;
    let fast = fixture.variant_run_file("run-fast.yaml", "/concurrency", json!(8));
    let mut a = Writer::start(&fixture, &fixture.run_file(), "a");
    wait_for_lines(&fixture, 1, 3).await;
    let b = Writer::start(&fixture, &fast, "b").finish().await;
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "B was to finish first, while A still ran"
    );
    let a = a.finish().await;
    assert_eq!(a.resumed, 0);
    assert!(b.resumed >= 3, "B found A's records: {b:?}");
    let requests = server.request_count() as u64;
    eprintln!("resumed: b {}; {requests} requests", b.resumed);
    assert_eq!(
        requests,
        2 * (started(&a) + started(&b)) - turns_taken_up(&fixture)
    );
    assert!(requests <= 2 * (2 * N - 3), "{requests}");
    assert_exactly_once(&server, &fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_killed_midway_leaves_the_other_to_complete_the_batch() {
    let (server, fixture) = one_batch_run(Duration::from_millis(30), 2).await;
    let mut a = Writer::start(&fixture, &fixture.run_file(), "a");
    let b = Writer::start(&fixture, &fixture.run_file(), "b");
    // Both are midway: each has written records.
    wait_for_lines(&fixture, 2, 2).await;
    a.child.kill().unwrap();
    let killed = wait(a.child).await;
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&killed.status),
        Some(Signal::SIGKILL as i32)
    );
    let b = b.finish().await;
    let files = fixture.records_files(0);
    assert_eq!(files.len(), 2, "{files:?}");
    // A killed process's file may end in a torn line; the other writer never touched it.
    let whole: Vec<usize> = files
        .iter()
        .map(|file| assert_whole_lines(&file.records, true))
        .collect();
    let requests = server.request_count() as u64;
    eprintln!(
        "whole lines {whole:?}, resumed: b {}; {requests} requests",
        b.resumed
    );
    // A started with nothing on storage; B ran its own pending to the end.
    assert!(requests <= 2 * (N + started(&b)), "{requests}");
    assert!(requests >= 2 * started(&b), "{requests}");
    assert_exactly_once(&server, &fixture).await;
}

/// Records a writer counted at its start, gone before it ends (a merge found them missing and
/// reopened the batch for them): the writer does not mark the batch done over the gap (before, it
/// did, from its own count, and the next round skipped the batch); it stops as transient with
/// reason `RecordsLost`, and the next writer runs exactly the keys that lost their record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_whose_counted_records_vanished_does_not_mark_the_batch_done() {
    let (server, fixture) = one_batch_run(Duration::from_millis(40), 1).await;
    let mut a = Writer::start(&fixture, &fixture.run_file(), "a");
    wait_for_lines(&fixture, 1, 3).await;
    a.child.kill().unwrap();
    wait(a.child).await;
    let a_file = fixture.records_files(0)[0].records.clone();
    let lost = assert_whole_lines(&a_file, true) as u64;
    let b = Writer::start(&fixture, &fixture.run_file(), "b");
    // B counted A's records and has written one of its own: A's go now.
    wait_for_lines(&fixture, 2, 1).await;
    std::fs::remove_file(&a_file).unwrap();
    let output = wait(b.child).await;
    assert_eq!(
        output.status.code(),
        Some(1),
        "transient: the Job runs it again"
    );
    let reported: Value = serde_json::from_slice(&std::fs::read(&b.log).unwrap()).unwrap();
    assert_eq!(reported["reason"], "RecordsLost", "{reported}");
    let marker = fixture.out().join("batches/batch-000000.done");
    assert!(!marker.exists(), "the batch was marked done over the gap");

    let requests = server.request_count() as u64;
    let c = Writer::start(&fixture, &fixture.run_file(), "c")
        .finish()
        .await;
    assert_eq!(c.resumed, N - lost, "{c:?}");
    // Each lost key's tool turn is in A's turn log (A was killed, so its log stays): C takes
    // those conversations up and asks only for their answers.
    assert_eq!(
        server.request_count() as u64 - requests,
        lost,
        "only the lost keys ran again, from their last turn"
    );
    assert!(marker.exists());
    assert_exactly_once(&server, &fixture).await;
}

/// A writer killed mid-write leaves a torn last line in its own file. The next writer leaves that
/// file byte for byte as it was, reads its whole lines (so it runs only the keys that have none),
/// and merge takes every whole line and never the torn one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_in_one_writers_file_is_left_as_it_is_and_read_up_to_it() {
    let (server, fixture) = one_batch_run(Duration::ZERO, 4).await;
    let location = fixture.location();
    let manifest =
        trajectory_worker::run::manifest::Manifest::require(&location.run_dir()).expect("planned");
    let engine = fixture.engine();
    run_batch(&engine, &location, &manifest, 0, &no_shutdown(), &|_| {})
        .await
        .unwrap();
    let requests = server.request_count();
    assert_eq!(requests as u64, 2 * N);
    // As if killed: the marker was not written yet, the last record was half written, and the
    // one before it never was.
    std::fs::remove_file(fixture.out().join("batches/batch-000000.done")).unwrap();
    let files = fixture.records_files(0);
    assert_eq!(files.len(), 1);
    let first = &files[0].records.clone();
    let text = std::fs::read_to_string(first).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let n = lines.len();
    let torn = &lines[n - 1][..lines[n - 1].len() / 2];
    let mut damaged = lines[..n - 2].join("\n") + "\n";
    damaged.push_str(torn);
    std::fs::write(first, &damaged).unwrap();
    let lost: Vec<(u64, u64)> = keys(
        &lines[n - 2..]
            .iter()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect::<Vec<Value>>(),
    );

    let summary = run_batch(&engine, &location, &manifest, 0, &no_shutdown(), &|_| {})
        .await
        .unwrap();
    assert_eq!(summary.resumed, N - 2);
    assert_eq!(
        server.request_count() - requests,
        2 * lost.len(),
        "only the keys without a whole line ran again"
    );
    assert_eq!(
        std::fs::read_to_string(first).unwrap(),
        damaged,
        "the other writer's file is untouched"
    );
    let files = fixture.records_files(0);
    assert_eq!(files.len(), 2);
    let second = files.iter().find(|file| file.records != *first).unwrap();
    let mut second = keys(&parse_lines(&second.records));
    second.sort_unstable();
    let mut expected = lost.clone();
    expected.sort_unstable();
    assert_eq!(
        second, expected,
        "the second writer wrote the lost keys alone"
    );

    let merged = merge::merge(&location).unwrap();
    assert_eq!((merged.trajectories, merged.skipped_lines), (N, 0));
    assert_eq!(
        keys(&fixture.lines("trajectories.jsonl")),
        (0..N).map(|i| (i, 0)).collect::<Vec<_>>()
    );
}

/// A planned run of `prompts` prompts in the Hermes and the `OpenAI` form, its batch 0 done by one
/// `batch` process.
async fn openai_run_done_by_one_writer(prompts: usize) -> (ScriptedServer, RunFixture) {
    let server = terminal_server(Duration::ZERO).await;
    let fixture = RunFixture::new(&server.base_url(), prompts).with("/openaiFormat", json!(true));
    assert!(worker(&fixture, &["plan"]).await.success());
    Writer::start(&fixture, &fixture.run_file(), "first")
        .finish()
        .await;
    (server, fixture)
}

/// Of one key's records in several writers' files, merge keeps a trajectory over a failed record
/// whatever file comes first, and pairs it with the `OpenAI` line of its own writer, even when
/// another writer's file holds a line with the same key and `finished_at`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_keeps_a_trajectory_of_any_writer_over_a_failure_and_its_own_writers_openai_line() {
    let (server, fixture) = openai_run_done_by_one_writer(2).await;
    let requests = server.request_count();
    let (main, openai) = (fixture.batch_lines(0), fixture.batch_openai_lines(0));
    let kept = main
        .iter()
        .find(|record| record["prompt_index"] == 1)
        .unwrap();
    // A writer whose files sort first ("0-" before any hex id) recorded prompt 1 as failed, and
    // holds an OpenAI line of that key carrying the kept trajectory's very `finished_at`.
    let other = fixture.out().join("batches/batch-000000/w-0-other");
    let failed = json!({
        "prompt_index": 1, "sample": 0, "status": "failed", "error_class": "context_length",
        "error": "too long", "finished_at": kept["finished_at"],
    });
    std::fs::write(other.with_extension("jsonl"), failed.to_string() + "\n").unwrap();
    let mut impostor = openai
        .iter()
        .find(|line| line["id"] == kept["id"])
        .unwrap()
        .clone();
    impostor["messages"] = json!([{"role": "user", "content": "from another writer"}]);
    std::fs::write(
        other.with_extension("openai.jsonl"),
        impostor.to_string() + "\n",
    )
    .unwrap();
    let files = fixture.records_files(0);
    assert_eq!(files.len(), 2);
    assert!(files[0].records.ends_with("w-0-other.jsonl"), "{files:?}");

    let summary = merge::merge(&fixture.location()).unwrap();
    assert_eq!(
        (summary.trajectories, summary.failed, summary.skipped_lines),
        (2, 0, 1)
    );
    assert!(fixture.lines("failures.jsonl").is_empty());
    let hermes = fixture.lines("trajectories.jsonl");
    let paired = fixture.lines("trajectories.openai.jsonl");
    assert_eq!(keys(&hermes), [(0, 0), (1, 0)]);
    assert_eq!(keys(&paired), keys(&hermes));
    for (hermes, paired) in hermes.iter().zip(&paired) {
        assert_eq!(hermes["finished_at"], paired["finished_at"]);
        let prompt = format!("task number {}", hermes["prompt_index"]);
        assert_eq!(paired["messages"][0]["content"], json!(prompt));
    }
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["counts"]["failed"], 0);
    assert_eq!(statistics["error_classes"], json!({}));
    assert_eq!(
        server.request_count(),
        requests,
        "merge asks the model nothing"
    );
}

/// A batch begun by a worker from before per-writer files left `batches/batch-NNNNNN.jsonl` (and
/// its `.openai.jsonl` twin): a new writer resumes from it without touching it, and merge takes its
/// records and their `OpenAI` lines along with the new writer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_batch_file_of_an_older_worker_counts_for_resume_and_merge() {
    let (server, fixture) = openai_run_done_by_one_writer(4).await;
    let requests = server.request_count();
    // As the older worker left it: one file, with the last record (and its twin) not written.
    let files = fixture.records_files(0);
    let batches = fixture.out().join("batches");
    let (legacy, legacy_openai) = (
        batches.join("batch-000000.jsonl"),
        batches.join("batch-000000.openai.jsonl"),
    );
    for (from, to) in [
        (&files[0].records, &legacy),
        (&files[0].openai, &legacy_openai),
    ] {
        let text = std::fs::read_to_string(from).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        std::fs::write(to, lines[..lines.len() - 1].join("\n") + "\n").unwrap();
        std::fs::remove_file(from).unwrap();
    }
    std::fs::remove_file(batches.join("batch-000000.done")).unwrap();
    let before = std::fs::read(&legacy).unwrap();

    let summary = Writer::start(&fixture, &fixture.run_file(), "new")
        .finish()
        .await;
    assert_eq!((summary.resumed, summary.succeeded), (3, 4));
    assert_eq!(server.request_count() - requests, 2, "one conversation");
    assert_eq!(std::fs::read(&legacy).unwrap(), before);
    let files = fixture.records_files(0);
    assert_eq!(files.len(), 2);
    assert_eq!(files[0].records, legacy, "the legacy file comes first");

    let merged = merge::merge(&fixture.location()).unwrap();
    assert_eq!((merged.trajectories, merged.skipped_lines), (4, 0));
    let hermes = fixture.lines("trajectories.jsonl");
    let paired = fixture.lines("trajectories.openai.jsonl");
    assert_eq!(keys(&hermes), (0..4).map(|i| (i, 0)).collect::<Vec<_>>());
    assert_eq!(keys(&paired), keys(&hermes));
    for (hermes, paired) in hermes.iter().zip(&paired) {
        assert_eq!(hermes["finished_at"], paired["finished_at"]);
    }
}

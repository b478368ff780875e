//! A kill costs one turn, not a conversation (issue 42): long conversations (24 tool turns each:
//! terminal and file tools changing a workspace, a background job started in the first turn and
//! checked in the last) run in the worker binary, which is `SIGKILL`ed 10 times at random
//! moments; each successor takes every unfinished conversation up from the turn log.
//!
//! What is counted: the scripted model serves every request and counts them; after each kill
//! the conversations in flight (a request sent, no record on storage) are counted from the
//! server's requests and the batch's records. The run must ask the model at most once per turn
//! of every conversation plus once per conversation in flight at each kill (restarting them, as
//! before the turn log, costs every turn they had). Every record is there once, its transcript
//! holds each turn once and in order (the script answers by the number of replies a request
//! holds, so a turn repeated or lost shifts everything after it), and the row's verifier, run in
//! the workspace the last attempt left, finds every file the transcript wrote and the log the
//! commands appended to, line for line.

mod common;

use std::collections::HashSet;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{RunFixture, keys, spawn_worker, tool_responses, worker};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use trajectory_testkit::long_conversation::{
    self, CALLS_PER_CONVERSATION, Requests, TOOL_TURNS, assert_whole_conversation,
};
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_calls_reply};
use trajectory_testkit::versitygw::Versitygw;

/// Conversations of the one batch.
const PROMPTS: usize = 32;
const KILLS: usize = 10;
/// What the model takes to answer: conversations last long enough for kills to land mid-way.
const LATENCY: Duration = Duration::from_millis(25);

async fn scripted_server(requests: Requests) -> ScriptedServer {
    ScriptedServer::start_responding(move |body| {
        long_conversation::respond(&requests, LATENCY, body)
    })
    .await
}

/// Where the run's files are: the fixture's volume, or a prefix of a bucket of a real S3 server.
enum Storage {
    Volume,
    Bucket(Versitygw),
}

/// The bucket [`common::spawn_on_bucket`] runs on.
const BUCKET: &str = "trajectories";
const PREFIX: &str = "kills";

impl Storage {
    /// A worker process running `args` on the fixture's run.
    fn spawn(&self, fixture: &RunFixture, args: &[&str]) -> Child {
        let Self::Bucket(server) = self else {
            return spawn_worker(fixture, args);
        };
        common::spawn_on_bucket(fixture, (server, &server.endpoint), PREFIX, "kills", args)
    }

    /// The whole record lines of batch 0, over every writer (on a bucket, read from the S3
    /// server's own directory: its POSIX backend keeps each object as a file).
    fn records(&self, fixture: &RunFixture) -> Vec<Value> {
        let Self::Bucket(server) = self else {
            return fixture.batch_lines(0);
        };
        let dir = server
            .bucket_dir(BUCKET)
            .join(PREFIX)
            .join("out/batches/batch-000000");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|path| {
                let name = path.file_name().unwrap().to_string_lossy();
                name.ends_with(".jsonl")
                    && !name.ends_with(".turns.jsonl")
                    && !name.ends_with(".openai.jsonl")
            })
            .flat_map(|path| common::parse_lines(&path))
            .collect()
    }
}

/// The keys with a record on storage.
fn recorded(storage: &Storage, fixture: &RunFixture) -> HashSet<usize> {
    keys(&storage.records(fixture))
        .into_iter()
        .map(|(prompt, _)| usize::try_from(prompt).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_costs_one_turn_per_conversation_in_flight_not_the_conversation() {
    kill_ten_times(Storage::Volume).await;
}

/// On a bucket a kill also loses the records of the part not yet written; their conversations'
/// turns are in the turn log's parts, so each costs one request more, not all of its turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_bucket_a_kill_costs_one_turn_per_conversation_in_flight_too() {
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket(BUCKET);
    kill_ten_times(Storage::Bucket(server)).await;
}

async fn kill_ten_times(storage: Storage) {
    let tokens = matches!(storage, Storage::Volume);
    let requests = Requests::default();
    let server = scripted_server(Arc::clone(&requests)).await;
    let lines: Vec<String> = (0..PROMPTS)
        .map(|task| long_conversation::row(task).to_string())
        .collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/batchSize", json!(PROMPTS))
        .with("/concurrency", json!(4))
        .with("/agent/maxTurns", json!(TOOL_TURNS + 5))
        .with("/agent/promptTimeoutSeconds", json!(600));
    // On a volume the run also keeps each call's token ids: a kill must not lose or repeat them.
    let fixture = if tokens {
        fixture.with("/model/tokens", json!({"request": "ReturnTokenIds"}))
    } else {
        fixture
    };
    if let Storage::Bucket(server) = &storage {
        let dataset = server
            .bucket_dir(BUCKET)
            .join(PREFIX)
            .join("datasets/prompts.jsonl");
        std::fs::create_dir_all(dataset.parent().unwrap()).unwrap();
        std::fs::copy(fixture.dataset(), dataset).unwrap();
    }
    let plan = common::wait(storage.spawn(&fixture, &["plan"])).await;
    assert!(
        plan.status.success(),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );

    let seed: u64 = std::env::var("TRAJ_TURN_KILL_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("kill moments drawn from seed {seed} (TRAJ_TURN_KILL_SEED)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut in_flight_at_kills = 0;
    let mut kills = 0;
    while kills < KILLS {
        let mut child = storage.spawn(&fixture, &["batch", "0"]);
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1_000))).await;
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the batch ended ({status}) before kill {}: make it longer",
                kills + 1
            );
        }
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
        let asked: HashSet<usize> = requests.lock().unwrap().keys().copied().collect();
        let done = recorded(&storage, &fixture);
        in_flight_at_kills += asked.difference(&done).count() as u64;
    }
    let output = common::wait(storage.spawn(&fixture, &["batch", "0"])).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let records = storage.records(&fixture);
    let resumed = long_conversation::assert_every_task_once(&records, PROMPTS);

    let made: u64 = requests.lock().unwrap().values().sum();
    let ideal = PROMPTS as u64 * CALLS_PER_CONVERSATION;
    eprintln!(
        "{kills} kills: {made} model requests for {ideal} turns; {in_flight_at_kills} \
         conversations in flight at the kills; {} taken up, from turns {resumed:?} (starting \
         them over would have asked at least {} requests more)",
        resumed.len(),
        resumed.iter().sum::<u64>()
    );
    assert!(
        made <= ideal + in_flight_at_kills,
        "{made} requests: more than the {ideal} turns plus one per conversation in flight at \
         each kill ({in_flight_at_kills})"
    );
    if tokens {
        let merge = common::wait(storage.spawn(&fixture, &["merge"])).await;
        assert!(
            merge.status.success(),
            "{}",
            String::from_utf8_lossy(&merge.stderr)
        );
        let lines = common::parse_lines(&fixture.out().join("trajectories.tokens.jsonl"));
        long_conversation::assert_tokens_once(&lines, PROMPTS);
    }
}

/// A replayed command whose output differs (a random number) follows the terminal's rule: the
/// difference is noted in the record, and the conversation goes on with what the model saw.
/// What the conversation spent, its verifier and `passesPerPrompt` count each turn once: its
/// usage and cost are its four calls' exactly, its verifier passes in the replayed workspace, and
/// the prompt's second sample is not run (one pass is enough).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_command_that_answers_otherwise_is_noted_and_the_conversation_goes_on() {
    let requests = Arc::new(Mutex::new(0_u64));
    let counted = Arc::clone(&requests);
    let server = ScriptedServer::start_responding(move |body| {
        *counted.lock().unwrap() += 1;
        let turn = body["messages"].as_array().map_or(0, |messages| {
            messages
                .iter()
                .filter(|message| message["role"] == "assistant")
                .count()
        });
        let call = |command: &str| {
            let arguments = json!({"command": command}).to_string();
            Step::ok(tool_calls_reply(&[("terminal", Value::String(arguments))]))
        };
        let step = match turn {
            0 => call("od -An -N8 -tu8 /dev/urandom | tr -d ' ' | tee random.txt"),
            1 => call("echo kept > kept.txt && echo written"),
            // Slow enough for the test to kill the worker while it waits.
            2 => Step::Delay(Duration::from_secs(2), Box::new(call("cat kept.txt"))),
            _ => Step::ok(text_reply("done")),
        };
        Step::Delay(LATENCY, Box::new(step))
    })
    .await;
    let row = json!({"prompt": "task number 0", "test": "test \"$(cat kept.txt)\" = kept"});
    let fixture = RunFixture::with_lines(&server.base_url(), &[row.to_string()])
        .with("/batchSize", json!(1))
        .with("/samplesPerPrompt", json!(2))
        .with("/verifier", json!({"passesPerPrompt": 1}))
        // A dollar a token: each call (10 tokens in, 5 out) costs $15.
        .with(
            "/model/pricing",
            json!({"input": 1_000_000, "output": 1_000_000}),
        )
        .with("/model/budget", json!({"maxCost": 1000}));
    assert!(worker(&fixture, &["plan"]).await.success());

    let mut child = spawn_worker(&fixture, &["batch", "0"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while common::logged_turns(&fixture) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "two turns never logged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let asked_before = *requests.lock().unwrap();
    assert!(worker(&fixture, &["batch", "0"]).await.success());

    let records = fixture.batch_lines(0);
    assert_eq!(records.len(), 2, "{records:?}");
    let record = records
        .iter()
        .find(|record| record["sample"] == 0)
        .expect("sample 0's record");
    let skipped = records
        .iter()
        .find(|record| record["sample"] == 1)
        .expect("sample 1's record");
    assert_eq!(skipped["filter"], "enough_passed", "{skipped}");
    assert_eq!(record["verification"]["passed"], true, "{record}");
    assert_eq!(
        record["usage"]["prompt_tokens"], 40,
        "four calls of 10 tokens in, each once: {record}"
    );
    assert_eq!(record["usage"]["completion_tokens"], 20, "{record}");
    assert_eq!(record["cost"]["total"], 60.0, "{record}");
    assert_eq!(record["resumed_from_turn"], 2, "{record}");
    assert_eq!(record["resume"]["replayed_calls"], 2, "{record}");
    assert_eq!(
        record["resume"]["divergences"],
        json!([{"turn": 0, "tool": "terminal", "call_id": record["resume"]["divergences"][0]["call_id"]}]),
        "{record}"
    );
    let responses = tool_responses(record);
    assert_eq!(responses[2]["content"]["output"], "kept", "{record}");
    // The successor asked for the third turn (whose call the kill cut) and the answer: the two
    // turns it took up were not asked again, and sample 1 nothing.
    let asked_after = *requests.lock().unwrap() - asked_before;
    assert_eq!(asked_after, 2, "{record}");
    // The fixture's maxTurns (3) tool turns; the answer's call is not counted.
    assert_eq!(record["api_calls"], 3, "{record}");
}

/// A pod whose grace period leaves its conversations no time (`--shutdown-grace-seconds 0`, as
/// the operator sets for a grace of 5 s or less) stops them at `SIGTERM` at once: no record is
/// written after the signal (a tool's answer from a pod whose task containers are being stopped
/// would be no answer), and the next run takes every conversation up from its last finished turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_no_grace_stops_the_conversations_at_once_and_keeps_their_turns() {
    const TASKS: usize = 4;
    let requests = Requests::default();
    let counted = Arc::clone(&requests);
    // 100 ms a call: a conversation takes 2.5 s, far longer than the stop may.
    let server = ScriptedServer::start_responding(move |body| {
        long_conversation::respond(&counted, Duration::from_millis(100), body)
    })
    .await;
    let lines: Vec<String> = (0..TASKS)
        .map(|task| long_conversation::row(task).to_string())
        .collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/batchSize", json!(TASKS))
        .with("/concurrency", json!(TASKS))
        .with("/agent/maxTurns", json!(TOOL_TURNS + 5))
        .with("/agent/promptTimeoutSeconds", json!(600));
    assert!(worker(&fixture, &["plan"]).await.success());

    let child = spawn_worker(&fixture, &["batch", "0", "--shutdown-grace-seconds", "0"]);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let signalled = std::time::Instant::now();
    let output =
        common::signal_after(child, Duration::ZERO, nix::sys::signal::Signal::SIGTERM).await;
    let stopped_in = signalled.elapsed();
    assert_eq!(
        output.status.code(),
        Some(trajectory_worker::contract::exit::INTERRUPTED),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stopped_in < Duration::from_millis(1_500),
        "the worker took {stopped_in:?} to stop: it went on with its conversations"
    );
    assert_eq!(fixture.batch_lines(0).len(), 0, "a record after the signal");
    let logged = common::logged_turns(&fixture);
    assert!(logged > 0, "no turn was logged before the signal");
    let asked_before: u64 = requests.lock().unwrap().values().sum();

    assert!(worker(&fixture, &["batch", "0"]).await.success());
    let records = fixture.batch_lines(0);
    assert_eq!(records.len(), TASKS, "{records:?}");
    for record in &records {
        let task = usize::try_from(record["prompt_index"].as_u64().unwrap()).unwrap();
        assert_whole_conversation(record, task);
    }
    let made: u64 = requests.lock().unwrap().values().sum();
    let ideal = TASKS as u64 * CALLS_PER_CONVERSATION;
    eprintln!(
        "stopped {stopped_in:?} after SIGTERM with {logged} turns logged, {asked_before} \
         requests; {made} in all for {ideal} turns"
    );
    assert!(
        made <= ideal + TASKS as u64,
        "{made} requests: more than the {ideal} turns plus the one each conversation was in"
    );
}

//! Verified trajectories on real files, real processes and the real executor: a scripted model
//! works on several tasks, each row's verifier runs after its conversation in the workspace the
//! conversation left, and the rewards go into the records, the filter and the statistics.
//! (Task containers: `tests/tests/real_pods.rs`.)

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use common::{
    RunFixture, keys, kill_batch_until_done, local_options, no_shutdown, scripted_model, terminal,
    worker,
};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    FixedLatency, ScriptedServer, text_reply, tool_calls_reply,
};
use trajectory_worker::run::local::run_local;

/// Base64 of a gzipped tar of `files` (name, text), made by the system's `tar`, as
/// terminal-bench's `tests_tar` is.
fn tests_tar(files: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let output = Command::new("tar")
        .arg("-czf")
        .arg("-")
        .arg("-C")
        .arg(dir.path())
        .args(files.iter().map(|(name, _)| name))
        .output()
        .expect("tar runs");
    assert!(output.status.success(), "{output:?}");
    base64::engine::general_purpose::STANDARD.encode(output.stdout)
}

/// What the model does in each task of [`a_run_verifies_each_row_in_what_its_conversation_left`].
fn work(task: &str) -> Vec<(&'static str, Value)> {
    match task {
        "fix" | "fix tb" => vec![terminal("echo 42 > answer.txt")],
        "miss" => vec![terminal("echo 41 > answer.txt")],
        // The cheat: a reward written where the verifier reads it, its test script replaced,
        // and a job that would write the reward again while the verifier runs.
        "cheat" => vec![
            terminal(
                "mkdir -p .verifier/logs/verifier .verifier/tests && \
                 echo 1 > .verifier/logs/verifier/reward.txt && \
                 printf 'exit 0' > .verifier/tests/test.sh",
            ),
            (
                "terminal",
                json!({"command": "while true; do mkdir -p .verifier/logs/verifier; \
                       echo 1 > .verifier/logs/verifier/reward.txt; sleep 0.05; done",
                       "background": true}),
            ),
        ],
        _ => vec![terminal("true")],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_verifies_each_row_in_what_its_conversation_left() {
    let server = ScriptedServer::start_responding(scripted_model(work)).await;
    let check = r#"test "$(cat answer.txt)" = 42"#;
    let test_outputs = "test \"$(cat answer.txt)\" = 42 && echo 1 > \"$REWARD_FILE\" \
                        || echo 0 > \"$REWARD_FILE\"";
    let rows = [
        json!({"prompt": "fix", "test": check}),
        json!({"prompt": "miss", "test": check}),
        // terminal-bench's form: the tests as a tar, the script that runs them.
        json!({"prompt": "fix tb", "tests_tar": tests_tar(&[("check.sh", test_outputs)]),
               "test_sh": "bash \"$TESTS_DIR/check.sh\""}),
        json!({"prompt": "slow", "test_sh": "sleep 30"}),
        json!({"prompt": "absent", "verify": "./run_tests.sh"}),
        json!({"prompt": "cheat", "test_sh": "sleep 1; exit 1"}),
        json!({"prompt": "unverified"}),
    ];
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/batchSize", json!(4))
        .with("/verifier", json!({"timeoutSeconds": 2}))
        .with("/filters", json!({"minReward": 1}));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    // One tool-call turn and one final answer a conversation: nothing was asked twice.
    assert_eq!(server.request_count(), 14);
    assert_eq!(report.merge.trajectories, 3, "fix, fix tb and unverified");
    let kept = fixture.lines("trajectories.jsonl");
    let discarded = fixture.lines("failures.jsonl");
    let by_task = |task: &str| -> Value {
        kept.iter()
            .chain(&discarded)
            .find(|record| record["conversations"][1]["value"] == task)
            .unwrap_or_else(|| panic!("no record of {task}"))
            .clone()
    };
    for task in ["fix", "fix tb"] {
        let record = by_task(task);
        assert_eq!(record["reward"], 1.0, "{task}: {record}");
        assert_eq!(record["verification"]["passed"], true, "{task}");
        assert_eq!(record["verification"]["exit_code"], 0, "{task}");
        assert_eq!(record["verification"]["error"], Value::Null, "{task}");
        assert!(record.get("status").is_none(), "{task} is a trajectory");
    }
    let fixed = by_task("fix");
    let keys: Vec<&str> = fixed
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let at = keys.iter().position(|key| *key == "reward").unwrap();
    assert_eq!(
        keys[at - 1..],
        ["finished_at", "reward", "verification", "source"]
    );
    let missed = by_task("miss");
    assert_eq!(missed["reward"], 0.0);
    assert_eq!(missed["verification"]["exit_code"], 1);
    assert_eq!(missed["verification"]["error"], Value::Null);
    assert_eq!(missed["status"], "discarded");
    assert_eq!(missed["filter"], "below_reward");
    assert_eq!(
        missed["conversations"].as_array().map(Vec::len),
        Some(5),
        "a discarded record keeps its conversation"
    );
    let slow = by_task("slow");
    assert_eq!(slow["reward"], 0.0);
    assert_eq!(slow["verification"]["exit_code"], Value::Null);
    assert_eq!(
        slow["verification"]["error"],
        "the verifier did not finish within 2 s and was stopped"
    );
    let duration = slow["verification"]["duration_ms"].as_u64().unwrap();
    assert!((2000..10_000).contains(&duration), "{duration} ms");
    let absent = by_task("absent");
    assert_eq!(absent["verification"]["exit_code"], 127);
    let error = absent["verification"]["error"].as_str().unwrap();
    assert!(error.contains("not found"), "{error}");
    assert!(
        absent["verification"]["output"]
            .as_str()
            .unwrap()
            .contains("run_tests.sh"),
        "{absent}"
    );
    let cheat = by_task("cheat");
    assert_eq!(cheat["reward"], 0.0, "the cheat paid: {cheat}");
    assert_eq!(cheat["verification"]["exit_code"], 1);
    let unverified = by_task("unverified");
    assert!(unverified.get("reward").is_none() && unverified.get("verification").is_none());
    check_statistics(&fixture.out());
    assert_workspaces_gone(&fixture.workspaces());
}

/// The run's `statistics.json` counts the six verified records, the four below the reward and
/// the two verifiers that gave no reward of their own.
fn check_statistics(out: &Path) {
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(out.join("statistics.json")).unwrap()).unwrap();
    let verification = &statistics["verification"];
    assert_eq!(verification["verified"], 6, "{verification}");
    assert_eq!(verification["passed"], 2);
    assert_eq!(verification["below_reward"], 4);
    assert_eq!(verification["verifier_errors"], 2, "slow and absent");
    assert_eq!(verification["reward"]["counts"], json!({"0": 4, "1": 2}));
    assert_eq!(verification["by_toolset"]["terminal"]["verified"], 6);
    assert_eq!(statistics["counts"]["discarded"], 4);
    assert_eq!(
        statistics["discarded_by_filter"],
        json!({"below_reward": 4})
    );
}

fn assert_workspaces_gone(root: &Path) {
    let left: Vec<_> = std::fs::read_dir(root)
        .map(|entries| entries.flatten().map(|entry| entry.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "workspaces left behind: {left:?}");
}

/// What the model does in the tasks of the best-of-n run: always right, or always wrong.
fn best_of_n_work(task: &str) -> Vec<(&'static str, Value)> {
    match task {
        "easy" => vec![terminal("echo 42 > answer.txt")],
        _ => vec![terminal("echo 41 > answer.txt")],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_a_prompt_stops_once_enough_samples_passed_and_the_rest_are_recorded_not_run() {
    let server = ScriptedServer::start_responding(scripted_model(best_of_n_work)).await;
    let check = r#"test "$(cat answer.txt)" = 42"#;
    let lines = [
        json!({"prompt": "easy", "test": check}).to_string(),
        json!({"prompt": "hard", "test": check}).to_string(),
    ];
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/samplesPerPrompt", json!(4))
        .with("/concurrency", json!(4))
        .with("/verifier", json!({"passesPerPrompt": 1}));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    // The easy prompt passed at its first sample: its other three never asked the model. The
    // hard one never passed: all four ran, one at a time.
    assert_eq!(server.request_count(), 2 + 4 * 2);
    assert_eq!(report.merge.trajectories, 5);
    let trajectories = fixture.lines("trajectories.jsonl");
    let samples = |task: &str| -> Vec<(u64, f64)> {
        trajectories
            .iter()
            .filter(|record| record["conversations"][1]["value"] == task)
            .map(|record| {
                (
                    record["sample"].as_u64().unwrap(),
                    record["reward"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(samples("easy"), [(0, 1.0)]);
    assert_eq!(samples("hard"), [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0)]);
    let not_run: Vec<(u64, u64, Value)> = fixture
        .lines("failures.jsonl")
        .iter()
        .map(|record| {
            (
                record["prompt_index"].as_u64().unwrap(),
                record["sample"].as_u64().unwrap(),
                record["filter"].clone(),
            )
        })
        .collect();
    assert_eq!(
        not_run,
        [
            (0, 1, json!("enough_passed")),
            (0, 2, json!("enough_passed")),
            (0, 3, json!("enough_passed"))
        ]
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(
        statistics["verification"]["early_stop"]["samples_not_run"],
        3
    );
    assert_eq!(statistics["verification"]["passed"], 1);
}

/// What the model does in the tasks of the out-of-time run: the answer is written, then the
/// command outlives the conversation's budget.
fn out_of_time_work(task: &str) -> Vec<(&'static str, Value)> {
    match task {
        "fix slowly" => vec![terminal("echo 42 > answer.txt; sleep 60")],
        _ => vec![terminal("echo 41 > answer.txt; sleep 60")],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_out_of_time_is_verified_in_what_it_left_and_its_pass_is_not_kept() {
    let server = ScriptedServer::start_responding(scripted_model(out_of_time_work)).await;
    let check = r#"test "$(cat answer.txt)" = 42"#;
    let lines = [
        json!({"prompt": "fix slowly", "test": check}).to_string(),
        json!({"prompt": "miss slowly", "test": check}).to_string(),
    ];
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/agent/promptTimeoutSeconds", json!(2))
        .with("/samplesPerPrompt", json!(2))
        .with("/verifier", json!({"passesPerPrompt": 1}));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    // One model request a conversation (its command outlived the budget); the first sample's
    // pass out of time is no kept pass, so the second sample of the fixed task ran too.
    assert_eq!(server.request_count(), 4);
    assert_eq!(report.merge.trajectories, 0);
    let failed = fixture.lines("failures.jsonl");
    assert_eq!(failed.len(), 4, "{failed:?}");
    for record in &failed {
        let key = (record["prompt_index"].as_u64(), record["sample"].as_u64());
        assert_eq!(record["status"], "failed", "{key:?}");
        assert_eq!(record["error_class"], "prompt_timeout", "{key:?}");
        let fixed = key.0 == Some(0);
        assert_eq!(record["reward"], if fixed { 1.0 } else { 0.0 }, "{key:?}");
        assert_eq!(record["verification"]["passed"], fixed, "{key:?}");
        assert_eq!(record["verification"]["error"], Value::Null, "{key:?}");
    }
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    let verification = &statistics["verification"];
    assert_eq!(verification["verified"], 4, "{verification}");
    assert_eq!(verification["passed"], 2, "{verification}");
    assert!(
        verification.get("early_stop").is_none(),
        "no sample went unrun"
    );
    assert_eq!(statistics["counts"]["failed"], 4);
    assert_workspaces_gone(&fixture.workspaces());
}

/// A batch whose conversations spend most of their time in their verifier, killed (`SIGKILL`) at
/// random points until it finishes: every (prompt, sample) ends with exactly one record, verified
/// once (its reward and verdict in it), and the model was asked at most for the conversations
/// that finished plus those each kill cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_killed_while_verifying_ends_with_one_verified_record_per_key() {
    const PROMPTS: u64 = 12;
    const CONCURRENCY: u64 = 3;
    let server = ScriptedServer::start_fixed_latency(FixedLatency {
        latency: Duration::from_millis(10),
        tool_call: tool_calls_reply(&[(
            "terminal",
            Value::String(json!({"command": "echo 42 > answer.txt"}).to_string()),
        )]),
        final_answer: text_reply("done"),
    })
    .await;
    let lines: Vec<String> = (0..PROMPTS)
        .map(|i| {
            json!({"prompt": format!("task {i}"),
                   "test": "sleep 0.4; test \"$(cat answer.txt)\" = 42"})
            .to_string()
        })
        .collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/batchSize", json!(PROMPTS))
        .with("/concurrency", json!(CONCURRENCY));
    assert!(worker(&fixture, &["plan"]).await.success());
    let seed = u64::from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos(),
    );
    eprintln!("kill schedule seed: {seed}");
    let delays =
        (0..).map(|kill: u64| Duration::from_millis(150 + seed.wrapping_add(kill * 7919) % 450));
    let kills = u64::from(kill_batch_until_done(&fixture, delays, Duration::from_secs(180)).await);
    assert!(kills >= 3, "only {kills} kills: resume was not exercised");
    assert!(worker(&fixture, &["merge"]).await.success());
    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(
        keys(&records),
        (0..PROMPTS).map(|i| (i, 0)).collect::<Vec<_>>()
    );
    for record in &records {
        assert_eq!(record["reward"], 1.0, "{record}");
        assert_eq!(record["verification"]["passed"], true, "{record}");
    }
    // Two requests a conversation. A kill loses the conversations in flight, and those that had
    // finished but whose records the writer had not yet committed (it commits every 20 ms at
    // most, and the three conversations a process starts at once finish together): at most
    // twice the concurrency a kill. (The loop on ab099f2 saw 97 requests against the in-flight
    // bound of 96: one conversation finished unflushed at a kill.)
    let requests = server.request_count() as u64;
    let bound = 2 * (PROMPTS + kills * 2 * CONCURRENCY);
    assert!(
        requests >= 2 * PROMPTS && requests <= bound,
        "{requests} model requests for {PROMPTS} conversations and {kills} kills (bound {bound})"
    );
}

/// Harbor's named rewards (`reward.json` beside the reward file, which it wins over) and a
/// row's own verifier timeout (`verifier_timeout_sec`, Harbor's `[verifier] timeout_sec`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harbors_named_rewards_win_and_a_rows_own_timeout_holds() {
    let server = ScriptedServer::start_responding(scripted_model(work)).await;
    let rows = [
        json!({"prompt": "named", "test_sh":
            "echo '{\"reward\": 0.5, \"cases\": 2}' > \"$LOGS_DIR/reward.json\"; echo 1 > \"$REWARD_FILE\""}),
        json!({"prompt": "unnamed", "test_sh": "echo '{\"a\": 1, \"b\": 0}' > \"$LOGS_DIR/reward.json\""}),
        json!({"prompt": "own timeout", "test_sh": "sleep 10", "verifier_timeout_sec": 1}),
    ];
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/verifier", json!({"timeoutSeconds": 60}));
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    let records: Vec<Value> = fixture
        .lines("trajectories.jsonl")
        .into_iter()
        .chain(fixture.lines("failures.jsonl"))
        .collect();
    let by_task = |task: &str| -> &Value {
        records
            .iter()
            .find(|record| record["conversations"][1]["value"] == task)
            .unwrap_or_else(|| panic!("no record of {task}"))
    };
    let named = by_task("named");
    assert_eq!(named["reward"], 0.5, "reward.json wins: {named}");
    assert_eq!(named["verification"]["error"], Value::Null);
    let unnamed = by_task("unnamed");
    assert_eq!(unnamed["reward"], 0.0);
    let error = unnamed["verification"]["error"].as_str().unwrap();
    assert!(
        error.contains("reward.json names no `reward` among its rewards (a, b)"),
        "{error}"
    );
    let timed_out = by_task("own timeout");
    assert_eq!(
        timed_out["verification"]["error"],
        "the verifier did not finish within 1 s and was stopped"
    );
    let duration = timed_out["verification"]["duration_ms"].as_u64().unwrap();
    assert!((1000..8000).contains(&duration), "{duration} ms");
}

/// The oracle pass, as `trajectory-worker oracle` runs it (the run file says nothing of the
/// oracle: the command sets `spec.agent.oracle`): each row's solution (`solution_tar`, as the
/// plan packs a Harbor task's `solution/`) runs where its conversation would, its verifier judges
/// what it left, and the model is never asked: the wrong solution and the row without one are
/// named by their reward, in the report and by the command, which exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oracle_runs_each_rows_solution_instead_of_the_model() {
    let server = ScriptedServer::start_responding(scripted_model(work)).await;
    let check = r#"test "$(cat answer.txt)" = 42"#;
    let rows = [
        json!({"prompt": "right", "test": check,
               "solution_tar": tests_tar(&[("solve.sh", "echo 42 > answer.txt; echo solved")])}),
        json!({"prompt": "wrong", "test": check,
               "solution_tar": tests_tar(&[("solve.sh", "echo 41 > answer.txt")])}),
        json!({"prompt": "none", "test": check}),
    ];
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    let fixture = RunFixture::with_lines(&server.base_url(), &lines);
    let output = tokio::process::Command::new(common::WORKER)
        .arg("oracle")
        .arg(fixture.run_file())
        .arg("--no-progress-bar")
        .arg("--workspace-root")
        .arg(fixture.workspaces())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("the worker binary starts");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert_eq!(output.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("oracle: 1 of 3 passed (the full reward); report "),
        "{stdout}"
    );
    assert!(
        stderr.contains("2 of 3 rows did not pass the oracle: row 1, row 2"),
        "{stderr}"
    );
    assert_eq!(server.request_count(), 0, "the oracle asks no model");
    let records: Vec<Value> = fixture
        .lines("trajectories.jsonl")
        .into_iter()
        .chain(fixture.lines("failures.jsonl"))
        .collect();
    assert_eq!(records.len(), 3);
    let by_task = |task: &str| -> &Value {
        records
            .iter()
            .find(|record| record["conversations"][1]["value"] == task)
            .unwrap_or_else(|| panic!("no record of {task}"))
    };
    let right = by_task("right");
    assert_eq!(right["reward"], 1.0, "{right}");
    let shown = right["conversations"].to_string();
    assert!(
        shown.contains("solve.sh") && shown.contains("exit 0") && shown.contains("solved"),
        "{shown}"
    );
    assert_eq!(by_task("wrong")["reward"], 0.0);
    let none = by_task("none");
    assert_eq!(none["reward"], 0.0);
    assert!(
        none["conversations"].to_string().contains("no solution"),
        "{none}"
    );
    // The report says, row by row in dataset order, which solutions earned the full reward.
    let report: Vec<(Value, Value, Value)> = fixture
        .lines("oracle.jsonl")
        .iter()
        .map(|line| {
            (
                line["prompt_index"].clone(),
                line["reward"].clone(),
                line["passed"].clone(),
            )
        })
        .collect();
    assert_eq!(
        report,
        [
            (json!(0), json!(1.0), json!(true)),
            (json!(1), json!(0.0), json!(false)),
            (json!(2), json!(0.0), json!(false)),
        ]
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(
        statistics["oracle"],
        json!({"records": 3, "passed": 1, "failed": 2, "failed_rows": ["row 1", "row 2"],
               "report": "oracle.jsonl"})
    );
}

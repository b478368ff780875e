//! Token ids and logprobs in the records (`spec.model.tokens`), on real model servers.
//!
//! The project's llama-cpp-python server gives logprobs on plain replies and nothing on
//! tool-call replies, and never ids: its records must say `none`, hold the logprobs it gave, and
//! leave `trajectories.jsonl` exactly as a run without tokens writes it.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use trajectory_worker::run::local::{LocalOptions, ProgressMode, run_local};
use trajectory_worker::training::{TOKENS_KEY, TokensAt};

fn model_server() -> String {
    std::env::var("MODEL_BASE_URL").unwrap_or_else(|_| {
        panic!(
            "MODEL_BASE_URL is not set: this test needs the real llama.cpp model server. Start it with \
             `scripts/model-server/start.sh && source /tmp/trajectory-model-server/env`, or run the whole \
             suite with `scripts/test.sh`"
        )
    })
}

fn model_name() -> String {
    std::env::var("MODEL_NAME").unwrap_or_else(|_| "smollm2-135m-instruct-q4_1".to_owned())
}

/// Writes a run of the quickstart's prompts keeping tokens as `request` asks, and runs it.
async fn run_with_tokens(dir: &Path, tokens: &str) -> trajectory_worker::run::local::LocalReport {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart");
    std::fs::create_dir_all(dir.join("datasets")).unwrap();
    std::fs::copy(
        example.join("datasets/quickstart.jsonl"),
        dir.join("datasets/quickstart.jsonl"),
    )
    .unwrap();
    let run = format!(
        r"apiVersion: trajectories.dev/v1alpha1
kind: TrajectoryRun
metadata:
  name: tokens
spec:
  dataset:
    path: datasets/quickstart.jsonl
  batchSize: 4
  concurrency: 2
  distribution: terminal_only
  seed: 42
  model:
    baseUrl: {}
    name: {}
    maxTokens: 96
    temperature: 0.0
    requestTimeoutSeconds: 60
{tokens}
  agent:
    maxTurns: 2
    promptTimeoutSeconds: 300
",
        model_server(),
        model_name()
    );
    std::fs::write(dir.join("run.yaml"), run).unwrap();
    let options = LocalOptions {
        run_file: dir.join("run.yaml"),
        storage: None,
        bucket: trajectory_worker::storage::BucketOptions::default(),
        base_url: None,
        workspace_root: dir.join("workspaces"),
        sandbox: common::sandbox(),
        path_dropped: Vec::new(),
        progress: ProgressMode::Lines,
    };
    run_local(&options, &common::no_shutdown())
        .await
        .expect("the run finishes")
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()))
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// Every record line of the run's batch files, by key.
fn batch_lines(run_dir: &Path) -> BTreeMap<(u64, u64), Vec<u8>> {
    let mut found = BTreeMap::new();
    for entry in walkdir::WalkDir::new(run_dir.join("batches")) {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("w-") && name.ends_with(".jsonl")) || name.contains(".openai.") {
            continue;
        }
        for line in std::fs::read(entry.path())
            .unwrap()
            .split(|byte| *byte == b'\n')
        {
            if line.is_empty() {
                continue;
            }
            let record: Value = serde_json::from_slice(line).unwrap();
            let key = (
                record["prompt_index"].as_u64().unwrap(),
                record["sample"].as_u64().unwrap_or(0),
            );
            found.insert(key, line.to_vec());
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_project_server_gives_no_ids_and_its_records_say_so_beside_unchanged_trajectories() {
    let storage = tempfile::tempdir().unwrap();
    let report = run_with_tokens(
        storage.path(),
        "    tokens:\n      request: LogprobsOnly\n      topLogprobs: 2",
    )
    .await;
    assert!(
        report.merge.trajectories >= 4,
        "most prompts succeed: {:?}",
        report.merge
    );
    let trajectories = lines(&report.run_dir.join("trajectories.jsonl"));
    let tokens = lines(&report.run_dir.join("trajectories.tokens.jsonl"));
    assert_eq!(
        tokens.len(),
        trajectories.len(),
        "one tokens line beside each trajectory"
    );
    let batch = batch_lines(&report.run_dir);
    let merged = std::fs::read_to_string(report.run_dir.join("trajectories.jsonl")).unwrap();
    let (mut plain_with_logprobs, mut tool_calls) = (0, 0);
    for ((record, tokens), merged_line) in trajectories.iter().zip(&tokens).zip(merged.lines()) {
        let key = (
            record["prompt_index"].as_u64().unwrap(),
            record["sample"].as_u64().unwrap_or(0),
        );
        assert_eq!(
            (
                tokens["prompt_index"].as_u64().unwrap(),
                tokens["sample"].as_u64().unwrap()
            ),
            key,
            "the tokens line of the same trajectory, in the same place"
        );
        assert!(record.get(TOKENS_KEY).is_none(), "{record}");
        // The merged record is the batch's line with its tokens cut off, byte for byte.
        let line = &batch[&key];
        let at = TokensAt::find(line).expect("the batch line ends with its tokens");
        let mut cut = line[..=at.cut].to_vec();
        *cut.last_mut().unwrap() = b'}';
        assert_eq!(String::from_utf8(cut).unwrap(), merged_line);
        assert_eq!(tokens["tokenization"]["source"], "none", "{tokens}");
        assert_eq!(tokens["tokenization"]["request"], "LogprobsOnly");
        assert_eq!(tokens["sampling"]["temperature"], 0.0);
        let steps = tokens["steps"].as_array().unwrap();
        let calls = record["api_calls"].as_u64().unwrap() as usize;
        assert!(
            steps.len() == calls || steps.len() == calls + 1,
            "one step per model call (the last without tools included): {} steps, {calls} calls",
            steps.len()
        );
        let conversations = record["conversations"].as_array().unwrap();
        for step in steps {
            assert!(
                step.get("prompt_token_ids").is_none()
                    && step.get("completion_token_ids").is_none()
            );
            let index = step["conversation_index"].as_u64().unwrap() as usize;
            let turn = &conversations[index];
            assert_eq!(turn["from"], "gpt", "{step}");
            let logprobs = step.get("logprobs").and_then(Value::as_array);
            if turn["value"].as_str().unwrap().contains("<tool_call>") {
                // llama-cpp-python gives no logprobs on a tool-call reply.
                tool_calls += 1;
                assert!(logprobs.is_none(), "{step}");
            } else if let Some(logprobs) = logprobs {
                plain_with_logprobs += 1;
                assert_eq!(
                    logprobs.len() as u64,
                    step["completion_tokens"].as_u64().unwrap(),
                    "one logprob per sampled token: {step}"
                );
                assert!(
                    logprobs
                        .iter()
                        .all(|logprob| logprob.as_f64().unwrap() <= 0.0)
                );
                let top = step["top_logprobs"].as_array().unwrap();
                assert_eq!(top.len(), logprobs.len());
                // As many as asked for, and llama-cpp-python lists the sampled token among them.
                assert!(top.iter().all(|alternatives| {
                    let alternatives = alternatives.as_array().unwrap();
                    (2..=3).contains(&alternatives.len())
                        && alternatives.iter().all(|alternative| {
                            alternative["logprob"].as_f64().unwrap() <= 0.0
                                && alternative["token"].is_string()
                        })
                }));
            }
        }
    }
    assert!(plain_with_logprobs > 0, "some plain replies carry logprobs");
    assert!(tool_calls > 0, "some replies call tools");
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(report.run_dir.join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["token_ids"]["none"], trajectories.len());
    assert_eq!(statistics["token_ids"]["server"], 0);
}

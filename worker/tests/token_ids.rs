//! Token ids and logprobs in the records (`spec.model.tokens`), on real model servers.
//!
//! llama.cpp's own `llama-server` gives each sampled token's id with its logprob, and the prompt's
//! ids through its `/apply-template` and `/tokenize`: its records must say `server`, each call's
//! ids counted as the server counted them, each prompt extending the one before, and the ids
//! must be the server's own: fed back to it as a prompt of ids, a final answer's prompt makes it
//! sample the same completion again (greedy decoding, no grammar on a call without tools).
//!
//! The project's llama-cpp-python server gives logprobs on plain replies and nothing on
//! tool-call replies, and never ids: its records must say `none`, hold the logprobs it gave, and
//! leave `trajectories.jsonl` exactly as a run without tokens writes it.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use trajectory_testkit::llama_cpp_server::LlamaCppServer;
use trajectory_worker::export::{ExportError, ExportFormat, export};
use trajectory_worker::model::{Message, ModelClient, ModelSettings};
use trajectory_worker::run::local::{LocalOptions, ProgressMode, run_local};
use trajectory_worker::spec::ModelSpec;
use trajectory_worker::training::{TOKENS_KEY, TokensAt};

/// Writes a run of the quickstart's prompts keeping tokens as `tokens` (YAML) asks, and runs it.
async fn run_with_tokens(dir: &Path, tokens: &str) -> trajectory_worker::run::local::LocalReport {
    run_on(dir, &common::model_server(), &common::model_name(), tokens).await
}

async fn run_on(
    dir: &Path,
    base_url: &str,
    model: &str,
    tokens: &str,
) -> trajectory_worker::run::local::LocalReport {
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
    baseUrl: {base_url}
    name: {model}
    maxTokens: 96
    temperature: 0.0
    requestTimeoutSeconds: 60
{tokens}
  agent:
    maxTurns: 2
    promptTimeoutSeconds: 300
"
    );
    std::fs::write(dir.join("run.yaml"), run).unwrap();
    let options = LocalOptions {
        run_file: dir.join("run.yaml"),
        storage: None,
        bucket: trajectory_worker::storage::BucketOptions::default(),
        base_url: None,
        oracle: false,
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

/// A finished run's trajectories and their tokens lines, most of its prompts succeeded.
fn merged(report: &trajectory_worker::run::local::LocalReport) -> (Vec<Value>, Vec<Value>) {
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
    (trajectories, tokens)
}

/// A call's ids under `key` (`completion_token_ids`, …) in a tokens line's step.
fn ids(step: &Value, key: &str) -> Vec<u64> {
    step[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} in {step}"))
        .iter()
        .map(|id| id.as_u64().unwrap())
        .collect()
}

/// Each call's whole prompt ids in a tokens line's `steps`, as `docs/training-data.md` says to
/// read them: `prompt_token_ids`, or the call before's prompt and completion followed by
/// `prompt_token_ids_new`.
fn prompts(steps: &[Value]) -> Vec<Vec<u64>> {
    let mut whole: Vec<Vec<u64>> = Vec::new();
    for step in steps {
        let prompt = if step.get("prompt_token_ids_new").is_some() {
            let before = whole.last().expect("a call before it");
            let mut prompt = before.clone();
            prompt.extend(ids(&steps[whole.len() - 1], "completion_token_ids"));
            prompt.extend(ids(step, "prompt_token_ids_new"));
            prompt
        } else {
            ids(step, "prompt_token_ids")
        };
        whole.push(prompt);
    }
    whole
}

/// A JSON count as an index.
fn index(value: &Value) -> usize {
    usize::try_from(value.as_u64().unwrap_or_else(|| panic!("a count: {value}"))).unwrap()
}

fn statistics(run_dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(run_dir.join("statistics.json")).unwrap()).unwrap()
}

/// Every record line of the run's batch files, by key.
fn batch_lines(run_dir: &Path) -> BTreeMap<(u64, u64), Vec<u8>> {
    let mut found = BTreeMap::new();
    for entry in walkdir::WalkDir::new(run_dir.join("batches")) {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        let jsonl = Path::new(&name)
            .extension()
            .is_some_and(|extension| extension.eq_ignore_ascii_case("jsonl"));
        if !(name.starts_with("w-") && jsonl) || name.contains(".openai.") {
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
    let (trajectories, tokens) = merged(&report);
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
        // llama-cpp-python names no template, and none was asked of it.
        assert!(
            tokens["tokenization"].get("chat_template_sha256").is_none(),
            "{tokens}"
        );
        assert_eq!(tokens["sampling"]["temperature"], 0.0);
        let steps = tokens["steps"].as_array().unwrap();
        let calls = index(&record["api_calls"]);
        assert!(
            steps.len() == calls || steps.len() == calls + 1,
            "one step per model call (the last without tools included): {} steps, {calls} calls",
            steps.len()
        );
        let conversations = record["conversations"].as_array().unwrap();
        for step in steps {
            assert!(
                step.get("prompt_token_ids").is_none()
                    && step.get("prompt_token_ids_new").is_none()
                    && step.get("completion_token_ids").is_none()
            );
            let turn = &conversations[index(&step["conversation_index"])];
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
    let statistics = statistics(&report.run_dir);
    assert_eq!(statistics["token_ids"]["none"], trajectories.len());
    assert_eq!(statistics["token_ids"]["server"], 0);
    let calls: u64 = tokens
        .iter()
        .map(|line| line["steps"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(
        statistics["token_ids"]["endpoints"],
        serde_json::json!({common::model_server(): {
            "calls": calls, "with_ids": 0, "retokenized": 0, "with_logprobs": plain_with_logprobs, "exact_rate": 0.0}}),
        "every call counted at the one endpoint, logprobs on the plain replies only"
    );

    exports_refuse_without_ids(&report.run_dir, trajectories.len());

    // The conversation formats need no ids: the tool calls are what they must carry.
    check_conversation_exports(&report.run_dir, &trajectories, &tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_ids_are_the_servers_own_and_each_prompt_extends_the_last() {
    let storage = tempfile::tempdir().unwrap();
    let server = LlamaCppServer::start(&storage.path().join("server"), 2, 2).await;
    let report = run_on(
        &storage.path().join("run"),
        &server.base_url,
        &server.model,
        "    tokens:\n      request: LlamaServer",
    )
    .await;
    let (trajectories, tokens) = merged(&report);
    let http = reqwest::Client::new();
    // The template the server says it applies (GET /props) names the tokenization.
    let template_sha256 = chat_template_sha256(&http, &server).await;
    let (mut steps_seen, mut pairs, mut extended, mut replayed) = (0, 0, 0, 0);
    // SmolLM2 calls no tool on llama-server (its grammar for tool calls does not bind here), so
    // the run's conversations are single calls; multi_turn_prompts_extend has several.
    for (record, tokens) in trajectories.iter().zip(&tokens) {
        assert_eq!(tokens["tokenization"]["source"], "server", "{tokens}");
        assert_eq!(
            tokens["tokenization"]["chat_template_sha256"], template_sha256,
            "{tokens}"
        );
        let steps = tokens["steps"].as_array().unwrap();
        let whole = prompts(steps);
        for (index, step) in steps.iter().enumerate() {
            steps_seen += 1;
            let (prompt, completion) = (whole[index].clone(), ids(step, "completion_token_ids"));
            assert_eq!(prompt.len() as u64, step["prompt_tokens"].as_u64().unwrap());
            assert_eq!(
                completion.len() as u64,
                step["completion_tokens"].as_u64().unwrap()
            );
            assert_eq!(
                step["logprobs"].as_array().unwrap().len(),
                completion.len(),
                "{step}"
            );
            if let Some(next_prompt) = whole.get(index + 1) {
                pairs += 1;
                assert!(
                    next_prompt.starts_with(&prompt),
                    "call {} of {}: its prompt does not extend the one before",
                    index + 1,
                    record["prompt_index"]
                );
                let mut whole = prompt.clone();
                whole.extend(&completion);
                if next_prompt.starts_with(&whole) {
                    extended += 1;
                }
            }
            // A reply cut off by the token limit is not in the conversation (index null).
            let turn = step["conversation_index"]
                .as_u64()
                .map(|at| &record["conversations"][usize::try_from(at).unwrap()]);
            if step["finish_reason"] == "stop"
                && turn.is_some_and(|turn| !turn["value"].as_str().unwrap().contains("<tool_call>"))
            {
                // The server's own ids: the prompt, fed back as ids, samples the same reply.
                let sampled = sample_again(&server, &prompt, completion.len()).await;
                assert!(
                    completion.starts_with(&sampled) && sampled.len() + 1 >= completion.len(),
                    "the recorded prompt ids sample {sampled:?}, not the recorded {completion:?}"
                );
                replayed += 1;
            }
        }
    }
    eprintln!(
        "{steps_seen} calls with the server's ids; {pairs} consecutive pairs, each prompt \
         extending the last; {extended} of them also extending its completion; {replayed} final \
         answers sampled again from their recorded prompt ids"
    );
    assert!(replayed > 0, "final answers sampled again");
    let (pairs, extended) = multi_turn_prompts_extend(&server).await;
    eprintln!(
        "a five-turn conversation: {pairs} consecutive calls, each prompt extending the last; \
         {extended} of them also extending its completion"
    );
    let statistics = statistics(&report.run_dir);
    assert_eq!(statistics["token_ids"]["server"], trajectories.len());
    assert_eq!(
        statistics["token_ids"]["endpoints"],
        serde_json::json!({&server.base_url: {
            "calls": steps_seen, "with_ids": steps_seen, "retokenized": 0, "with_logprobs": steps_seen, "exact_rate": 100.0}})
    );
    shown_per_endpoint(&report, &server.base_url, steps_seen, trajectories.len());

    check_exports(&report.run_dir, &trajectories, &tokens);
    check_conversation_exports(&report.run_dir, &trajectories, &tokens);
}

/// Ids made again from text are not the sampled ones. On llama-server, replies sampled at a high
/// temperature (the server's own ids) are tokenized again as `Retokenize` does; some come back
/// as other ids (the drift the research measured on this model), so such ids must be flagged.
/// Then a run with `Retokenize` and llama-server as its tokenizer (`tokenizerUrl`, its ids in
/// the answers set aside): its records say `retokenized`, each call's ids are what the
/// tokenizer makes of its text, the sample exports refuse them and `--force` writes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_made_again_from_text_drift_from_the_sampled_ones_and_are_flagged_retokenized() {
    let storage = tempfile::tempdir().unwrap();
    let server = LlamaCppServer::start(&storage.path().join("server"), 2, 2).await;
    let (calls, drifted) = replies_drift_when_tokenized_again(&server).await;
    eprintln!("{drifted} of {calls} sampled replies tokenized again to other ids");
    assert!(
        drifted > 0,
        "some of {calls} replies drift when tokenized again"
    );

    let report = run_on(
        &storage.path().join("run"),
        &server.base_url,
        &server.model,
        &format!(
            "    tokens:\n      request: Retokenize\n      tokenizerUrl: {}",
            server.root
        ),
    )
    .await;
    let (trajectories, tokens) = merged(&report);
    let steps_seen = retokenized_steps_read_back(&server, &trajectories, &tokens).await;
    let statistics = statistics(&report.run_dir);
    assert_eq!(statistics["token_ids"]["retokenized"], trajectories.len());
    assert_eq!(statistics["token_ids"]["server"], 0);
    let endpoint = &statistics["token_ids"]["endpoints"][&server.base_url];
    assert_eq!(endpoint["retokenized"], steps_seen, "{endpoint}");
    assert_eq!(endpoint["with_ids"], 0, "{endpoint}");

    let refused = export(&report.run_dir, ExportFormat::Verl, false, &mut Vec::new()).unwrap_err();
    assert!(
        matches!(&refused, ExportError::NotExact { id_source, .. } if id_source == "retokenized"),
        "{refused}"
    );
    let mut out = Vec::new();
    let summary = export(&report.run_dir, ExportFormat::Verl, true, &mut out).unwrap();
    assert_eq!(
        (summary.retokenized, summary.skipped),
        (trajectories.len() as u64, 0),
        "--force writes the ids made again"
    );
    let samples = out
        .split(|byte| *byte == b'\n')
        .filter(|line| !line.is_empty())
        .count();
    assert_eq!(samples as u64, summary.samples);
    assert!(summary.samples >= trajectories.len() as u64, "{summary:?}");
}

/// Checks each tokens line of a `Retokenize` run against the tokenizer `server`: flagged, its
/// template named, each call's ids the tokenizer's text of the row's prompt and of the reply,
/// each prompt extending the last. Returns the calls seen.
async fn retokenized_steps_read_back(
    server: &LlamaCppServer,
    trajectories: &[Value],
    tokens: &[Value],
) -> u64 {
    let http = reqwest::Client::new();
    let template_sha256 = chat_template_sha256(&http, server).await;
    let mut steps_seen = 0;
    for (record, tokens) in trajectories.iter().zip(tokens) {
        assert_eq!(tokens["tokenization"]["source"], "retokenized", "{tokens}");
        assert_eq!(tokens["tokenization"]["request"], "Retokenize");
        assert_eq!(
            tokens["tokenization"]["chat_template_sha256"], template_sha256,
            "the tokenizer's template"
        );
        let steps = tokens["steps"].as_array().unwrap();
        let prompt = record["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|turn| turn["from"] == "human")
            .unwrap()["value"]
            .as_str()
            .unwrap();
        let whole = prompts(steps);
        for (index, step) in steps.iter().enumerate() {
            steps_seen += 1;
            assert_eq!(step["retokenized"], true, "{step}");
            let (prompt_ids, completion_ids) = (&whole[index], ids(step, "completion_token_ids"));
            // The tokenizer's text of them: the prompt holds the row's prompt, the completion the
            // reply as the conversation keeps it.
            let prompt_text = server.detokenize(prompt_ids).await;
            assert!(
                prompt_text.contains(prompt),
                "{prompt_text:?} holds {prompt:?}"
            );
            let completion_text = server.detokenize(&completion_ids).await;
            if let Some(at) = step["conversation_index"].as_u64() {
                let reply = record["conversations"][usize::try_from(at).unwrap()]["value"]
                    .as_str()
                    .unwrap();
                // Hermes' gpt turns open with their (here empty) reasoning block.
                let reply = reply
                    .rsplit_once("</think>")
                    .map_or(reply, |(_, text)| text);
                if !reply.contains("<tool_call>") {
                    assert!(
                        completion_text.contains(reply.trim()),
                        "{completion_text:?} holds the reply {reply:?}"
                    );
                }
            }
            if let Some(next) = whole.get(index + 1) {
                assert!(
                    next.starts_with(prompt_ids),
                    "each prompt extends the one before"
                );
            }
        }
    }
    steps_seen
}

/// Samples ten prompts four times each (seeded, temperature 1.2, 24 tokens at most) through the
/// worker's client keeping llama-server's own ids, and tokenizes each call again as
/// `Retokenize` does. Returns the calls with the server's whole ids and how many of their
/// replies came back as other ids than the sampled ones.
async fn replies_drift_when_tokenized_again(server: &LlamaCppServer) -> (usize, usize) {
    use trajectory_worker::model::tokens::LlamaCppTokenizer;
    let http = reqwest::Client::new();
    let tokenizer = LlamaCppTokenizer {
        http: &http,
        root: &server.root,
        authorization: None,
        timeout: std::time::Duration::from_secs(60),
    };
    let (mut calls, mut drifted, mut unwhole) = (0, 0, 0);
    for seed in 1..=4 {
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "baseUrl": server.base_url, "name": server.model, "maxTokens": 24,
            "temperature": 1.2, "tokens": {"request": "LlamaServer"},
            "extraBody": {"seed": seed},
        }))
        .unwrap();
        let client = ModelClient::new(ModelSettings::from_spec(&spec, None).unwrap()).unwrap();
        for question in [
            "Write a haiku about the sea.",
            "Name three fruits and an emoji for each.",
            "What is the capital of France?",
            "Describe your favourite colour.",
            "Tell me a very short joke.",
            "Say hello in four languages.",
            "What is 17 times 23?",
            "List two uses of a paperclip.",
            "Invent a word and define it.",
            "Spell 'skinny' backwards.",
        ] {
            let messages = [Message::User(question.to_owned())];
            let body = client.request_body(None, &messages, None);
            let completion = client.complete(&body, 0).await.unwrap();
            let tokens = completion.tokens.clone().expect("the call's tokens");
            let prompt = tokens.prompt_token_ids.expect("the server's prompt ids");
            // llama-server gives one logprob for the pieces of a character it sampled in
            // several (an emoji's bytes): fewer ids than it counted, so none are kept.
            let Some(sampled) = tokens.completion_token_ids else {
                unwhole += 1;
                continue;
            };
            let reply = Message::Assistant(completion.message).to_wire();
            let (prompt_again, completion_again) = tokenizer
                .retokenize(&serde_json::to_vec(&body).unwrap(), reply)
                .await
                .unwrap();
            assert_eq!(
                prompt_again, prompt,
                "the prompt is rendered as the server did"
            );
            calls += 1;
            // Made again, the reply's ids end with the template's end of turn; those sampled
            // (the end of turn among them or not) begin them unless the text drifted.
            drifted += usize::from(!completion_again.starts_with(&sampled));
        }
    }
    eprintln!("{unwhole} replies of 40 without their whole ids from the server");
    (calls, drifted)
}

/// Without the server's ids there is nothing to train on: the sample formats refuse, naming the
/// line, and `--force` leaves every trajectory out.
fn exports_refuse_without_ids(run_dir: &Path, trajectories: usize) {
    let refused = export(run_dir, ExportFormat::Verl, false, &mut Vec::new()).unwrap_err();
    assert!(
        matches!(refused, ExportError::NotExact { line: 1, .. }),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("trajectories.tokens.jsonl:1"),
        "{refused}"
    );
    let mut out = Vec::new();
    let summary = export(run_dir, ExportFormat::Verl, true, &mut out).unwrap();
    assert_eq!(
        usize::try_from(summary.skipped).unwrap(),
        trajectories,
        "--force leaves them out"
    );
    assert!(out.is_empty());
}

/// The run's summary and its report show the ids per endpoint.
fn shown_per_endpoint(
    report: &trajectory_worker::run::local::LocalReport,
    endpoint: &str,
    steps_seen: u64,
    trajectories: usize,
) {
    let summary = trajectory_worker::run::local::render_report(report);
    assert!(
        summary.contains(&format!(
            "token ids: {trajectories} of {trajectories} trajectories with the server's own"
        )),
        "{summary}"
    );
    let profile = tempfile::tempdir().unwrap();
    let dom = trajectory_testkit::chromium::headless(profile.path())
        .args([
            "--dump-dom",
            &format!("file://{}", report.run_dir.join("report.html").display()),
        ])
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    let row = format!(
        r#"data-endpoint="{endpoint}" data-calls="{steps_seen}" data-with-ids="{steps_seen}" data-retokenized="0" data-with-logprobs="{steps_seen}""#
    );
    assert!(dom.contains(&row), "the report's endpoint row: {row}");
}

/// How many times `needle` begins a line in the `from` turns of the records.
fn blocks(trajectories: &[Value], from: &str, needle: &str) -> u64 {
    trajectories
        .iter()
        .flat_map(|record| record["conversations"].as_array().unwrap())
        .filter(|turn| turn["from"] == from)
        .map(|turn| {
            turn["value"]
                .as_str()
                .unwrap()
                .lines()
                .filter(|line| *line == needle)
                .count() as u64
        })
        .sum()
}

/// The conversation formats of a run, each checked by the format's own published code
/// (scripts/formats/validate.py: Harbor's ATIF validator, the Agent Data Protocol's models,
/// Hugging Face `datasets`), and counted: every call, result and kept id is in each.
fn check_conversation_exports(run_dir: &Path, trajectories: &[Value], tokens: &[Value]) {
    let python =
        trajectory_testkit::installed("TRAJ_FORMATS_PYTHON", "formats/install.sh", "--print-path");
    let validator = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/formats/validate.py");
    let records = trajectories.len() as u64;
    let calls = blocks(trajectories, "gpt", "<tool_call>");
    let results = blocks(trajectories, "tool", "<tool_response>");
    let replies = trajectories
        .iter()
        .flat_map(|record| record["conversations"].as_array().unwrap())
        .filter(|turn| turn["from"] == "gpt")
        .count() as u64;
    let turns: usize = trajectories
        .iter()
        .map(|record| record["conversations"].as_array().unwrap().len())
        .sum();
    let with_ids = tokens
        .iter()
        .flat_map(|line| line["steps"].as_array().unwrap())
        .filter(|step| {
            step["conversation_index"].is_u64() && step["completion_token_ids"].is_array()
        })
        .count() as u64;
    for (format, name) in [
        (ExportFormat::Atif, "atif"),
        (ExportFormat::Adp, "adp"),
        (ExportFormat::Sharegpt, "sharegpt"),
        (ExportFormat::Openai, "openai"),
    ] {
        let mut out = Vec::new();
        let summary = export(run_dir, format, false, &mut out).unwrap();
        assert_eq!(summary.trajectories, records, "{name}");
        let path = run_dir.join(format!("export.{name}.jsonl"));
        std::fs::write(&path, out).unwrap();
        let output = std::process::Command::new(&python)
            .arg(&validator)
            .arg(name)
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let counts: Value = serde_json::from_slice(&output.stdout).unwrap();
        eprintln!("{name}: {counts}");
        if matches!(format, ExportFormat::Atif | ExportFormat::Adp) {
            // The validators are strict: a key the format does not define fails the line.
            let text = std::fs::read_to_string(&path).unwrap();
            let mut first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
            first["not_in_the_format"] = true.into();
            let broken = run_dir.join(format!("broken.{name}.jsonl"));
            std::fs::write(&broken, format!("{first}\n")).unwrap();
            let output = std::process::Command::new(&python)
                .arg(&validator)
                .arg(name)
                .arg(&broken)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                !output.status.success()
                    && stderr.contains(":1:")
                    && stderr.contains("not_in_the_format"),
                "{name}: {stderr}"
            );
        }
        let expected = match format {
            ExportFormat::Atif => serde_json::json!({"documents": records, "agent_steps": replies,
                "steps_with_ids": with_ids, "tool_calls": calls, "observations": results}),
            ExportFormat::Adp => serde_json::json!({"trajectories": records,
                "api_actions": calls, "message_actions": replies - replies_with_calls(trajectories),
                "tool_results": calls}),
            ExportFormat::Sharegpt => serde_json::json!({"rows": records,
                "columns": ["conversations", "id", "prompt_index", "reward", "sample"],
                "turns": turns}),
            _ => serde_json::json!({"rows": records,
                "columns": ["id", "messages", "prompt_index", "reward", "sample", "tools"],
                "tool_calls": calls, "tool_messages": results}),
        };
        assert_eq!(counts, expected, "{name}");
    }
}

/// The replies that call tools.
fn replies_with_calls(trajectories: &[Value]) -> u64 {
    trajectories
        .iter()
        .flat_map(|record| record["conversations"].as_array().unwrap())
        .filter(|turn| {
            turn["from"] == "gpt" && turn["value"].as_str().unwrap().contains("\n<tool_call>\n")
        })
        .count() as u64
}

/// Every export of a run: the model's sampled tokens, and only those, trained.
fn check_exports(run_dir: &Path, trajectories: &[Value], tokens: &[Value]) {
    let sampled: u64 = tokens
        .iter()
        .flat_map(|line| line["steps"].as_array().unwrap())
        .map(|step| step["completion_tokens"].as_u64().unwrap())
        .sum();
    for format in [
        ExportFormat::Verl,
        ExportFormat::Skyrl,
        ExportFormat::Slime,
        ExportFormat::Atropos,
        ExportFormat::PrimeRl,
    ] {
        let mut out = Vec::new();
        let summary = export(run_dir, format, false, &mut out).unwrap();
        assert_eq!(
            usize::try_from(summary.trajectories).unwrap(),
            trajectories.len()
        );
        let exported: Vec<Value> = out
            .split(|byte| *byte == b'\n')
            .filter(|line| !line.is_empty())
            .map(|line| serde_json::from_slice(line).unwrap())
            .collect();
        assert_eq!(
            trained_tokens(format, &exported),
            sampled,
            "{format:?}: the trained tokens are exactly the sampled ones"
        );
    }
}

/// The SHA-256 of the chat template `server` says it applies (`GET /props`).
async fn chat_template_sha256(http: &reqwest::Client, server: &LlamaCppServer) -> String {
    use sha2::Digest as _;
    let props: Value = http
        .get(format!("{}/props", server.root))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let template = props["chat_template"]
        .as_str()
        .expect("llama-server names its template");
    format!("{:x}", sha2::Sha256::digest(template.as_bytes()))
}

/// What the server samples greedily, as ids, from the prompt ids `prompt`: `tokens` of them.
async fn sample_again(server: &LlamaCppServer, prompt: &[u64], tokens: usize) -> Vec<u64> {
    let again = server
        .post(
            "/completion",
            &serde_json::json!({
                "prompt": prompt, "n_predict": tokens,
                "temperature": 0.0, "return_tokens": true, "cache_prompt": false,
            }),
        )
        .await;
    again["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("{again}"))
        .iter()
        .map(|id| id.as_u64().unwrap())
        .collect()
}

/// A conversation of five user turns through the worker's client on `server`, keeping tokens:
/// every call has the server's ids, and each prompt extends the last prompt (the template
/// renders the history the same way each time). Returns the consecutive pairs and how many
/// also extend the last completion (the reply rendered back as sampled).
async fn multi_turn_prompts_extend(server: &LlamaCppServer) -> (usize, usize) {
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "baseUrl": server.base_url, "name": server.model, "maxTokens": 24,
        "temperature": 0.0, "tokens": {"request": "LlamaServer"},
    }))
    .unwrap();
    let client = ModelClient::new(ModelSettings::from_spec(&spec, None).unwrap()).unwrap();
    let mut messages = Vec::new();
    let mut calls: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
    for question in [
        "Name a colour.",
        "Name another one.",
        "Which of the two is darker?",
        "Say it in French.",
        "Thank you.",
    ] {
        messages.push(Message::User(question.to_owned()));
        let body = client.request_body(None, &messages, None);
        let completion = client.complete(&body, calls.len()).await.unwrap();
        let tokens = completion.tokens.clone().expect("the call's tokens");
        let prompt = tokens.prompt_token_ids.expect("the server's prompt ids");
        let sampled = tokens
            .completion_token_ids
            .expect("the server's completion ids");
        assert_eq!(prompt.len() as u64, completion.usage.prompt_tokens);
        assert_eq!(tokens.logprobs.len(), sampled.len());
        calls.push((prompt, sampled));
        messages.push(Message::Assistant(completion.message));
    }
    let mut extended = 0;
    for pair in calls.windows(2) {
        let ((prompt, completion), (next, _)) = (&pair[0], &pair[1]);
        assert!(next.starts_with(prompt), "each prompt extends the last");
        let mut whole = prompt.clone();
        whole.extend(completion);
        extended += usize::from(next.starts_with(&whole));
    }
    (calls.len() - 1, extended)
}

/// The tokens an export trains, checking each sample's shape as its trainer documents it: the
/// fields it reads, masks as long as what they mask, logprobs beside every token.
fn trained_tokens(format: ExportFormat, lines: &[Value]) -> u64 {
    let numbers = |value: &Value| -> Vec<i64> {
        value
            .as_array()
            .unwrap_or_else(|| panic!("an array: {value}"))
            .iter()
            .map(|number| number.as_i64().unwrap())
            .collect()
    };
    let mask_sum = |mask: &[i64]| -> u64 {
        assert!(mask.iter().all(|bit| *bit == 0 || *bit == 1), "{mask:?}");
        u64::try_from(mask.iter().sum::<i64>()).unwrap()
    };
    let lengths = |line: &Value, keys: &[&str]| {
        let first = line[keys[0]].as_array().unwrap().len();
        for key in keys {
            assert_eq!(
                line[*key].as_array().unwrap().len(),
                first,
                "{format:?} {key}"
            );
        }
    };
    lines
        .iter()
        .map(|line| match format {
            ExportFormat::Verl => {
                lengths(
                    line,
                    &["response_ids", "response_mask", "response_logprobs"],
                );
                assert!(line["num_turns"].as_u64().unwrap() >= 1);
                assert!(!line["prompt_ids"].as_array().unwrap().is_empty());
                mask_sum(&numbers(&line["response_mask"]))
            }
            ExportFormat::Skyrl => {
                lengths(line, &["response_ids", "loss_masks", "rollout_logprobs"]);
                assert!(line["is_last_step"].is_boolean() && line["trajectory_ids"].is_string());
                mask_sum(&numbers(&line["loss_masks"]))
            }
            ExportFormat::Slime => {
                lengths(line, &["loss_mask", "rollout_log_probs"]);
                let response = index(&line["response_length"]);
                assert_eq!(line["loss_mask"].as_array().unwrap().len(), response);
                assert!(line["tokens"].as_array().unwrap().len() > response);
                mask_sum(&numbers(&line["loss_mask"]))
            }
            ExportFormat::Atropos => {
                let members = line["tokens"].as_array().unwrap().len();
                assert_eq!(line["scores"].as_array().unwrap().len(), members);
                (0..members)
                    .map(|member| {
                        let tokens = numbers(&line["tokens"][member]);
                        let masks = numbers(&line["masks"][member]);
                        let logprobs = line["inference_logprobs"][member].as_array().unwrap();
                        assert_eq!((masks.len(), logprobs.len()), (tokens.len(), tokens.len()));
                        let mut trained = 0;
                        for ((token, mask), logprob) in tokens.iter().zip(&masks).zip(logprobs) {
                            if *mask == -100 {
                                assert_eq!(logprob.as_f64(), Some(1.0));
                            } else {
                                assert_eq!(mask, token, "a trained position's mask is its token");
                                trained += 1;
                            }
                        }
                        trained
                    })
                    .sum()
            }
            ExportFormat::PrimeRl => line["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|step| {
                    let tokens = &step["tokens"];
                    lengths(
                        tokens,
                        &["completion_ids", "completion_mask", "completion_logprobs"],
                    );
                    lengths(tokens, &["prompt_ids", "prompt_mask"]);
                    assert_eq!(mask_sum(&numbers(&tokens["prompt_mask"])), 0);
                    mask_sum(&numbers(&tokens["completion_mask"]))
                })
                .sum(),
            other => panic!("{other:?} trains on no ids"),
        })
        .sum()
}

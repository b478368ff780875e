//! Anthropic's Message Batches, as the worker speaks them (`spec.model.batch.provider:
//! Anthropic`), against the test kit's double of the API (`trajectory_testkit::batch_server`):
//! the chat requests translated into messages' params and run on a real Messages endpoint
//! (llama.cpp's `llama-server` serves `/v1/messages`), their answers translated back into chat
//! completions; per-line errors, expiry, a refused batch and a throttled create; and a tool loop
//! of 40 conversations whose every turn goes through Message Batches, on a scripted model for
//! exact turn counts, each paid once at the batch price.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use trajectory_testkit::batch_server::{BatchServer, Behaviour};
use trajectory_testkit::scripted_server::{ScriptedServer, Step};
use trajectory_worker::model::batch_api::{BatchApiError, BatchProvider, BatchStatus, LineOutcome};
use trajectory_worker::model::types::parse_completion;

use common::batches::{batch_api, batch_run, ended, window_file};

/// A tool loop's history as the agent sends it: a system prompt, a tool call, its result.
fn tool_history(model: &str) -> Value {
    json!({
        "model": model, "max_tokens": 12, "temperature": 0.0,
        "tools": [{"type": "function", "function": {"name": "terminal",
            "description": "Runs a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}}],
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Which files are here?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function",
                "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "terminal",
             "content": "notes.txt"},
        ],
    })
}

/// Message Batches on a real Messages server: plain requests and a tool loop's history
/// (system, `tool_use`, `tool_result`, tools) run and read back as chat completions with their
/// usage; a refused line comes back as a 400, as a live call's would; each line run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_batches_run_on_a_real_messages_server_and_read_back_as_chat_completions() {
    let state = tempfile::tempdir().unwrap();
    let refusing = Behaviour {
        refuse_lines_containing: vec!["refused".into()],
        ..Behaviour::default()
    };
    let (server, batches, api) = batch_api(state.path(), BatchProvider::Anthropic, refusing).await;
    let mut lines = window_file(&api, &server.model, &["m-0", "m-1", "refused-2"]);
    lines.extend(
        api.request_line("tools-3", &tool_history(&server.model))
            .unwrap(),
    );
    let input = api.prepare(&lines).await.unwrap();
    let created = api.create(&input, &serde_json::Map::new()).await.unwrap();
    assert!(created.id.starts_with("msgbatch_"), "{created:?}");
    assert!(!api.names_batches());
    let batch = ended(&api, &created.id).await;
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = api.results(&batch).await.unwrap();
    assert_eq!(results.len(), 4, "{results:?}");
    for result in &results {
        match (&result.outcome, result.custom_id.as_str()) {
            (LineOutcome::Answered(body), "m-0" | "m-1" | "tools-3") => {
                let completion = parse_completion(body, 0, false).expect("a chat completion");
                assert!(completion.usage.completion_tokens > 0, "{completion:?}");
                assert!(completion.usage.prompt_tokens > 0, "{completion:?}");
                assert!(
                    !completion.message.content.is_empty()
                        || !completion.message.tool_calls.is_empty(),
                    "{completion:?}"
                );
            }
            (
                LineOutcome::Refused {
                    status: 400,
                    message,
                },
                "refused-2",
            ) => {
                assert!(message.contains("invalid_request_error"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let counts = batches.counts();
    assert_eq!(counts.executed, 3, "the refused line is not run");
    assert!(counts.executed_ids.values().all(|runs| *runs == 1));
    // The tool loop's history reached the server as a Messages history: its prompt holds the
    // system prompt, the call and the tool's result, so it is longer than a plain question's.
    let usage = |id: &str| {
        results
            .iter()
            .find_map(|result| match (&result.outcome, result.custom_id == id) {
                (LineOutcome::Answered(body), true) => Some(
                    parse_completion(body, 0, false)
                        .unwrap()
                        .usage
                        .prompt_tokens,
                ),
                _ => None,
            })
            .unwrap()
    };
    assert!(usage("tools-3") > usage("m-0"), "{results:?}");
}

/// What else ends a Message Batch's lines: expiry (the lines never run come back `expired`,
/// which send a turn live), a batch refused at its creation, a create answered 429 with a
/// `Retry-After`, and a create without `anthropic-version`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_batches_read_expiry_refusal_and_a_throttled_create() {
    let state = tempfile::tempdir().unwrap();
    let expiring = Behaviour {
        expire_after_lines: Some(1),
        ..Behaviour::default()
    };
    let (server, batches, api) = batch_api(state.path(), BatchProvider::Anthropic, expiring).await;
    let input = api
        .prepare(&window_file(&api, &server.model, &["e-0", "e-1", "e-2"]))
        .await
        .unwrap();
    let created = api.create(&input, &serde_json::Map::new()).await.unwrap();
    let batch = ended(&api, &created.id).await;
    let results = api.results(&batch).await.unwrap();
    assert_eq!(
        common::batches::answered_and_expired(&results),
        (1, 2),
        "{results:?}"
    );

    batches.set_behaviour(Behaviour {
        fail_batches: 1,
        throttle_creates: 1,
        ..Behaviour::default()
    });
    let input = api
        .prepare(&window_file(&api, &server.model, &["f-0"]))
        .await
        .unwrap();
    let throttled = api
        .create(&input, &serde_json::Map::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            throttled,
            BatchApiError::Status {
                status: 429,
                retry_after: Some(_),
                ..
            }
        ),
        "{throttled:?}"
    );
    assert!(throttled.is_transient());
    let refused = api
        .create(&input, &serde_json::Map::new())
        .await
        .unwrap_err();
    assert!(
        matches!(refused, BatchApiError::Status { status: 400, .. }) && !refused.is_transient(),
        "{refused:?}"
    );
    // The double requires the version header, as Anthropic does: the client sends it.
    let unversioned = reqwest::Client::new()
        .post(format!("{}/messages/batches", batches.base_url()))
        .json(&json!({"requests": [{"custom_id": "x", "params": {}}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(unversioned.status(), 400);
    let counts = batches.counts();
    assert_eq!(
        (counts.executed, counts.batches, counts.throttled),
        (1, 1, 1)
    );
}

/// USD per million tokens at the standard tier (the batch tier is half).
const STANDARD: (f64, f64) = (3.0, 15.0);

/// Four tool calls, then an answer, in the Messages shape (Message Batches' lines) or the chat
/// shape (a live call, which the test asserts never happens): five turns a conversation, each
/// 1,000 input and 100 output tokens.
fn five_turns(body: &Value) -> Step {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
    let usage = json!({"input_tokens": 1000, "output_tokens": 100});
    let content = if turn < 4 {
        json!([{"type": "tool_use", "id": format!("toolu_{turn}"), "name": "terminal",
                "input": {"command": "true"}}])
    } else {
        json!([{"type": "text", "text": "done"}])
    };
    let stop_reason = if turn < 4 { "tool_use" } else { "end_turn" };
    Step::ok(
        json!({"id": format!("msg_{turn}"), "type": "message", "role": "assistant",
        "model": body["model"], "content": content, "stop_reason": stop_reason,
        "stop_sequence": null, "usage": usage}),
    )
}

/// A tool loop over Message Batches: 40 conversations of five turns, every turn translated into
/// a message's params and sent in a batch, its answer translated back, the tools run between
/// rounds. Every record complete once, every turn paid once (counted at the batch server by
/// custom id and at the model), none live, each priced at the batch rate; each turn's history
/// holds the previous turn's `tool_use` answered by a `tool_result`, and its last block is the
/// conversation's cache breakpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_loop_over_message_batches_pays_every_turn_once_at_the_batch_price() {
    let model = ScriptedServer::start_responding(five_turns).await;
    let batches = BatchServer::start(&model.base_url(), Behaviour::default()).await;
    let fixture = batch_run(
        &model,
        &batches,
        STANDARD,
        40,
        json!({"provider": "Anthropic", "maxRequests": 40, "maxWaitSeconds": 1,
               "pollSeconds": 1, "liveTailPercent": 0}),
    )
    .await;

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 40, "{:?}", fixture.lines("failures.jsonl"));
    let ids: BTreeSet<&str> = records
        .iter()
        .map(|record| record["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 40, "every record once");
    let counts = batches.counts();
    assert_eq!(counts.executed, 200, "five turns of 40 conversations");
    assert!(
        counts.executed_ids.values().all(|runs| *runs == 1),
        "no turn paid twice"
    );
    let requests = model.requests();
    let by_path = |path: &str| requests.iter().filter(|r| r.path == path).count();
    assert_eq!(by_path("/v1/messages"), 200);
    assert_eq!(by_path("/v1/chat/completions"), 0, "no turn went live");
    let mut turns_by_conversation: BTreeMap<usize, usize> = BTreeMap::new();
    for request in &requests {
        let params = &request.body;
        assert_eq!(params["tools"][0]["name"], "terminal", "{params}");
        assert!(params["tools"][0]["input_schema"].is_object(), "{params}");
        assert!(params["max_tokens"].is_u64(), "{params}");
        let messages = params["messages"].as_array().unwrap();
        let last = messages.last().unwrap();
        assert_eq!(last["role"], "user");
        assert_eq!(
            last["content"].as_array().unwrap().last().unwrap()["cache_control"],
            json!({"type": "ephemeral"}),
            "{params}"
        );
        let turn = messages.iter().filter(|m| m["role"] == "assistant").count();
        if turn > 0 {
            let previous = &messages[messages.len() - 2];
            assert_eq!(previous["content"][0]["type"], "tool_use", "{params}");
            assert_eq!(
                last["content"][0],
                json!({"type": "tool_result", "tool_use_id": format!("toolu_{}", turn - 1),
                       "content": last["content"][0]["content"],
                       "cache_control": {"type": "ephemeral"}}),
                "{params}"
            );
        }
        *turns_by_conversation.entry(turn).or_default() += 1;
    }
    assert_eq!(
        turns_by_conversation,
        (0..5).map(|turn| (turn, 40)).collect(),
        "every conversation's five turns"
    );
    let per_call = (1000.0 * STANDARD.0 + 100.0 * STANDARD.1) / 1e6;
    for record in &records {
        assert_eq!(record["api_calls"], 5, "{record}");
        assert_eq!(record["tool_stats"]["terminal"]["count"], 4, "{record}");
        let cost = &record["cost"];
        assert_eq!(cost["tiers"]["batch"]["calls"], 5, "{record}");
        assert!(
            (cost["total"].as_f64().unwrap() - 2.5 * per_call).abs() < 1e-12,
            "{cost}"
        );
    }
}

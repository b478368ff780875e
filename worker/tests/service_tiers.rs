//! Service tiers on a real model server: llama.cpp's `llama-server` behind a double of a
//! provider's flex tier (`trajectory_testkit::tier_gate`, which refuses flex calls with a 429 while
//! it has no capacity and says which tier served each answer). Calls refused for capacity wait and
//! are then served at flex, priced at the flex rates, with what the standard tier would have cost
//! beside it; a run that allows a fallback sends calls refused for longer at the standard tier,
//! priced so. Each is counted at the gate and in the records. And the Batch API as the worker
//! speaks it, against the test kit's double of one (`trajectory_testkit::batch_server`) whose
//! batches run on the same real server.

mod common;

use common::RunFixture;
use serde_json::{Value, json};
use trajectory_testkit::batch_server::{BatchServer, Behaviour};
use trajectory_testkit::llama_cpp_server::LlamaCppServer;
use trajectory_testkit::scripted_server::{ScriptedServer, Step, text_reply, tool_calls_reply};
use trajectory_testkit::tier_gate::TierGate;
use trajectory_worker::model::batch_api::{BatchApiError, BatchProvider, BatchStatus, LineOutcome};
use trajectory_worker::model::types::parse_completion;
use trajectory_worker::run::local::run_local;

/// USD per million tokens: the standard tier's, and the flex tier's (half).
const STANDARD: (f64, f64) = (2.0, 8.0);
const FLEX: (f64, f64) = (1.0, 4.0);
/// Float noise of summed costs.
const TOLERANCE: f64 = 1e-12;

fn priced(record: &Value, (input, output): (f64, f64)) -> f64 {
    let usage = &record["usage"];
    (usage["prompt_tokens"].as_f64().unwrap() * input
        + usage["completion_tokens"].as_f64().unwrap() * output)
        / 1e6
}

/// A run of 4 rows through `gate`, with the flex tier asked as `service_tier`.
async fn run_through(gate: &TierGate, server: &LlamaCppServer, service_tier: Value) -> RunFixture {
    let lines: Vec<String> = ["Name a colour.", "Name a fruit.", "Name a city.", "Say hi."]
        .iter()
        .map(|prompt| json!({"prompt": prompt}).to_string())
        .collect();
    let fixture = RunFixture::with_lines(&gate.base_url(), &lines)
        .with(
            "/model",
            json!({
                "baseUrl": gate.base_url(),
                "name": server.model,
                "maxTokens": 16,
                "temperature": 0.0,
                "requestTimeoutSeconds": 120,
                "serviceTier": service_tier,
                "pricing": {
                    "input": STANDARD.0, "output": STANDARD.1,
                    "flex": {"input": FLEX.0, "output": FLEX.1},
                },
            }),
        )
        .with(
            "/agent",
            json!({"maxTurns": 1, "promptTimeoutSeconds": 600}),
        );
    run_local(&common::local_options(&fixture), &common::no_shutdown())
        .await
        .expect("the run finishes");
    fixture
}

fn calls(records: &[Value]) -> u64 {
    records
        .iter()
        .map(|record| record["api_calls"].as_u64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_calls_refused_for_capacity_wait_and_are_served_at_the_flex_price() {
    let state = tempfile::tempdir().unwrap();
    let server = LlamaCppServer::start(state.path(), 2, 2).await;
    let gate = TierGate::start(&server.base_url, 3).await;
    let fixture = run_through(&gate, &server, json!({"tier": "Flex"})).await;

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 4, "{:?}", fixture.lines("failures.jsonl"));
    let counts = gate.counts();
    assert_eq!(counts.refused, 3, "refused for capacity, then asked again");
    assert_eq!(
        counts.flex as u64,
        calls(&records),
        "every call served at flex"
    );
    assert_eq!(counts.standard, 0, "no call left the flex tier");
    let (mut total, mut at_standard) = (0.0, 0.0);
    for record in &records {
        let cost = &record["cost"];
        let api_calls = record["api_calls"].as_u64().unwrap();
        assert_eq!(
            cost["tiers"]["flex"]["calls"].as_u64(),
            Some(api_calls),
            "{record}"
        );
        assert!(cost["tiers"].get("standard").is_none(), "{record}");
        let flex_price = priced(record, FLEX);
        assert!(
            (cost["total"].as_f64().unwrap() - flex_price).abs() < TOLERANCE,
            "{record}"
        );
        let standard_price = priced(record, STANDARD);
        assert!(
            (cost["at_standard"].as_f64().unwrap() - standard_price).abs() < TOLERANCE,
            "{record}"
        );
        total += flex_price;
        at_standard += standard_price;
    }
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    let cost = &statistics["cost"];
    assert_eq!(
        cost["tiers"]["flex"]["calls"].as_u64(),
        Some(calls(&records))
    );
    assert!(
        (cost["total"].as_f64().unwrap() - total).abs() < 1e-8,
        "{cost}"
    );
    assert!(
        (cost["saved"].as_f64().unwrap() - (at_standard - total)).abs() < 1e-8,
        "{cost}"
    );
    assert!(cost["saved"].as_f64().unwrap() > 0.0, "{cost}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_past_the_fallback_wait_goes_at_the_standard_tier() {
    let state = tempfile::tempdir().unwrap();
    let server = LlamaCppServer::start(state.path(), 2, 2).await;
    // No flex capacity at all.
    let gate = TierGate::start(&server.base_url, usize::MAX).await;
    let fixture = run_through(
        &gate,
        &server,
        json!({"tier": "Flex", "fallbackAfterSeconds": 2}),
    )
    .await;

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 4, "{:?}", fixture.lines("failures.jsonl"));
    let counts = gate.counts();
    assert_eq!(counts.flex, 0);
    assert_eq!(
        counts.standard as u64,
        calls(&records),
        "each call fell back once"
    );
    assert!(counts.refused as u64 >= calls(&records), "{counts:?}");
    for record in &records {
        let cost = &record["cost"];
        assert!(cost.get("tiers").is_none(), "only standard calls: {record}");
        assert!(cost.get("at_standard").is_none(), "{record}");
        assert!(
            (cost["total"].as_f64().unwrap() - priced(record, STANDARD)).abs() < TOLERANCE,
            "{record}"
        );
        // Each call waited out its fallback time first.
        let api_calls = record["api_calls"].as_u64().unwrap();
        assert!(
            record["model_time_ms"].as_u64().unwrap() >= 2000 * api_calls,
            "{record}"
        );
    }
}

fn metadata(window: &str) -> serde_json::Map<String, Value> {
    json!({"run": "tiers", "window": window})
        .as_object()
        .unwrap()
        .clone()
}

/// The Batch API, as the worker speaks it, against the test kit's batch server in front of
/// `llama-server`: lines uploaded and run, their answers read back as chat completions, a refused
/// line, and a batch found again by its metadata; each executed line counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_api_runs_lines_on_a_real_model_server_and_reads_their_answers_back() {
    let state = tempfile::tempdir().unwrap();
    let refusing = Behaviour {
        refuse_lines_containing: vec!["refused".into()],
        ..Behaviour::default()
    };
    let (server, batches, api) =
        common::batches::batch_api(state.path(), BatchProvider::OpenAI, refusing).await;
    let file = api
        .prepare(&common::batches::window_file(
            &api,
            &server.model,
            &["c-0", "c-1", "c-2", "refused-3"],
        ))
        .await
        .unwrap();
    let created = api.create(&file, &metadata("1")).await.unwrap();
    let batch = common::batches::ended(&api, &created.id).await;
    assert_eq!(batch.status, BatchStatus::Completed);
    let results = api.results(&batch).await.unwrap();
    assert_eq!(results.len(), 4);
    for result in &results {
        match (&result.outcome, result.custom_id.as_str()) {
            (LineOutcome::Answered(body), "c-0" | "c-1" | "c-2") => {
                let completion = parse_completion(body, 0, false).expect("a chat completion");
                assert!(completion.usage.completion_tokens > 0, "{completion:?}");
            }
            (LineOutcome::Refused { status: 400, .. }, "refused-3") => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let counts = batches.counts();
    assert_eq!(counts.executed, 3, "the refused line is not run");
    assert!(counts.executed_ids.values().all(|runs| *runs == 1));
    let found = api.find(&metadata("1"), created.created_at).await.unwrap();
    assert_eq!(
        found
            .iter()
            .map(|batch| batch.id.as_str())
            .collect::<Vec<_>>(),
        [created.id.as_str()]
    );
    assert!(api.find(&metadata("2"), 0).await.unwrap().is_empty());
}

/// What ends a batch otherwise: expiry with a partial output, a batch refused at validation, a
/// create answered 429 with a `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_api_reads_expired_and_refused_batches_and_a_throttled_create() {
    let state = tempfile::tempdir().unwrap();
    let expiring = Behaviour {
        expire_after_lines: Some(1),
        ..Behaviour::default()
    };
    let (server, batches, api) =
        common::batches::batch_api(state.path(), BatchProvider::OpenAI, expiring).await;
    let file = api
        .prepare(&common::batches::window_file(
            &api,
            &server.model,
            &["e-0", "e-1", "e-2"],
        ))
        .await
        .unwrap();
    let expired =
        common::batches::ended(&api, &api.create(&file, &metadata("2")).await.unwrap().id).await;
    assert_eq!(expired.status, BatchStatus::Expired);
    let results = api.results(&expired).await.unwrap();
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
    let file = api
        .prepare(&common::batches::window_file(&api, &server.model, &["f-0"]))
        .await
        .unwrap();
    let throttled = api.create(&file, &metadata("3")).await.unwrap_err();
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
    let failed =
        common::batches::ended(&api, &api.create(&file, &metadata("3")).await.unwrap().id).await;
    assert_eq!(failed.status, BatchStatus::Failed);
    assert!(failed.failure().contains("refused"), "{}", failed.failure());
    assert!(api.results(&failed).await.unwrap().is_empty());
    let counts = batches.counts();
    assert_eq!(
        (counts.executed, counts.batches, counts.throttled),
        (1, 2, 1)
    );
}

/// Four tool calls, then an answer: five turns a conversation, each reporting 1,000 prompt and
/// 100 completion tokens.
fn five_turns(body: &Value) -> Step {
    let turns = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "assistant").count()
    });
    let mut reply = if turns < 4 {
        let (name, arguments) = common::terminal("true");
        tool_calls_reply(&[(name, Value::String(arguments.to_string()))])
    } else {
        text_reply("done")
    };
    reply["usage"] = json!({"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100});
    Step::ok(reply)
}

/// Batch mode on a tool loop: 40 conversations of five turns each, every turn sent in a provider
/// batch (the test kit's batch server, its lines run on a scripted model for exact turn counts),
/// the tools run between rounds. Every record complete once, every turn paid once (counted at the
/// batch server by custom id and at the model), none live, each priced at the batch rate (half).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_loop_over_provider_batches_pays_every_turn_once_at_the_batch_price() {
    let model = ScriptedServer::start_responding(five_turns).await;
    let batches = BatchServer::start(&model.base_url(), Behaviour::default()).await;
    let fixture = common::batches::batch_run(
        &model,
        &batches,
        STANDARD,
        40,
        json!({"maxRequests": 40, "maxWaitSeconds": 1, "pollSeconds": 1, "liveTailPercent": 0}),
    )
    .await;

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 40, "{:?}", fixture.lines("failures.jsonl"));
    let ids: std::collections::BTreeSet<&str> = records
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
    assert_eq!(model.request_count(), 200, "no turn went live");
    // Each conversation's turns name it as the cache key, round after round.
    let mut keys: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for request in model.requests() {
        let key = request.body["prompt_cache_key"]
            .as_str()
            .unwrap_or_default();
        *keys.entry(key.to_owned()).or_default() += 1;
    }
    assert_eq!(
        keys.keys()
            .map(String::as_str)
            .collect::<std::collections::BTreeSet<_>>(),
        ids,
        "{keys:?}"
    );
    assert!(keys.values().all(|turns| *turns == 5), "{keys:?}");
    // Five rounds at least; windows of one round may split by age.
    assert!(
        (5..=200).contains(&counts.batches),
        "{} windows",
        counts.batches
    );
    let per_call = (1000.0 * STANDARD.0 + 100.0 * STANDARD.1) / 1e6;
    for record in &records {
        assert_eq!(record["api_calls"], 5, "{record}");
        assert_eq!(record["tool_stats"]["terminal"]["count"], 4, "{record}");
        assert_eq!(record["batch_waits_ms"].as_array().unwrap().len(), 5);
        let cost = &record["cost"];
        assert_eq!(cost["tiers"]["batch"]["calls"], 5, "{record}");
        assert!(
            (cost["total"].as_f64().unwrap() - 2.5 * per_call).abs() < TOLERANCE,
            "{cost}"
        );
        assert!((cost["at_standard"].as_f64().unwrap() - 5.0 * per_call).abs() < TOLERANCE);
    }
}

/// A batch slower than the run's deadline: every turn goes live at the standard price, and each
/// window whose turns all went live is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_waiting_past_the_deadline_go_live_and_their_windows_are_cancelled() {
    let model = ScriptedServer::start_responding(five_turns).await;
    let slow = Behaviour {
        turnaround: std::time::Duration::from_secs(30),
        ..Behaviour::default()
    };
    let batches = BatchServer::start(&model.base_url(), slow).await;
    let fixture = common::batches::batch_run(
        &model,
        &batches,
        STANDARD,
        4,
        json!({"maxWaitSeconds": 1, "pollSeconds": 1, "deadlineSeconds": 1}),
    )
    .await;

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 4, "{:?}", fixture.lines("failures.jsonl"));
    let per_call = (1000.0 * STANDARD.0 + 100.0 * STANDARD.1) / 1e6;
    for record in &records {
        let cost = &record["cost"];
        assert!(cost.get("tiers").is_none(), "every call live: {record}");
        assert!(
            (cost["total"].as_f64().unwrap() - 5.0 * per_call).abs() < TOLERANCE,
            "{cost}"
        );
    }
    // The batch server ran each window's lines too (as a provider would, before the deadline):
    // what the model served is the live calls and those.
    assert_eq!(model.request_count(), 20 + batches.counts().executed);
    let cancelled = batches
        .batches()
        .iter()
        .filter(|batch| matches!(batch["status"].as_str(), Some("cancelling" | "cancelled")))
        .count();
    assert!(cancelled >= 1, "{:?}", batches.batches());
}

/// Tasks 10 and 11 take five turns, the others two: the long ones' last turns come when every
/// other conversation has finished.
fn two_long_tasks(body: &Value) -> Step {
    let task: usize = body["messages"]
        .as_array()
        .and_then(|messages| messages.iter().find(|m| m["role"] == "user"))
        .and_then(|user| user["content"].as_str())
        .and_then(|content| content.strip_prefix("task "))
        .and_then(|number| number.parse().ok())
        .expect("a task's prompt");
    let turns = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "assistant").count()
    });
    if turns < if task >= 10 { 4 } else { 1 } {
        let (name, arguments) = common::terminal("true");
        Step::ok(tool_calls_reply(&[(
            name,
            Value::String(arguments.to_string()),
        )]))
    } else {
        Step::ok(text_reply("done"))
    }
}

/// The batch's tail goes live: twelve conversations, two of them longer; once the ten short ones
/// have finished, the two still running are within `liveTailPercent` (17 % of 12) and their last
/// three turns go live instead of waiting a batch's turnaround each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_conversations_of_a_batch_go_live() {
    let model = ScriptedServer::start_responding(two_long_tasks).await;
    let batches = BatchServer::start(&model.base_url(), Behaviour::default()).await;
    let fixture = common::batches::batch_run(
        &model,
        &batches,
        STANDARD,
        12,
        json!({"maxRequests": 12, "maxWaitSeconds": 1, "pollSeconds": 1,
               "liveTailPercent": 17}),
    )
    .await;

    let records = fixture.lines("trajectories.jsonl");
    assert_eq!(records.len(), 12, "{:?}", fixture.lines("failures.jsonl"));
    let executed = batches.counts().executed;
    // Two rounds of twelve in batches; turns of the long two that had joined a third window when
    // the tail came were pulled out of it (and may have run there too).
    assert!((24..=26).contains(&executed), "{executed}");
    assert_eq!(
        model.request_count(),
        executed + 6,
        "the long conversations' last three turns each, live"
    );
    for record in &records {
        let tiers = &record["cost"]["tiers"];
        let long = record["conversations"][1]["value"]
            .as_str()
            .is_some_and(|prompt| prompt == "task 10" || prompt == "task 11");
        let (batch, live) = if long { (2, 3) } else { (2, 0) };
        assert_eq!(tiers["batch"]["calls"], batch, "{record}");
        assert_eq!(
            tiers["standard"]["calls"].as_u64().unwrap_or(0),
            live,
            "{record}"
        );
    }
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["batch_mode"]["calls"], 24, "{statistics}");
    assert_eq!(statistics["batch_mode"]["live_calls"], 6, "{statistics}");
}

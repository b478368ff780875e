//! Service tiers on a real model server: llama.cpp's `llama-server` behind a double of a
//! provider's flex tier (`trajectory_testkit::tier_gate`, which refuses flex calls with a 429 while
//! it has no capacity and says which tier served each answer). Calls refused for capacity wait and
//! are then served at flex, priced at the flex rates, with what the standard tier would have cost
//! beside it; a run that allows a fallback sends calls refused for longer at the standard tier,
//! priced so. Each is counted at the gate and in the records.

mod common;

use common::RunFixture;
use serde_json::{Value, json};
use trajectory_testkit::llama_cpp_server::LlamaCppServer;
use trajectory_testkit::tier_gate::TierGate;
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

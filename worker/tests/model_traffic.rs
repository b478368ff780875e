//! Model traffic on real local runs against scripted model servers: every record's cost and the
//! run's totals (usages with cached tokens priced by the run's prices, and for one task a cost
//! of the provider's own, `usage.cost` as `OpenRouter` reports it), a budget that stops the run
//! and, raised, finishes it, a burst of "slow down" answers that neither fails a turn nor
//! stops the batch, and conversations spread over several endpoints, each on one, moving off
//! one that fails.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use common::{RunFixture, four_turns, local_options, no_shutdown, terminal};
use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    ScriptedServer, Step, first_user_message, text_reply, tool_calls_reply,
};
use trajectory_worker::model::routing::{Endpoints, Route};
use trajectory_worker::run::local::{render_report, run_local};

/// Every request's usage: 1,000 prompt tokens of which 400 were read from the cache, 100
/// completion tokens; for the task "reported", the provider's own cost too.
fn model(body: &Value) -> Step {
    let answered = body["messages"]
        .as_array()
        .is_some_and(|messages| messages.iter().any(|m| m["role"] == "assistant"));
    let mut reply = if answered {
        text_reply("done")
    } else {
        // "slow" outlives a short conversation budget in its command.
        let command = if first_user_message(body) == "slow" {
            "sleep 30"
        } else {
            "true"
        };
        let (name, arguments) = terminal(command);
        tool_calls_reply(&[(name, Value::String(arguments.to_string()))])
    };
    reply["usage"] = json!({"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100,
                            "prompt_tokens_details": {"cached_tokens": 400}});
    if first_user_message(body) == "reported" {
        reply["usage"]["cost"] = json!(0.25);
    }
    Step::ok(reply)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_carry_their_cost_and_the_run_its_totals() {
    let server = ScriptedServer::start_responding(model).await;
    let lines = [
        json!({"prompt": "priced"}).to_string(),
        json!({"prompt": "reported"}).to_string(),
    ];
    // USD per million tokens.
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with(
            "/model/pricing",
            json!({"input": 2.0, "cachedInput": 1.0, "output": 8.0}),
        )
        .with("/openaiFormat", json!(true));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!(server.request_count(), 4, "a tool call and an answer each");
    let records = fixture.lines("trajectories.jsonl");
    let cost_of = |task: &str| -> Value {
        records
            .iter()
            .find(|record| record["conversations"][1]["value"] == task)
            .unwrap_or_else(|| panic!("no record of {task}"))["cost"]
            .clone()
    };
    // Per call: 600 uncached tokens at $2/M, 400 cached at $1/M, 100 out at $8/M; two calls.
    let priced = cost_of("priced");
    for (kind, expected) in [
        ("input", 0.0024),
        ("cached_input", 0.0008),
        ("cache_write", 0.0),
        ("output", 0.0016),
        ("total", 0.0048),
    ] {
        let value = priced[kind].as_f64().unwrap();
        assert!(
            (value - expected).abs() < 1e-12,
            "{kind}: {value} ({priced})"
        );
    }
    assert_eq!(
        (&priced["currency"], &priced["source"]),
        (&json!("USD"), &json!("prices"))
    );
    let reported = cost_of("reported");
    assert_eq!(reported["total"], 0.5);
    assert_eq!(reported["source"], "reported");
    let usage = &records[0]["usage"];
    assert_eq!(usage["cached_tokens"], 800, "{usage}");
    assert!(usage.get("cache_write_tokens").is_none(), "none written");

    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    let cost = &statistics["cost"];
    assert_eq!(cost["total"], 0.5048, "{cost}");
    assert_eq!(cost["records_priced"], 2);
    assert_eq!(cost["per_trajectory"], 0.2524);
    assert_eq!(cost["currency"], "USD");
    assert_eq!(report.merge.cost.as_deref(), Some("0.5048"));
    // The run's claims (it has prices) count the same calls: the run spent what its records cost.
    assert_eq!(report.merge.spent.as_deref(), Some("0.5048"));
    // Per batch: its `.done` marker (and the batch pod's summary) say what its records cost.
    let marker: Value = serde_json::from_slice(
        &std::fs::read(trajectory_worker::storage::RunDir::new(fixture.out()).batch_done(0))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(marker["cost"], "0.5048", "{marker}");
    assert!(
        render_report(&report).contains("cost (USD)       0.5048"),
        "{}",
        render_report(&report)
    );
    let openai: Vec<Value> = fixture.lines("trajectories.openai.jsonl");
    let mut totals: Vec<f64> = openai
        .iter()
        .map(|record| record["cost"].as_f64().unwrap())
        .collect();
    totals.sort_by(f64::total_cmp);
    assert_eq!(totals, [0.0048, 0.5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_out_of_time_keeps_what_it_spent_and_the_totals_count_it() {
    let server = ScriptedServer::start_responding(model).await;
    let lines = [
        json!({"prompt": "priced"}).to_string(),
        json!({"prompt": "slow"}).to_string(),
    ];
    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/agent/promptTimeoutSeconds", json!(2))
        .with(
            "/model/pricing",
            json!({"input": 2.0, "cachedInput": 1.0, "output": 8.0}),
        );
    run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    let failed = fixture.lines("failures.jsonl");
    let [slow] = &failed[..] else {
        panic!("{failed:?}")
    };
    assert_eq!(slow["error_class"], "prompt_timeout");
    // Its one reply (the tool call) was paid for before the command outlived the budget.
    assert_eq!(slow["usage"]["prompt_tokens"], 1000, "{slow}");
    assert_eq!(slow["cost"]["total"], 0.0024, "{slow}");
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["cost"]["total"], 0.0072);
    assert_eq!(statistics["cost"]["records_priced"], 2);
    assert_eq!(
        statistics["cost"]["per_trajectory"], 0.0048,
        "the mean over trajectories only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_prices_records_no_cost_and_bad_prices_name_their_field() {
    let server = ScriptedServer::start_responding(model).await;
    let lines = [json!({"prompt": "priced"}).to_string()];
    let fixture = RunFixture::with_lines(&server.base_url(), &lines);
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert!(fixture.lines("trajectories.jsonl")[0].get("cost").is_none());
    assert_eq!(report.merge.cost, None);

    let fixture = RunFixture::with_lines(&server.base_url(), &lines)
        .with("/model/pricing", json!({"input": 2.0}));
    let requests = server.request_count();
    let error = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("spec.model.pricing.output: is required (USD per million tokens)"),
        "{error}"
    );
    assert_eq!(
        server.request_count(),
        requests,
        "refused before any request"
    );
}

/// Every record line written into the run's batch files so far (`batches` batches).
fn records_on_storage(out: &std::path::Path, batches: u32) -> Vec<Value> {
    let run_dir = trajectory_worker::storage::RunDir::new(out);
    (0..batches)
        .flat_map(|batch| run_dir.records_files(batch).unwrap())
        .flat_map(|file| common::parse_lines(&file.records))
        .collect()
}

/// USD each conversation of [`model`] costs at the prices below: two calls of 600 uncached
/// input tokens at $2/M, 400 cached at $1/M and 100 output at $8/M.
const CONVERSATION_COST: f64 = 0.0048;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stops_at_its_budget_and_raising_it_finishes_every_record_once() {
    const PROMPTS: usize = 20;
    const CONCURRENCY: usize = 4;
    let server = ScriptedServer::start_responding(model).await;
    let budget = 0.05;
    let fixture = RunFixture::new(&server.base_url(), PROMPTS)
        .with("/batchSize", json!(5))
        .with("/concurrency", json!(CONCURRENCY))
        .with(
            "/model/pricing",
            json!({"input": 2.0, "cachedInput": 1.0, "output": 8.0}),
        )
        .with("/model/budget", json!({"maxCost": budget}));
    let error = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect_err("the budget stops the run");
    assert_eq!(error.exit_code(), 75, "{error}");
    assert_eq!(error.reason(), "BudgetExhausted");
    let message = error.to_string();
    eprintln!("stopped: {message}");
    assert!(
        message.contains("of its budget of 0.05 USD (spec.model.budget.maxCost)"),
        "{message}"
    );
    let records = records_on_storage(&fixture.out(), 4);
    let requests = server.request_count();
    // Nothing started was cut short: two requests for each record, none for a lost conversation.
    assert_eq!(requests, 2 * records.len(), "{records:?}");
    assert!(records.len() < PROMPTS, "the budget stopped nothing");
    let spent: f64 = records
        .iter()
        .map(|record| record["cost"]["total"].as_f64().unwrap())
        .sum();
    let in_flight = CONCURRENCY as f64 * CONVERSATION_COST;
    assert!(
        spent <= budget + in_flight + 1e-9,
        "spent {spent} past the budget {budget} and what {CONCURRENCY} conversations in flight cost"
    );
    assert!(
        spent + CONVERSATION_COST > budget,
        "stopped at {spent}, with room for more"
    );

    // Raised: the same command finishes the run; what was done is not asked again.
    let fixture = fixture.with("/model/budget", json!({"maxCost": 1.0}));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the raised budget lets the run finish");
    assert_eq!(
        server.request_count(),
        2 * PROMPTS,
        "every conversation once"
    );
    assert_eq!(report.merge.trajectories, PROMPTS as u64);
    assert_eq!(
        common::keys(&fixture.lines("trajectories.jsonl")).len(),
        PROMPTS
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(fixture.out().join("statistics.json")).unwrap())
            .unwrap();
    assert_eq!(statistics["cost"]["total"], 0.096);
}

/// A server that answers the run's first requests with 429s (`Retry-After: 0`, the named test
/// double), more in a row than the batch's circuit takes before it opens on failures: being
/// throttled is not failing, so the run finishes with every conversation once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_rate_limits_neither_fails_a_turn_nor_stops_the_batch() {
    const THROTTLED: usize = 12;
    let answered = std::sync::atomic::AtomicUsize::new(0);
    let server = ScriptedServer::start_responding(move |body| {
        if answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < THROTTLED {
            Step::RetryAfterSeconds(429, 0)
        } else {
            model(body)
        }
    })
    .await;
    let fixture = RunFixture::new(&server.base_url(), 4)
        .with("/concurrency", json!(2))
        .with("/model/maxAttempts", json!(2));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("throttling is waited out, not failed on");
    assert_eq!(report.merge.trajectories, 4);
    assert_eq!(report.merge.failed, 0);
    assert_eq!(server.request_count(), THROTTLED + 4 * 2);
}

/// The model's endpoints in a run file, each server's base URL, the conversation's identity
/// sent in the body too.
fn endpoints(base_urls: &[String]) -> Value {
    let endpoints: Vec<Value> = base_urls
        .iter()
        .map(|url| json!({"baseUrl": url}))
        .collect();
    json!({"name": "scripted", "endpoints": endpoints, "maxAttempts": 6,
           "requestTimeoutSeconds": 10, "routing": {"promptCacheKey": true}})
}

/// Each server's requests by the conversation that made them (`prompt_cache_key`), with the
/// session header checked against it.
fn conversations_at(server: &ScriptedServer) -> BTreeMap<String, usize> {
    let mut conversations = BTreeMap::new();
    for request in server.requests() {
        let identity = request.body["prompt_cache_key"]
            .as_str()
            .expect("every request names its conversation")
            .to_owned();
        assert_eq!(request.session.as_deref(), Some(identity.as_str()));
        *conversations.entry(identity).or_default() += 1;
    }
    conversations
}

fn record_ids(fixture: &RunFixture) -> BTreeSet<String> {
    fixture
        .lines("trajectories.jsonl")
        .iter()
        .map(|line| line["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Every turn of a conversation goes to one of the model's three endpoints, named by the
/// record's id in a header and in `prompt_cache_key`, and the conversations are spread over all
/// three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_of_a_conversation_goes_to_one_endpoint_and_all_share_the_load() {
    let servers = [
        ScriptedServer::start_responding(four_turns).await,
        ScriptedServer::start_responding(four_turns).await,
        ScriptedServer::start_responding(four_turns).await,
    ];
    let base_urls: Vec<String> = servers.iter().map(ScriptedServer::base_url).collect();
    let fixture = RunFixture::new(&base_urls[0], 24).with("/model", endpoints(&base_urls));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .unwrap();
    assert_eq!(report.merge.trajectories, 24);
    let mut seen = BTreeSet::new();
    for (index, server) in servers.iter().enumerate() {
        let conversations = conversations_at(server);
        assert!(
            conversations.len() >= 3,
            "endpoint {index} served {} conversations",
            conversations.len()
        );
        for (identity, requests) in conversations {
            assert_eq!(requests, 4, "every turn of {identity} at endpoint {index}");
            assert!(
                seen.insert(identity.clone()),
                "{identity} went to two endpoints"
            );
        }
    }
    assert_eq!(seen, record_ids(&fixture));
}

/// One of three endpoints refuses every connection: it is taken out after its failures, and
/// the conversations it would have served finish on the others, each once, none failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conversations_of_an_endpoint_that_fails_finish_on_the_others() {
    let servers = [
        ScriptedServer::start_responding(four_turns).await,
        ScriptedServer::start_responding(four_turns).await,
    ];
    let refusing = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1", listener.local_addr().unwrap())
    };
    let base_urls = vec![
        servers[0].base_url(),
        refusing.clone(),
        servers[1].base_url(),
    ];
    let fixture = RunFixture::new(&base_urls[0], 24).with("/model", endpoints(&base_urls));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the other endpoints serve the run");
    assert_eq!(report.merge.trajectories, 24);
    assert_eq!(report.merge.failed, 0);
    let [first, second] = [conversations_at(&servers[0]), conversations_at(&servers[1])];
    for (identity, requests) in first.iter().chain(&second) {
        assert_eq!(
            *requests, 4,
            "{identity}: every turn on the endpoint it moved to"
        );
        assert!(!second.contains_key(identity) || !first.contains_key(identity));
    }
    let served: BTreeSet<String> = first.keys().chain(second.keys()).cloned().collect();
    assert_eq!(served, record_ids(&fixture));
    // The conversations whose first choice was the refusing endpoint moved.
    let unloaded = Arc::new(Endpoints::new(
        &base_urls,
        trajectory_worker::spec::RoutingStrategy::ConversationHash,
        1.25,
    ));
    let moved = served
        .iter()
        .filter(|identity| Route::new(Arc::clone(&unloaded), identity).endpoint() == 1)
        .count();
    assert!(
        moved >= 1,
        "no conversation chose the refusing endpoint first"
    );
}

/// A conversation alone on an endpoint that refuses every connection moves when its failures
/// take the endpoint out, with attempts to spare: the failure that takes it out spends none.
/// (Before, with `maxAttempts` 3, its third failure both took the endpoint out and used up the
/// turn's last attempt, and the conversation failed instead of moving.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_alone_on_a_dead_endpoint_moves_before_its_attempts_run_out() {
    let healthy = ScriptedServer::start_responding(four_turns).await;
    let refusing = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/v1", listener.local_addr().unwrap())
    };
    let base_urls = vec![refusing, healthy.base_url()];
    // One conversation at a time, so each is alone wherever it goes. Which endpoint a
    // conversation prefers follows from its id, which the spec's hash (the endpoints' random
    // ports) decides: with 24, none preferring the dead one is a chance of 2^-24 (at 12, one in
    // 4,096, it happened).
    let fixture = RunFixture::new(&base_urls[0], 24)
        .with("/concurrency", json!(1))
        .with("/workers", json!(1))
        .with("/model", endpoints(&base_urls))
        .with("/model/maxAttempts", json!(3));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(
        report.merge.failed,
        0,
        "{:?}",
        fixture.lines("failures.jsonl")
    );
    assert_eq!(report.merge.trajectories, 24);
    let requests_by_conversation = conversations_at(&healthy);
    assert!(
        requests_by_conversation
            .values()
            .all(|requests| *requests == 4),
        "{requests_by_conversation:?}"
    );
    assert_eq!(
        requests_by_conversation
            .keys()
            .cloned()
            .collect::<BTreeSet<_>>(),
        record_ids(&fixture)
    );
    let unloaded = Arc::new(Endpoints::new(
        &base_urls,
        trajectory_worker::spec::RoutingStrategy::ConversationHash,
        1.25,
    ));
    assert!(
        requests_by_conversation
            .keys()
            .any(|identity| Route::new(Arc::clone(&unloaded), identity).endpoint() == 0),
        "no conversation chose the refusing endpoint first"
    );
}

/// `spec.model.limits.requestsPerMinute` holds a local run's requests to the limit over any
/// window, letting its first burst (a twentieth of the limit) through at once and the rest at
/// 95 % of it: 24 conversations of four turns (96 requests) that would all go within a second
/// take some seven at 600 a minute, none refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_a_minute_hold_over_any_window_and_wait_instead_of_being_refused() {
    let (server, arrivals) = common::recording_four_turns().await;
    let fixture = RunFixture::new(&server.base_url(), 24)
        .with("/concurrency", json!(24))
        .with("/workers", json!(1))
        .with("/model/limits", json!({"requestsPerMinute": 600}));
    let report = run_local(&local_options(&fixture), &no_shutdown())
        .await
        .expect("the run finishes");
    assert_eq!(report.merge.trajectories, 24);
    let mut arrivals = arrivals.lock().unwrap().clone();
    arrivals.sort();
    assert_eq!(arrivals.len(), 96);
    common::assert_within_600_a_minute(&arrivals, &[1, 2, 5]);
    // 30 at once, then one every 60 s / 570.
    let interval = std::time::Duration::from_secs(60).div_f64(570.0);
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(
        spread >= interval * 60,
        "96 requests over {spread:?}: past the burst of 30 they wait their turn"
    );
}

//! Fixtures for the batch-mode tests: a client of the test kit's batch server in front of a
//! real `llama-server`, windows of short requests, and a run whose model calls go through
//! provider batches.

use serde_json::{Value, json};
use trajectory_testkit::batch_server::{BatchServer, Behaviour};
use trajectory_testkit::llama_cpp_server::LlamaCppServer;
use trajectory_testkit::scripted_server::ScriptedServer;
use trajectory_worker::model::batch_api::{
    BatchApi, BatchProvider, LineOutcome, LineResult, ProviderBatch,
};
use trajectory_worker::run::local::run_local;

use super::RunFixture;

/// Polls `id` until it ends (at most 5 minutes).
pub async fn ended(api: &BatchApi, id: &str) -> ProviderBatch {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let batch = api.retrieve(id).await.expect("the batch's status");
        if batch.status.ended() {
            return batch;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{batch:?} did not end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Of a batch's `results`, how many were answered and how many never ran because the batch
/// expired.
pub fn answered_and_expired(results: &[LineResult]) -> (usize, usize) {
    let count = |kind: fn(&LineOutcome) -> bool| {
        results
            .iter()
            .filter(|result| kind(&result.outcome))
            .count()
    };
    (
        count(|outcome| matches!(outcome, LineOutcome::Answered(_))),
        count(
            |outcome| matches!(outcome, LineOutcome::NotRun { code, .. } if code == "batch_expired"),
        ),
    )
}

/// A batch server doing `behaviour` in front of a new `llama-server`, and a client of it
/// speaking `provider`'s dialect.
pub async fn batch_api(
    state: &std::path::Path,
    provider: BatchProvider,
    behaviour: Behaviour,
) -> (LlamaCppServer, BatchServer, BatchApi) {
    let server = LlamaCppServer::start(state, 2, 2).await;
    let batches = BatchServer::start(&server.base_url, behaviour).await;
    let api = BatchApi::new(
        reqwest::Client::new(),
        &batches.base_url(),
        provider,
        Some("test-key"),
    )
    .expect("a key fit for a header");
    (server, batches, api)
}

/// The lines of one short request of `model` per id, in `api`'s dialect.
pub fn window_file(api: &BatchApi, model: &str, ids: &[&str]) -> Vec<u8> {
    ids.iter()
        .flat_map(|id| {
            let body = json!({"model": model, "max_tokens": 8, "temperature": 0.0,
                              "messages": [{"role": "user", "content": format!("Say {id}.")}]});
            api.request_line(id, &body)
                .expect("a request the dialect can ask")
        })
        .collect()
}

/// A run of `rows` conversations whose model calls go through `batches` (`spec.model.batch`
/// given by `batch`), the live path to `model`, priced at `prices` (USD per million input and
/// output tokens) with every conversation its own cache key.
pub async fn batch_run(
    model: &ScriptedServer,
    batches: &BatchServer,
    prices: (f64, f64),
    rows: usize,
    batch: Value,
) -> RunFixture {
    let lines: Vec<String> = (0..rows)
        .map(|row| json!({"prompt": format!("task {row}")}).to_string())
        .collect();
    let mut spec_batch = batch;
    spec_batch["baseUrl"] = json!(batches.base_url());
    let fixture = RunFixture::with_lines(&model.base_url(), &lines)
        .with("/batchSize", json!(rows))
        .with("/concurrency", json!(rows))
        .with("/model/batch", spec_batch)
        .with(
            "/model/pricing",
            json!({"input": prices.0, "output": prices.1}),
        )
        .with("/model/routing", json!({"promptCacheKey": true}))
        .with(
            "/agent",
            json!({"maxTurns": 6, "promptTimeoutSeconds": 600}),
        );
    run_local(&super::local_options(&fixture), &super::no_shutdown())
        .await
        .expect("the run finishes");
    fixture
}

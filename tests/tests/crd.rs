//! The `TrajectoryRun` API as the real API server enforces it: the generated `crds/` installs, a
//! valid run is accepted and defaulted, and bad or forbidden changes are refused with a message that
//! names the field. Needs a running cluster:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test crd`.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use trajectory_operator::api::{TrajectoryRun, TrajectoryRunSpec};
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};
use trajectory_worker::spec::{DistributionSpec, RunSpec};

/// A valid run with the defaults, for the tests to change one thing at a time.
fn run(name: &str) -> TrajectoryRun {
    let spec: RunSpec = serde_json::from_value(json!({
        "dataset": {"path": "datasets/coding.jsonl"},
        "model": {"baseUrl": "http://vllm.inference:8000/v1", "name": "NousResearch/Hermes-4-70B"},
    }))
    .expect("a minimal spec");
    TrajectoryRun::new(name, TrajectoryRunSpec::from(spec))
}

trait RunBuilder {
    fn with(self, change: impl FnOnce(&mut RunSpec)) -> Self;
}

impl RunBuilder for TrajectoryRun {
    fn with(mut self, change: impl FnOnce(&mut RunSpec)) -> Self {
        change(&mut self.spec.run);
        self
    }
}

async fn setup(prefix: &str) -> (TestNamespace, Api<TrajectoryRun>) {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, prefix).await;
    let runs = Api::namespaced(client, namespace.name());
    (namespace, runs)
}

/// Merge-patches the spec of the run `live`.
async fn patch(runs: &Api<TrajectoryRun>, spec: serde_json::Value) -> kube::Result<TrajectoryRun> {
    runs.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": spec })),
    )
    .await
}

/// Creates `run`, expecting a refusal, and returns the API server's message.
async fn refused(runs: &Api<TrajectoryRun>, run: &TrajectoryRun) -> String {
    match runs.create(&PostParams::default(), run).await {
        Ok(_) => panic!("the API server accepted an invalid run: {:#?}", run.spec),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn valid_run_is_accepted_and_defaulted() {
    let (_namespace, runs) = setup("crd-valid").await;
    let created = runs
        .create(&PostParams::default(), &run("coding-v1"))
        .await
        .expect("a valid run is accepted");
    let spec = &created.spec.run;
    assert_eq!(spec.batch_size, 10);
    assert_eq!(spec.workers, 4);
    assert_eq!(spec.dataset.prompt_field, "prompt");
    assert_eq!(spec.retry.per_batch, 3);
    assert_eq!(
        spec.distribution,
        DistributionSpec::Named("terminal_only".into())
    );

    let inline = run("inline").with(|spec| {
        spec.distribution = DistributionSpec::Inline(BTreeMap::from([
            ("terminal".to_owned(), 70.0),
            ("web".to_owned(), 100.0),
        ]));
    });
    runs.create(&PostParams::default(), &inline)
        .await
        .expect("an inline distribution with percents in 0..=100 is accepted");
}

#[tokio::test]
async fn bad_specs_are_refused_naming_the_field() {
    let (_namespace, runs) = setup("crd-invalid").await;

    let message = refused(&runs, &run("zero-batch").with(|spec| spec.batch_size = 0)).await;
    assert!(message.contains("spec.batchSize"), "{message}");

    let message = refused(&runs, &run("zero-workers").with(|spec| spec.workers = 0)).await;
    assert!(message.contains("spec.workers"), "{message}");

    let message = refused(
        &runs,
        &run("escape").with(|spec| spec.dataset.path = "../x".into()),
    )
    .await;
    assert!(message.contains("spec.dataset.path"), "{message}");
    assert!(message.contains(".."), "{message}");

    let message = refused(
        &runs,
        &run("absolute").with(|spec| spec.dataset.path = "/etc/passwd".into()),
    )
    .await;
    assert!(message.contains("spec.dataset.path"), "{message}");

    let message = refused(
        &runs,
        &run("ftp").with(|spec| spec.model.base_url = "ftp://m".into()),
    )
    .await;
    assert!(message.contains("model.baseUrl"), "{message}");

    // The distribution is checked by the admission policy, which the API server loads a moment
    // after it is created: retry until it refuses.
    let over = run("percent").with(|spec| {
        spec.distribution =
            DistributionSpec::Inline(BTreeMap::from([("terminal".to_owned(), 120.0)]));
    });
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let message = wait_until(
        "the admission policy to refuse a percent of 120",
        Duration::from_secs(30),
        || async {
            runs.create(&dry_run, &over)
                .await
                .err()
                .map(|e| e.to_string())
        },
    )
    .await;
    assert!(message.contains("spec.distribution"), "{message}");
    assert!(message.contains("between 0 and 100"), "{message}");
}

#[tokio::test]
async fn generating_fields_are_immutable_and_workers_is_not() {
    let (_namespace, runs) = setup("crd-immutable").await;
    runs.create(
        &PostParams::default(),
        &run("live").with(|spec| spec.seed = 42),
    )
    .await
    .expect("a valid run is accepted");

    let error = patch(&runs, json!({"seed": 43}))
        .await
        .expect_err("changing seed is refused");
    let message = error.to_string();
    assert!(message.contains("spec.seed"), "{message}");
    assert!(message.contains("immutable"), "{message}");

    let error = patch(&runs, json!({"batchSize": 20}))
        .await
        .expect_err("changing batchSize is refused");
    assert!(error.to_string().contains("spec.batchSize"), "{error}");

    let error = patch(&runs, json!({"model": {"temperature": 0.2}}))
        .await
        .expect_err("adding a temperature is refused");
    assert!(error.to_string().contains("model.temperature"), "{error}");

    let message = wait_until(
        "the admission policy to refuse a changed distribution",
        Duration::from_secs(30),
        || async {
            patch(&runs, json!({"distribution": "development"}))
                .await
                .err()
                .map(|e| e.to_string())
        },
    )
    .await;
    assert!(
        message.contains("spec.distribution is immutable"),
        "{message}"
    );

    let changed = patch(
        &runs,
        json!({"workers": 16, "suspend": true, "retry": {"perBatch": 5}}),
    )
    .await
    .expect("workers, suspend and retry can change during a run");
    assert_eq!(changed.spec.run.workers, 16);
    assert!(changed.spec.run.suspend);
    assert_eq!(changed.spec.run.seed, 42);
}

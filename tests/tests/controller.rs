//! The controller against the real control plane: a new run gets its plan `ConfigMap` and Job
//! (owned by the run), its status follows, and a plan Job that ends without the worker's summary
//! fails the run with `PlanFailed` — the Job is watched, not polled. kwok completes pods without
//! running them, so this is as far as a run gets without a real worker image.
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test controller`.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;
use tokio::sync::oneshot;
use trajectory_operator::api::{Phase, TrajectoryRun, TrajectoryRunSpec};
use trajectory_operator::controller;
use trajectory_operator::reconcile::Context;
use trajectory_operator::settings::Settings;
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};
use trajectory_worker::spec::RunSpec;

/// Stops the in-process controller when the test ends, also when it fails.
struct ControllerGuard(Option<oneshot::Sender<()>>);

impl Drop for ControllerGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.0.take() {
            let _ = stop.send(());
        }
    }
}

#[tokio::test]
async fn a_new_run_is_planned_and_a_plan_without_summary_fails_it() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "controller").await;

    let (stop, stopped) = oneshot::channel::<()>();
    let _guard = ControllerGuard(Some(stop));
    let ctx = Context::new(client.clone(), Settings::default());
    tokio::spawn(controller::run(ctx, async {
        let _ = stopped.await;
    }));

    let spec: RunSpec = serde_json::from_value(json!({
        "dataset": {"path": "datasets/coding.jsonl"},
        "model": {"baseUrl": "http://vllm:8000/v1", "name": "hermes"},
        "storage": {"volume": {"emptyDir": {}}},
    }))
    .expect("a valid spec");
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), namespace.name());
    let created = runs
        .create(
            &PostParams::default(),
            &TrajectoryRun::new("smoke", TrajectoryRunSpec::from(spec)),
        )
        .await
        .expect("create the run");
    let uid = created.metadata.uid.clone().expect("a uid");

    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace.name());
    let job = wait_until(
        "the plan Job smoke-plan",
        Duration::from_secs(30),
        || async { jobs.get_opt("smoke-plan").await.ok().flatten() },
    )
    .await;
    let owner = &job
        .metadata
        .owner_references
        .as_ref()
        .expect("owner references")[0];
    assert_eq!(
        (owner.uid.as_str(), owner.controller),
        (uid.as_str(), Some(true))
    );
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace.name());
    let plan = maps.get("smoke-plan").await.expect("the plan ConfigMap");
    assert!(plan.data.expect("data")["plan.json"].contains("\"uid\""));

    // kwok marks the plan pod Succeeded without running the worker: no summary, so the run fails.
    let failed = wait_until(
        "the run to fail with PlanFailed",
        Duration::from_secs(60),
        || async {
            let run = runs.get("smoke").await.ok()?;
            let status = run.status.clone()?;
            (status.phase == Some(Phase::Failed)).then_some(run)
        },
    )
    .await;
    let status = failed.status.expect("a status");
    assert_eq!(status.observed_generation, Some(1));
    let condition = |type_: &str| {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no {type_} condition in {:#?}", status.conditions))
    };
    assert_eq!(condition("Failed").reason, "PlanFailed");
    assert_eq!(condition("Stalled").status, "True");
    assert_eq!(condition("Progressing").status, "False");
    assert!(status.start_time.is_some() && status.completion_time.is_some());

    // Every phase change is an Event on the run.
    let events: Api<Event> = Api::namespaced(client.clone(), namespace.name());
    let reasons = wait_until(
        "Planning and Failed Events on the run",
        Duration::from_secs(30),
        || async {
            let list = events.list(&ListParams::default()).await.ok()?;
            let reasons: Vec<String> = list
                .items
                .into_iter()
                .filter(|event| {
                    event.regarding.as_ref().and_then(|r| r.uid.as_deref()) == Some(uid.as_str())
                })
                .filter_map(|event| event.reason)
                .collect();
            (reasons.iter().any(|r| r == "Planning") && reasons.iter().any(|r| r == "Failed"))
                .then_some(reasons)
        },
    )
    .await;
    assert!(!reasons.is_empty());
}

/// A controller told to stop at once, before its first list of runs arrived, still stops (within
/// its drain limit): kube-runtime alone would wait for a cache the shutdown keeps from filling.
#[tokio::test]
async fn a_controller_stopped_at_once_still_stops() {
    let client = client().await;
    install_crds(&client).await;
    let started = std::time::Instant::now();
    let ctx = Context::new(client.clone(), Settings::default());
    tokio::time::timeout(
        controller::DRAIN_LIMIT + Duration::from_secs(5),
        controller::run(ctx, std::future::ready(())),
    )
    .await
    .expect("the controller stops within its drain limit");
    eprintln!("stopped after {:?}", started.elapsed());
}

//! A run reconciled end to end on the real control plane: plan Job → generation Indexed Job →
//! merge Job → `Succeeded`, with the operator's controller in process and the real Job controller
//! computing `completedIndexes`.
//!
//! kwok would complete the run's pods without running anything, so the run's pods get a node
//! selector no node matches: they stay Pending, and the test plays the kubelet. For each pod it reads
//! what a kubelet would hand the container — the mounted plan `ConfigMap`, the completion index
//! annotation behind `JOB_COMPLETION_INDEX` — runs the worker's real step (`plan`, `batch` or
//! `merge`, from the container's args) on a temporary directory standing in for the shared volume,
//! with a scripted OpenAI-compatible server as the model, and reports the result through the pod's
//! `status` subresource: phase, exit code and the summary as the termination message. The data
//! path is the one a cluster runs: same plan, same storage directory, same summaries.
//!
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test end_to_end`.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::desired::labels;
use trajectory_tests::e2e::{
    Kubelet, Played, Scratch, children, done_batches, jsonl, model, phase_events, phase_of,
    printed_row, run_spec, start_controller, write_dataset,
};
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};
use trajectory_worker::plan::{exit, paths};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_goes_from_plan_through_an_indexed_job_and_merge_to_succeeded() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "e2e").await;
    let ns = namespace.name();
    let _controller = start_controller(&client);
    let model = model().await;
    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 10);

    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
    let created = runs
        .create(
            &PostParams::default(),
            &TrajectoryRun::new("e2e", run_spec(&model.base_url(), &json!({}))),
        )
        .await
        .expect("create the run");
    let uid = created.metadata.uid.clone().expect("a uid");

    let kubelet = Kubelet::new(&client, ns, "e2e", &scratch);
    let run = kubelet
        .serve_until("the run to succeed", Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let status = run.status.clone().expect("a status");
    assert_eq!(
        status.phase,
        Some(Phase::Succeeded),
        "status {status:#?}; played {:#?}",
        kubelet.played()
    );

    // Each stage's pods ran in its phase: Planning → Running → Merging.
    let played = kubelet.played();
    let by_mode =
        |mode: &str| -> Vec<&Played> { played.iter().filter(|p| p.mode == mode).collect() };
    let (plans, batches, merges) = (by_mode("plan"), by_mode("batch"), by_mode("merge"));
    assert_eq!((plans.len(), merges.len()), (1, 1), "{played:#?}");
    assert_eq!(plans[0].phase, Some(Phase::Planning));
    assert_eq!(merges[0].phase, Some(Phase::Merging));
    assert!(
        batches.iter().all(|p| p.phase == Some(Phase::Running)),
        "{played:#?}"
    );
    assert!(
        played.iter().all(|p| p.ran && p.exit_code == 0),
        "{played:#?}"
    );
    // Every batch ran exactly once, each on the index the Job controller gave it.
    let worked: Vec<u32> = {
        let mut ids: Vec<u32> = batches.iter().filter_map(|p| p.batch).collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(worked, [0, 1, 2, 3]);

    // Status: counts from the plan and merge summaries, batches from completedIndexes.
    assert_eq!(status.progress.as_deref(), Some("4/4"));
    let batch_counts = status.batches.as_ref().expect("batch counts");
    assert_eq!(
        (
            batch_counts.total,
            batch_counts.completed.as_str(),
            batch_counts.failed.as_str()
        ),
        (4, "0-3", "")
    );
    let prompts = status.prompts.as_ref().expect("prompt counts");
    assert_eq!(
        (prompts.total, prompts.invalid, prompts.succeeded),
        (10, 0, 10)
    );
    let output = status.output.as_ref().expect("output");
    assert_eq!(
        (output.path.as_str(), output.trajectories),
        (format!("runs/{ns}/e2e").as_str(), 10)
    );
    assert_eq!(status.attempt, Some(1));
    assert!(status.completion_time.is_some());
    let condition = |type_: &str| {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.status.as_str(), c.reason.as_str()))
    };
    assert_eq!(condition("Succeeded"), Some(("True", "Succeeded")));
    assert_eq!(condition("Ready"), Some(("True", "Succeeded")));

    // `kubectl get trun`: the printer columns as the API server renders them.
    let row = printed_row(&client, ns, "e2e").await;
    assert_eq!(row.get("Phase"), Some(&json!("Succeeded")), "{row:?}");
    assert_eq!(row.get("Progress"), Some(&json!("4/4")), "{row:?}");
    assert_eq!(row.get("Trajectories"), Some(&json!(10)), "{row:?}");

    // The data: every prompt exactly once, in dataset order, with its tool call.
    let out = scratch.storage().join(format!("runs/{ns}/e2e"));
    let lines = jsonl(&out.join("trajectories.jsonl"));
    let indexes: Vec<u64> = lines
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    assert_eq!(indexes, (0..10).collect::<Vec<u64>>());
    for (i, line) in lines.iter().enumerate() {
        let text = line.to_string();
        assert!(
            text.contains(&format!("task number {i}")),
            "line {i}: {text}"
        );
        assert!(
            text.contains("echo hi"),
            "line {i} has no tool call: {text}"
        );
    }
    assert_eq!(
        std::fs::metadata(out.join("trajectories.jsonl"))
            .expect("trajectories.jsonl")
            .len(),
        output.bytes
    );
    assert!(out.join("manifest.json").is_file() && out.join("statistics.json").is_file());
    // 10 conversations of two model calls each.
    assert_eq!(model.request_count(), 20);

    // O(1) children: one plan, one generation and one merge Job, each with its plan ConfigMap.
    let (jobs, maps) = children(&client, ns, "e2e").await;
    assert_eq!(jobs, ["e2e-gen-1", "e2e-merge", "e2e-plan"]);
    assert_eq!(maps, jobs);
    let gen_job: Api<Job> = Api::namespaced(client.clone(), ns);
    let gen_status = gen_job
        .get("e2e-gen-1")
        .await
        .expect("gen-1")
        .status
        .expect("status");
    assert_eq!(gen_status.completed_indexes.as_deref(), Some("0-3"));

    // An Event at every phase change, in order.
    let events = wait_until("the Succeeded Event", Duration::from_secs(30), || async {
        let events = phase_events(&client, ns, &uid).await;
        events.iter().any(|r| r == "Succeeded").then_some(events)
    })
    .await;
    assert_eq!(events, ["Planning", "Running", "Merging", "Succeeded"]);
}

/// A batch pod that crashes once is retried on the same index (`backoffLimitPerIndex`) and resumes;
/// a status wiped mid-run is rebuilt from the Jobs, and no batch is generated twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_batch_is_retried_and_a_wiped_status_is_rebuilt_without_redoing_batches() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "e2e-retry").await;
    let ns = namespace.name();
    let _controller = start_controller(&client);
    let model = model().await;
    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 10);

    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
    runs.create(
        &PostParams::default(),
        &TrajectoryRun::new(
            "retry",
            run_spec(
                &model.base_url(),
                &json!({"retry": {"perBatch": 2, "maxFailedBatches": 1}}),
            ),
        ),
    )
    .await
    .expect("create the run");

    let mut kubelet = Kubelet::new(&client, ns, "retry", &scratch);
    // Batch 2's first pod crashes with a transient exit code before doing anything.
    kubelet.crash = Box::new(|mode, batch, played| {
        let first = !played.iter().any(|p| p.batch == Some(2));
        (mode == "batch" && batch == Some(2) && first).then_some(exit::TRANSIENT)
    });

    // Work until two batches are done, then wipe the status.
    kubelet
        .serve_until("two batches done", Duration::from_secs(90), |run| {
            done_batches(run) >= 2
        })
        .await;
    runs.patch_status(
        "retry",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": null})),
    )
    .await
    .expect("wipe the status");

    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let status = run.status.clone().expect("a status");
    let played = kubelet.played();
    assert_eq!(
        status.phase,
        Some(Phase::Succeeded),
        "{status:#?}; played {played:#?}"
    );
    assert_eq!(status.progress.as_deref(), Some("4/4"));
    assert_eq!(status.output.as_ref().map(|o| o.trajectories), Some(10));
    // The crash counted against the index, not the run: one attempt, nothing left failed.
    assert_eq!(status.attempt, Some(1));
    assert_eq!(status.batches.as_ref().map(|b| b.failed.as_str()), Some(""));

    // Batch 2 crashed once and ran on its retry; every batch ran to completion exactly once.
    let crashed: Vec<&Played> = played.iter().filter(|p| !p.ran).collect();
    assert_eq!(crashed.len(), 1, "{played:#?}");
    assert_eq!(
        (crashed[0].batch, crashed[0].exit_code),
        (Some(2), exit::TRANSIENT)
    );
    let mut ran: Vec<u32> = played
        .iter()
        .filter(|p| p.mode == "batch" && p.ran)
        .filter_map(|p| p.batch)
        .collect();
    ran.sort_unstable();
    assert_eq!(ran, [0, 1, 2, 3], "{played:#?}");
    assert_eq!(
        model.request_count(),
        20,
        "a conversation was generated twice"
    );

    let out = scratch.storage().join(format!("runs/{ns}/retry"));
    let indexes: BTreeSet<u64> = jsonl(&out.join("trajectories.jsonl"))
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    assert_eq!(indexes, (0..10).collect());
    let (jobs, _) = children(&client, ns, "retry").await;
    assert_eq!(jobs, ["retry-gen-1", "retry-merge", "retry-plan"]);
    let gen_job: Api<Job> = Api::namespaced(client.clone(), ns);
    let gen_status = gen_job
        .get("retry-gen-1")
        .await
        .expect("gen-1")
        .status
        .expect("status");
    assert_eq!(gen_status.completed_indexes.as_deref(), Some("0-3"));
    assert_eq!(gen_status.failed, Some(1));
}

/// A run deleted mid-generation and re-created under the same name on the same storage picks up
/// where the data says it stopped: the plan's scan finds the done batches, the new run's Indexed Job
/// works only the others (its plan `ConfigMap` maps index *i* to `batches[i]`), and nothing is
/// generated twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_re_created_run_generates_only_the_batches_not_done_on_storage() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "e2e-again").await;
    let ns = namespace.name();
    let _controller = start_controller(&client);
    let model = model().await;
    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 10);

    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);
    let run = TrajectoryRun::new("again", run_spec(&model.base_url(), &json!({})));
    runs.create(&PostParams::default(), &run)
        .await
        .expect("create the run");

    // Batches 0 and 1 get done; 2 and 3 stay Pending.
    let mut kubelet = Kubelet::new(&client, ns, "again", &scratch);
    kubelet.hold = BTreeSet::from([2, 3]);
    kubelet
        .serve_until("batches 0 and 1 done", Duration::from_secs(90), |run| {
            done_batches(run) >= 2
        })
        .await;
    assert_eq!(model.request_count(), 12, "two batches of three prompts");

    // Delete the run and its children (never the data), and wait until all are gone.
    runs.delete("again", &DeleteParams::foreground())
        .await
        .expect("delete the run");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_until(
        "the run, its Jobs, ConfigMaps and pods to be gone",
        Duration::from_secs(60),
        || async {
            let run_gone = runs.get_opt("again").await.ok()?.is_none();
            let (jobs, maps) = children(&client, ns, "again").await;
            let selector = format!("{}=again", labels::RUN);
            let pods = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .ok()?;
            (run_gone && jobs.is_empty() && maps.is_empty() && pods.items.is_empty()).then_some(())
        },
    )
    .await;

    // The same run again.
    runs.create(&PostParams::default(), &run)
        .await
        .expect("re-create the run");
    kubelet.hold.clear();
    let before = kubelet.played().len();
    let finished = kubelet
        .serve_until(
            "the re-created run to finish",
            Duration::from_secs(120),
            |run| matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed)),
        )
        .await;
    let status = finished.status.clone().expect("a status");
    let played: Vec<Played> = kubelet.played().split_off(before);
    assert_eq!(
        status.phase,
        Some(Phase::Succeeded),
        "{status:#?}; played {played:#?}"
    );
    assert_eq!(status.progress.as_deref(), Some("4/4"));
    assert_eq!(
        status.batches.as_ref().map(|b| b.completed.as_str()),
        Some("0-3")
    );
    assert_eq!(status.output.as_ref().map(|o| o.trajectories), Some(10));

    // Only batches 2 and 3 ran, on indexes 0 and 1 of the new run's Indexed Job.
    let mut ran: Vec<u32> = played
        .iter()
        .filter(|p| p.mode == "batch")
        .filter_map(|p| p.batch)
        .collect();
    ran.sort_unstable();
    assert_eq!(ran, [2, 3], "{played:#?}");
    assert_eq!(
        model.request_count(),
        20,
        "a conversation was generated twice"
    );
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let gen_plan = maps.get("again-gen-1").await.expect("the gen-1 plan");
    let gen_plan: Value =
        serde_json::from_str(&gen_plan.data.expect("data")[paths::PLAN_FILE]).expect("plan JSON");
    assert_eq!(gen_plan["batches"], json!([2, 3]));
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let gen_job = jobs.get("again-gen-1").await.expect("gen-1");
    assert_eq!(gen_job.spec.and_then(|s| s.completions), Some(2));

    let out = scratch.storage().join(format!("runs/{ns}/again"));
    let indexes: Vec<u64> = jsonl(&out.join("trajectories.jsonl"))
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    assert_eq!(indexes, (0..10).collect::<Vec<u64>>());
}

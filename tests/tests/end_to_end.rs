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
//! Beyond the happy path: a crashed index retried, a wiped status rebuilt, a run re-created on its
//! storage, `workers` scaled live, `suspend`, deletion by the garbage collector, an evicted pod
//! not counted as a failure, and the operator replaced mid-run by another replica — each ending
//! with every batch generated exactly once.
//!
//! Each test's controller acts only on its own namespace, as the one operator of a cluster would.
//!
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test end_to_end`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::leader::LeaseConfig;
use trajectory_operator::reconcile::children::labels;
use trajectory_operator::service::{self, Exit};
use trajectory_operator::settings::Settings;
use trajectory_testkit::versitygw::Versitygw;
use trajectory_tests::e2e::{
    ControllerGuard, Kubelet, NO_NODE, Played, Scratch, assert_image_run,
    assert_ran_once_on_a_new_pod, assert_succeeded_once, children, condition, count_live_children,
    done_batches, job_status, jsonl, mark_done, model, phase_events, phase_of,
    plan_termination_message, pods_of_index, printed_row, random_batches, run_spec, snapshot,
    start_controller_in, write_dataset, write_image_dataset,
};
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};
use trajectory_worker::contract::{exit, paths};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_goes_from_plan_through_an_indexed_job_and_merge_to_succeeded() {
    let setup = Setup::without_controller("e2e").await;
    let (client, ns, model, scratch, runs) = (
        &setup.client,
        setup.ns(),
        &setup.model,
        &setup.scratch,
        &setup.runs,
    );
    let _controller = start_controller_in(client, ns);
    let created = runs
        .create(
            &PostParams::default(),
            &TrajectoryRun::new("e2e", run_spec(&model.base_url(), &json!({}))),
        )
        .await
        .expect("create the run");
    let uid = created.metadata.uid.clone().expect("a uid");

    let kubelet = Kubelet::new(client, ns, "e2e", scratch);
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

    assert_each_stage_ran_in_its_phase_and_each_batch_once(&kubelet.played());
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
    let condition =
        |type_: &str| condition(&status, type_).map(|c| (c.status.as_str(), c.reason.as_str()));
    assert_eq!(condition("Succeeded"), Some(("True", "Succeeded")));
    assert_eq!(condition("Ready"), Some(("True", "Succeeded")));
    // kstatus reads a finished run as Current: the latest generation observed, neither
    // Reconciling nor Stalled.
    assert_eq!(condition("Reconciling").map(|c| c.0), Some("False"));
    assert_eq!(condition("Stalled").map(|c| c.0), Some("False"));
    assert_eq!(status.observed_generation, run.metadata.generation);
    // What a user or a pipeline waits on.
    kubectl_wait(ns, "trun/e2e", "condition=Succeeded").await;

    // `kubectl get trun`: the printer columns as the API server renders them.
    let row = printed_row(client, ns, "e2e").await;
    assert_eq!(row.get("Phase"), Some(&json!("Succeeded")), "{row:?}");
    assert_eq!(row.get("Progress"), Some(&json!("4/4")), "{row:?}");
    assert_eq!(row.get("Trajectories"), Some(&json!(10)), "{row:?}");

    assert_every_prompt_is_written_once_in_order(
        &scratch.storage().join(format!("runs/{ns}/e2e")),
        output.bytes,
    );
    // The report page's place, where the merge pod wrote it.
    assert_eq!(output.report, format!("runs/{ns}/e2e/report.html"));
    let report = std::fs::read_to_string(scratch.storage().join(&output.report))
        .expect("the merge wrote the report");
    assert!(
        report.contains("\"records\":10"),
        "the report is not this run's"
    );
    // 10 conversations of two model calls each.
    assert_eq!(model.request_count(), 20);

    // O(1) children: one plan, one generation and one merge Job, each with its plan ConfigMap.
    let (jobs, maps) = children(client, ns, "e2e").await;
    assert_eq!(jobs, ["e2e-gen-1", "e2e-merge", "e2e-plan"]);
    assert_eq!(maps, jobs);
    let gen_status = job_status(client, ns, "e2e-gen-1").await;
    assert_eq!(gen_status.completed_indexes.as_deref(), Some("0-3"));

    // An Event at every phase change, in order.
    let events = wait_until("the Succeeded Event", Duration::from_secs(30), || async {
        let events = phase_events(client, ns, &uid).await;
        events.iter().any(|r| r == "Succeeded").then_some(events)
    })
    .await;
    assert_eq!(events, ["Planning", "Running", "Merging", "Succeeded"]);
}

/// Each stage's pods ran in its phase (Planning → Running → Merging), every pod ran to exit 0, and
/// every batch ran exactly once, each on the index the Job controller gave it.
fn assert_each_stage_ran_in_its_phase_and_each_batch_once(played: &[Played]) {
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
    let worked: Vec<u32> = {
        let mut ids: Vec<u32> = batches.iter().filter_map(|p| p.batch).collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(worked, [0, 1, 2, 3]);
}

/// `trajectories.jsonl` in `out` holds every prompt exactly once, in dataset order, each with its
/// tool call, in `bytes` bytes; the manifest and statistics are there.
fn assert_every_prompt_is_written_once_in_order(out: &Path, bytes: u64) {
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
        bytes
    );
    assert!(out.join("manifest.json").is_file() && out.join("statistics.json").is_file());
}

/// A batch pod that crashes once is retried on the same index (`backoffLimitPerIndex`) and resumes;
/// a status wiped mid-run is rebuilt from the Jobs, and no batch is generated twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_batch_is_retried_and_a_wiped_status_is_rebuilt_without_redoing_batches() {
    let setup = Setup::without_controller("e2e-retry").await;
    let (client, ns, model, scratch, runs) = (
        &setup.client,
        setup.ns(),
        &setup.model,
        &setup.scratch,
        &setup.runs,
    );
    let _controller = start_controller_in(client, ns);
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

    let mut kubelet = Kubelet::new(client, ns, "retry", scratch);
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
    let (jobs, _) = children(client, ns, "retry").await;
    assert_eq!(jobs, ["retry-gen-1", "retry-merge", "retry-plan"]);
    let gen_status = job_status(client, ns, "retry-gen-1").await;
    assert_eq!(gen_status.completed_indexes.as_deref(), Some("0-3"));
    assert_eq!(gen_status.failed, Some(1));
}

/// A run deleted mid-generation and re-created under the same name on the same storage picks up
/// where the data says it stopped: the plan's scan finds the done batches, the new run's Indexed Job
/// works only the others (its plan `ConfigMap` maps index *i* to `batches[i]`), and nothing is
/// generated twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_re_created_run_generates_only_the_batches_not_done_on_storage() {
    let setup = Setup::without_controller("e2e-again").await;
    let (client, ns, model, scratch, runs) = (
        &setup.client,
        setup.ns(),
        &setup.model,
        &setup.scratch,
        &setup.runs,
    );
    let _controller = start_controller_in(client, ns);
    let run = TrajectoryRun::new("again", run_spec(&model.base_url(), &json!({})));
    runs.create(&PostParams::default(), &run)
        .await
        .expect("create the run");

    // Batches 0 and 1 get done; 2 and 3 stay Pending.
    let mut kubelet = Kubelet::new(client, ns, "again", scratch);
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
            let (jobs, maps) = children(client, ns, "again").await;
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

/// Tells an operator process to stop and checks that it stopped cleanly (its Lease released).
async fn stop_replica(
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<Exit, service::ServiceError>>,
) {
    stop.send(()).expect("the replica runs");
    let exit = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the replica stops in time")
        .expect("the replica does not panic")
        .expect("the replica runs without error");
    assert_eq!(exit, Exit::Stopped);
}

/// `kubectl wait --for=FOR OBJECT` with the cluster's own kubectl; panics unless it succeeds.
async fn kubectl_wait(namespace: &str, object: &str, wait_for: &str) {
    let Some(kubectl) = std::env::var_os("TRAJ_CLUSTER_KUBECTL") else {
        panic!(
            "TRAJ_CLUSTER_KUBECTL is not set: {}",
            trajectory_tests::HOW_TO_START
        );
    };
    let output = tokio::process::Command::new(&kubectl)
        .args(["wait", "-n", namespace, object, "--timeout=10s"])
        .arg(format!("--for={wait_for}"))
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {}: {e}", kubectl.to_string_lossy()));
    assert!(
        output.status.success(),
        "kubectl wait --for={wait_for} {object}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A namespace with a controller acting on it, a scripted model, and storage with 10 prompts (4
/// batches of 3 in [`run_spec`]).
struct Setup {
    client: kube::Client,
    namespace: TestNamespace,
    model: trajectory_testkit::scripted_server::ScriptedServer,
    scratch: Scratch,
    runs: Api<TrajectoryRun>,
}

impl Setup {
    /// Everything but the controller, which the test starts (or several, one after the other).
    async fn without_controller(prefix: &str) -> Self {
        let client = client().await;
        install_crds(&client).await;
        let namespace = TestNamespace::create(&client, prefix).await;
        let runs = Api::namespaced(client.clone(), namespace.name());
        let scratch = Scratch::new();
        write_dataset(&scratch.storage(), 10);
        Self {
            client,
            namespace,
            model: model().await,
            scratch,
            runs,
        }
    }

    /// A controller acting on the namespace, the run `name` created with `extra` in its spec, and
    /// a kubelet for its pods.
    async fn with_run(prefix: &str, name: &str, extra: &Value) -> (Self, ControllerGuard, Kubelet) {
        let setup = Self::without_controller(prefix).await;
        let controller = start_controller_in(&setup.client, setup.ns());
        setup.create(name, extra).await;
        let kubelet = Kubelet::new(&setup.client, setup.ns(), name, &setup.scratch);
        (setup, controller, kubelet)
    }

    fn ns(&self) -> &str {
        self.namespace.name()
    }

    async fn create(&self, name: &str, extra: &Value) {
        self.runs
            .create(
                &PostParams::default(),
                &TrajectoryRun::new(name, run_spec(&self.model.base_url(), extra)),
            )
            .await
            .unwrap_or_else(|e| panic!("create the run {name}: {e}"));
    }

    async fn patch_spec(&self, name: &str, spec: &Value) {
        self.runs
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": spec })),
            )
            .await
            .unwrap_or_else(|e| panic!("patch the spec of {name} with {spec}: {e}"));
    }

    fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.client.clone(), self.ns())
    }

    /// Checks a finished run: every prompt once ([`assert_succeeded_once`]).
    fn assert_succeeded_once(&self, run: &TrajectoryRun, kubelet: &Kubelet) {
        assert_succeeded_once(run, kubelet, self.model.request_count(), "");
    }
}

fn finished(run: &TrajectoryRun) -> bool {
    matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
}

fn condition_status(run: &TrajectoryRun, type_: &str) -> Option<String> {
    condition(run.status.as_ref()?, type_).map(|c| c.status.clone())
}

/// `spec.workers` changed on a running run reaches the live Indexed Job's `parallelism`, and the
/// real Job controller runs that many pods at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scaling_workers_changes_the_live_jobs_parallelism() {
    let (setup, _controller, mut kubelet) =
        Setup::with_run("e2e-scale", "scale", &json!({"workers": 1})).await;
    kubelet.hold = BTreeSet::from([0, 1, 2, 3]);
    let jobs = setup.jobs();
    let parallelism = |want: i32| {
        let jobs = jobs.clone();
        async move {
            let job = jobs.get_opt("scale-gen-1").await.ok().flatten()?;
            let have = job.spec.as_ref()?.parallelism?;
            let active = job.status.as_ref()?.active.unwrap_or(0);
            (have == want && active == want).then_some(())
        }
    };
    kubelet
        .serve_until("the Indexed Job", Duration::from_secs(60), |run| {
            phase_of(run) == Some(Phase::Running)
        })
        .await;
    wait_until("one pod at a time", Duration::from_secs(30), || {
        parallelism(1)
    })
    .await;

    setup.patch_spec("scale", &json!({"workers": 3})).await;
    wait_until(
        "parallelism 3 and three pods at once",
        Duration::from_secs(30),
        || parallelism(3),
    )
    .await;
    let run = setup.runs.get("scale").await.expect("the run");
    assert_eq!(
        run.status.as_ref().and_then(|s| s.observed_generation),
        run.metadata.generation,
        "the new generation is observed"
    );

    kubelet.hold.clear();
    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(120), finished)
        .await;
    setup.assert_succeeded_once(&run, &kubelet);
    let (jobs, _) = children(&setup.client, setup.ns(), "scale").await;
    assert_eq!(
        jobs,
        ["scale-gen-1", "scale-merge", "scale-plan"],
        "one Job per stage"
    );
}

/// `spec.suspend` suspends the live Job — its pods are stopped, finished batches stay finished,
/// the run says `Suspended` — and clearing it resumes the Job, which works only what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_suspended_run_stops_its_pods_and_resumes_where_it_stopped() {
    let (setup, _controller, mut kubelet) =
        Setup::with_run("e2e-suspend", "pause", &json!({})).await;
    kubelet.hold = BTreeSet::from([3]);
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
    kubelet
        .serve_until("three batches done", Duration::from_secs(90), |run| {
            done_batches(run) >= 3
        })
        .await;
    let held = wait_until("the pod of batch 3", Duration::from_secs(30), || async {
        pods_of_index(&pods, "pause-gen-1", 3)
            .await
            .into_iter()
            .next()
    })
    .await
    .metadata
    .name
    .expect("a pod name");

    setup.patch_spec("pause", &json!({"suspend": true})).await;
    let jobs = setup.jobs();
    let suspended = kubelet
        .serve_until(
            "the run and its Job suspended, no pod left",
            Duration::from_secs(60),
            |run| condition_status(run, "Suspended").as_deref() == Some("True"),
        )
        .await;
    assert_eq!(
        phase_of(&suspended),
        Some(Phase::Running),
        "the phase names stay"
    );
    assert_eq!(
        condition_status(&suspended, "Progressing").as_deref(),
        Some("False")
    );
    wait_until(
        "the Job suspended with no pod left",
        Duration::from_secs(60),
        || async {
            kubelet.play_pending().await;
            let job = jobs.get("pause-gen-1").await.ok()?;
            let suspended = job.spec.as_ref()?.suspend == Some(true)
                && job
                    .status
                    .as_ref()?
                    .conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Suspended" && c.status == "True");
            let left = pods_of_index(&pods, "pause-gen-1", 3).await;
            (suspended && left.is_empty()).then_some(())
        },
    )
    .await;

    setup.patch_spec("pause", &json!({"suspend": false})).await;
    kubelet.hold.clear();
    let run = kubelet
        .serve_until(
            "the resumed run to finish",
            Duration::from_secs(120),
            finished,
        )
        .await;
    setup.assert_succeeded_once(&run, &kubelet);
    assert_ran_once_on_a_new_pod(&kubelet, 3, &held);
    assert_eq!(
        condition_status(&run, "Suspended").as_deref(),
        Some("False")
    );
    assert_eq!(
        run.status.as_ref().and_then(|s| s.attempt),
        Some(1),
        "the same Job resumed"
    );
}

/// Deleting a run deletes its Jobs, `ConfigMaps` and pods through owner references (the garbage
/// collector, not the operator) and leaves every byte on the storage as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_run_leaves_no_children_and_its_data_untouched() {
    let (setup, _controller, mut kubelet) = Setup::with_run("e2e-delete", "gone", &json!({})).await;
    kubelet.hold = BTreeSet::from([2, 3]);
    kubelet
        .serve_until("two batches done", Duration::from_secs(90), |run| {
            done_batches(run) >= 2
        })
        .await;
    let (jobs, maps) = children(&setup.client, setup.ns(), "gone").await;
    assert_eq!(jobs, ["gone-gen-1", "gone-plan"]);
    assert_eq!(maps, jobs);
    let before = snapshot(&setup.scratch.storage());
    assert!(
        before
            .keys()
            .any(|path| path.ends_with("batches/batch-000001.done")),
        "{:?}",
        before.keys()
    );

    // The default propagation of a custom resource: background, by the garbage collector.
    setup
        .runs
        .delete("gone", &DeleteParams::default())
        .await
        .expect("delete the run");
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
    let selector = format!("{}=gone", labels::RUN);
    wait_until(
        "the run's Jobs, ConfigMaps and pods to be gone",
        Duration::from_secs(60),
        || async {
            // Deleted pods are stopped, as a kubelet would.
            kubelet.play_pending().await;
            let (jobs, maps) = children(&setup.client, setup.ns(), "gone").await;
            let pods = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .ok()?;
            (jobs.is_empty() && maps.is_empty() && pods.items.is_empty()).then_some(())
        },
    )
    .await;
    assert!(setup.runs.get_opt("gone").await.expect("get").is_none());
    assert_eq!(
        snapshot(&setup.scratch.storage()),
        before,
        "the storage changed"
    );
}

/// The children's owner references block their owner's deletion (as the built-in controllers'
/// do), and the operator leaves a run being deleted alone: a foreground deletion ends once the
/// garbage collector has removed the run's Jobs and `ConfigMaps`, so a run re-created under the
/// same name never meets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreground_deletion_of_a_run_ends_after_its_children_are_gone() {
    let (setup, _controller, mut kubelet) =
        Setup::with_run("e2e-foreground", "fg", &json!({})).await;
    kubelet.hold = BTreeSet::from([2, 3]);
    kubelet
        .serve_until("two batches done", Duration::from_secs(90), |run| {
            done_batches(run) >= 2
        })
        .await;
    setup
        .runs
        .delete("fg", &DeleteParams::foreground())
        .await
        .expect("delete the run");
    // Until the run is gone: whether it was seen waiting for its Jobs.
    let mut saw_run_waiting = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while setup
        .runs
        .get_opt("fg")
        .await
        .expect("get the run")
        .is_some()
    {
        let (jobs, _) = children(&setup.client, setup.ns(), "fg").await;
        saw_run_waiting |= !jobs.is_empty();
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run still exists after 60 s; its Jobs: {jobs:?}"
        );
        // Deleted pods are stopped, as a kubelet would.
        kubelet.play_pending().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(saw_run_waiting, "the run never waited for its Jobs");
    assert_eq!(
        children(&setup.client, setup.ns(), "fg").await,
        (Vec::new(), Vec::new()),
        "the run was gone before its children"
    );
}

/// The plan's and the merge's summaries are read from their pods' termination messages, and a
/// finished pod goes with its node (an autoscaler scaling the node down hours into a run, the pod
/// garbage collector removing it). Once the status recorded them, the run goes on without the plan
/// pod, and a succeeded run keeps its counts without the merge pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_goes_on_and_keeps_its_counts_when_its_finished_pods_are_gone() {
    let (setup, _controller, mut kubelet) =
        Setup::with_run("e2e-gone-pods", "nodes", &json!({})).await;
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
    let remove_pods_of = |job: &'static str| {
        let pods = pods.clone();
        async move {
            let selector = format!("batch.kubernetes.io/job-name={job}");
            let removed = pods
                .delete_collection(
                    &DeleteParams {
                        grace_period_seconds: Some(0),
                        ..DeleteParams::default()
                    },
                    &ListParams::default().labels(&selector),
                )
                .await
                .unwrap_or_else(|e| panic!("delete the pods of {job}: {e}"));
            let removed = removed
                .left()
                .map(|list| list.items.len())
                .unwrap_or_default();
            assert!(removed >= 1, "no pod of {job} to delete");
            wait_until("the pods to be gone", Duration::from_secs(30), || async {
                let left = pods
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .ok()?;
                left.items.is_empty().then_some(())
            })
            .await;
        }
    };

    kubelet.hold = BTreeSet::from([2, 3]);
    kubelet
        .serve_until("two batches done", Duration::from_secs(90), |run| {
            done_batches(run) >= 2
        })
        .await;
    remove_pods_of("nodes-plan").await;
    kubelet.hold.clear();
    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(120), finished)
        .await;
    let status = run.status.expect("a status");
    assert_eq!(status.phase, Some(Phase::Succeeded), "{status:#?}");
    assert_eq!(status.progress.as_deref(), Some("4/4"));
    assert_eq!(status.prompts.as_ref().map(|p| p.total), Some(10));
    assert_eq!(status.output.as_ref().map(|o| o.trajectories), Some(10));

    // Without the merge pod either, a reconcile (here: a label on the run) changes nothing.
    remove_pods_of("nodes-merge").await;
    setup
        .runs
        .patch(
            "nodes",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .expect("label the run");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = setup.runs.get("nodes").await.expect("get the run");
    let labels = later.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("touched").map(String::as_str), Some("yes"));
    assert_eq!(later.status.as_ref(), Some(&status));
}

/// A pod evicted (the control plane marks it `DisruptionTarget`, as for preemption, a drained or
/// lost node) is not a failure: with no retry allowed per batch and no failed batch allowed, the
/// Job still replaces the pod on the same index and the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicted_pod_is_replaced_without_counting_as_a_failure() {
    let (setup, _controller, mut kubelet) = Setup::with_run(
        "e2e-evict",
        "evict",
        &json!({"retry": {"perBatch": 0, "maxFailedBatches": 0}}),
    )
    .await;
    kubelet.hold = BTreeSet::from([1]);
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), setup.ns());
    kubelet
        .serve_until("the Indexed Job", Duration::from_secs(60), |run| {
            phase_of(run) == Some(Phase::Running)
        })
        .await;
    let first = wait_until("the pod of batch 1", Duration::from_secs(30), || async {
        pods_of_index(&pods, "evict-gen-1", 1)
            .await
            .into_iter()
            .next()
    })
    .await;
    let evicted = first.metadata.name.clone().expect("a pod name");
    pods.evict(&evicted, &EvictParams::default())
        .await
        .expect("evict the pod of batch 1");
    let disrupted = pods
        .get(&evicted)
        .await
        .expect("the evicted pod, kept by the Job's finalizer");
    let reason = disrupted
        .status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget")
        .map(|c| (c.status, c.reason));
    assert_eq!(
        reason,
        Some(("True".to_owned(), Some("EvictionByEvictionAPI".to_owned())))
    );

    // The kubelet stops the evicted pod; the Job controller replaces it on the same index.
    let replacement = wait_until(
        "a replacement pod for batch 1",
        Duration::from_secs(60),
        || async {
            kubelet.play_pending().await;
            pods_of_index(&pods, "evict-gen-1", 1)
                .await
                .into_iter()
                .find(|pod| pod.metadata.name.as_deref() != Some(evicted.as_str()))
        },
    )
    .await;
    assert_eq!(kubelet.stopped(), std::slice::from_ref(&evicted));
    kubelet.hold.clear();
    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(120), finished)
        .await;
    setup.assert_succeeded_once(&run, &kubelet);
    let ran_on: Vec<String> = kubelet
        .played()
        .iter()
        .filter(|p| p.batch == Some(1))
        .map(|p| p.pod.clone())
        .collect();
    assert_eq!(ran_on, [replacement.metadata.name.clone().expect("a name")]);
    let job = setup.jobs().get("evict-gen-1").await.expect("gen-1");
    let status = job.status.expect("a Job status");
    assert_eq!(status.failed_indexes.as_deref(), Some(""), "{status:#?}");
    assert_eq!(status.completed_indexes.as_deref(), Some("0-3"));
    assert_eq!(run.status.as_ref().and_then(|s| s.attempt), Some(1));
}

/// The operator replaced mid-run: replica A leads (leader election on a Lease), works the run
/// half-way and stops; replica B, standing by, takes the Lease and finishes the run from what the
/// Jobs and the storage say — every batch generated once, one Event per phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_replica_finishes_a_run_after_the_leader_stops_mid_run() {
    let setup = Setup::without_controller("e2e-restart").await;
    let ns = setup.ns().to_owned();
    let lease = |identity: &str| LeaseConfig {
        name: "trajectory-operator".into(),
        namespace: ns.clone(),
        identity: identity.into(),
        duration: Duration::from_secs(6),
        grace: Duration::from_secs(2),
    };
    let replica = |identity: &str| {
        let (stop, stopped) = oneshot::channel::<()>();
        let client = setup.client.clone();
        let settings = Settings {
            watch_namespace: Some(ns.clone()),
            ..Settings::default()
        };
        let lease = lease(identity);
        let task = tokio::spawn(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
            service::run(client, settings, listener, Some(lease), async {
                let _ = stopped.await;
            })
            .await
        });
        (stop, task)
    };
    let leases: Api<Lease> = Api::namespaced(setup.client.clone(), &ns);
    let holder = || async {
        leases
            .get_opt("trajectory-operator")
            .await
            .ok()
            .flatten()
            .and_then(|lease| lease.spec?.holder_identity)
    };

    let (stop_a, a) = replica("replica-a");
    wait_until("replica A to lead", Duration::from_secs(30), || async {
        (holder().await.as_deref() == Some("replica-a")).then_some(())
    })
    .await;
    let (stop_b, b) = replica("replica-b");

    setup.create("relay", &json!({})).await;
    let created = setup.runs.get("relay").await.expect("the run");
    let mut kubelet = Kubelet::new(&setup.client, &ns, "relay", &setup.scratch);
    kubelet.hold = BTreeSet::from([2, 3]);
    kubelet
        .serve_until(
            "two batches done under replica A",
            Duration::from_secs(90),
            |run| done_batches(run) >= 2,
        )
        .await;
    assert_eq!(holder().await.as_deref(), Some("replica-a"));

    stop_replica(stop_a, a).await;
    // Batches go on while no operator runs: the Job controller does not need one.
    kubelet.hold.clear();
    let run = kubelet
        .serve_until(
            "replica B to finish the run",
            Duration::from_secs(120),
            finished,
        )
        .await;
    assert_eq!(holder().await.as_deref(), Some("replica-b"));
    setup.assert_succeeded_once(&run, &kubelet);
    assert_eq!(run.status.as_ref().and_then(|s| s.attempt), Some(1));
    let (jobs, _) = children(&setup.client, &ns, "relay").await;
    assert_eq!(jobs, ["relay-gen-1", "relay-merge", "relay-plan"]);
    let uid = created.metadata.uid.expect("a uid");
    let events = wait_until("the Succeeded Event", Duration::from_secs(30), || async {
        let events = phase_events(&setup.client, &ns, &uid).await;
        events.iter().any(|r| r == "Succeeded").then_some(events)
    })
    .await;
    assert_eq!(events, ["Planning", "Running", "Merging", "Succeeded"]);

    stop_replica(stop_b, b).await;
}

/// A run whose Job the API server refuses (a toleration it cannot accept) is stalled — `Failed`
/// and `Stalled` with the API server's message naming the field, one Warning Event — and waits for
/// a change instead of retrying; fixing the spec starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_whose_job_is_refused_stalls_until_its_spec_is_fixed() {
    let node_selector = json!({NO_NODE.0: NO_NODE.1});
    let (setup, _controller, _kubelet) = Setup::with_run(
        "e2e-refused",
        "refused",
        &json!({"podTemplate": {
            "nodeSelector": node_selector,
            "tolerations": [{"key": "spot", "operator": "Sometimes"}],
        }}),
    )
    .await;
    let uid = setup
        .runs
        .get("refused")
        .await
        .expect("the run")
        .metadata
        .uid
        .expect("a uid");
    let stalled = wait_until("the run to stall", Duration::from_secs(30), || async {
        let run = setup.runs.get("refused").await.ok()?;
        (condition_status(&run, "Stalled").as_deref() == Some("True")).then_some(run)
    })
    .await;
    let status = stalled.status.clone().expect("a status");
    assert_eq!(status.phase, Some(Phase::Failed));
    let failed = condition(&status, "Failed").expect("a Failed condition");
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "InvalidSpec")
    );
    assert!(
        failed.message.contains("refused-plan")
            && failed
                .message
                .contains("spec.template.spec.tolerations[0].operator"),
        "{}",
        failed.message
    );
    assert_eq!(
        condition_status(&stalled, "Reconciling").as_deref(),
        Some("False")
    );
    // It waits: no Job, and the status is not rewritten while nothing changes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = setup.runs.get("refused").await.expect("the run");
    assert_eq!(
        later.metadata.resource_version,
        stalled.metadata.resource_version
    );
    let (jobs, _) = children(&setup.client, setup.ns(), "refused").await;
    assert!(jobs.is_empty(), "{jobs:?}");
    assert_eq!(
        phase_events(&setup.client, setup.ns(), &uid).await,
        ["Failed"]
    );

    setup
        .patch_spec("refused", &json!({"podTemplate": {"tolerations": null}}))
        .await;
    let fixed = wait_until("the fixed run to plan", Duration::from_secs(30), || async {
        let run = setup.runs.get("refused").await.ok()?;
        (phase_of(&run) == Some(Phase::Planning)).then_some(run)
    })
    .await;
    assert_eq!(condition_status(&fixed, "Failed").as_deref(), Some("False"));
    assert_eq!(
        condition_status(&fixed, "Stalled").as_deref(),
        Some("False")
    );
    assert_eq!(
        fixed.status.as_ref().and_then(|s| s.observed_generation),
        Some(2)
    );
    let (jobs, _) = children(&setup.client, setup.ns(), "refused").await;
    assert_eq!(jobs, ["refused-plan"]);
}

/// A run of a million batches (one prompt each) is planned, sharded over ten Indexed Jobs of
/// 100,000 completions (the most Kubernetes accepts with `backoffLimitPerIndex`) and dispatched:
/// `workers` pods in all over the shards, each shard's plan `ConfigMap` a few hundred bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_of_a_million_batches_is_planned_sharded_and_dispatched() {
    const BATCHES: u32 = 1_000_000;
    let setup = Setup::without_controller("e2e-million").await;
    write_dataset(
        &setup.scratch.storage(),
        usize::try_from(BATCHES).expect("a count"),
    );
    let (client, ns) = (&setup.client, setup.ns());
    let _controller = start_controller_in(client, ns);
    setup
        .create("million", &json!({"batchSize": 1, "workers": 12}))
        .await;
    // Only the plan pod is played: the batch pods are to be counted, not run.
    let kubelet = Kubelet::new(client, ns, "million", &setup.scratch);
    let shards = generation_jobs_after_the_plan(&kubelet, client, ns, 10).await;
    let selector = format!("{}=million,{}=generate", labels::RUN, labels::COMPONENT);
    let mut shape: Vec<(String, Option<i32>, Option<i32>)> = shards
        .iter()
        .map(|job| {
            let spec = job.spec.as_ref().expect("a Job spec");
            (
                job.metadata.name.clone().unwrap_or_default(),
                spec.completions,
                spec.parallelism,
            )
        })
        .collect();
    shape.sort();
    let expected: Vec<(String, Option<i32>, Option<i32>)> = (0..10)
        .map(|shard| {
            let name = if shard == 0 {
                "million-gen-1".to_owned()
            } else {
                format!("million-gen-1-{shard}")
            };
            // 12 workers over ten Jobs: the first two get two.
            (name, Some(100_000), Some(if shard < 2 { 2 } else { 1 }))
        })
        .collect();
    assert_eq!(shape, expected);

    assert_shard_plans_are_small(&Api::namespaced(client.clone(), ns), &shards).await;

    // Dispatched: the Job controller starts the run's 12 pods over the shards.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_until("12 active batch pods", Duration::from_secs(60), || async {
        let list = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .ok()?;
        let active = list
            .items
            .iter()
            .filter(|pod| {
                matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Pending" | "Running")
                )
            })
            .count();
        (active == 12).then_some(())
    })
    .await;
    let run = setup.runs.get("million").await.expect("the run");
    let status = run.status.expect("a status");
    assert_eq!(status.phase, Some(Phase::Running));
    assert_eq!(status.progress.as_deref(), Some("0/1000000"));
    assert_eq!(status.attempt, Some(1));
}

/// Plays the run's plan pod, then waits for its `count` generation Jobs (printing how long after
/// the plan they all were there).
async fn generation_jobs_after_the_plan(
    kubelet: &Kubelet,
    client: &kube::Client,
    ns: &str,
    count: usize,
) -> Vec<Job> {
    assert!(kubelet.play_the_plan().await, "the plan pod was played");
    let planned = std::time::Instant::now();
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let selector = format!(
        "{}={},{}=generate",
        labels::RUN,
        kubelet.run,
        labels::COMPONENT
    );
    let shards = wait_until("the generation Jobs", Duration::from_secs(120), || async {
        let list = jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .ok()?;
        (list.items.len() == count).then_some(list.items)
    })
    .await;
    eprintln!(
        "{count} generation Jobs {} ms after the plan finished",
        planned.elapsed().as_millis()
    );
    shards
}

/// The plan `ConfigMap` of a generation Job, checked to be under 4 KiB.
async fn small_shard_plan(
    maps: &Api<ConfigMap>,
    job: &Job,
) -> trajectory_worker::contract::RunPlan {
    let name = job.metadata.name.clone().unwrap_or_default();
    let map = maps.get(&name).await.expect("the shard's plan ConfigMap");
    let text = &map.data.as_ref().expect("data")[paths::PLAN_FILE];
    eprintln!("{name}: plan ConfigMap {} bytes", text.len());
    assert!(text.len() < 4096, "{name}: {} bytes", text.len());
    serde_json::from_str(text).expect("a run plan")
}

/// A Pending pod of the Job `job`, once there is one.
async fn a_pending_pod(pods: &Api<Pod>, job: &str) -> Pod {
    let selector = format!("batch.kubernetes.io/job-name={job}");
    wait_until(
        "a pending pod of the Job",
        Duration::from_secs(60),
        || async {
            pods.list(&ListParams::default().labels(&selector))
                .await
                .ok()?
                .items
                .into_iter()
                .find(|pod| pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending"))
        },
    )
    .await
}

/// Every shard's plan `ConfigMap` is small: the first shard is the identity (its Job's completions
/// bound it), the others name their 100,000 batches as ranges.
async fn assert_shard_plans_are_small(maps: &Api<ConfigMap>, shards: &[Job]) {
    for job in shards {
        let name = job.metadata.name.clone().unwrap_or_default();
        let plan = small_shard_plan(maps, job).await;
        let first = plan.batch_for_index(0).expect("a first batch");
        assert_eq!(first % 100_000, 0, "{name}");
        assert_eq!(plan.batch_for_index(99_999), Some(first + 99_999), "{name}");
        if first == 0 {
            // The first shard is the identity, bounded by its Job's completions.
            assert_eq!(plan.batch_ranges, None, "{name}");
        } else {
            assert_eq!(plan.batch_for_index(100_000), None, "{name}");
        }
    }
}

/// A model server that refuses the key stops the first batch pod with exit code 78; the Job's pod
/// failure policy fails the Job at once, and the run fails with the worker's own reason,
/// `ModelUnauthorized`, without spending the rest of the dataset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_model_that_refuses_the_key_fails_the_run_as_model_unauthorized() {
    let setup = Setup::without_controller("e2e-401").await;
    let (client, ns) = (&setup.client, setup.ns());
    let refusing = trajectory_testkit::scripted_server::ScriptedServer::start_with_default(
        [],
        trajectory_testkit::scripted_server::Step::error(401, "invalid_api_key", "bad key"),
    )
    .await;
    let _controller = start_controller_in(client, ns);
    setup
        .runs
        .create(
            &PostParams::default(),
            &TrajectoryRun::new("refused", run_spec(&refusing.base_url(), &json!({}))),
        )
        .await
        .expect("create the run");
    let kubelet = Kubelet::new(client, ns, "refused", &setup.scratch);
    let run = kubelet
        .serve_until("the run to fail", Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let status = run.status.expect("a status");
    let failed = condition(&status, "Failed").expect("a Failed condition");
    assert_eq!(
        (failed.status.as_str(), failed.reason.as_str()),
        ("True", "ModelUnauthorized"),
        "{failed:?}"
    );
    assert!(
        failed.message.contains("HTTP 401"),
        "the worker's words: {}",
        failed.message
    );
    // Two pods at once, two conversations each, one request per conversation before the stop:
    // the other batches' prompts were never sent.
    let batch_pods = kubelet
        .played()
        .iter()
        .filter(|p| p.mode == "batch")
        .count();
    assert!(
        refusing.request_count() <= 4 && batch_pods <= 2,
        "{} requests from {batch_pods} batch pods",
        refusing.request_count()
    );
}

/// A run re-created over storage where every other batch is already done: the plan's summary of
/// 200 scattered ranges does not fit the 4 KiB termination message, so it lists the first ones
/// (`doneTruncated`); the pods of the other done batches find them done and end at once, and the
/// run succeeds with every prompt exactly once and no conversation generated twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_over_scattered_done_batches_redoes_none_of_them() {
    const BATCHES: u32 = 400;
    let setup = Setup::without_controller("e2e-scattered").await;
    let (client, ns, model, scratch) = (&setup.client, setup.ns(), &setup.model, &setup.scratch);
    write_dataset(&scratch.storage(), 400);
    let extra = json!({"batchSize": 1, "workers": 8, "concurrency": 1});
    let spec = run_spec(&model.base_url(), &extra);

    // An earlier run on the same storage finished the even batches.
    let kubelet = Kubelet::new(client, ns, "scattered", scratch);
    let (plan_path, workspace) = kubelet.plan_an_earlier_run(ns, &spec.run).await;
    for batch in (0..BATCHES).step_by(2) {
        let (code, message) = kubelet
            .run_worker("batch", &plan_path, Some(batch), &workspace)
            .await;
        assert_eq!(code, 0, "batch {batch}: {message}");
    }
    let earlier = model.request_count();
    assert_eq!(earlier, 200 * 2, "200 conversations of two calls");

    let _controller = start_controller_in(client, ns);
    setup.create("scattered", &extra).await;
    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(240), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let status = run.status.expect("a status");
    assert_eq!(status.phase, Some(Phase::Succeeded), "{status:#?}");
    assert_eq!(status.progress.as_deref(), Some("400/400"));
    assert_eq!(
        model.request_count() - earlier,
        200 * 2,
        "only the odd batches' conversations were generated"
    );

    // The plan's summary fitted by cutting its done ranges short.
    let message = plan_termination_message(client, ns, "scattered")
        .await
        .expect("the plan's termination message");
    assert!(message.len() <= 4096, "{} bytes", message.len());
    let summary: trajectory_worker::contract::PlanSummary =
        serde_json::from_str(&message).expect("a plan summary");
    assert!(summary.done_truncated, "{message}");
    assert!(summary.done.len() < 200, "{} ranges", summary.done.len());
    // The whole count, and the list of the 200 batches not done, on storage.
    assert_eq!(summary.done_count, 200, "{message}");
    let list = summary.pending_list.expect("a pending list");

    let out = scratch.storage().join(format!("runs/{ns}/scattered"));
    let pending = std::fs::read_to_string(out.join(&list)).expect("the pending list");
    assert_eq!(
        trajectory_worker::contract::parse_ranges(&pending).expect("ranges"),
        (1..BATCHES).step_by(2).collect::<Vec<u32>>()
    );
    let mut indexes: Vec<u64> = jsonl(&out.join("trajectories.jsonl"))
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    indexes.dedup();
    assert_eq!(indexes, (0..400).collect::<Vec<u64>>());
}

/// A batch marked done that lost a record (storage that dropped a write, a file edited by hand)
/// is found by the merge, which clears the batch's marker and fails with `IncompleteBatch`; the
/// run then makes a second round: a plan that finds just that batch pending, one attempt that
/// regenerates just the lost conversation, and a merge that finds everything. `Succeeded` means
/// complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_found_incomplete_by_the_merge_is_generated_again_in_a_second_round() {
    let (setup, _controller, mut kubelet) =
        Setup::with_run("e2e-rounds", "rounds", &json!({})).await;
    let (client, ns, model) = (&setup.client, setup.ns(), &setup.model);
    let run_dir = setup.scratch.storage().join(format!("runs/{ns}/rounds"));
    // Just before the first merge runs, prompt 4's record (batch 1 holds prompts 3 to 5) goes.
    kubelet.crash = Box::new(move |mode, _, played| {
        if mode == "merge" && !played.iter().any(|p| p.mode == "merge") {
            assert_eq!(drop_record(&run_dir, 1, 4), 1, "prompt 4 had one record");
        }
        None
    });
    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(180), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let status = run.status.expect("a status");
    let played = kubelet.played();
    assert_eq!(
        status.phase,
        Some(Phase::Succeeded),
        "{status:#?}; played {played:#?}"
    );
    assert_eq!(status.output.as_ref().map(|o| o.trajectories), Some(10));
    // Round 2 numbers its attempts on: its first is attempt 4.
    assert_eq!(status.attempt, Some(4));

    // Round 1: the plan, the four batches in any order, the merge that found batch 1
    // incomplete; round 2: the plan, batch 1 alone, the merge.
    let mut stages: Vec<(&str, Option<u32>, i32)> = played
        .iter()
        .map(|p| (p.mode.as_str(), p.batch, p.exit_code))
        .collect();
    assert_eq!(stages.len(), 9, "{played:#?}");
    stages[1..5].sort_unstable();
    assert_eq!(
        stages,
        [
            ("plan", None, 0),
            ("batch", Some(0), 0),
            ("batch", Some(1), 0),
            ("batch", Some(2), 0),
            ("batch", Some(3), 0),
            ("merge", None, exit::PERMANENT_CONFIG),
            ("plan", None, 0),
            ("batch", Some(1), 0),
            ("merge", None, 0),
        ],
        "{played:#?}"
    );
    assert_eq!(
        model.request_count(),
        22,
        "10 conversations of two calls, and the lost one once more"
    );
    let (jobs, _) = children(client, ns, "rounds").await;
    assert_eq!(
        jobs,
        [
            "rounds-gen-1",
            "rounds-gen-4",
            "rounds-merge",
            "rounds-merge-2",
            "rounds-plan",
            "rounds-plan-2"
        ]
    );
    let out = setup.scratch.storage().join(format!("runs/{ns}/rounds"));
    let indexes: Vec<u64> = jsonl(&out.join("trajectories.jsonl"))
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    assert_eq!(indexes, (0..10).collect::<Vec<u64>>());
}

/// Removes the record lines of `prompt` from batch `batch`'s record files (every writer's) in
/// the run directory `run_dir`; returns how many it removed.
fn drop_record(run_dir: &Path, batch: u32, prompt: u64) -> usize {
    let files = trajectory_worker::storage::RunDir::new(run_dir)
        .records_files(batch)
        .expect("the batch's records files");
    let mut removed = 0;
    for file in files {
        let text = std::fs::read_to_string(&file.records).expect("a records file");
        let kept: Vec<&str> = text
            .lines()
            .filter(|line| {
                let record: Value = serde_json::from_str(line).expect("a record line");
                let lost = record["prompt_index"].as_u64() == Some(prompt);
                removed += usize::from(lost);
                !lost
            })
            .collect();
        let mut rewritten = kept.join("\n");
        if !kept.is_empty() {
            rewritten.push('\n');
        }
        std::fs::write(&file.records, rewritten).expect("rewrite the records file");
    }
    removed
}

/// A resume of a million batches with 40 % of them done at random (some 240,000 gaps, far more
/// than a 4 KiB summary lists): the plan writes the pending batches to a list on storage, and the
/// operator shards just those 600,000 over six Jobs whose indexes count positions in the list; a
/// pod of any shard works a batch that was not done, and no done batch gets a pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_of_a_million_batches_forty_percent_done_at_random_plans_only_the_rest() {
    Box::pin(resume_of_a_million_batches(None)).await;
}

/// The same, the dataset, the markers and the pending list in a bucket of a real S3 server: the
/// plan streams the dataset and lists the 400,000 markers from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_of_a_million_batches_forty_percent_done_planned_from_a_bucket_plans_only_the_rest()
 {
    let server = Versitygw::start("127.0.0.1");
    server.create_bucket("trajectories");
    Box::pin(resume_of_a_million_batches(Some(&server))).await;
}

/// A resume of a million batches, 40 % done, on a volume, or on `bucket`'s bucket `trajectories`.
async fn resume_of_a_million_batches(bucket: Option<&Versitygw>) {
    const BATCHES: u32 = 1_000_000;
    const DONE: u32 = 400_000;
    let mut setup = Setup::without_controller("e2e-sparse").await;
    setup.scratch = Scratch::in_memory();
    let (client, ns, model, scratch) = (&setup.client, setup.ns(), &setup.model, &setup.scratch);
    let (storage, mut extra) = match bucket {
        None => (scratch.storage(), json!({})),
        Some(server) => {
            let object = json!({"object": {
                "url": "s3://trajectories/sparse",
                "endpoint": server.endpoint,
                "pathStyle": true,
            }});
            (
                server.bucket_dir("trajectories").join("sparse"),
                json!({"storage": object}),
            )
        }
    };
    std::fs::create_dir_all(storage.join("datasets")).expect("the datasets directory");
    write_dataset(&storage, usize::try_from(BATCHES).expect("a count"));
    extra["batchSize"] = json!(1);
    extra["workers"] = json!(6);
    let spec = run_spec(&model.base_url(), &extra);
    let output = storage.join(spec.run.output_path(ns, "sparse"));

    // An earlier run on the same storage planned the dataset and finished 400,000 batches at
    // random (their markers are written here: generating them would take 400,000 conversations).
    let mut kubelet = Kubelet::new(client, ns, "sparse", scratch);
    if bucket.is_some() {
        kubelet.storage.clone_from(&storage);
        kubelet.bucket = Some(trajectory_worker::storage::BucketOptions {
            keys: Some(trajectory_worker::storage::AccessKeys {
                id: trajectory_testkit::versitygw::ACCESS_KEY.into(),
                secret: trajectory_testkit::versitygw::SECRET_KEY.into(),
            }),
            ..Default::default()
        });
    }
    kubelet.plan_an_earlier_run(ns, &spec.run).await;
    let done = random_batches(BATCHES, DONE, 14);
    mark_done(&output.join("batches"), &done);

    let _controller = start_controller_in(client, ns);
    setup.create("sparse", &extra).await;
    let shards = generation_jobs_after_the_plan(&kubelet, client, ns, 6).await;
    let completions: i32 = shards
        .iter()
        .map(|job| job.spec.as_ref().and_then(|s| s.completions).unwrap_or(0))
        .sum();
    assert_eq!(completions, 600_000, "only the batches not done");

    let message = plan_termination_message(client, ns, "sparse")
        .await
        .expect("the plan's termination message");
    eprintln!("plan termination message: {} bytes", message.len());
    assert!(message.len() <= 4096, "{} bytes", message.len());
    let summary: trajectory_worker::contract::PlanSummary =
        serde_json::from_str(&message).expect("a plan summary");
    assert_eq!(summary.done_count, DONE);
    let list = summary
        .pending_list
        .clone()
        .expect("a pending list on storage");
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    for job in &shards {
        let plan = small_shard_plan(&maps, job).await;
        assert_eq!(plan.pending_list.as_deref(), Some(list.as_str()));
    }

    // Pods of the first and the last shard work batches that were not done, each its own.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for job in ["sparse-gen-1", "sparse-gen-1-5"] {
        let pod = a_pending_pod(&pods, job).await;
        assert!(kubelet.play(&pod).await, "played a pod of {job}");
    }
    let mut worked = BTreeSet::new();
    for played in kubelet.played().iter().filter(|p| p.mode == "batch") {
        let batch = played.batch.expect("the pod's batch");
        assert_eq!(played.exit_code, 0, "{played:?}");
        assert!(!done.contains(&batch), "batch {batch} was done already");
        assert!(
            output
                .join(format!("batches/batch-{batch:06}.done"))
                .exists(),
            "the pod of index {batch} marked its batch done"
        );
        worked.insert(batch);
    }
    assert_eq!(worked.len(), 2);
    assert_eq!(
        model.request_count(),
        2 * 2,
        "two conversations of two calls"
    );

    let run = setup.runs.get("sparse").await.expect("the run");
    let status = run.status.expect("a status");
    let counts = status.batches.expect("batch counts");
    assert_eq!(counts.pending_list.map(|l| l.batches), Some(600_000));
    assert!(counts.completed_count >= DONE, "{}", counts.completed_count);
}

/// A run of 400 rows over 100 images (more than the plan's summary lists, so the groups are read
/// in pages): one Job per image, never more running at once than workers, each deleted once the
/// status records its batch, and every prompt written once. The pages' Job goes too; the groups
/// stay in the operator's `ConfigMap`. `E2E_IMAGE_ROWS`, `E2E_IMAGES` and `E2E_IMAGE_WORKERS`
/// scale it (`docs/benchmarks.md`: 10,000 rows over 2,000 images).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_over_many_images_keeps_its_jobs_within_the_window_and_cleans_them_up() {
    let setup = Setup::without_controller("e2e-images").await;
    let knob = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(default)
    };
    let (rows, images, workers) = (
        knob("E2E_IMAGE_ROWS", 400),
        knob("E2E_IMAGES", 100),
        knob("E2E_IMAGE_WORKERS", 6),
    );
    let started = std::time::Instant::now();
    write_image_dataset(&setup.scratch.storage(), rows, images);
    let _controller = start_controller_in(&setup.client, setup.ns());
    let created = std::time::Instant::now();
    setup
        .create(
            "images",
            &json!({
                "dataset": {"path": "datasets/images.jsonl"},
                "batchSize": 4, "workers": workers, "concurrency": 4,
            }),
        )
        .await;
    let (stop, counting) = count_live_children(&setup.client, setup.ns(), created);
    let kubelet = Kubelet::new(&setup.client, setup.ns(), "images", &setup.scratch);
    let run = kubelet
        .serve_until("the run to end", Duration::from_secs(3600), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    let took = started.elapsed();
    let _ = stop.send(());
    let live = counting.await.expect("the counter");
    eprintln!(
        "{rows} rows over {images} images, {workers} workers: done in {took:?}; first generation \
         pod after {:?}; most generation Jobs running at once {}, most generation pods {}; \
         status writes {}",
        live.first_pod, live.most_jobs, live.most_pods, live.status_writes
    );
    assert_image_run(
        &setup.client,
        setup.ns(),
        &run,
        &kubelet,
        (rows, images, workers),
        live,
    )
    .await;
}

//! Queued runs under a real Kueue (v0.19, `scripts/kueue/build.sh`) beside the test control plane:
//! every Job of a run admitted within quota, a run waiting for quota with a reason that names it,
//! a run preempted by a workload of higher priority and finishing once readmitted, a run stopped
//! (suspended, held at its budget, deleted) through Kueue's own mechanism and staying stopped, and
//! `workers` changed mid-run without a requeue.
//!
//! Pods are played by the test-kubelet (`trajectory_tests::e2e`), as in `end_to_end.rs`: they stay
//! Pending on no node, so that the test counts exactly which batches ran and how many model
//! requests they made. Each test has its own namespace, `ClusterQueue` and flavor.
//!
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test kueue`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::reconcile::children::labels;
use trajectory_testkit::scripted_server::ScriptedServer;
use trajectory_tests::e2e::{
    ControllerGuard, Kubelet, NO_NODE, Scratch, assert_image_run, assert_ran_once_on_a_new_pod,
    assert_succeeded_once, condition, count_live_children, create_run, done_batches, model,
    phase_of, pods_of_index, start_controller_in, write_dataset, write_image_dataset,
};
use trajectory_tests::kueue::{Kueue, holds, job_of, kueue_api, workloads};
use trajectory_tests::{TestNamespace, client, install_crds, wait_until};
use trajectory_worker::contract::exit;

/// The `LocalQueue` every test's runs name.
const QUEUE: &str = "team-a";

/// What each worker pod asks of its queue's quota.
const POD_CPU: &str = "500m";

/// A namespace managed by Kueue with its queue, a controller acting on it, a scripted model, and
/// storage with 10 prompts (4 batches of 3 in [`run_spec`]).
struct Setup {
    client: Client,
    kueue: &'static Kueue,
    namespace: TestNamespace,
    model: ScriptedServer,
    scratch: Scratch,
    runs: Api<TrajectoryRun>,
    _controller: ControllerGuard,
}

impl Setup {
    /// A namespace whose `ClusterQueue` has `quota` (cpu, memory) in a flavor that injects
    /// `node_labels` into the pods it admits.
    async fn new(prefix: &str, quota: (&str, &str), node_labels: &Value) -> Self {
        let client = client().await;
        install_crds(&client).await;
        let kueue = Kueue::shared(&client).await;
        let namespace = kueue
            .namespace(&client, prefix, QUEUE, quota, node_labels)
            .await;
        let runs = Api::namespaced(client.clone(), namespace.name());
        let scratch = Scratch::new();
        write_dataset(&scratch.storage(), 10);
        let controller = start_controller_in(&client, namespace.name());
        Self {
            client,
            kueue,
            namespace,
            model: model().await,
            scratch,
            runs,
            _controller: controller,
        }
    }

    fn ns(&self) -> &str {
        self.namespace.name()
    }

    /// Creates the run `name` through the queue, its pods asking [`POD_CPU`], with `extra` in its
    /// spec; returns a kubelet for its pods.
    async fn create(&self, name: &str, extra: &Value) -> Kubelet {
        let spec = json!({
            "queueName": QUEUE,
            "podTemplate": {
                "nodeSelector": {NO_NODE.0: NO_NODE.1},
                "resources": {"requests": {"cpu": POD_CPU, "memory": "64Mi"}},
            },
        });
        create_run(&self.runs, &self.model.base_url(), name, spec, extra).await;
        Kubelet::new(&self.client, self.ns(), name, &self.scratch)
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

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), self.ns())
    }

    /// The live (not terminating) pods of Job `job`.
    async fn live_pods(&self, job: &str) -> Vec<Pod> {
        let selector = format!("batch.kubernetes.io/job-name={job}");
        self.pods()
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the Job's pods")
            .items
            .into_iter()
            .filter(|pod| pod.metadata.deletion_timestamp.is_none())
            .filter(|pod| {
                !matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Failed" | "Succeeded")
                )
            })
            .collect()
    }

    /// The run's `Admitted` condition: (status, reason, message).
    async fn admitted(&self, name: &str) -> Option<(String, String, String)> {
        let run = self.runs.get(name).await.ok()?;
        let condition = condition(run.status.as_ref()?, "Admitted")?;
        Some((
            condition.status.clone(),
            condition.reason.clone(),
            condition.message.clone(),
        ))
    }

    /// Checks a finished run: every prompt once ([`assert_succeeded_once`]).
    fn assert_succeeded_once(&self, run: &TrajectoryRun, kubelet: &Kubelet) {
        let context = format!("; Kueue: {}", self.kueue.process.log_tail());
        assert_succeeded_once(run, kubelet, self.model.request_count(), &context);
    }

    /// Plays the run until batches 0-2 are done, batch 3 held; returns the pending pod of batch 3
    /// of the generation Job `job`.
    async fn hold_the_last_batch(&self, kubelet: &mut Kubelet, job: &str) -> Pod {
        kubelet.hold = BTreeSet::from([3]);
        kubelet
            .serve_until("three batches done", Duration::from_secs(120), |run| {
                done_batches(run) >= 3
            })
            .await;
        let pods = self.pods();
        wait_until("the pod of batch 3", Duration::from_secs(30), || async {
            pods_of_index(&pods, job, 3).await.into_iter().next()
        })
        .await
    }

    /// Lets every batch run, plays the run to its end and checks that it finished with every
    /// prompt once ([`Setup::assert_succeeded_once`]).
    async fn finish_once(&self, kubelet: &mut Kubelet, what: &str) -> TrajectoryRun {
        kubelet.hold.clear();
        let run = kubelet
            .serve_until(what, Duration::from_secs(180), finished)
            .await;
        self.assert_succeeded_once(&run, kubelet);
        run
    }

    /// The Workload of Job `job` that is not finished.
    async fn workload_of(&self, job: &str) -> Option<DynamicObject> {
        workloads(&self.client, self.ns())
            .await
            .into_iter()
            .find(|w| job_of(w) == job && !holds(w, "Finished"))
    }

    /// Waits until Job `job` is stopped through its Workload (deactivated, the Job suspended, no
    /// pod left), then checks for `window` that it stays so: the Job's `generation` (bumped by every
    /// change of its `suspend`) never moves and no pod of it is created.
    async fn assert_stays_stopped(&self, kubelet: &Kubelet, job: &str, window: Duration) {
        let jobs = self.jobs();
        wait_until(
            "the Job stopped through its Workload",
            Duration::from_secs(60),
            || async {
                kubelet.play_pending().await;
                let workload = self.workload_of(job).await?;
                let job = jobs.get(job).await.ok()?;
                let stopped = workload.data["spec"]["active"] == false
                    && job.spec.as_ref()?.suspend == Some(true)
                    && self.live_pods(&job.name_any()).await.is_empty();
                stopped.then_some(())
            },
        )
        .await;
        // Kueue's own stop is two writes (suspend, then the pod template restored once the Job
        // controller saw the pods go): settled when the spec stays the same for 3 s, which a Job
        // flipped back and forth never does.
        let settling = Instant::now();
        let mut generation = jobs.get(job).await.expect("the Job").metadata.generation;
        let mut stable_since = Instant::now();
        while stable_since.elapsed() < Duration::from_secs(3) {
            assert!(
                settling.elapsed() < Duration::from_secs(30),
                "the stopped Job's spec never stayed the same for 3 s; Kueue: {}",
                self.kueue.process.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = jobs.get(job).await.expect("the Job").metadata.generation;
            if now != generation {
                (generation, stable_since) = (now, Instant::now());
            }
        }
        let pods_before: BTreeSet<String> = self
            .pods()
            .list(&ListParams::default())
            .await
            .expect("pods")
            .items
            .iter()
            .filter_map(ResourceExt::uid)
            .collect();
        let started = Instant::now();
        while started.elapsed() < window {
            kubelet.play_pending().await;
            let now = jobs.get(job).await.expect("the Job");
            assert_eq!(
                now.metadata.generation,
                generation,
                "the stopped Job's spec changed after {:?} (suspend flipped): {:#?}; Kueue: {}",
                started.elapsed(),
                now.spec,
                self.kueue.process.log_tail()
            );
            let created: Vec<String> = self
                .pods()
                .list(&ListParams::default())
                .await
                .expect("pods")
                .items
                .iter()
                .filter(|pod| pod.uid().is_some_and(|uid| !pods_before.contains(&uid)))
                .map(ResourceExt::name_any)
                .collect();
            assert!(
                created.is_empty(),
                "pods created while the run was stopped, after {:?}: {created:?}",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

fn finished(run: &TrajectoryRun) -> bool {
    matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
}

fn condition_status(run: &TrajectoryRun, type_: &str) -> Option<String> {
    condition(run.status.as_ref()?, type_).map(|c| c.status.clone())
}

/// Every Job of a queued run (plan, generation, merge) goes through its own Workload and is
/// admitted within quota; the flavor's node selector that Kueue injects at admission stays on the
/// Job (the operator never asserts its template again), and the run succeeds with every prompt
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_run_is_admitted_job_by_job_and_succeeds_once() {
    let setup = Setup::new(
        "kq-admit",
        ("10", "10Gi"),
        &json!({"trajectories.dev/flavor": "kueue-test"}),
    )
    .await;
    let kubelet = setup.create("admit", &json!({})).await;
    let jobs = setup.jobs();
    let job = kubelet
        .serve_until("the generation Job", Duration::from_secs(120), |run| {
            phase_of(run) == Some(Phase::Running)
        })
        .await;
    drop(job);
    let admitted = wait_until(
        "the generation Job admitted and running, the run saying by whom",
        Duration::from_secs(60),
        || async {
            let job = jobs.get("admit-gen-1").await.ok()?;
            let (status, _, message) = setup.admitted("admit").await?;
            let said = status == "True"
                && message.contains("admit-gen-1")
                && message.contains(&format!("ClusterQueue {}", setup.ns()));
            (job.spec.as_ref()?.suspend == Some(false) && said).then_some(job)
        },
    )
    .await;
    let selector = admitted
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .and_then(|pod| pod.node_selector.clone())
        .unwrap_or_default();
    assert_eq!(
        selector.get("trajectories.dev/flavor").map(String::as_str),
        Some("kueue-test"),
        "Kueue injected the flavor's node labels: {selector:?}"
    );
    assert_eq!(
        admitted
            .annotations()
            .get("kueue.x-k8s.io/elastic-job")
            .map(String::as_str),
        Some("true"),
        "generation Jobs are created elastic"
    );

    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(180), finished)
        .await;
    setup.assert_succeeded_once(&run, &kubelet);
    let mut admitted_jobs: Vec<String> = workloads(&setup.client, setup.ns())
        .await
        .iter()
        .filter(|w| holds(w, "Admitted") || holds(w, "Finished"))
        .map(job_of)
        .collect();
    admitted_jobs.sort();
    admitted_jobs.dedup();
    assert_eq!(
        admitted_jobs,
        ["admit-gen-1", "admit-merge", "admit-plan"],
        "each Job admitted through its own Workload"
    );
    let (status, reason, message) = setup
        .admitted("admit")
        .await
        .expect("an Admitted condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Admitted"),
        "{message}"
    );
}

/// Quota smaller than one pod leaves the run waiting, never `Failed`, with a condition that names
/// the queue's reason; raising the quota admits it and it finishes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_beyond_its_queues_quota_waits_with_the_reason_and_runs_once_quota_is_raised() {
    let setup = Setup::new("kq-quota", ("100m", "10Gi"), &json!({})).await;
    let kubelet = setup.create("small", &json!({})).await;
    let (_, reason, message) = wait_until(
        "the run to say why it waits",
        Duration::from_secs(60),
        || async {
            let admitted = setup.admitted("small").await?;
            (admitted.0 == "False" && admitted.2.contains("insufficient quota")).then_some(admitted)
        },
    )
    .await;
    assert_eq!(reason, "Queued", "{message}");
    assert!(
        message.contains("small-plan")
            && message.contains(&format!("LocalQueue {QUEUE}"))
            && message.contains("cpu"),
        "it names the Job, the queue and the resource short: {message}"
    );
    // Held for a while: still waiting, never failed, no pod.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let run = setup.runs.get("small").await.expect("the run");
    assert_ne!(phase_of(&run), Some(Phase::Failed), "{:#?}", run.status);
    assert_eq!(
        condition_status(&run, "Reconciling").as_deref(),
        Some("True"),
        "in progress for kstatus while it waits"
    );
    assert!(setup.live_pods("small-plan").await.is_empty());
    assert_eq!(setup.model.request_count(), 0);

    setup
        .kueue
        .set_quota(&setup.client, setup.ns(), ("10", "10Gi"))
        .await;
    let run = kubelet
        .serve_until(
            "the run to finish once admitted",
            Duration::from_secs(180),
            finished,
        )
        .await;
    setup.assert_succeeded_once(&run, &kubelet);
}

/// `spec.suspend` on a running queued run stops it through its Workload (deactivated): its pods
/// go and for a whole minute no pod is created and the Job's `suspend` never flips (before, Kueue
/// and the operator fought over it, some 15 times a second). Resuming admits it again and it
/// works only what was left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_suspended_queued_run_stays_stopped_and_resumes_where_it_stopped() {
    let setup = Setup::new("kq-suspend", ("10", "10Gi"), &json!({})).await;
    let mut kubelet = setup.create("pause", &json!({})).await;
    let held = setup
        .hold_the_last_batch(&mut kubelet, "pause-gen-1")
        .await
        .name_any();

    setup.patch_spec("pause", &json!({"suspend": true})).await;
    Box::pin(setup.assert_stays_stopped(&kubelet, "pause-gen-1", Duration::from_secs(60))).await;
    let run = setup.runs.get("pause").await.expect("the run");
    assert_eq!(condition_status(&run, "Suspended").as_deref(), Some("True"));
    let (status, reason, _) = setup.admitted("pause").await.expect("Admitted");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "Deactivated"));

    setup.patch_spec("pause", &json!({"suspend": false})).await;
    let run = setup
        .finish_once(&mut kubelet, "the resumed run to finish")
        .await;
    assert_ran_once_on_a_new_pod(&kubelet, 3, &held);
    assert_eq!(
        run.status.as_ref().and_then(|s| s.attempt),
        Some(1),
        "the same Job resumed"
    );
}

/// A queued run held at its budget (a batch pod stopped with the worker's `BudgetExhausted` exit,
/// reported by the test-kubelet as the worker reports it) stops through its Workload and stays
/// stopped for a minute; raising the budget admits it again and it finishes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_run_held_at_its_budget_stays_stopped_until_the_budget_is_raised() {
    let setup = Setup::new("kq-budget", ("10", "10Gi"), &json!({})).await;
    let budget = json!({"pricing": {"input": 1.0, "output": 2.0}, "budget": {"maxCost": 0.5}});
    let mut kubelet = setup
        .create("held", &json!({"model": model_with(&setup, &budget)}))
        .await;
    let pod = setup.hold_the_last_batch(&mut kubelet, "held-gen-1").await;
    let image = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.containers.first())
        .and_then(|container| container.image.clone())
        .unwrap_or_default();
    // What the worker writes when it finds the run's budget spent (contract::WorkerFailure).
    let stopped = json!({
        "error": "the run spent its budget of 0.5 USD", "reason": "BudgetExhausted",
        "exitCode": exit::BUDGET_EXHAUSTED, "budget": 0.5, "runSpent": "0.5",
    });
    kubelet
        .report(
            &pod.name_any(),
            &image,
            exit::BUDGET_EXHAUSTED,
            &stopped.to_string(),
        )
        .await;
    Box::pin(setup.assert_stays_stopped(&kubelet, "held-gen-1", Duration::from_secs(60))).await;
    let run = setup.runs.get("held").await.expect("the run");
    assert_eq!(
        condition(run.status.as_ref().expect("a status"), "Suspended").map(|c| c.reason.as_str()),
        Some("BudgetExhausted")
    );

    let raised = json!({"pricing": {"input": 1.0, "output": 2.0}, "budget": {"maxCost": 5.0}});
    setup
        .patch_spec("held", &json!({"model": model_with(&setup, &raised)}))
        .await;
    setup
        .finish_once(&mut kubelet, "the run to finish once the budget is raised")
        .await;
}

/// The run's `model` with `extra` fields (prices, budget).
fn model_with(setup: &Setup, extra: &Value) -> Value {
    let mut model = json!({
        "baseUrl": setup.model.base_url(), "name": "scripted", "maxAttempts": 2,
        "requestTimeoutSeconds": 10,
    });
    for (key, value) in extra.as_object().into_iter().flatten() {
        model[key] = value.clone();
    }
    model
}

/// `workers` changed on a running queued run resizes its elastic Job in place: growing keeps
/// every running pod (the new one waits gated until its Workload slice is admitted), shrinking
/// stops only the surplus, and the Job is never suspended and requeued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changing_workers_of_a_queued_run_resizes_it_without_a_requeue() {
    let setup = Setup::new("kq-scale", ("10", "10Gi"), &json!({})).await;
    let mut kubelet = setup.create("scale", &json!({"workers": 2})).await;
    kubelet.hold = BTreeSet::from([0, 1, 2, 3]);
    let jobs = setup.jobs();
    kubelet
        .serve_until("the generation Job", Duration::from_secs(120), |run| {
            phase_of(run) == Some(Phase::Running)
        })
        .await;
    let setup = &setup;
    let running = |want: usize| async move {
        let pods = setup.live_pods("scale-gen-1").await;
        let ungated = pods.iter().all(|pod| {
            pod.spec
                .as_ref()
                .and_then(|spec| spec.scheduling_gates.as_ref())
                .is_none_or(Vec::is_empty)
        });
        (pods.len() == want && ungated).then(|| {
            pods.iter()
                .filter_map(ResourceExt::uid)
                .collect::<BTreeSet<String>>()
        })
    };
    let two = wait_until("two pods", Duration::from_secs(60), || running(2)).await;
    let suspended_since = |job: &Job| {
        job.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Suspended").cloned())
            .map(|c| (c.status, c.last_transition_time))
    };
    let before = suspended_since(&jobs.get("scale-gen-1").await.expect("the Job"));

    setup.patch_spec("scale", &json!({"workers": 3})).await;
    let three = wait_until("three pods, none gated", Duration::from_secs(60), || {
        running(3)
    })
    .await;
    assert!(
        two.is_subset(&three),
        "growing kept both running pods: {two:?} then {three:?}"
    );
    setup.patch_spec("scale", &json!({"workers": 1})).await;
    let one = wait_until("one pod", Duration::from_secs(60), || async {
        kubelet.play_pending().await;
        running(1).await
    })
    .await;
    assert!(
        one.is_subset(&three),
        "shrinking stopped only the surplus: {three:?} then {one:?}"
    );
    assert_eq!(
        suspended_since(&jobs.get("scale-gen-1").await.expect("the Job")),
        before,
        "the Job was never suspended and requeued"
    );
    let (status, _, message) = setup.admitted("scale").await.expect("Admitted");
    assert_eq!(status, "True", "{message}");

    setup.finish_once(&mut kubelet, "the run to finish").await;
}

/// A workload of higher priority preempts a running queued run: its pods go, nothing it finished
/// is lost or redone, the preempted pods count as no batch failure, and the status says it was
/// preempted; readmitted once the other workload is gone, it finishes with every prompt once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_preempted_run_keeps_its_progress_and_finishes_once_when_readmitted() {
    // Room for the run's two pods, or the urgent Job's one of a whole CPU.
    let setup = Setup::new("kq-preempt", ("1", "10Gi"), &json!({})).await;
    let mut kubelet = setup.create("low", &json!({"workers": 2})).await;
    kubelet.hold = BTreeSet::from([2, 3]);
    kubelet
        .serve_until("two batches done", Duration::from_secs(120), |run| {
            done_batches(run) >= 2
        })
        .await;
    wait_until(
        "the pods of batches 2 and 3",
        Duration::from_secs(60),
        || async { (setup.live_pods("low-gen-1").await.len() == 2).then_some(()) },
    )
    .await;
    let requests_before = setup.model.request_count();

    let priority = format!("{}-urgent", setup.ns());
    kueue_api(&setup.client, "WorkloadPriorityClass", None)
        .patch(
            &priority,
            &PatchParams::apply("trajectory-tests-kueue").force(),
            &Patch::Apply(json!({
                "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                "metadata": {"name": priority, "labels": {"trajectory-tests": "true"}},
                "value": 1000,
            })),
        )
        .await
        .expect("a WorkloadPriorityClass");
    let urgent: Job = serde_json::from_value(json!({
        "metadata": {"name": "urgent", "labels": {
            "kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": priority,
        }},
        "spec": {
            "suspend": true,
            "template": {"spec": {
                "restartPolicy": "Never",
                "nodeSelector": {NO_NODE.0: NO_NODE.1},
                "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}],
            }},
        },
    }))
    .expect("a Job");
    let jobs = setup.jobs();
    jobs.create(&PostParams::default(), &urgent)
        .await
        .expect("create the urgent Job");

    let (_, reason, message) = wait_until(
        "the run preempted, its pods gone",
        Duration::from_secs(60),
        || async {
            kubelet.play_pending().await;
            let admitted = setup.admitted("low").await?;
            let gone = setup.live_pods("low-gen-1").await.is_empty();
            (admitted.0 == "False" && gone).then_some(admitted)
        },
    )
    .await;
    assert_eq!(reason, "Preempted", "{message}");
    let run = setup.runs.get("low").await.expect("the run");
    assert_eq!(phase_of(&run), Some(Phase::Running), "{:#?}", run.status);
    assert_eq!(
        run.status
            .as_ref()
            .and_then(|s| s.batches.as_ref())
            .map(|b| b.failed.clone()),
        Some(String::new()),
        "preempted pods are no batch failures"
    );
    assert_eq!(done_batches(&run), 2, "finished batches stay finished");

    jobs.delete("urgent", &DeleteParams::background())
        .await
        .expect("delete the urgent Job");
    setup
        .finish_once(&mut kubelet, "the readmitted run to finish")
        .await;
    assert_eq!(
        setup.model.request_count() - requests_before,
        8,
        "only batches 2 and 3 (4 prompts, 2 requests each) ran after the preemption"
    );
    let (status, _, message) = setup.admitted("low").await.expect("Admitted");
    assert!(
        status == "True" && message.contains("evicted a Job once"),
        "{message}"
    );
}

/// Deleting a running queued run removes its Jobs, Workloads and pods, and nothing comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_queued_run_leaves_no_job_workload_or_pod() {
    let setup = Setup::new("kq-delete", ("10", "10Gi"), &json!({})).await;
    let mut kubelet = setup.create("gone", &json!({})).await;
    kubelet.hold = BTreeSet::from([0, 1, 2, 3]);
    kubelet
        .serve_until("the generation Job", Duration::from_secs(120), |run| {
            phase_of(run) == Some(Phase::Running)
        })
        .await;
    wait_until("its pods", Duration::from_secs(60), || async {
        (setup.live_pods("gone-gen-1").await.len() == 2).then_some(())
    })
    .await;
    setup
        .runs
        .delete("gone", &DeleteParams::foreground())
        .await
        .expect("delete the run");
    let jobs = setup.jobs();
    let selector = format!("{}=gone", labels::RUN);
    let empty = || async {
        kubelet.play_pending().await;
        let jobs = jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .ok()?;
        let workloads = workloads(&setup.client, setup.ns()).await;
        let pods = setup.live_pods("gone-gen-1").await;
        (jobs.items.is_empty() && workloads.is_empty() && pods.is_empty()).then_some(())
    };
    wait_until(
        "no Job, Workload or pod of the run",
        Duration::from_secs(60),
        empty,
    )
    .await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(15) {
        assert!(
            empty().await.is_some(),
            "something of the deleted run came back after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A queued run whose rows name images: the image pages Job and each image's generation Job are
/// admitted through Workloads of their own (the operator never unsuspends a queued Job, so a
/// finished run means every one was), at most `workers` of them at once, and the run succeeds as
/// it does without a queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_run_over_images_admits_each_images_job_and_succeeds() {
    let setup = Setup::new("kq-images", ("10", "10Gi"), &json!({})).await;
    // Enough images that the plan's summary cannot list them all: the image pages Job (read
    // through the queue too) reports them.
    let (rows, images, workers) = (120, 60, 4);
    write_image_dataset(&setup.scratch.storage(), rows, images);
    let created = Instant::now();
    let kubelet = setup
        .create(
            "images",
            &json!({
                "dataset": {"path": "datasets/images.jsonl"},
                "batchSize": 4, "workers": workers, "concurrency": 4,
            }),
        )
        .await;
    let (stop, counting) = count_live_children(&setup.client, setup.ns(), created);
    let run = kubelet
        .serve_until(
            "the queued image run to end",
            Duration::from_secs(300),
            finished,
        )
        .await;
    let _ = stop.send(());
    let live = counting.await.expect("the counter");
    assert_image_run(
        &setup.client,
        setup.ns(),
        &run,
        &kubelet,
        (rows, images, workers),
        live,
    )
    .await;
    let (status, reason, message) = setup.admitted("images").await.expect("Admitted");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Admitted"),
        "{message}"
    );
}

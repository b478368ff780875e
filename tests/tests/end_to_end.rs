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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use trajectory_operator::api::{Phase, TrajectoryRun, TrajectoryRunSpec};
use trajectory_operator::controller::{self, Context};
use trajectory_operator::desired::{CONTAINER, Settings, labels};
use trajectory_tests::{TestNamespace, client, unique_name, wait_until};
use trajectory_worker::plan::{exit, paths, termination_message};
use trajectory_worker::run::batch::{Engine, run_batch, shutdown_channel};
use trajectory_worker::run::manifest::Manifest;
use trajectory_worker::run::{RunError, RunLocation, load_plan, merge, plan};
use trajectory_worker::scripted_server::{
    FixedLatency, ScriptedServer, text_reply, tool_call_reply,
};
use trajectory_worker::spec::RunSpec;

mod common;
use common::install_crds;

/// The annotation the Job controller puts on an Indexed Job's pods (the source of
/// `JOB_COMPLETION_INDEX`).
const COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// A node selector no node of the test cluster matches: the run's pods stay Pending and kwok
/// never completes them.
const NO_NODE: (&str, &str) = ("trajectories.dev/e2e-kubelet", "the-test");

/// Stops the in-process controller when the test ends, also when it fails.
struct ControllerGuard(Option<oneshot::Sender<()>>);

impl Drop for ControllerGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.0.take() {
            let _ = stop.send(());
        }
    }
}

fn start_controller(client: &Client) -> ControllerGuard {
    let (stop, stopped) = oneshot::channel::<()>();
    let ctx = Context::new(client.clone(), Settings::default());
    tokio::spawn(controller::run(ctx, async {
        let _ = stopped.await;
    }));
    ControllerGuard(Some(stop))
}

/// A temporary directory: `data/` stands in for the shared volume, `pods/` holds what a kubelet
/// would mount into each pod. Removed on drop unless the test failed (then its path is printed).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(unique_name("trajectory-e2e"));
        std::fs::create_dir_all(dir.join("data/datasets")).expect("create the scratch directory");
        Self(dir)
    }

    fn storage(&self) -> PathBuf {
        self.0.join("data")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "keeping the storage of the failed test: {}",
                self.0.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Writes `prompts` prompts to `datasets/prompts.jsonl` on the storage.
fn write_dataset(storage: &Path, prompts: usize) {
    let mut text = String::new();
    for i in 0..prompts {
        text.push_str(&json!({"prompt": format!("task number {i}")}).to_string());
        text.push('\n');
    }
    std::fs::write(storage.join("datasets/prompts.jsonl"), text).expect("write the dataset");
}

/// The run's spec: 10 prompts in batches of 3 (4 batches), two pods at a time, the scripted model.
fn run_spec(base_url: &str, extra: &Value) -> TrajectoryRunSpec {
    let mut spec = json!({
        "dataset": {"path": "datasets/prompts.jsonl"},
        "batchSize": 3,
        "workers": 2,
        "concurrency": 2,
        "distribution": "terminal_only",
        "seed": 7,
        "model": {"baseUrl": base_url, "name": "scripted", "maxAttempts": 2, "requestTimeoutSeconds": 10},
        "agent": {"maxTurns": 3, "promptTimeoutSeconds": 60},
        "storage": {"volume": {"emptyDir": {}}},
        "podTemplate": {"nodeSelector": {NO_NODE.0: NO_NODE.1}},
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        for (key, value) in extra {
            spec.insert(key.clone(), value.clone());
        }
    }
    let spec: RunSpec = serde_json::from_value(spec).expect("a valid spec");
    TrajectoryRunSpec::from(spec)
}

/// What the test-kubelet did with one pod.
#[derive(Debug, Clone)]
struct Played {
    pod: String,
    /// `plan`, `batch` or `merge` (the container's args).
    mode: String,
    /// The batch a `batch` pod worked.
    batch: Option<u32>,
    /// The run's phase when the pod was played.
    phase: Option<Phase>,
    exit_code: i32,
    /// Whether the worker step ran (false when the test made the pod fail without running it).
    ran: bool,
}

/// Decides, per pod about to be played, whether it crashes (exit code) before running the worker.
type Crash = dyn Fn(&str, Option<u32>, &[Played]) -> Option<i32> + Send + Sync;

/// Plays the kubelet for the pods of one run.
struct Kubelet {
    pods: Api<Pod>,
    maps: Api<ConfigMap>,
    runs: Api<TrajectoryRun>,
    run: String,
    storage: PathBuf,
    scratch: PathBuf,
    played: Arc<Mutex<Vec<Played>>>,
    crash: Box<Crash>,
    /// Batches whose pods are left Pending for now.
    hold: BTreeSet<u32>,
}

impl Kubelet {
    fn new(client: &Client, namespace: &str, run: &str, scratch: &Scratch) -> Self {
        Self {
            pods: Api::namespaced(client.clone(), namespace),
            maps: Api::namespaced(client.clone(), namespace),
            runs: Api::namespaced(client.clone(), namespace),
            run: run.to_owned(),
            storage: scratch.storage(),
            scratch: scratch.0.join("pods"),
            played: Arc::default(),
            crash: Box::new(|_, _, _| None),
            hold: BTreeSet::new(),
        }
    }

    fn played(&self) -> Vec<Played> {
        self.played.lock().expect("not poisoned").clone()
    }

    /// Plays every Pending pod of the run once; returns how many it played.
    async fn play_pending(&self) -> usize {
        let selector = format!("{}={}", labels::RUN, self.run);
        let list = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the run's pods");
        let mut count = 0;
        for pod in list.items {
            let pending = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
            let seen = self.played().iter().any(|p| p.pod == pod.name_any());
            if pending
                && !seen
                && pod.metadata.deletion_timestamp.is_none()
                && self.play(&pod).await
            {
                count += 1;
            }
        }
        count
    }

    /// Runs what the pod's container would run, then reports it through the pod's status; false
    /// when the pod's batch is held or the run's phase is not yet the pod's stage.
    async fn play(&self, pod: &Pod) -> bool {
        let name = pod.name_any();
        let spec = pod.spec.as_ref().expect("a pod spec");
        let container = spec
            .containers
            .iter()
            .find(|c| c.name == CONTAINER)
            .expect("the worker container");
        let mode = container
            .args
            .as_ref()
            .and_then(|args| args.first())
            .cloned()
            .expect("the worker subcommand in the container's args");
        let env = |key: &str| {
            container
                .env
                .iter()
                .flatten()
                .find(|e| e.name == key)
                .and_then(|e| e.value.clone())
        };
        // The pod's contract paths; the test maps them onto its directories.
        assert_eq!(
            env("TRAJ_PLAN_PATH").as_deref(),
            Some(format!("{}/{}", paths::PLAN_DIR, paths::PLAN_FILE).as_str())
        );
        assert_eq!(
            env("TRAJ_STORAGE_ROOT").as_deref(),
            Some(paths::STORAGE_ROOT)
        );

        // The mounted plan ConfigMap.
        let map_name = spec
            .volumes
            .iter()
            .flatten()
            .find_map(|v| v.config_map.as_ref().map(|c| c.name.clone()))
            .expect("the plan ConfigMap volume");
        let map = self.maps.get(&map_name).await.expect("the plan ConfigMap");
        let plan_json = map
            .data
            .and_then(|mut d| d.remove(paths::PLAN_FILE))
            .expect("plan.json in the ConfigMap");
        let pod_dir = self.scratch.join(&name);
        std::fs::create_dir_all(&pod_dir).expect("create the pod's directory");
        let plan_path = pod_dir.join(paths::PLAN_FILE);
        std::fs::write(&plan_path, plan_json).expect("write the mounted plan");
        let index: Option<u32> = pod
            .annotations()
            .get(COMPLETION_INDEX)
            .map(|i| i.parse().expect("a numeric completion index"));

        let phase = self
            .runs
            .get(&self.run)
            .await
            .ok()
            .and_then(|r| r.status.and_then(|s| s.phase));
        // A pod is played once the run's status shows its stage (the controller writes the status
        // right after creating the Job; this keeps the test from outrunning it).
        let stage_phase = match mode.as_str() {
            "plan" => Phase::Planning,
            "batch" => Phase::Running,
            _ => Phase::Merging,
        };
        if phase != Some(stage_phase) {
            return false;
        }
        let batch = load_plan(&plan_path)
            .ok()
            .and_then(|plan| index.and_then(|i| plan.batch_for_index(i)));
        if batch.is_some_and(|batch| self.hold.contains(&batch)) {
            return false;
        }
        let crash = (self.crash)(&mode, batch, &self.played());
        let (exit_code, message, ran) = if let Some(code) = crash {
            (code, String::new(), false)
        } else {
            let (code, message) = self
                .run_worker(&mode, &plan_path, index, &pod_dir.join("workspace"))
                .await;
            (code, message, true)
        };
        self.played.lock().expect("not poisoned").push(Played {
            pod: name.clone(),
            mode,
            batch,
            phase,
            exit_code,
            ran,
        });
        self.report(
            &name,
            &container.image.clone().unwrap_or_default(),
            exit_code,
            &message,
        )
        .await;
        true
    }

    /// The worker's step, as `trajectory-worker <mode>` runs it: exit code and termination message.
    async fn run_worker(
        &self,
        mode: &str,
        plan_path: &Path,
        index: Option<u32>,
        workspace: &Path,
    ) -> (i32, String) {
        fn report<T: serde::Serialize>(result: Result<T, RunError>) -> (i32, String) {
            match result {
                Ok(summary) => (exit::OK, termination_message(&summary)),
                Err(error) => (
                    error.exit_code(),
                    termination_message(&json!({
                        "error": error.to_string(), "reason": error.reason(), "exitCode": error.exit_code(),
                    })),
                ),
            }
        }
        let location = match load_plan(plan_path) {
            Ok(plan) => RunLocation {
                storage_root: self.storage.clone(),
                plan,
            },
            Err(error) => return report::<()>(Err(error)),
        };
        match mode {
            "plan" => report(
                tokio::task::spawn_blocking(move || plan::plan(&location).map(|(_, s)| s))
                    .await
                    .expect("the plan step does not panic"),
            ),
            "merge" => report(
                tokio::task::spawn_blocking(move || merge::merge(&location))
                    .await
                    .expect("the merge step does not panic"),
            ),
            "batch" => {
                let result = async {
                    let index =
                        index.ok_or_else(|| RunError::Spec("no completion index".into()))?;
                    let batch = location.plan.batch_for_index(index).ok_or_else(|| {
                        RunError::BadBatchInput(format!("index {index} has no batch"))
                    })?;
                    let manifest = Manifest::require(&location.run_dir())?;
                    let engine = Engine::new(&location.plan.spec, workspace.to_path_buf())?;
                    let (_trigger, shutdown) = shutdown_channel();
                    run_batch(&engine, &location, &manifest, batch, &shutdown, &|_| {}).await
                }
                .await;
                report(result)
            }
            other => panic!("unknown worker mode {other:?}"),
        }
    }

    /// Reports the container's end through the pod's `status` subresource, as a kubelet does.
    async fn report(&self, pod: &str, image: &str, exit_code: i32, message: &str) {
        let now = Timestamp::now().to_string();
        let (phase, reason) = if exit_code == exit::OK {
            ("Succeeded", "Completed")
        } else {
            ("Failed", "Error")
        };
        let patch = json!({
            "status": {
                "phase": phase,
                "conditions": [
                    {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now},
                ],
                "containerStatuses": [{
                    "name": CONTAINER,
                    "image": image,
                    "imageID": "",
                    "ready": false,
                    "restartCount": 0,
                    "started": false,
                    "state": {"terminated": {
                        "exitCode": exit_code,
                        "reason": reason,
                        "message": message,
                        "startedAt": now,
                        "finishedAt": now,
                    }},
                }],
            }
        });
        self.pods
            .patch_status(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("patching the status of pod {pod}: {e}"));
    }

    /// Plays pods until `done` holds for the run (checked after every round), or `timeout`.
    async fn serve_until(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&TrajectoryRun) -> bool,
    ) -> TrajectoryRun {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            self.play_pending().await;
            if let Ok(run) = self.runs.get(&self.run).await
                && done(&run)
            {
                return run;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {what}; played {:#?}; run status {:#?}",
                self.played(),
                self.runs.get(&self.run).await.ok().and_then(|r| r.status)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn phase_of(run: &TrajectoryRun) -> Option<Phase> {
    run.status.as_ref().and_then(|s| s.phase)
}

/// The done batches of `status.progress` (`done/total`).
fn done_batches(run: &TrajectoryRun) -> u32 {
    run.status
        .as_ref()
        .and_then(|s| s.progress.as_deref())
        .and_then(|p| p.split_once('/'))
        .and_then(|(done, _)| done.parse().ok())
        .unwrap_or(0)
}

/// The model: each conversation calls the terminal once, then answers.
async fn model() -> ScriptedServer {
    ScriptedServer::start_fixed_latency(FixedLatency {
        latency: Duration::from_millis(5),
        tool_call: tool_call_reply("terminal", &json!({"command": "echo hi"})),
        final_answer: text_reply("done"),
    })
    .await
}

/// The lines of a JSONL output file of the run.
fn jsonl(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}")))
        .collect()
}

/// The run's row as `kubectl get trun` prints it: the server-side Table of the printer columns.
async fn printed_row(client: &Client, namespace: &str, name: &str) -> BTreeMap<String, Value> {
    let mut request = kube::core::Request::new(format!(
        "/apis/trajectories.dev/v1alpha1/namespaces/{namespace}/trajectoryruns"
    ))
    .get(name, &kube::api::GetParams::default())
    .expect("a GET request");
    request.headers_mut().insert(
        "accept",
        "application/json;as=Table;v=v1;g=meta.k8s.io"
            .try_into()
            .expect("a valid header"),
    );
    let table: Value = client.request(request).await.expect("the run as a Table");
    let columns: Vec<String> = table["columnDefinitions"]
        .as_array()
        .expect("column definitions")
        .iter()
        .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
        .collect();
    let cells = table["rows"][0]["cells"]
        .as_array()
        .expect("one row")
        .clone();
    columns.into_iter().zip(cells).collect()
}

/// Every Job and `ConfigMap` of the run, by name.
async fn children(client: &Client, namespace: &str, run: &str) -> (Vec<String>, Vec<String>) {
    let selector = format!("{}={run}", labels::RUN);
    let params = ListParams::default().labels(&selector);
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut job_names: Vec<String> = jobs
        .list(&params)
        .await
        .expect("list Jobs")
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let mut map_names: Vec<String> = maps
        .list(&params)
        .await
        .expect("list ConfigMaps")
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    job_names.sort();
    map_names.sort();
    (job_names, map_names)
}

/// The phase-change Events on the run, in the order they happened.
async fn phase_events(client: &Client, namespace: &str, uid: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    let mut list: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .expect("list Events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.uid.as_deref()) == Some(uid))
        .collect();
    list.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    list.into_iter().filter_map(|e| e.reason).collect()
}

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

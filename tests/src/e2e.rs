//! The end-to-end driver: an in-process controller, a scratch directory standing in for the shared
//! volume, and a test-kubelet that runs the worker's real steps where a run's pods would.
//!
//! kwok would complete the run's pods without running anything, so a run driven by [`Kubelet`] gets
//! a node selector no node matches ([`NO_NODE`]): its pods stay Pending, and the kubelet reads what
//! a real one would hand the container — the mounted plan `ConfigMap`, the completion index
//! annotation behind `JOB_COMPLETION_INDEX` — runs the worker's step (`plan`, `batch` or `merge`,
//! from the container's args) on the scratch storage with a scripted OpenAI-compatible server as
//! the model, and reports the result through the pod's `status` subresource: phase, exit code and
//! the summary as the termination message.
//!
//! Runs in real pods on a real kubelet are `tests/tests/real_pods.rs` (the quickstart, a `SIGKILL`ed
//! batch container, a 401, an eviction, the pod's settings at run time). The test-kubelet stays for
//! what a real kubelet cannot give a test deterministically or at this scale:
//! - a crash at an exact point of an exact batch ([`Kubelet::crash`]) and a batch held Pending while
//!   others finish ([`Kubelet::hold`]), which the retry, resume, suspend and re-create tests need
//!   to count exactly which batches ran and how many model requests they made;
//! - runs of thousands to a million batches (the operator bench, the sharding test): kwok's nodes
//!   take their pods without running them, where one real node runs a few at a time;
//! - many runs at once on two cores (the memory bench, the leader hand-over), whose pods would
//!   compete with the control plane;
//! - a run's pods on kwok nodes that never run, so that the operator's own behaviour (status
//!   pacing, a wiped status, deletion, a refused Job) is tested apart from a container runtime;
//! - dozens of batch processes `SIGKILL`ed at random moments of one run (the kill loop,
//!   `tests/tests/kill_loop.rs`), each kill's conversations in flight counted exactly: with
//!   [`Kubelet::worker_binary`] set the kubelet runs each pod as a process of the worker's command
//!   line, several at once, and [`Kubelet::kill`] kills one;
//! - a run's pods on the kwok nodes an autoscaler makes for them (`tests/tests/autoscaling.rs`):
//!   with [`Kubelet::on_nodes`] set it runs only pods bound to a node, and ends a drained one as a
//!   kubelet does (`SIGTERM`, then `SIGKILL` past its grace), which kwok would complete instead.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::{Job, JobStatus};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, PodSpec, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use trajectory_operator::api::{Phase, TrajectoryRun, TrajectoryRunSpec, TrajectoryRunStatus};
use trajectory_operator::controller;
use trajectory_operator::reconcile::Context;
use trajectory_operator::reconcile::children::{CONTAINER, image_index_name, labels};
use trajectory_operator::reconcile::observe::JobState;
use trajectory_operator::settings::Settings;
use trajectory_testkit::scripted_server::{
    FixedLatency, ScriptedServer, text_reply, tool_call_reply,
};
use trajectory_worker::contract::{
    self, RunPlan, WorkerFailure, env, exit, paths, termination_message,
};
use trajectory_worker::run::batch::{Engine, run_batch, shutdown_channel};
use trajectory_worker::run::manifest::Manifest;
use trajectory_worker::run::{RunError, RunLocation, load_plan, merge, plan};
use trajectory_worker::spec::RunSpec;
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};

use crate::{unique_name, wait_until};

/// The annotation the Job controller puts on an Indexed Job's pods (the source of
/// `JOB_COMPLETION_INDEX`).
pub const COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// A node selector no node of the test cluster matches: the run's pods stay Pending and kwok
/// never completes them.
pub const NO_NODE: (&str, &str) = ("trajectories.dev/e2e-kubelet", "the-test");

/// Stops the in-process controller when the test ends, also when it fails.
#[derive(Debug)]
pub struct ControllerGuard {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ControllerGuard {
    /// Stops the controller and waits until it has stopped: an operator restart, the old process
    /// gone before the new one starts.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("the controller stops within 30 s")
                .expect("the controller does not panic");
        }
    }
}

impl Drop for ControllerGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub fn start_controller(client: &Client) -> ControllerGuard {
    start_controller_with(client, Settings::default())
}

/// [`start_controller`] acting only on the runs of `namespace`: tests running at once in one
/// process each reconcile their own runs, as the one operator of a cluster would.
pub fn start_controller_in(client: &Client, namespace: &str) -> ControllerGuard {
    start_controller_with(
        client,
        Settings {
            watch_namespace: Some(namespace.to_owned()),
            ..Settings::default()
        },
    )
}

/// [`start_controller`] with the operator's settings of a given deployment.
pub fn start_controller_with(client: &Client, settings: Settings) -> ControllerGuard {
    let (stop, stopped) = oneshot::channel::<()>();
    let ctx = Context::new(client.clone(), settings);
    let task = tokio::spawn(controller::run(ctx, async {
        let _ = stopped.await;
    }));
    ControllerGuard {
        stop: Some(stop),
        task: Some(task),
    }
}

/// A temporary directory: `data/` stands in for the shared volume, `pods/` holds what a kubelet
/// would mount into each pod. Removed on drop unless the test failed (then its path is printed).
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new() -> Self {
        Self::under(&std::env::temp_dir())
    }

    /// A scratch directory in memory (`/dev/shm`): for storage of hundreds of thousands of small
    /// files, which a disk shared with builds creates and removes a few hundred a second.
    pub fn in_memory() -> Self {
        let shm = Path::new("/dev/shm");
        assert!(
            shm.is_dir(),
            "no /dev/shm for an in-memory scratch directory"
        );
        Self::under(shm)
    }

    fn under(parent: &Path) -> Self {
        let dir = parent.join(unique_name("trajectory-e2e"));
        std::fs::create_dir_all(dir.join("data/datasets")).expect("create the scratch directory");
        Self(dir)
    }

    pub fn storage(&self) -> PathBuf {
        self.0.join("data")
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
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
pub fn write_dataset(storage: &Path, prompts: usize) {
    let mut text = String::new();
    for i in 0..prompts {
        text.push_str(&json!({"prompt": format!("task number {i}")}).to_string());
        text.push('\n');
    }
    std::fs::write(storage.join("datasets/prompts.jsonl"), text).expect("write the dataset");
}

/// The run's spec: 10 prompts in batches of 3 (4 batches), two pods at a time, the scripted model.
pub fn run_spec(base_url: &str, extra: &Value) -> TrajectoryRunSpec {
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

/// Creates the run `name` of [`run_spec`] with `spec` and then `extra` in its spec: the keys of
/// `extra` win, and its `podTemplate` keys are added to those of `spec`.
pub async fn create_run(
    runs: &Api<TrajectoryRun>,
    base_url: &str,
    name: &str,
    mut spec: Value,
    extra: &Value,
) {
    for (key, value) in extra.as_object().into_iter().flatten() {
        match (
            key.as_str(),
            spec.get_mut(key).and_then(Value::as_object_mut),
        ) {
            ("podTemplate", Some(template)) => {
                for (field, setting) in value.as_object().into_iter().flatten() {
                    template.insert(field.clone(), setting.clone());
                }
            }
            _ => spec[key] = value.clone(),
        }
    }
    runs.create(
        &kube::api::PostParams::default(),
        &TrajectoryRun::new(name, run_spec(base_url, &spec)),
    )
    .await
    .unwrap_or_else(|e| panic!("create the run {name}: {e}"));
}

/// What the test-kubelet did with one pod.
#[derive(Debug, Clone)]
pub struct Played {
    pub pod: String,
    /// `plan`, `batch` or `merge` (the container's args).
    pub mode: String,
    /// The batch a `batch` pod worked.
    pub batch: Option<u32>,
    /// The run's phase when the pod was played.
    pub phase: Option<Phase>,
    pub exit_code: i32,
    /// Whether the worker step ran (false when the test made the pod fail without running it).
    pub ran: bool,
    /// The node the pod was bound to, if any.
    pub node: Option<String>,
}

/// Decides, per pod about to be played, whether it crashes (exit code) before running the worker.
pub type Crash = dyn Fn(&str, Option<u32>, &[Played]) -> Option<i32> + Send + Sync;

/// Plays the kubelet for the pods of one run.
pub struct Kubelet {
    pub pods: Api<Pod>,
    pub maps: Api<ConfigMap>,
    /// Where the values of `secretKeyRef` variables are read, as a kubelet reads them.
    pub secrets: Api<Secret>,
    pub runs: Api<TrajectoryRun>,
    pub run: String,
    pub storage: PathBuf,
    pub scratch: PathBuf,
    pub played: Arc<Mutex<Vec<Played>>>,
    /// Pods that were deleted before they ended (a suspended Job, an eviction) and that the
    /// kubelet stopped, as a real one kills a deleted pod's containers.
    pub stopped: Arc<Mutex<Vec<String>>>,
    pub crash: Box<Crash>,
    /// Batches whose pods are left Pending for now.
    pub hold: BTreeSet<u32>,
    /// When set, each pod's step runs as a process of this binary — the worker's command line,
    /// built with these tests as the `e2e-worker` binary (`env!("CARGO_BIN_EXE_e2e-worker")`) —
    /// in the background, so that several pods run at once and a process can be killed
    /// ([`Kubelet::kill`]). Pods deleted while their process runs are not stopped.
    pub worker_binary: Option<PathBuf>,
    /// For a run on a bucket (`spec.storage.object`), how the steps played in this process reach
    /// it (its keys included: the Secret's values of a real pod); `storage` is then where this
    /// machine sees the bucket's prefix.
    pub bucket: Option<trajectory_worker::storage::BucketOptions>,
    /// Plays only pods the scheduler bound to a node (an autoscaler's kwok node, labelled to match
    /// the run's node selector), and ends a deleted bound pod as a kubelet does: its process sent
    /// `SIGTERM`, `SIGKILL` once the pod's grace period has passed, then the pod removed.
    pub on_nodes: bool,
    /// The pods whose worker process runs, by name.
    running: Arc<Mutex<BTreeMap<String, RunningPod>>>,
}

/// A pod whose worker process runs.
#[derive(Debug)]
struct RunningPod {
    batch: Option<u32>,
    started: Instant,
    pid: Option<u32>,
    /// When the process was sent `SIGTERM` (its pod deleted).
    terminated: Option<Instant>,
    /// Tells the task waiting for the process to `SIGKILL` it.
    kill: Option<oneshot::Sender<()>>,
}

/// A batch pod whose worker process runs, as [`Kubelet::running_batches`] lists them.
#[derive(Debug, Clone)]
pub struct RunningBatch {
    pub pod: String,
    pub batch: u32,
    pub running_for: Duration,
}

impl std::fmt::Debug for Kubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubelet")
            .field("run", &self.run)
            .field("storage", &self.storage)
            .field("hold", &self.hold)
            .field("played", &self.played())
            .finish_non_exhaustive()
    }
}

impl Kubelet {
    pub fn new(client: &Client, namespace: &str, run: &str, scratch: &Scratch) -> Self {
        Self {
            pods: Api::namespaced(client.clone(), namespace),
            maps: Api::namespaced(client.clone(), namespace),
            secrets: Api::namespaced(client.clone(), namespace),
            runs: Api::namespaced(client.clone(), namespace),
            run: run.to_owned(),
            storage: scratch.storage(),
            scratch: scratch.0.join("pods"),
            played: Arc::default(),
            stopped: Arc::default(),
            crash: Box::new(|_, _, _| None),
            hold: BTreeSet::new(),
            worker_binary: None,
            bucket: None,
            on_nodes: false,
            running: Arc::default(),
        }
    }

    pub fn played(&self) -> Vec<Played> {
        self.played.lock().expect("not poisoned").clone()
    }

    pub fn stopped(&self) -> Vec<String> {
        self.stopped.lock().expect("not poisoned").clone()
    }

    /// Plays every Pending pod of the run once, and stops the deleted ones; returns how many it
    /// played.
    pub async fn play_pending(&self) -> usize {
        let selector = format!("{}={}", labels::RUN, self.run);
        let list = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the run's pods");
        let mut count = 0;
        for pod in list.items {
            if self.on_nodes {
                // An unscheduled pod has no kubelet yet.
                if pod
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.node_name.as_ref())
                    .is_none()
                {
                    continue;
                }
                if pod.metadata.deletion_timestamp.is_some() {
                    self.end_deleted(&pod).await;
                    continue;
                }
            }
            let pending = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
            let seen = self.seen(&pod.name_any());
            // A pod with scheduling gates (Kueue's, on an elastic Job's new pod until its slice is
            // admitted) is not scheduled, so no kubelet starts it.
            let gated = pod
                .spec
                .as_ref()
                .and_then(|spec| spec.scheduling_gates.as_ref())
                .is_some_and(|gates| !gates.is_empty());
            if !pending || seen || gated {
                continue;
            }
            if pod.metadata.deletion_timestamp.is_some() {
                self.stop(&pod).await;
            } else if self.play(&pod).await {
                count += 1;
            }
        }
        count
    }

    /// Ends a pod deleted before it ran, as a kubelet does: its container killed (exit code 143,
    /// SIGTERM), the pod `Failed`. The conditions the control plane set stay (a strategic merge
    /// keeps `DisruptionTarget`), so the Job's pod failure policy sees why it was deleted.
    pub async fn stop(&self, pod: &Pod) {
        let name = pod.name_any();
        if self.stopped().contains(&name) {
            return;
        }
        let now = Timestamp::now().to_string();
        let patch = json!({
            "status": {
                "phase": "Failed",
                "containerStatuses": [{
                    "name": CONTAINER,
                    "image": pod.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone()).unwrap_or_default(),
                    "imageID": "",
                    "ready": false,
                    "restartCount": 0,
                    "started": false,
                    "state": {"terminated": {
                        "exitCode": 143, "reason": "Error", "startedAt": now, "finishedAt": now,
                    }},
                }],
            }
        });
        match self
            .pods
            .patch_status(&name, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
        {
            Ok(_) => self.stopped.lock().expect("not poisoned").push(name),
            // Gone already: the Job controller let go of it.
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => panic!("stopping the deleted pod {name}: {e}"),
        }
    }

    /// Ends a deleted pod bound to a node, one step per call, as a kubelet does: a running process
    /// is sent `SIGTERM` (the worker finishes its conversations in flight and exits), then
    /// `SIGKILL` once the pod's grace period has passed; a pod never started is stopped; an ended
    /// one is removed (deleted with no grace), which lets a drained node go.
    async fn end_deleted(&self, pod: &Pod) {
        let name = pod.name_any();
        let grace = Duration::from_secs(
            pod.metadata
                .deletion_grace_period_seconds
                .and_then(|seconds| u64::try_from(seconds).ok())
                .unwrap_or(30),
        );
        let kill = {
            let mut running = self.running.lock().expect("not poisoned");
            match running.get_mut(&name) {
                Some(process) => match process.terminated {
                    None => {
                        process.terminated = Some(Instant::now());
                        if let Some(pid) = process.pid.and_then(|pid| i32::try_from(pid).ok()) {
                            // An error means the process has just ended; its end is reported.
                            let _ = nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid),
                                nix::sys::signal::Signal::SIGTERM,
                            );
                        }
                        return;
                    }
                    Some(sent) if sent.elapsed() >= grace => process.kill.take(),
                    Some(_) => return,
                },
                None => None,
            }
        };
        if let Some(kill) = kill {
            let _ = kill.send(());
            return;
        }
        if !self.seen(&name) {
            self.stop(pod).await;
        }
        match self
            .pods
            .delete(&name, &DeleteParams::default().grace_period(0))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => panic!("removing the ended pod {name}: {e}"),
        }
    }

    /// Waits for the run's plan pod and for the run to show `Planning` (see [`Kubelet::play`]), then
    /// plays that pod alone; returns whether it played.
    pub async fn play_the_plan(&self) -> bool {
        let selector = format!("{}={},{}=plan", labels::RUN, self.run, labels::COMPONENT);
        let plan_pod = wait_until("the plan pod", Duration::from_secs(30), || async {
            self.pods
                .list(&ListParams::default().labels(&selector))
                .await
                .ok()?
                .items
                .into_iter()
                .next()
        })
        .await;
        wait_until(
            "the run to show Planning",
            Duration::from_secs(30),
            || async {
                let run = self.runs.get(&self.run).await.ok()?;
                (phase_of(&run) == Some(Phase::Planning)).then_some(())
            },
        )
        .await;
        self.play(&plan_pod).await
    }

    /// Runs what the pod's container would run, then reports it through the pod's status; false
    /// when the pod cannot start (no plan `ConfigMap`), its batch is held or the run's phase is not
    /// yet the pod's stage. With [`Kubelet::worker_binary`] set it starts the worker's process and
    /// returns at once; the process's end is reported when it comes.
    pub async fn play(&self, pod: &Pod) -> bool {
        let name = pod.name_any();
        let spec = pod.spec.as_ref().expect("a pod spec");
        let container = spec
            .containers
            .iter()
            .find(|c| c.name == CONTAINER)
            .expect("the worker container");
        let mode = worker_mode(container);
        let pod_dir = self.scratch.join(&name);
        // Without its ConfigMap (the run is being deleted) a kubelet cannot start the pod either.
        let Some(plan_path) = self.mount_plan(spec, &pod_dir).await else {
            return false;
        };
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
            "plan" | "image-page" => Phase::Planning,
            "batch" => Phase::Running,
            _ => Phase::Merging,
        };
        if phase != Some(stage_phase) {
            return false;
        }
        // Only a batch pod's completion index maps to a batch (an image-page pod's is a page).
        let batch = load_plan(&plan_path)
            .ok()
            .filter(|_| mode == "batch")
            .and_then(|plan| index.and_then(|i| self.batch_of(&plan, i)));
        if batch.is_some_and(|batch| self.hold.contains(&batch)) {
            return false;
        }
        let crash = (self.crash)(&mode, batch, &self.played());
        let played = Played {
            pod: name.clone(),
            mode,
            batch,
            phase,
            exit_code: exit::OK,
            ran: crash.is_none(),
            node: spec.node_name.clone(),
        };
        if let (Some(binary), None) = (&self.worker_binary, crash) {
            let secrets = self.secret_values(container).await;
            self.start_process(binary, pod, container, played, &pod_dir, &secrets);
            return true;
        }
        let (exit_code, message) = if let Some(code) = crash {
            (code, String::new())
        } else {
            let env_var = |name: &str| {
                container
                    .env
                    .iter()
                    .flatten()
                    .find(|var| var.name == name)
                    .and_then(|var| var.value.clone())
            };
            let pod_env = PodEnv {
                image_index: env_var(env::IMAGE_INDEX),
                image_unavailable: env_var(env::IMAGE_UNAVAILABLE),
            };
            self.run_worker_in(
                &played.mode,
                &plan_path,
                index,
                &pod_dir.join("workspace"),
                &pod_env,
            )
            .await
        };
        self.played.lock().expect("not poisoned").push(Played {
            exit_code,
            ..played
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

    /// Plays an earlier run of this run's name on the same storage (another uid, the same spec):
    /// its plan step. Returns that plan's path and a workspace, for its batch steps.
    pub async fn plan_an_earlier_run(&self, namespace: &str, spec: &RunSpec) -> (PathBuf, PathBuf) {
        let earlier = RunPlan {
            name: self.run.clone(),
            namespace: namespace.to_owned(),
            uid: "an-earlier-run".into(),
            output_path: spec.output_path(namespace, &self.run),
            spec: spec.clone(),
            batches: None,
            batch_ranges: None,
            pending_list: None,
        };
        let earlier_dir = self.scratch.join("earlier");
        std::fs::create_dir_all(&earlier_dir).expect("the earlier run's directory");
        let plan_path = earlier_dir.join(paths::PLAN_FILE);
        std::fs::write(&plan_path, serde_json::to_string(&earlier).expect("JSON"))
            .expect("the earlier plan");
        let workspace = earlier_dir.join("workspace");
        let (code, message) = self.run_worker("plan", &plan_path, None, &workspace).await;
        assert_eq!(code, exit::OK, "the earlier run's plan: {message}");
        (plan_path, workspace)
    }

    /// The batch completion index `index` works under `plan`: through the plan's pending list on
    /// storage when it has one.
    fn batch_of(&self, plan: &RunPlan, index: u32) -> Option<u32> {
        let Some(list) = &plan.pending_list else {
            return plan.batch_for_index(index);
        };
        let path = self.storage.join(&plan.output_path).join(list);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading the pending list {}: {e}", path.display()));
        contract::resolve_batch(text.trim(), plan.batch_ranges.as_deref(), index)
    }

    /// Starts the pod's container as a process of `binary` with the container's args and
    /// environment ([`process_env`]), its output in `log` in the pod's directory, and a task that
    /// reports its end — exit code, or 128 + the signal that ended it, as a container runtime
    /// does (137 for `SIGKILL`) — with the termination log as the message.
    /// The values of the container's `secretKeyRef` variables, by variable: a key missing from
    /// its Secret is left out when the reference is optional, and fails the test otherwise.
    async fn secret_values(&self, container: &Container) -> BTreeMap<String, String> {
        let mut values = BTreeMap::new();
        for var in container.env.iter().flatten() {
            let Some(selector) = var
                .value_from
                .as_ref()
                .and_then(|from| from.secret_key_ref.as_ref())
            else {
                continue;
            };
            let secret =
                self.secrets.get(&selector.name).await.unwrap_or_else(|e| {
                    panic!("the Secret {} of {}: {e}", selector.name, var.name)
                });
            let value = secret
                .data
                .as_ref()
                .and_then(|data| data.get(&selector.key))
                .map(|bytes| String::from_utf8_lossy(&bytes.0).into_owned());
            match value {
                Some(value) => {
                    values.insert(var.name.clone(), value);
                }
                None if selector.optional == Some(true) => {}
                None => panic!("the Secret {} has no key {}", selector.name, selector.key),
            }
        }
        values
    }

    fn start_process(
        &self,
        binary: &Path,
        pod: &Pod,
        container: &Container,
        mut played: Played,
        pod_dir: &Path,
        secrets: &BTreeMap<String, String>,
    ) {
        let log_path = pod_dir.join("log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log_path.display()));
        let stderr = log.try_clone().expect("a second handle on the log");
        let mut child = tokio::process::Command::new(binary)
            .args(container.args.iter().flatten())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(process_env(pod, container, &self.storage, pod_dir, secrets))
            .current_dir(pod_dir)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(stderr)
            // A test that fails or ends leaves no worker running.
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let (kill, killed) = oneshot::channel();
        self.running.lock().expect("not poisoned").insert(
            played.pod.clone(),
            RunningPod {
                batch: played.batch,
                started: Instant::now(),
                pid: child.id(),
                terminated: None,
                kill: Some(kill),
            },
        );
        let (pods, record, running) = (
            self.pods.clone(),
            Arc::clone(&self.played),
            Arc::clone(&self.running),
        );
        let image = container.image.clone().unwrap_or_default();
        let termination_log = pod_dir.join("termination-log");
        tokio::spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                Ok(()) = killed => {
                    // `start_kill` is SIGKILL; an error means the process had ended already.
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            played.exit_code = status.map_or(-1, |status| {
                use std::os::unix::process::ExitStatusExt;
                status
                    .code()
                    .or_else(|| status.signal().map(|signal| 128 + signal))
                    .unwrap_or(-1)
            });
            // As a kubelet reads `terminationMessagePath`: empty when the worker wrote nothing.
            let message = std::fs::read_to_string(&termination_log).unwrap_or_default();
            if let Err(e) =
                report_status(&pods, &played.pod, &image, played.exit_code, &message).await
            {
                eprintln!("reporting the end of pod {}: {e}", played.pod);
            }
            // One step under both locks (in this order, as `started_pods` takes them): the pod is
            // always either running or played.
            let mut running = running.lock().expect("not poisoned");
            running.remove(&played.pod);
            record.lock().expect("not poisoned").push(played);
        });
    }

    /// The batch pods whose worker process runs now.
    pub fn running_batches(&self) -> Vec<RunningBatch> {
        self.running
            .lock()
            .expect("not poisoned")
            .iter()
            .filter_map(|(pod, running)| {
                Some(RunningBatch {
                    pod: pod.clone(),
                    batch: running.batch?,
                    running_for: running.started.elapsed(),
                })
            })
            .collect()
    }

    /// Whether the kubelet has started the pod (its process may still run).
    fn seen(&self, pod: &str) -> bool {
        let running = self.running.lock().expect("not poisoned");
        let played = self.played.lock().expect("not poisoned");
        running.contains_key(pod) || played.iter().any(|p| p.pod == pod)
    }

    /// How many pods of `batch` the kubelet has started, ended or running.
    pub fn started_pods(&self, batch: u32) -> usize {
        let running = self.running.lock().expect("not poisoned");
        let played = self.played.lock().expect("not poisoned");
        running.values().filter(|r| r.batch == Some(batch)).count()
            + played.iter().filter(|p| p.batch == Some(batch)).count()
    }

    /// `SIGKILL`s the worker process of `pod`, as `kill -9` or the OOM killer on a node would,
    /// and waits until its end is reported (exit code 137, or its own when it ended just before
    /// the signal); `None` when no process of that pod is running.
    pub async fn kill(&self, pod: &str) -> Option<Played> {
        let kill = self
            .running
            .lock()
            .expect("not poisoned")
            .get_mut(pod)?
            .kill
            .take()?;
        // A refused signal means the process ended by itself meanwhile; its end is reported all
        // the same.
        let _ = kill.send(());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(played) = self.played().into_iter().rev().find(|p| p.pod == pod) {
                return Some(played);
            }
            assert!(
                Instant::now() < deadline,
                "the killed process of pod {pod} was not reported within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Writes the pod's plan `ConfigMap` where the pod would see it mounted; `None` when the
    /// `ConfigMap` is gone.
    async fn mount_plan(&self, spec: &PodSpec, pod_dir: &Path) -> Option<PathBuf> {
        let map_name = spec
            .volumes
            .iter()
            .flatten()
            .find_map(|v| v.config_map.as_ref().map(|c| c.name.clone()))
            .expect("the plan ConfigMap volume");
        let map = self
            .maps
            .get_opt(&map_name)
            .await
            .expect("get the plan ConfigMap")?;
        let plan_json = map
            .data
            .and_then(|mut d| d.remove(paths::PLAN_FILE))
            .expect("plan.json in the ConfigMap");
        std::fs::create_dir_all(pod_dir).expect("create the pod's directory");
        let plan_path = pod_dir.join(paths::PLAN_FILE);
        std::fs::write(&plan_path, plan_json).expect("write the mounted plan");
        Some(plan_path)
    }

    /// The worker's step, as `trajectory-worker <mode>` runs it: exit code and termination message.
    pub async fn run_worker(
        &self,
        mode: &str,
        plan_path: &Path,
        index: Option<u32>,
        workspace: &Path,
    ) -> (i32, String) {
        self.run_worker_in(mode, plan_path, index, workspace, &PodEnv::default())
            .await
    }

    /// [`Kubelet::run_worker`] with what the pod's environment adds.
    pub async fn run_worker_in(
        &self,
        mode: &str,
        plan_path: &Path,
        index: Option<u32>,
        workspace: &Path,
        pod_env: &PodEnv,
    ) -> (i32, String) {
        fn report<T: serde::Serialize>(result: Result<T, RunError>) -> (i32, String) {
            match result {
                Ok(summary) => (exit::OK, termination_message(&summary)),
                Err(error) => (
                    error.exit_code(),
                    termination_message(&WorkerFailure::new(
                        &error.to_string(),
                        error.reason(),
                        error.exit_code(),
                    )),
                ),
            }
        }
        let location = match (load_plan(plan_path), &self.bucket) {
            (Ok(plan), None) => RunLocation {
                storage_root: self.storage.clone(),
                store: trajectory_worker::storage::Store::Volume,
                plan,
            },
            (Ok(plan), Some(bucket)) => {
                match RunLocation::of_plan(self.storage.clone(), bucket, plan) {
                    Ok(location) => location,
                    Err(error) => return report::<()>(Err(error)),
                }
            }
            (Err(error), _) => return report::<()>(Err(error)),
        };
        match mode {
            // As `trajectory-worker plan` does: the summary cut to fit the termination message,
            // the pending list written to storage when it is.
            "plan" => report(
                tokio::task::spawn_blocking(move || plan::plan_for_operator(&location))
                    .await
                    .expect("the plan step does not panic"),
            ),
            "merge" => report(
                tokio::task::spawn_blocking(move || merge::merge(&location))
                    .await
                    .expect("the merge step does not panic"),
            ),
            "image-page" => report(plan::image_page(
                &location,
                pod_env.image_index.as_deref().unwrap_or_default(),
                index.unwrap_or_default(),
            )),
            "batch" => {
                let result = async {
                    let index =
                        index.ok_or_else(|| RunError::Spec("no completion index".into()))?;
                    let batch = location.batch_for_index(index)?;
                    let manifest = Manifest::require(&location.run_dir())?;
                    let mut engine = Engine::new(&location.plan.spec, workspace.to_path_buf())?;
                    engine.sandbox = Sandbox::local(LandlockMode::Auto);
                    engine
                        .image_unavailable
                        .clone_from(&pod_env.image_unavailable);
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
    pub async fn report(&self, pod: &str, image: &str, exit_code: i32, message: &str) {
        report_status(&self.pods, pod, image, exit_code, message)
            .await
            .unwrap_or_else(|e| panic!("patching the status of pod {pod}: {e}"));
    }

    /// Plays pods until `done` holds for the run (checked after every round), or `timeout`.
    pub async fn serve_until(
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

/// What a pod's environment tells its worker step beyond the plan (the operator sets it).
#[derive(Debug, Clone, Default)]
pub struct PodEnv {
    /// `TRAJ_IMAGE_INDEX`: the image index whose page an `image-page` pod reports.
    pub image_index: Option<String>,
    /// `TRAJ_IMAGE_UNAVAILABLE`: the batch's rows' image could not be pulled.
    pub image_unavailable: Option<String>,
}

/// The container's end reported through the pod's `status` subresource, as a kubelet does:
/// `Succeeded` on exit code 0, `Failed` otherwise, the summary as the termination message.
async fn report_status(
    pods: &Api<Pod>,
    pod: &str,
    image: &str,
    exit_code: i32,
    message: &str,
) -> Result<(), kube::Error> {
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
    // A strategic merge, as a kubelet's: the conditions others set (`DisruptionTarget`, which
    // the Job's pod failure policy reads) stay.
    pods.patch_status(pod, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .map(drop)
}

/// The run status' condition `type_`.
pub fn condition<'a>(status: &'a TrajectoryRunStatus, type_: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

pub fn phase_of(run: &TrajectoryRun) -> Option<Phase> {
    run.status.as_ref().and_then(|s| s.phase)
}

/// The done batches of `status.progress` (`done/total`).
pub fn done_batches(run: &TrajectoryRun) -> u32 {
    run.status
        .as_ref()
        .and_then(|s| s.progress.as_deref())
        .and_then(|p| p.split_once('/'))
        .and_then(|(done, _)| done.parse().ok())
        .unwrap_or(0)
}

/// The model: each conversation calls the terminal once, then answers.
pub async fn model() -> ScriptedServer {
    model_with_latency(Duration::from_millis(5)).await
}

/// [`model`] answering each request after `latency`.
pub async fn model_with_latency(latency: Duration) -> ScriptedServer {
    ScriptedServer::start_fixed_latency(FixedLatency {
        latency,
        tool_call: tool_call_reply("terminal", &json!({"command": "echo hi"})),
        final_answer: text_reply("done"),
    })
    .await
}

/// The lines of a JSONL output file of the run.
pub fn jsonl(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}")))
        .collect()
}

/// The run's row as `kubectl get trun` prints it: the server-side Table of the printer columns.
pub async fn printed_row(client: &Client, namespace: &str, name: &str) -> BTreeMap<String, Value> {
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
pub async fn children(client: &Client, namespace: &str, run: &str) -> (Vec<String>, Vec<String>) {
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

/// The status of the Job `name`.
pub async fn job_status(client: &Client, namespace: &str, name: &str) -> JobStatus {
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    jobs.get(name)
        .await
        .unwrap_or_else(|e| panic!("get the Job {name}: {e}"))
        .status
        .unwrap_or_else(|| panic!("the Job {name} has no status"))
}

/// The phase-change Events on the run, in the order they happened.
pub async fn phase_events(client: &Client, namespace: &str, uid: &str) -> Vec<String> {
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

/// Every file under `dir` with its content, to show that nothing on the storage changed.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(dir: &Path, files: &mut BTreeMap<PathBuf, Vec<u8>>) {
        let entries =
            std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, files);
            } else {
                let content = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                files.insert(path, content);
            }
        }
    }
    let mut files = BTreeMap::new();
    walk(dir, &mut files);
    files
}

/// The pods of the Job `job` that work completion index `index`, oldest first.
pub async fn pods_of_index(pods: &Api<Pod>, job: &str, index: u32) -> Vec<Pod> {
    let selector = format!("batch.kubernetes.io/job-name={job}");
    let mut list: Vec<Pod> = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .expect("list the Job's pods")
        .items
        .into_iter()
        .filter(|pod| pod.annotations().get(COMPLETION_INDEX) == Some(&index.to_string()))
        .collect();
    list.sort_by_key(|pod| pod.metadata.creation_timestamp.as_ref().map(|t| t.0));
    list
}

/// `GET path` over plain HTTP/1.1 (the operator's `/metrics`, `/readyz`): the whole response, or
/// `None` when nothing answers.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    Some(response)
}

/// Checks a finished run of the 10 prompts of [`write_dataset`] in the 4 batches of [`run_spec`]:
/// `Succeeded`, every batch done and none failed, each batch's pod run once, every prompt generated
/// exactly once (`model_requests`, the model's count, is 20: a conversation redone would ask
/// more) and merged once in dataset order. `context` is added to the message of a run that did not
/// succeed.
pub fn assert_succeeded_once(
    run: &TrajectoryRun,
    kubelet: &Kubelet,
    model_requests: usize,
    context: &str,
) {
    let status = run.status.clone().expect("a status");
    assert_eq!(
        status.phase,
        Some(Phase::Succeeded),
        "{status:#?}; played {:#?}{context}",
        kubelet.played()
    );
    let batches = status.batches.as_ref().expect("batch counts");
    assert_eq!(
        (batches.completed.as_str(), batches.failed.as_str()),
        ("0-3", ""),
        "every batch done, none counted as failed"
    );
    // A pod stopped by SIGTERM (a drained node) left its batch for the next pod; the test that
    // stops one checks it.
    let mut ran: Vec<u32> = kubelet
        .played()
        .iter()
        .filter(|p| p.mode == "batch" && p.ran && p.exit_code != exit::INTERRUPTED)
        .filter_map(|p| p.batch)
        .collect();
    ran.sort_unstable();
    assert_eq!(ran, [0, 1, 2, 3], "{:#?}", kubelet.played());
    assert_eq!(model_requests, 20, "a conversation was generated twice");
    let namespace = run.namespace().unwrap_or_default();
    let out = kubelet
        .storage
        .join(run.spec.run.output_path(&namespace, &run.name_any()));
    let indexes: Vec<u64> = jsonl(&out.join("trajectories.jsonl"))
        .iter()
        .map(|line| line["prompt_index"].as_u64().expect("prompt_index"))
        .collect();
    assert_eq!(indexes, (0..10).collect::<Vec<u64>>());
}

/// Checks that `batch` ran exactly once, and not on `held`, the pod that held it before the run
/// was stopped: a pod of the resumed Job ran it.
pub fn assert_ran_once_on_a_new_pod(kubelet: &Kubelet, batch: u32, held: &str) {
    let played = kubelet.played();
    let ran: Vec<&Played> = played.iter().filter(|p| p.batch == Some(batch)).collect();
    assert!(
        ran.len() == 1 && ran[0].pod != held,
        "batch {batch} ran once, on a pod of the resumed Job: {ran:#?}"
    );
}

/// The environment of the pod's worker container as the process sees it: its literal values and
/// the values it takes from the pod's labels and annotations (the Job controller's
/// `JOB_COMPLETION_INDEX`), with the contract's paths mapped onto what this kubelet mounts — the
/// storage, the plan, the termination log and the workspace in the pod's directory.
fn process_env(
    pod: &Pod,
    container: &Container,
    storage: &Path,
    pod_dir: &Path,
    secrets: &BTreeMap<String, String>,
) -> Vec<(String, OsString)> {
    let field = |path: &str| -> Option<String> {
        let (map, key) = path.strip_suffix("']")?.split_once("['")?;
        let values = match map {
            "metadata.annotations" => pod.metadata.annotations.as_ref(),
            "metadata.labels" => pod.metadata.labels.as_ref(),
            _ => None,
        }?;
        values.get(key).cloned()
    };
    let mounted = |name: &str| -> Option<PathBuf> {
        match name {
            env::PLAN_PATH => Some(pod_dir.join(paths::PLAN_FILE)),
            env::STORAGE_ROOT => Some(storage.to_path_buf()),
            env::TERMINATION_LOG => Some(pod_dir.join("termination-log")),
            env::WORKSPACE_ROOT => Some(pod_dir.join("workspace")),
            _ => None,
        }
    };
    container
        .env
        .iter()
        .flatten()
        // The test-kubelet runs no sandbox container: its workers start their executors
        // themselves, as a local run does.
        .filter(|var| var.name != env::SANDBOX_SOCKET)
        .filter(|var| {
            // An optional key its Secret does not hold: the variable is not set.
            let from_secret = var
                .value_from
                .as_ref()
                .is_some_and(|from| from.secret_key_ref.is_some());
            !from_secret || secrets.contains_key(&var.name)
        })
        .map(|var| {
            let value = if let Some(path) = mounted(&var.name) {
                path.into_os_string()
            } else if let Some(value) = &var.value {
                value.into()
            } else if let Some(value) = secrets.get(&var.name) {
                value.into()
            } else {
                let Some(path) = var
                    .value_from
                    .as_ref()
                    .and_then(|from| from.field_ref.as_ref())
                    .map(|field_ref| field_ref.field_path.as_str())
                else {
                    panic!("the test-kubelet cannot resolve {var:?}");
                };
                field(path)
                    .unwrap_or_else(|| panic!("pod {} has no {path}", pod.name_any()))
                    .into()
            };
            (var.name.clone(), value)
        })
        .collect()
}

/// One record line of a batch file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BatchRecord {
    /// The batch of the file that holds it.
    pub batch: u32,
    pub prompt_index: u64,
    pub sample: u64,
}

/// The records of the batch files in `run_dir`'s `batches/` (of `batch` only, when given), in
/// batch, file and line order: every records file of a batch (each writer's, and the single file
/// of older workers) but the `OpenAI` twins. A torn last line (a writer killed mid-write) is no
/// record: resume and merge leave it out too.
pub fn batch_records(run_dir: &Path, batch: Option<u32>) -> Vec<BatchRecord> {
    let batches: Vec<u32> = match batch {
        Some(batch) => vec![batch],
        None => batches_with_records(run_dir),
    };
    let mut records = Vec::new();
    for batch in batches {
        for record in crate::real_pods::batch_records(run_dir, batch) {
            records.push(BatchRecord {
                batch,
                prompt_index: record["prompt_index"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("batch {batch}: no prompt_index: {record}")),
                sample: record["sample"].as_u64().unwrap_or(0),
            });
        }
    }
    records
}

/// The batches of `run_dir` with records files: a directory `batch-NNNNNN` of writers' files, or
/// an older worker's `batch-NNNNNN.jsonl`; ascending.
fn batches_with_records(run_dir: &Path) -> Vec<u32> {
    let dir = run_dir.join("batches");
    let mut batches: Vec<u32> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|entry| {
            let name = entry.expect("a directory entry").file_name();
            let name = name.to_str()?.strip_prefix("batch-")?;
            let digits = name.strip_suffix(".jsonl").unwrap_or(name);
            (digits.len() == 6).then(|| digits.parse().ok()).flatten()
        })
        .collect();
    batches.sort_unstable();
    batches.dedup();
    batches
}

/// The worker subcommand of the pod's container, after checking that the container points the
/// worker at the contract's paths (which the test maps onto its own directories).
fn worker_mode(container: &Container) -> String {
    let env = |key: &str| {
        container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == key)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(
        env("TRAJ_PLAN_PATH").as_deref(),
        Some(format!("{}/{}", paths::PLAN_DIR, paths::PLAN_FILE).as_str())
    );
    assert_eq!(
        env("TRAJ_STORAGE_ROOT").as_deref(),
        Some(paths::STORAGE_ROOT)
    );
    container
        .args
        .as_ref()
        .and_then(|args| args.first())
        .cloned()
        .expect("the worker subcommand in the container's args")
}

/// The termination message of the plan pod of `run`, once the pod has ended.
pub async fn plan_termination_message(
    client: &Client,
    namespace: &str,
    run: &str,
) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let selector = format!("{}={run},{}=plan", labels::RUN, labels::COMPONENT);
    pods.list(&ListParams::default().labels(&selector))
        .await
        .expect("list the plan pod")
        .items
        .into_iter()
        .filter_map(|pod| pod.status?.container_statuses)
        .flatten()
        .find_map(|status| status.state?.terminated?.message)
}

/// `count` distinct batch ids below `total`, drawn with `seed`.
pub fn random_batches(total: u32, count: u32, seed: u64) -> BTreeSet<u32> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let to_usize = |n: u32| usize::try_from(n).expect("a count");
    rand::seq::index::sample(&mut rng, to_usize(total), to_usize(count))
        .into_iter()
        .map(|id| u32::try_from(id).expect("a batch id"))
        .collect()
}

/// Writes the `.done` markers of `batches` in the batches directory `dir`, as batches that
/// finished would have.
pub fn mark_done(dir: &Path, batches: &BTreeSet<u32>) {
    std::fs::create_dir_all(dir).expect("the batches directory");
    for batch in batches {
        let marker = json!({
            "batch": batch, "succeeded": 1, "discarded": 0, "failed": 0,
            "finishedAt": "2026-12-01T00:00:00Z",
        });
        std::fs::write(
            dir.join(format!("batch-{batch:06}.done")),
            marker.to_string(),
        )
        .expect("a done marker");
    }
}

/// Writes `rows` rows over `images` images (row *i* names image `i * images / rows`, under a long
/// registry name, as SWE-style datasets' are) to `datasets/images.jsonl` on the storage.
pub fn write_image_dataset(storage: &Path, rows: usize, images: usize) {
    let lines: Vec<String> = (0..rows)
        .map(|row| {
            json!({
                "prompt": format!("prompt {row}"),
                // Exactly `images` images, in order, their rows as even as the division allows
                // (20,000 rows over 3,500 images: 5 or 6 each).
                "image": format!(
                    "registry.example.internal:5000/swebench/sweb.eval.x86_64.task_{:05}:latest",
                    row * images / rows
                ),
            })
            .to_string()
        })
        .collect();
    std::fs::create_dir_all(storage.join("datasets")).expect("the datasets directory");
    std::fs::write(
        storage.join("datasets/images.jsonl"),
        lines.join("\n") + "\n",
    )
    .expect("the dataset");
}

/// What [`count_live_children`] saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveChildren {
    /// The most generation Jobs running at once.
    pub most_jobs: usize,
    /// The most generation pods at once (finished ones included, until their Job is deleted).
    pub most_pods: usize,
    /// When the first generation pod was seen, after `since`.
    pub first_pod: Option<Duration>,
    /// The writes of the namespace's runs' status seen (a watch shows each write), and over how
    /// long.
    pub status_writes: usize,
    pub watched: Duration,
}

/// Counts the changes of the status of the runs in `runs` the watch shows, until `stopped`.
async fn count_status_writes(
    runs: Api<TrajectoryRun>,
    mut stopped: oneshot::Receiver<()>,
) -> usize {
    use futures::StreamExt as _;
    use kube::runtime::{WatchStreamExt as _, watcher};
    let mut last: BTreeMap<String, Option<TrajectoryRunStatus>> = BTreeMap::new();
    let mut writes = 0;
    let mut stream = std::pin::pin!(watcher(runs, watcher::Config::default()).applied_objects());
    loop {
        tokio::select! {
            _ = &mut stopped => return writes,
            next = stream.next() => match next {
                Some(Ok(run)) => {
                    let previous = last.insert(run.name_any(), run.status.clone());
                    if previous.is_some_and(|previous| previous != run.status) {
                        writes += 1;
                    }
                }
                Some(Err(_)) => {}
                None => return writes,
            }
        }
    }
}

/// Counts the generation Jobs that have not finished, and the generation pods, every 100 ms until
/// stopped: the most of each seen at once, and when the first pod appeared after `since` (the
/// run's creation).
pub fn count_live_children(
    client: &Client,
    namespace: &str,
    since: Instant,
) -> (oneshot::Sender<()>, JoinHandle<LiveChildren>) {
    let (jobs, pods): (Api<Job>, Api<Pod>) = (
        Api::namespaced(client.clone(), namespace),
        Api::namespaced(client.clone(), namespace),
    );
    let (stop, mut stopped) = oneshot::channel::<()>();
    let (stop_watch, watch_stopped) = oneshot::channel::<()>();
    let status_writes = tokio::spawn(count_status_writes(
        Api::namespaced(client.clone(), namespace),
        watch_stopped,
    ));
    let counting = tokio::spawn(async move {
        let mut seen = LiveChildren::default();
        let generate = ListParams::default().labels("app.kubernetes.io/component=generate");
        loop {
            if let Ok(listed) = jobs.list(&generate).await {
                let live = listed
                    .items
                    .iter()
                    .filter(|job| JobState::of(job) == JobState::Running)
                    .count();
                seen.most_jobs = seen.most_jobs.max(live);
            }
            if let Ok(listed) = pods.list(&generate).await {
                seen.most_pods = seen.most_pods.max(listed.items.len());
                if seen.first_pod.is_none() && !listed.items.is_empty() {
                    seen.first_pod = Some(since.elapsed());
                }
            }
            tokio::select! {
                _ = &mut stopped => {
                    let _ = stop_watch.send(());
                    seen.status_writes = status_writes.await.unwrap_or_default();
                    seen.watched = since.elapsed();
                    return seen;
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    });
    (stop, counting)
}

/// What a run of `rows` rows over `images` images and `workers` workers must have done once it
/// ended: succeeded with every image pulled, never more generation Jobs running at once than
/// workers (nor pods than twice that per batch of an image), its groups read in pages, each batch
/// played once, every row written, and its children cleaned up: the finished Jobs once the status
/// records their batches, the pages' Job once the groups are kept; the operator keeps the groups.
pub async fn assert_image_run(
    client: &Client,
    namespace: &str,
    run: &TrajectoryRun,
    kubelet: &Kubelet,
    (rows, images, workers): (usize, usize, usize),
    live: LiveChildren,
) {
    let status = run.status.clone().expect("a status");
    assert_eq!(status.phase, Some(Phase::Succeeded), "{status:#?}");
    let image_status = status.images.clone().expect("status.images");
    let total_images = u32::try_from(images).expect("a count");
    assert_eq!(
        (image_status.total, image_status.pulled),
        (total_images, total_images)
    );
    assert!(
        live.most_jobs <= workers,
        "{} generation Jobs ran at once",
        live.most_jobs
    );
    // A running Job keeps the pods of its finished batches, and a finished Job's pods go with it
    // once the status (paced) records its batches: at most one more window of them.
    let total = status.batches.as_ref().expect("batch counts").total;
    let per_image = usize::try_from(total.div_ceil(total_images)).expect("a count");
    assert!(
        live.most_pods <= 2 * workers * per_image,
        "{} generation pods at once ({per_image} batches an image)",
        live.most_pods
    );
    // Progress (the batches, the images pulled) is written at most once per 3 s status interval;
    // what else changes (the phase, a condition) is written at once, a few dozen times a run. An
    // image's first batch done once wrote the status at once, about one write an image.
    let paced = usize::try_from(live.watched.as_secs() / 3).expect("a count") + 30;
    assert!(
        live.status_writes <= paced,
        "{} status writes over {:?} ({images} images): more than progress at most every 3 s and \
         30 others",
        live.status_writes,
        live.watched
    );
    let played = kubelet.played();
    assert!(
        played.iter().any(|p| p.mode == "image-page"),
        "the groups were read in pages"
    );
    let batches: Vec<u32> = played.iter().filter_map(|p| p.batch).collect();
    let distinct: BTreeSet<u32> = batches.iter().copied().collect();
    assert_eq!(
        (batches.len(), distinct.len()),
        (usize::try_from(total).expect("a count"), batches.len()),
        "each batch ran once: {batches:?}"
    );
    let name = run.name_any();
    let dir = kubelet
        .storage
        .join(run.spec.run.output_path(namespace, &name));
    let written = jsonl(&dir.join("trajectories.jsonl"));
    assert_eq!(written.len(), rows);
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    wait_until(
        "the generation Jobs deleted",
        Duration::from_secs(60),
        || async {
            let left = jobs.list(&ListParams::default()).await.expect("list Jobs");
            left.items
                .iter()
                .all(|job| {
                    let component = job
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(labels::COMPONENT));
                    !matches!(
                        component.map(String::as_str),
                        Some("generate" | "image-pages")
                    )
                })
                .then_some(())
        },
    )
    .await;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let kept = maps
        .get(&image_index_name(&name, 1))
        .await
        .expect("the kept image groups");
    assert_eq!(
        kept.data.expect("data")["groups.jsonl"].lines().count(),
        images
    );
}

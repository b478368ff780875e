//! Runs in real pods: the operator (in-process here) creates its Jobs, and the real node's kubelet,
//! containerd and runc run them from the worker image `scripts/images/build.sh --test` built and
//! the node imported. Every pod of a run mounts one `hostPath` `PersistentVolume`; the model is the
//! llama.cpp server on the host or a scripted server, both reached at the host's bridge address.
//!
//! Needs the real node, the image and (for the quickstart) a model server listening where pods
//! reach it; fails, naming what is missing, without them (see [`HOW_TO_RUN`]).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{EvictParams, ListParams, LogParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::reconcile::observe::JobState;
use trajectory_operator::settings::Settings;
use trajectory_testkit::envoy::{RateLimit, SheddingProxy};
use trajectory_testkit::gubernator::Gubernator;
use trajectory_testkit::scripted_server::{
    FixedLatency, ScriptedServer, Step, first_user_message, text_reply, tool_call_reply,
    tool_calls_reply,
};
use trajectory_testkit::versitygw::Versitygw;
use trajectory_tests::e2e::{self, ControllerGuard, phase_of, run_spec, start_controller_with};
use trajectory_tests::helm;
use trajectory_tests::real_pods::{
    NONROOT, OPERATOR_IMAGE, RealNode, SharedStorage, TAINT_KEY, WORKER_IMAGE, batch_records,
    check_record, jsonl_lines, kill_container, model_server_for_pods, pod_summary, pod_template,
    pods_of_index, quickstart_run, real_node_with, terminated,
};
use trajectory_tests::{TestNamespace, client, wait_until};

mod harbor;
mod kills;
mod pulls;
mod side_by_side;
mod throughput;

/// Everything one test needs: the real node (checked to hold the worker image), a namespace, the
/// shared volume, and the operator acting on that namespace with the test image as its workers'.
struct Setup {
    client: Client,
    node: RealNode,
    storage: SharedStorage,
    runs: Api<TrajectoryRun>,
    pods: Api<Pod>,
    _controller: Option<ControllerGuard>,
    ns: TestNamespace,
}

impl Setup {
    async fn new(prefix: &str) -> Self {
        Self::create(prefix, true).await
    }

    /// As [`Setup::new`], with no operator: the test installs one.
    async fn without_operator(prefix: &str) -> Self {
        Self::create(prefix, false).await
    }

    async fn create(prefix: &str, in_process_operator: bool) -> Self {
        let client = client().await;
        let node = real_node_with(&client, WORKER_IMAGE).await;
        trajectory_tests::install_crds(&client).await;
        let ns = TestNamespace::create(&client, prefix).await;
        let storage = SharedStorage::create(&client, ns.name(), prefix).await;
        let controller = in_process_operator.then(|| {
            start_controller_with(
                &client,
                Settings {
                    watch_namespace: Some(ns.name().to_owned()),
                    worker_image: WORKER_IMAGE.to_owned(),
                    ..Settings::default()
                },
            )
        });
        Self {
            runs: Api::namespaced(client.clone(), ns.name()),
            pods: Api::namespaced(client.clone(), ns.name()),
            client,
            node,
            storage,
            _controller: controller,
            ns,
        }
    }

    fn ns(&self) -> &str {
        self.ns.name()
    }

    /// A scripted model listening on every address, and its URL as the pods reach it.
    fn model_url(&self, model: &ScriptedServer) -> String {
        format!("http://{}:{}/v1", self.node.ip, model.address().port())
    }

    /// Creates run `name` of `prompts` scripted prompts (`datasets/prompts.jsonl`) with `extra`
    /// spec keys.
    async fn create_scripted(&self, name: &str, model_url: &str, prompts: usize, extra: &Value) {
        self.storage.write_prompts(prompts);
        let mut keys = json!({"storage": self.storage.spec(), "podTemplate": pod_template()});
        for (key, value) in extra.as_object().into_iter().flatten() {
            keys[key] = value.clone();
        }
        let spec = run_spec(model_url, &keys);
        self.runs
            .create(&PostParams::default(), &TrajectoryRun::new(name, spec))
            .await
            .expect("create the run");
    }

    /// Creates run `name` of `prompts` scripted prompts in one batch, run by one worker with
    /// `concurrency` conversations at once against `model`, with `extra` spec keys.
    async fn create_one_batch(
        &self,
        name: &str,
        model: &ScriptedServer,
        prompts: usize,
        concurrency: usize,
        extra: Value,
    ) {
        self.create_one_batch_at(name, &self.model_url(model), prompts, concurrency, extra)
            .await;
    }

    /// [`Setup::create_one_batch`] against the model at `model_url`.
    async fn create_one_batch_at(
        &self,
        name: &str,
        model_url: &str,
        prompts: usize,
        concurrency: usize,
        extra: Value,
    ) {
        let mut keys = json!({"batchSize": prompts, "workers": 1, "concurrency": concurrency});
        for (key, value) in extra.as_object().into_iter().flatten() {
            keys[key] = value.clone();
        }
        self.create_scripted(name, model_url, prompts, &keys).await;
    }

    /// Waits until run `name` is finished; panics with its status and pods after `timeout`.
    async fn finished(&self, name: &str, timeout: Duration) -> TrajectoryRun {
        let deadline = Instant::now() + timeout;
        loop {
            let run = self.runs.get(name).await.expect("get the run");
            if phase_of(&run).is_some_and(Phase::is_finished) {
                if phase_of(&run) == Some(Phase::Failed) {
                    eprintln!(
                        "run {name} failed; its pods: {:#?}",
                        pod_summary(&self.pods).await
                    );
                }
                return run;
            }
            assert!(
                Instant::now() < deadline,
                "run {name} not finished after {timeout:?}: status {:#?}; pods {:#?}",
                run.status,
                pod_summary(&self.pods).await
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The records of run `name`: `trajectories.jsonl` and `failures.jsonl`, each trajectory checked.
    fn prompt_indexes(&self, name: &str) -> (Vec<u64>, usize) {
        prompt_indexes_in(&self.storage.run_dir(self.ns(), name))
    }

    /// Waits until run `name` of `prompts` prompts, all in one batch, has succeeded in one pod
    /// (so that its conversations shared one sandbox container), with one record per prompt and
    /// two requests to `model` per conversation; returns the records' tool turns.
    async fn one_pod_succeeded_once_per_prompt(
        &self,
        name: &str,
        prompts: usize,
        model: &ScriptedServer,
    ) -> Vec<String> {
        self.succeeded_in_one_pod(name, prompts).await;
        assert_two_requests_per_conversation(model, prompts);
        tool_turns(&self.storage.run_dir(self.ns(), name))
    }

    /// Waits until run `name` of `prompts` prompts, all in one batch, has succeeded in one pod
    /// (so that its conversations shared one sandbox container), with one record per prompt.
    async fn succeeded_in_one_pod(&self, name: &str, prompts: usize) {
        let run = self.finished(name, Duration::from_secs(300)).await;
        assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
        let (indexes, failed) = self.prompt_indexes(name);
        assert_eq!((indexes, failed), ((0..prompts as u64).collect(), 0));
        let pods = self
            .pods
            .list(&kube::api::ListParams::default().labels(&format!("job-name={name}-gen-1")))
            .await
            .expect("list the generation Job's pods")
            .items;
        assert_eq!(pods.len(), 1, "{:#?}", pod_summary(&self.pods).await);
    }

    /// The first pod of index 0 of the generation Job, once it is running and has written `records`
    /// records to its batch file.
    async fn running_batch_pod(&self, job: &str, run: &str, records: usize) -> Pod {
        let run_dir = self.storage.run_dir(self.ns(), run);
        wait_until(
            &format!("a running pod of {job} with {records} records written"),
            Duration::from_secs(180),
            || async {
                let pod = pods_of_index(&self.pods, job, 0).await.into_iter().next()?;
                let running = pod.status.as_ref()?.phase.as_deref() == Some("Running");
                (running && batch_records(&run_dir, 0).len() >= records).then_some(pod)
            },
        )
        .await
    }
}

impl Setup {
    /// Runs the quickstart (`examples/quickstart/run.yaml`, its dataset on the volume already) with
    /// the model `model_name` at `model_url` until it ends, and checks that it succeeded in pods of
    /// the real node with one valid record per prompt.
    async fn run_the_quickstart(&self, model_url: &str, model_name: &str) {
        let run = quickstart_run(model_url, model_name, &self.storage);
        let run_dir = self.storage.run_dir(self.ns(), "quickstart");
        Box::pin(self.run_to_success(run, &run_dir)).await;
    }

    /// Runs `run` (the quickstart, under any name) until it ends, and checks that it succeeded in
    /// pods of the real node with one valid record per prompt in `run_dir` (where this machine
    /// sees its files).
    async fn run_to_success(&self, run: TrajectoryRun, run_dir: &Path) {
        let setup = self;
        let started = Instant::now();
        let name = run.name_any();
        setup
            .runs
            .create(&PostParams::default(), &run)
            .await
            .expect("create the quickstart run");
        let run = setup.finished(&name, Duration::from_secs(600)).await;
        eprintln!("the run {name} took {:?} in real pods", started.elapsed());
        let status = run.status.clone().expect("a status");
        assert_eq!(
            status.phase,
            Some(Phase::Succeeded),
            "status {status:#?}; pods {:#?}",
            pod_summary(&setup.pods).await
        );
        let prompts = status.prompts.expect("prompt counts");
        assert_eq!(prompts.total, 8);
        assert_eq!(prompts.succeeded + prompts.discarded + prompts.failed, 8);
        let (indexes, failed) = prompt_indexes_in(run_dir);
        assert_eq!(indexes, (0..8).collect::<Vec<u64>>(), "every prompt once");
        assert_eq!(
            status.output.map(|o| o.trajectories),
            Some(8 - failed as u64)
        );
        // Every stage ran in a pod of the real node.
        let jobs: Api<Job> = Api::namespaced(setup.client.clone(), setup.ns());
        for stage in ["plan", "gen-1", "merge"] {
            let job = format!("{name}-{stage}");
            let succeeded = jobs
                .get(&job)
                .await
                .unwrap_or_else(|e| panic!("Job {job}: {e}"))
                .status
                .and_then(|s| s.succeeded);
            assert!(succeeded.is_some_and(|n| n > 0), "Job {job}: {succeeded:?}");
        }
        let on_node = setup
            .pods
            .list(&kube::api::ListParams::default())
            .await
            .expect("list pods")
            .items
            .iter()
            .all(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&setup.node.name)
            });
        assert!(on_node, "every pod ran on the real node");
    }
}

/// The prompt indexes of the records and failures in `dir`, sorted, and the number of failures.
fn prompt_indexes_in(dir: &Path) -> (Vec<u64>, usize) {
    let records = jsonl_lines(&dir.join("trajectories.jsonl"));
    let failures = jsonl_lines(&dir.join("failures.jsonl"));
    let mut indexes: Vec<u64> = records.iter().map(check_record).collect();
    indexes.extend(failures.iter().filter_map(|f| f["prompt_index"].as_u64()));
    indexes.sort_unstable();
    (indexes, failures.len())
}

/// The first tool turn of every record run `run_dir` wrote, in the order written.
fn tool_turns(run_dir: &std::path::Path) -> Vec<String> {
    jsonl_lines(&run_dir.join("trajectories.jsonl"))
        .iter()
        .map(|record| {
            record["conversations"]
                .as_array()
                .expect("conversations")
                .iter()
                .find(|t| t["from"] == "tool")
                .unwrap_or_else(|| panic!("a tool turn in {record}"))["value"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

/// The tool's result in tool turn `turn` (`<tool_response>` around the call's id, name and
/// result).
fn tool_result(turn: &str) -> Value {
    let payload = turn
        .strip_prefix("<tool_response>\n")
        .and_then(|rest| rest.strip_suffix("\n</tool_response>"))
        .unwrap_or_else(|| panic!("not a tool response: {turn}"));
    let payload: Value =
        serde_json::from_str(payload).unwrap_or_else(|e| panic!("bad tool response {turn}: {e}"));
    payload["content"].clone()
}

/// The tool turn of the one record a run of one prompt wrote into `run_dir`'s output.
fn only_tool_turn(run_dir: &std::path::Path) -> String {
    let mut turns = tool_turns(run_dir);
    assert_eq!(turns.len(), 1, "{turns:#?}");
    turns.remove(0)
}

/// A scripted model on every address (the pods reach it at the bridge address): a terminal call
/// running `command`, then a final answer, each after `latency`.
async fn scripted_model(latency: Duration, command: &str) -> ScriptedServer {
    ScriptedServer::start_fixed_latency_on(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        FixedLatency {
            latency,
            tool_call: tool_call_reply("terminal", &json!({ "command": command })),
            final_answer: text_reply("done"),
        },
    )
    .await
}

/// A scripted model on every address that gives `replies` in order, whatever the request, then a
/// final answer to every later request.
async fn model_replying(replies: impl IntoIterator<Item = Value>) -> ScriptedServer {
    ScriptedServer::start_with_default_on(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        replies.into_iter().map(Step::ok),
        Step::ok(text_reply("done")),
    )
    .await
}

/// A model reply calling `terminal` with `command`.
fn terminal_call(command: &str) -> Value {
    tool_call_reply("terminal", &json!({ "command": command }))
}

/// `model` was asked twice per conversation for `conversations` conversations (the tool call, then
/// the final answer): none was lost or redone. Lists the requests when not.
fn assert_two_requests_per_conversation(model: &ScriptedServer, conversations: usize) {
    let requests = model.requests();
    let asked: Vec<String> = requests
        .iter()
        .map(|request| {
            let messages = request.body["messages"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let roles: Vec<&str> = messages.iter().filter_map(|m| m["role"].as_str()).collect();
            let prompt = first_user_message(&request.body);
            format!("{prompt:?}: {roles:?}")
        })
        .collect();
    assert_eq!(
        requests.len(),
        2 * conversations,
        "two model requests per conversation: {asked:#?}"
    );
}

fn condition(run: &TrajectoryRun, type_: &str) -> Option<(String, String)> {
    e2e::condition(run.status.as_ref()?, type_).map(|c| (c.status.clone(), c.reason.clone()))
}

/// The quickstart on a bucket of a real S3 server (versitygw) and, at the same time, on the volume,
/// both against one scripted model: comparing records needs the same replies to the same prompts
/// (the quickstart with the llama.cpp model is `the_quickstart_run_succeeds_in_real_pods`). No pod
/// of the bucket's run mounts storage, the keys reach the worker container from a Secret, plan,
/// generation and merge work on objects to `Succeeded` with every batch marked done, and the
/// records and failures are the volume run's but for when they ran; two model requests per
/// conversation in all, none redone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_quickstart_in_real_pods_on_a_bucket_with_no_volume_writes_the_records_it_writes_on_a_volume()
 {
    let setup = Setup::new("pods-bucket").await;
    let model = scripted_model(Duration::ZERO, "echo $((6 * 7)) answers; uname -s").await;
    let model_url = setup.model_url(&model);
    let quickstart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart");
    setup
        .storage
        .add_dataset(&quickstart.join("datasets/quickstart.jsonl"));
    let server = Versitygw::start("0.0.0.0");
    server.create_bucket("trajectories");
    let datasets = server
        .bucket_dir("trajectories")
        .join("experiments/datasets");
    std::fs::create_dir_all(&datasets).unwrap();
    std::fs::copy(
        quickstart.join("datasets/quickstart.jsonl"),
        datasets.join("quickstart.jsonl"),
    )
    .unwrap();
    let keys: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": "bucket-keys"},
        "stringData": {
            "AWS_ACCESS_KEY_ID": trajectory_testkit::versitygw::ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": trajectory_testkit::versitygw::SECRET_KEY,
        },
    }))
    .unwrap();
    Api::namespaced(setup.client.clone(), setup.ns())
        .create(&PostParams::default(), &keys)
        .await
        .expect("create the bucket's Secret");
    let port = server.endpoint.rsplit_once(':').expect("host:port").1;
    let on_volume = quickstart_run(&model_url, "scripted", &setup.storage);
    let mut on_bucket = quickstart_run(&model_url, "scripted", &setup.storage);
    on_bucket.metadata.name = Some("quickstart-on-bucket".to_owned());
    on_bucket.spec.run.storage = serde_json::from_value(json!({"object": {
        "url": "s3://trajectories/experiments",
        "endpoint": format!("http://{}:{port}", setup.node.ip),
        "pathStyle": true,
        "credentialsSecret": "bucket-keys",
    }}))
    .unwrap();
    let volume_dir = setup.storage.run_dir(setup.ns(), "quickstart");
    let bucket_dir = server
        .bucket_dir("trajectories")
        .join("experiments/runs")
        .join(setup.ns())
        .join("quickstart-on-bucket");
    tokio::join!(
        setup.run_to_success(on_volume, &volume_dir),
        setup.run_to_success(on_bucket, &bucket_dir),
    );
    assert_two_requests_per_conversation(&model, 2 * 8);
    for name in ["trajectories.jsonl", "failures.jsonl"] {
        let records = |dir: &Path| -> Vec<Value> {
            jsonl_lines(&dir.join(name))
                .into_iter()
                .map(trajectory_testkit::without_timing)
                .collect()
        };
        assert_eq!(records(&bucket_dir), records(&volume_dir), "{name}");
    }
    assert_eq!(jsonl_lines(&bucket_dir.join("trajectories.jsonl")).len(), 8);
    for batch in 0..3 {
        assert!(
            bucket_dir
                .join(format!("batches/batch-{batch:06}.done"))
                .exists(),
            "batch {batch} marked done on the bucket"
        );
    }
    // Nothing of the bucket's run went to the volume, and none of its pods mounts a claim.
    assert!(
        !setup
            .storage
            .run_dir(setup.ns(), "quickstart-on-bucket")
            .exists()
    );
    let pods = setup
        .pods
        .list(&ListParams::default().labels("trajectories.dev/run=quickstart-on-bucket"))
        .await
        .expect("list pods")
        .items;
    assert!(
        pods.len() >= 3,
        "plan, generation and merge pods: {pods:#?}"
    );
    for pod in &pods {
        let volumes = pod.spec.as_ref().and_then(|spec| spec.volumes.clone());
        assert!(
            volumes
                .iter()
                .flatten()
                .all(|volume| volume.persistent_volume_claim.is_none()),
            "{} mounts no claim",
            pod.name_any()
        );
    }
}

/// The shipped quickstart (eight prompts, the small llama.cpp model, `terminal_only`) goes plan →
/// generation → merge → `Succeeded` in real pods, and its output holds one valid record per prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_quickstart_run_succeeds_in_real_pods() {
    let setup = Setup::new("pods-quickstart").await;
    let (model_url, model_name) = model_server_for_pods(&setup.node);
    setup.storage.add_dataset(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/quickstart/datasets/quickstart.jsonl"),
    );
    Box::pin(setup.run_the_quickstart(&model_url, &model_name)).await;
}

/// The pod's settings hold at run time, seen from inside the container by the agent's terminal
/// tool (its output is in the record): uid and gid 65532, a read-only root filesystem, no
/// `ServiceAccount` token. The batch summary reaches the pod status as the termination message and
/// the run status from there; `kubectl logs` of the batch pod shows the worker's progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_pod_runs_as_its_spec_says_and_logs_its_progress() {
    let setup = Setup::new("pods-settings").await;
    // Run in the sandbox sidecar: PID 1 there is the executor's server, the worker's processes
    // are in another PID namespace, and neither the data volume nor the worker's environment
    // is there.
    let probe = "id -u; id -g; touch /probe 2>&1; \
                 ls /var/run/secrets/kubernetes.io/serviceaccount 2>&1; ls /data 2>&1; \
                 echo \"pid1=$(tr '\\0' ' ' < /proc/1/cmdline)\"; \
                 echo \"workers=$(cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'trajectory-worke[r] batch')\"; \
                 echo \"traj_env=$(env | grep -c '^TRAJ_')\"; ls /workspace 2>&1; echo probed";
    let model = scripted_model(Duration::from_millis(5), probe).await;
    setup
        .create_scripted(
            "settings",
            &setup.model_url(&model),
            1,
            &json!({"batchSize": 1, "workers": 1, "concurrency": 1}),
        )
        .await;
    let run = setup.finished("settings", Duration::from_secs(300)).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);

    let dir = setup.storage.run_dir(setup.ns(), "settings");
    let tool_turn = only_tool_turn(&dir);
    assert!(tool_turn.contains("probed"), "{tool_turn}");
    assert!(
        tool_turn.contains(&format!("{NONROOT}\\n{NONROOT}")),
        "uid and gid: {tool_turn}"
    );
    // The root filesystem is read-only, and where the node's kernel has Landlock the sandbox
    // refuses writes outside the workspace first; likewise /var is not mounted with a token, and
    // under Landlock it is not readable at all.
    assert!(
        tool_turn.contains("Read-only file system") || tool_turn.contains("Permission denied"),
        "{tool_turn}"
    );
    assert!(
        tool_turn.contains("No such file or directory") || tool_turn.contains("Permission denied"),
        "no token: {tool_turn}"
    );
    assert!(
        !tool_turn.contains("ca.crt") && !tool_turn.contains("namespace\\ntoken"),
        "no token: {tool_turn}"
    );
    assert!(
        tool_turn.contains("pid1=/sandbox/bin/trajectory-executor serve"),
        "the command ran in the sandbox container: {tool_turn}"
    );
    assert!(
        tool_turn.contains("workers=0"),
        "no worker process visible: {tool_turn}"
    );
    assert!(
        tool_turn.contains("traj_env=0"),
        "no worker environment: {tool_turn}"
    );
    assert!(
        tool_turn.contains("ls: cannot access '/data': No such file or directory"),
        "no data volume in the sandbox: {tool_turn}"
    );

    let pod = pods_of_index(&setup.pods, "settings-gen-1", 0)
        .await
        .into_iter()
        .next()
        .expect("the batch pod");
    let (code, _, message) = terminated(&pod).expect("the batch pod terminated");
    assert_eq!(code, 0);
    let summary: Value = serde_json::from_str(&message)
        .unwrap_or_else(|e| panic!("termination message {message:?}: {e}"));
    assert_eq!(summary["succeeded"], 1, "{summary}");
    // This machine's kernel has Landlock, and the runtime's default seccomp profile lets it
    // through: the sandbox confined the command.
    assert_eq!(summary["landlock"], "enforced", "{summary}");
    let status = run.status.expect("a status");
    assert_eq!(status.prompts.map(|p| p.succeeded), Some(1));
    assert_eq!(
        status.sandbox.map(|sandbox| sandbox.landlock).as_deref(),
        Some("Enforced"),
        "the run's status says the commands were confined"
    );
    let spec = pod.spec.as_ref().expect("a pod spec");
    assert_eq!(spec.automount_service_account_token, Some(false));
    let sidecars: Vec<_> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(sidecars, ["install-executor", "sandbox"]);

    let logs = setup
        .pods
        .logs(&pod.name_any(), &LogParams::default())
        .await
        .expect("kubectl logs of the batch pod (API server -> kubelet)");
    assert!(logs.contains("starting batch"), "logs:\n{logs}");
    assert!(logs.contains("batch done"), "logs:\n{logs}");
}

/// The run's task image (`spec.sandbox.image`) as a dataset's images come: from a registry the node
/// pulls over the network (`scripts/registry/task-images.sh`), not imported. The executor, copied
/// in by the init container, serves the terminal in a glibc image and in a busybox one, where the
/// command reads the image's own files; in an image without a shell the call is a tool error
/// naming the missing shell, the conversation goes on, and the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_image_from_a_registry_runs_the_terminal_and_one_without_a_shell_is_a_tool_error() {
    let setup = Setup::new("pods-task-image").await;
    let registry = trajectory_tests::real_pods::registry(trajectory_tests::real_pods::HOW_TO_RUN);
    let model = scripted_model(Duration::from_millis(5), "echo marker=$(cat /task/marker)").await;
    let images = ["glibc", "busybox", "noshell"];
    for image in images {
        let spec = json!({
            "batchSize": 1, "workers": 1, "concurrency": 1,
            "sandbox": {"image": format!("{registry}/tasks/{image}:1")},
        });
        setup
            .create_scripted(image, &setup.model_url(&model), 1, &spec)
            .await;
    }
    for image in images {
        let run = setup.finished(image, Duration::from_secs(300)).await;
        assert_eq!(
            phase_of(&run),
            Some(Phase::Succeeded),
            "{image}: {:#?}",
            run.status
        );
        let turn = only_tool_turn(&setup.storage.run_dir(setup.ns(), image));
        let content = tool_result(&turn).to_string();
        if image == "noshell" {
            assert!(
                content.contains("this environment has no shell") && !content.contains("marker="),
                "{image}: a tool error naming the missing shell: {turn}"
            );
        } else {
            assert!(
                content.contains(&format!("marker={image}")),
                "{image}: {turn}"
            );
        }
    }
    assert_two_requests_per_conversation(&model, images.len());
}

/// What each conversation of the task-image run runs: which image and directory it is in, what an
/// earlier conversation could have left in that directory, and which `sleep 97531` processes
/// run; then it leaves a file there and a background job behind.
const TASK_PROBE: &str = "echo \"marker=$(cat /task/marker 2>/dev/null) pwd=$(pwd) \
left=$(cat left-by-earlier 2>/dev/null || echo none) \
jobs=$(grep -l 9753[1] /proc/[0-9]*/cmdline 2>/dev/null | wc -l)\"; \
echo here > left-by-earlier; sleep 97531 &";

/// A dataset row of the task-image run: its image and `cwd`, and the marker and directory its
/// conversation should find (empty for a row whose commands find none).
type ImageRow = (
    Option<String>,
    Option<&'static str>,
    &'static str,
    &'static str,
);

/// A run whose rows name their own images, pulled by the real node from a registry: 14 rows over
/// the glibc, busybox and shell-less task images, one missing image and none. Every conversation
/// runs in a fresh container of its row's image, in its `cwd` or the image's working directory,
/// and finds nothing an earlier conversation of the same image left (no file, no process); the
/// shell-less image's calls are tool errors; the missing image's rows are recorded failed
/// (`image_unavailable`, naming the image) without a model request, and the run goes on. Two model
/// requests per conversation that ran; never more image Jobs running than workers. After the run
/// nothing of it is left on the node: no container, no background job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rows_naming_images_run_in_fresh_task_containers_and_a_missing_image_is_recorded_unavailable()
 {
    let setup = Setup::new("pods-row-images").await;
    let registry = trajectory_tests::real_pods::registry(trajectory_tests::real_pods::HOW_TO_RUN);
    let image = |name: &str| Some(format!("{registry}/tasks/{name}:1"));
    let rows: Vec<ImageRow> = vec![
        (image("glibc"), None, "glibc", "/testbed"),
        (image("glibc"), None, "glibc", "/testbed"),
        (image("glibc"), Some("/"), "glibc", "/"),
        (image("glibc"), None, "glibc", "/testbed"),
        (image("glibc"), Some("/task"), "glibc", "/task"),
        (image("busybox"), None, "busybox", "/work"),
        (image("busybox"), Some("/task"), "busybox", "/task"),
        (image("busybox"), None, "busybox", "/work"),
        (image("noshell"), None, "", ""),
        (image("noshell"), None, "", ""),
        (image("missing"), None, "", ""),
        (image("missing"), None, "", ""),
        (None, None, "", ""),
        (image("glibc"), None, "glibc", "/testbed"),
    ];
    write_image_rows(&setup, &rows);
    let model = scripted_model(Duration::from_millis(5), TASK_PROBE).await;
    let spec = json!({
        "dataset": {"path": "datasets/rows.jsonl"},
        "batchSize": 2, "workers": 2, "concurrency": 2,
        "sandbox": {"imageUnavailableAfterSeconds": 60},
    });
    setup
        .create_scripted("images", &setup.model_url(&model), 0, &spec)
        .await;
    let (run, most_running) = finished_counting_jobs(&setup, "images").await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    assert!(
        most_running <= 2,
        "{most_running} generation Jobs ran at once"
    );
    let images = run
        .status
        .as_ref()
        .unwrap()
        .images
        .clone()
        .expect("status.images");
    assert_eq!(
        (images.total, images.pulled, images.unavailable),
        (4, 3, 1),
        "{images:?}"
    );
    assert_eq!(
        Some(images.unavailable_images[0].image.clone()),
        image("missing")
    );

    let dir = setup.storage.run_dir(setup.ns(), "images");
    check_image_records(&dir, &rows);
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(dir.join("statistics.json")).unwrap()).unwrap();
    let mut task_images = statistics["task_images"].clone();
    // What the pods waited for their images: one pod a batch that ran in a task container (the
    // missing image's batch had none), per image.
    let pulls = task_images
        .as_object_mut()
        .and_then(|images| images.remove("pulls"))
        .expect("the pods' waits for their images");
    let waited: Vec<&String> = pulls["images"].as_object().unwrap().keys().collect();
    assert_eq!(
        waited,
        [image("busybox"), image("glibc"), image("noshell")]
            .map(Option::unwrap)
            .iter()
            .collect::<Vec<_>>()
    );
    assert_eq!(pulls["pods"], 7, "{pulls}");
    assert_eq!(
        task_images,
        json!({"images": 4, "pulled": 3, "unavailable": 1,
               "conversations": {"ran": 11, "image_unavailable": 2}}),
        "the row naming no image is not one of them"
    );
    let failures = jsonl_lines(&dir.join("failures.jsonl"));
    let unavailable: Vec<u64> = failures
        .iter()
        .filter(|f| f["error_class"] == "image_unavailable")
        .map(|f| f["prompt_index"].as_u64().unwrap())
        .collect();
    assert_eq!(unavailable, [10, 11], "{failures:#?}");
    let missing = image("missing").unwrap();
    assert!(
        failures[0]["error"].as_str().unwrap().contains(&missing),
        "{failures:#?}"
    );
    // The missing image's prompts never reached the model; the others twice each.
    for request in model.requests() {
        let text = request.body.to_string();
        assert!(
            !text.contains("row 10") && !text.contains("row 11"),
            "{text}"
        );
    }
    assert_two_requests_per_conversation(&model, 12);
    // The image Jobs are deleted once recorded; with their pods go the containers, their files
    // and every background job the conversations left.
    trajectory_tests::real_pods::assert_nothing_left_on_node(setup.ns(), &["sleep", "97531"]).await;
}

/// Base64 of a gzipped tar holding `check.sh` with `script`, made by the system's `tar` and
/// `base64`: a terminal-bench row's `tests_tar`.
fn tests_tar_of(script: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("check.sh"), script).unwrap();
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg("tar -czf - -C \"$0\" check.sh | base64 -w0")
        .arg(dir.path())
        .output()
        .expect("tar and base64 run");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

/// Rows verified in their own task containers, pulled from the registry: the glibc task image's
/// repository at `/testbed`, whose `add.sh` has a bug that its `test_add.sh` finds. The model fixes
/// the bug in one task and breaks it otherwise in another (a plain `test` command: rewards 1 and
/// 0); a terminal-bench row's tests arrive as a tar whose script writes
/// `/logs/verifier/reward.txt` (reward 1: the image has neither `/tests` nor `/logs`, which the
/// container's server makes for the verifier); a cheating model tries to write that reward and
/// the tests itself (its commands cannot make directories in `/`), rewrites the repository's own
/// test, and leaves a job rewriting the reward, yet its verifier fails (reward 0); a verifier that
/// runs past its timeout and one whose command is not there give reward 0 with the reason; a row
/// without an image is verified in its workspace in the sandbox container (reward 1). Two model
/// requests a conversation: verifying asked the model nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rows_are_verified_in_their_own_task_containers_and_a_cheat_does_not_pay() {
    let setup = Setup::new("pods-verified").await;
    let registry = trajectory_tests::real_pods::registry(trajectory_tests::real_pods::HOW_TO_RUN);
    let glibc = format!("{registry}/tasks/glibc:1");
    let terminal_bench = "test \"$(bash /testbed/add.sh 2 3)\" = 5 \
                          && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt";
    let rows = [
        json!({"prompt": "task number 0", "image": glibc, "test": "bash test_add.sh"}),
        json!({"prompt": "task number 1", "docker_image": glibc, "test": "bash test_add.sh"}),
        json!({"prompt": "task number 2", "image": glibc,
               "tests_tar": tests_tar_of(terminal_bench), "test_sh": "bash /tests/check.sh"}),
        json!({"prompt": "task number 3", "image": glibc,
               "tests_tar": tests_tar_of(terminal_bench), "test_sh": "sleep 1; bash /tests/check.sh"}),
        json!({"prompt": "task number 4", "test": r#"test "$(cat answer)" = 42"#}),
        json!({"prompt": "task number 5", "image": glibc, "test": "sleep 30"}),
        json!({"prompt": "task number 6", "image": glibc, "verify": "./run_tests.sh"}),
    ];
    let dataset = tempfile::tempdir().unwrap();
    let file = dataset.path().join("verified.jsonl");
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    setup.storage.add_dataset(&file);
    let (model, url) = model_scripting(&setup, |seen| {
        if !seen.results.is_empty() {
            return text_reply("done");
        }
        match seen.task {
            0 | 2 => terminal_call("sed -i 's/\\$1 - \\$2/$1 + $2/' /testbed/add.sh"),
            1 => terminal_call("sed -i 's/\\$1 - \\$2/$1 * $2/' /testbed/add.sh"),
            3 => tool_calls_reply(&[
                (
                    "terminal",
                    Value::String(
                        json!({"command": "mkdir -p /logs/verifier /tests; \
                                echo 1 > /logs/verifier/reward.txt; \
                                printf 'exit 0' > /tests/check.sh; \
                                printf 'exit 0' > /testbed/test_add.sh; echo cheated"})
                        .to_string(),
                    ),
                ),
                (
                    "terminal",
                    Value::String(
                        json!({"command": "while true; do mkdir -p /logs/verifier; \
                                echo 1 > /logs/verifier/reward.txt; sleep 0.05; done",
                               "background": true})
                        .to_string(),
                    ),
                ),
            ]),
            4 => terminal_call("echo 42 > answer"),
            _ => terminal_call("true"),
        }
    })
    .await;
    let spec = json!({
        "dataset": {"path": "datasets/verified.jsonl"},
        "batchSize": 2, "workers": 2, "concurrency": 2,
        "verifier": {"timeoutSeconds": 5},
    });
    setup.create_scripted("verified", &url, 0, &spec).await;
    let run = setup.finished("verified", Duration::from_secs(300)).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let dir = setup.storage.run_dir(setup.ns(), "verified");
    check_verified_records(&dir);
    assert_eq!(
        run.status
            .as_ref()
            .and_then(|status| status.verification.clone()),
        Some(trajectory_operator::api::VerificationStatus {
            verified: 7,
            passed: 3
        })
    );
    assert_two_requests_per_conversation(&model, 7);
}

/// The records of [`rows_are_verified_in_their_own_task_containers_and_a_cheat_does_not_pay`]:
/// each row's reward, exit code and error, and the statistics' counts.
fn check_verified_records(dir: &Path) {
    let records = jsonl_lines(&dir.join("trajectories.jsonl"));
    assert_eq!(records.len(), 7, "{records:#?}");
    let outcomes: Vec<(Value, Value, Value)> = records
        .iter()
        .map(|record| {
            (
                record["reward"].clone(),
                record["verification"]["exit_code"].clone(),
                record["verification"]["error"].clone(),
            )
        })
        .collect();
    let clean = |reward: f64, code: i32| (json!(reward), json!(code), Value::Null);
    assert_eq!(
        outcomes[..5],
        [
            clean(1.0, 0),
            clean(0.0, 1),
            clean(1.0, 0),
            clean(0.0, 0),
            clean(1.0, 0)
        ],
        "{records:#?}"
    );
    assert_eq!(
        outcomes[5],
        (
            json!(0.0),
            Value::Null,
            json!("the verifier did not finish within 5 s and was stopped")
        )
    );
    assert_eq!((&outcomes[6].0, &outcomes[6].1), (&json!(0.0), &json!(127)));
    assert!(
        outcomes[6]
            .2
            .as_str()
            .is_some_and(|error| error.contains("not found")),
        "{:?}",
        outcomes[6]
    );
    let cheat_turns = records[3]["conversations"].to_string();
    assert!(
        cheat_turns.contains("cheated"),
        "the cheat ran: {cheat_turns}"
    );
    let statistics: Value =
        serde_json::from_slice(&std::fs::read(dir.join("statistics.json")).unwrap()).unwrap();
    assert_eq!(statistics["verification"]["verified"], 7);
    assert_eq!(statistics["verification"]["passed"], 3);
    assert_eq!(statistics["verification"]["verifier_errors"], 2);
}

/// Writes `rows` as `datasets/rows.jsonl` (prompts `row <i>`, the image in `image` or
/// `docker_image` by turns: both of the reference's field names).
fn write_image_rows(setup: &Setup, rows: &[ImageRow]) {
    let lines: Vec<String> = rows
        .iter()
        .enumerate()
        .map(|(i, (image, cwd, _, _))| {
            let mut row = json!({"prompt": format!("row {i}")});
            if let Some(image) = image {
                let field = if i % 2 == 0 { "image" } else { "docker_image" };
                row[field] = json!(image);
            }
            if let Some(cwd) = cwd {
                row["cwd"] = json!(cwd);
            }
            row.to_string()
        })
        .collect();
    add_rows(setup, &lines);
}

/// Adds `lines` to the run's storage as the dataset `datasets/rows.jsonl`.
fn add_rows(setup: &Setup, lines: &[String]) {
    let dataset = tempfile::tempdir().unwrap();
    let file = dataset.path().join("rows.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    setup.storage.add_dataset(&file);
}

/// Run `name` once finished, and the most generation Jobs seen running at once meanwhile. Prints
/// how long each generation pod of a task image took from its creation to its worker's start
/// (its task containers started one after the other, the image pulled or cached), the first pod
/// of each image apart from the later ones (`docs/benchmarks.md`).
async fn finished_counting_jobs(setup: &Setup, name: &str) -> (TrajectoryRun, usize) {
    let jobs: Api<Job> = Api::namespaced(setup.client.clone(), setup.ns());
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut most_running = 0;
    let mut startups = std::collections::BTreeMap::<String, (String, f64)>::new();
    let mut container_gaps = Vec::new();
    loop {
        for pod in setup
            .pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=generate"))
            .await
            .unwrap()
            .items
        {
            if let Some((image, seconds)) = task_pod_startup(&pod)
                && !startups.contains_key(&pod.name_any())
            {
                startups.insert(pod.name_any(), (image, seconds));
                if let Some(gaps) = task_container_gaps(&setup.pods, &pod).await {
                    container_gaps.extend(gaps);
                }
            }
        }
        let listed = jobs
            .list(&ListParams::default().labels("app.kubernetes.io/component=generate"))
            .await
            .unwrap();
        let running = listed
            .items
            .iter()
            .filter(|job| matches!(JobState::of(job), JobState::Running))
            .count();
        most_running = most_running.max(running);
        let run = setup.runs.get(name).await.unwrap();
        if phase_of(&run).is_some_and(Phase::is_finished) {
            print_startups(&startups);
            eprintln!(
                "task pods, one more conversation's fresh container (s, from one task \
                 container's server listening to the next's): {container_gaps:.3?}"
            );
            return (run, most_running);
        }
        assert!(
            Instant::now() < deadline,
            "not finished: {:#?}; pods {:#?}",
            run.status,
            pod_summary(&setup.pods).await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The image of a generation pod's task containers and the seconds from the pod's creation to
/// its worker container's start, once it started.
fn task_pod_startup(pod: &Pod) -> Option<(String, f64)> {
    let image = pod
        .spec
        .as_ref()?
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "task-0")?
        .image
        .clone()?;
    let created = pod.metadata.creation_timestamp.as_ref()?.0;
    let started = pod
        .status
        .as_ref()?
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == "worker")?
        .state
        .as_ref()?
        .running
        .as_ref()?
        .started_at
        .as_ref()?
        .0;
    Some((image, started.duration_since(created).as_secs_f64()))
}

/// The seconds between one task container's server listening and the next's, in a pod whose
/// containers started (native sidecars start one after the other): what each further
/// conversation's fresh environment costs the pod's start. Read from the containers' first log
/// lines, whose timestamps (unlike the API's) have sub-second precision.
async fn task_container_gaps(pods: &Api<Pod>, pod: &Pod) -> Option<Vec<f64>> {
    let tasks = pod
        .spec
        .as_ref()?
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.name.starts_with("task-"))
        .count();
    let mut listening = Vec::new();
    for slot in 0..tasks {
        let params = LogParams {
            container: Some(format!("task-{slot}")),
            timestamps: true,
            limit_bytes: Some(4096),
            ..LogParams::default()
        };
        let logs = pods.logs(&pod.name_any(), &params).await.ok()?;
        let line = logs.lines().find(|line| line.contains("listening on"))?;
        let stamp: k8s_openapi::jiff::Timestamp = line.split_whitespace().next()?.parse().ok()?;
        listening.push(stamp);
    }
    Some(
        listening
            .windows(2)
            .map(|pair| pair[1].duration_since(pair[0]).as_secs_f64())
            .collect(),
    )
}

/// Prints the pods' start-up times: the first pod of each image (a pull, unless the node had it)
/// and the later ones (cached).
fn print_startups(startups: &std::collections::BTreeMap<String, (String, f64)>) {
    // Keyed by pod name: an image's pods in completion-index order, its first one first.
    let mut seen = BTreeSet::new();
    let (mut first, mut later) = (Vec::new(), Vec::new());
    for (image, seconds) in startups.values() {
        if seen.insert(image.clone()) {
            first.push(*seconds);
        } else {
            later.push(*seconds);
        }
    }
    eprintln!(
        "task pods, creation to worker start (s): first of an image {first:.1?}; later {later:.1?}"
    );
}

/// Each trajectory of the task-image run found its own image and directory, fresh; the rows of
/// the shell-less image got the tool error, the row naming no image ran in the sandbox.
fn check_image_records(dir: &Path, rows: &[ImageRow]) {
    let records = jsonl_lines(&dir.join("trajectories.jsonl"));
    assert_eq!(records.len(), 12, "every row but the missing image's");
    for record in &records {
        let index = usize::try_from(record["prompt_index"].as_u64().unwrap()).unwrap();
        let (image, _, marker, pwd) = &rows[index];
        let turn = record["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["from"] == "tool")
            .unwrap_or_else(|| panic!("a tool turn: {record}"))["value"]
            .as_str()
            .unwrap()
            .to_owned();
        let content = tool_result(&turn).to_string();
        match image.as_deref() {
            None => assert!(content.contains("marker= "), "row {index}: {content}"),
            Some(name) if name.ends_with("noshell:1") => assert!(
                content.contains("this environment has no shell"),
                "row {index}: {content}"
            ),
            Some(_) => assert!(
                content.contains(&format!("marker={marker} pwd={pwd} left=none jobs=0")),
                "row {index}: a fresh {marker} container in {pwd}: {content}"
            ),
        }
    }
}

/// A command that forks past the run's process limit, in the sandbox container of a real pod, is
/// stopped with a tool error naming the limit, and its conversation and the run go on to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_command_past_the_sandbox_process_limit_is_stopped_in_a_real_pod() {
    let setup = Setup::new("pods-limits").await;
    let model = scripted_model(
        Duration::from_millis(5),
        "for i in $(seq 64); do sleep 30 & done; wait; echo all-waited",
    )
    .await;
    setup
        .create_scripted(
            "limits",
            &setup.model_url(&model),
            1,
            &json!({
                "batchSize": 1, "workers": 1, "concurrency": 1,
                "sandbox": {"limits": {"processes": 16}},
            }),
        )
        .await;
    let run = setup.finished("limits", Duration::from_secs(300)).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let dir = setup.storage.run_dir(setup.ns(), "limits");
    let tool_turn = only_tool_turn(&dir);
    assert!(
        tool_turn.contains("exceeded the sandbox's process limit (16"),
        "{tool_turn}"
    );
    assert!(!tool_turn.contains("all-waited"), "{tool_turn}");
}

/// What each conversation of the orphans probe runs in the sandbox container: first it lists the
/// processes earlier conversations' commands left there (markers: `sleep 98790N`) and the
/// container's zombies, then it starts its own would-be survivors — `setsid`, `nohup`, a double
/// fork, `setsid -f` and a daemon that forks twice, calls `setsid`, moves to `/` and closes its
/// standard streams — and checks that they run. The markers are put together at run time, so
/// that no command line but the survivors' holds one (the shell's and the executor's hold this
/// text).
const ORPHANS_PROBE: &str = r#"m=98790
echo "pid1=$(tr '\0' ' ' < /proc/1/cmdline)"
left=$(grep -a -l "${m}[1-5]" /proc/[0-9]*/cmdline 2>/dev/null)
echo "left=[$(for f in $left; do tr '\0' ' ' < $f; echo "($f);"; done)]"
echo "zombies=[$(grep -l '^[0-9]* ([^)]*) Z' /proc/[0-9]*/stat 2>/dev/null | tr '\n' ' ')]"
setsid sleep ${m}1 &
nohup sleep ${m}2 >/dev/null 2>&1 &
( (sleep ${m}3 &) & )
setsid -f sleep ${m}4
python3 -c 'import os, sys
if os.fork(): sys.exit()
os.setsid()
if os.fork(): sys.exit()
os.chdir("/")
os.closerange(0, 3)
os.execvp("sleep", ["sleep", sys.argv[1]])' ${m}5
sleep 1
echo "running=$(grep -a -l "${m}[1-5]" /proc/[0-9]*/cmdline 2>/dev/null | wc -l)""#;

/// Nothing a command starts outlives its conversation in a real pod: three conversations, one
/// after the other in the sandbox container of one batch pod, each start processes meant to
/// survive (`setsid`, `nohup`, a double fork, a daemon), and each later one finds none of the
/// earlier ones' processes left, and no zombie. The second one also kills its own executor, the
/// one of its conversation's shell (`SIGKILL`, as the OOM killer would), leaving its processes to
/// the sandbox server; its tool result is then the error of a sandbox that hung up. Two model
/// requests per conversation: no record is missing and none was redone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nothing_a_command_starts_outlives_its_conversation_in_a_real_pod() {
    let setup = Setup::new("pods-orphans").await;
    // The session's executor relays the command's output: what is still in its pipe when it
    // dies is lost, so the probe's last line is given a moment to get through first.
    let kills_its_executor = format!("{ORPHANS_PROBE}\nsleep 1; kill -KILL $PPID; sleep 30");
    let model = model_replying([
        terminal_call(ORPHANS_PROBE),
        text_reply("done"),
        terminal_call(&kills_its_executor),
        text_reply("done"),
        terminal_call(ORPHANS_PROBE),
    ])
    .await;
    let prompts = 3;
    setup
        .create_one_batch("orphans", &model, prompts, 1, json!({}))
        .await;
    let turns = setup
        .one_pod_succeeded_once_per_prompt("orphans", prompts, &model)
        .await;
    for turn in &turns {
        assert!(
            turn.contains("pid1=/sandbox/bin/trajectory-executor serve"),
            "in the sandbox container: {turn}"
        );
        assert!(
            turn.contains("running=5"),
            "every would-be survivor started: {turn}"
        );
        assert!(
            turn.contains("left=[]"),
            "processes outlived their conversation: {turn}"
        );
        assert!(
            turn.contains("zombies=[]"),
            "zombies in the sandbox container: {turn}"
        );
    }
    // The command that killed its executor killed its conversation's shell session with it: the
    // sandbox hung up, a tool error (with the output so far, checked above) where the executor of
    // one command used to report 137.
    let mut codes: Vec<Option<i64>> = turns
        .iter()
        .map(|turn| tool_result(turn)["exit_code"].as_i64())
        .collect();
    codes.sort_unstable();
    assert_eq!(
        codes,
        [None, Some(0), Some(0)],
        "one command killed its executor"
    );
    let errors: Vec<&str> = turns
        .iter()
        .filter_map(|turn| tool_result(turn)["error"].as_str().map(str::to_owned))
        .map(|error| {
            if error.contains("closed the connection") {
                "lost"
            } else {
                "other"
            }
        })
        .collect();
    assert_eq!(errors, ["lost"], "{turns:#?}");
}

/// A memory hog and a disk filler, each in its own conversation in the sandbox container of one
/// real pod, past small `spec.sandbox.limits`: each gets a tool error naming its limit and goes on
/// to its final answer, while a neighbour conversation running at the same time in the same pod
/// does its work as if alone; the run succeeds with every record, none redone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_memory_hog_and_a_disk_filler_stop_only_their_own_conversation_in_a_real_pod() {
    let setup = Setup::new("pods-hogs").await;
    let hog = "for i in 1 2 3 4; do head -c 2G /dev/zero | tail & done; wait; echo hog-done";
    let filler = "for i in $(seq 100); do head -c 4M /dev/zero > f$i; done; echo filler-done";
    let neighbour = "for i in $(seq 20); do echo $i > n$i; sleep 0.1; done; cat n* | wc -l";
    // The three conversations start at once, so each gets one of the three first replies.
    let model = model_replying([hog, filler, neighbour].map(terminal_call)).await;
    let prompts = 3;
    let limits = json!({"limits": {"memoryBytes": 128 << 20, "workspaceBytes": 32 << 20}});
    setup
        .create_one_batch("hogs", &model, prompts, prompts, json!({"sandbox": limits}))
        .await;
    let turns = setup
        .one_pod_succeeded_once_per_prompt("hogs", prompts, &model)
        .await;
    let turn_with = |text: &str| {
        turns
            .iter()
            .find(|turn| turn.contains(text))
            .unwrap_or_else(|| panic!("no tool turn with {text:?}: {turns:#?}"))
    };
    let memory = turn_with("the sandbox's memory limit (128 MiB");
    assert!(!memory.contains("hog-done"), "{memory}");
    let workspace = turn_with("the sandbox's workspace limit (32 MiB");
    assert!(!workspace.contains("filler-done"), "{workspace}");
    let neighbour = turns
        .iter()
        .map(|turn| tool_result(turn))
        .find(|result| result["error"].is_null())
        .unwrap_or_else(|| panic!("no tool turn without an error: {turns:#?}"));
    assert_eq!(
        neighbour,
        json!({"output": "20", "exit_code": 0, "error": null}),
        "the neighbour did its work as if alone"
    );
}

/// What a conversation has seen when it asks the model: its prompt, the prompt's number (`task
/// number N`) and its tool results so far, in order.
struct Seen {
    prompt: String,
    task: u64,
    results: Vec<Value>,
}

impl Seen {
    fn of(body: &Value) -> Self {
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let prompt = first_user_message(body);
        let task = prompt
            .strip_prefix("task number ")
            .and_then(|number| number.trim().parse().ok())
            .unwrap_or(u64::MAX);
        let results = messages
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| {
                let content = m["content"].as_str().unwrap_or_default();
                serde_json::from_str(content).unwrap_or_else(|_| json!(content))
            })
            .collect();
        Self {
            prompt: prompt.to_owned(),
            task,
            results,
        }
    }

    /// The `session_id` of the background job tool result `index` started.
    fn job(&self, index: usize) -> &str {
        self.results
            .get(index)
            .and_then(|result| result["session_id"].as_str())
            .unwrap_or("no-such-job")
    }
}

/// A scripted model whose every reply is `script` of what the conversation asking has seen, and
/// the URL the pods reach it at: the server listens on loopback, and a relay on every address
/// passes the pods' connections on to it.
async fn model_scripting(
    setup: &Setup,
    script: impl Fn(&Seen) -> Value + Send + Sync + 'static,
) -> (ScriptedServer, String) {
    let model =
        ScriptedServer::start_responding(move |body| Step::ok(script(&Seen::of(body)))).await;
    let target = model.address();
    let relay = tokio::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        .await
        .expect("bind the model's relay");
    let port = relay.local_addr().expect("the relay's address").port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = relay.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (model, format!("http://{}:{port}/v1", setup.node.ip))
}

/// A model reply calling `terminal` to start `command` as a background job.
fn background_call(command: &str) -> Value {
    tool_call_reply(
        "terminal",
        &json!({ "command": command, "background": true }),
    )
}

/// A model reply calling `process` with `arguments`.
fn process_call(arguments: &Value) -> Value {
    tool_call_reply("process", arguments)
}

/// The tool results of every record run `run_dir` wrote, by prompt number, in call order.
fn results_by_task(run_dir: &Path) -> std::collections::BTreeMap<u64, Vec<Value>> {
    jsonl_lines(&run_dir.join("trajectories.jsonl"))
        .iter()
        .map(|record| {
            let results = record["conversations"]
                .as_array()
                .expect("conversations")
                .iter()
                .filter(|t| t["from"] == "tool")
                .map(|t| tool_result(t["value"].as_str().unwrap_or_default()))
                .collect();
            (check_record(record), results)
        })
        .collect()
}

/// The spec keys of a scripted run whose conversations take several turns.
fn long_conversations(extra: &Value) -> Value {
    let mut keys = json!({"agent": {"maxTurns": 12, "promptTimeoutSeconds": 180}});
    for (key, value) in extra.as_object().into_iter().flatten() {
        keys[key] = value.clone();
    }
    keys
}

/// The port of the probe's HTTP server in the sandbox container (the pod's own network
/// namespace: nothing else listens there).
const SERVER_PORT: u16 = 18765;

/// The terminal keeps its state between the calls of a conversation in a real pod, as the
/// reference's does: a `cd` and an `export` in one call are there in the next, and an HTTP server
/// started as a background job in one call answers a later one, from the directory it was
/// started in. When the conversation ends, so does the server: the next conversation in the same
/// sandbox container finds no process of it and nothing listening on its port. Five model
/// requests for the first conversation, two for the second, one record each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn state_and_a_background_server_last_the_conversation_and_end_with_it_in_a_real_pod() {
    let setup = Setup::new("pods-state").await;
    // `curl` is not in the image: Python fetches, retrying until the server listens.
    let fetch = format!(
        "python3 -c 'import time, urllib.request\n\
         for _ in range(150):\n    \
             try:\n        \
                 print(urllib.request.urlopen(\"http://127.0.0.1:{SERVER_PORT}/index.html\").read().decode()); break\n    \
             except OSError: time.sleep(0.1)'"
    );
    // The marker is put together at run time, so that only the server's command line holds it.
    let after = format!(
        "echo \"left=[$(grep -a -l '{}[{}]' /proc/[0-9]*/cmdline 2>/dev/null | tr '\\n' ' ')]\"\n\
         echo \"zombies=[$(grep -l '^[0-9]* ([^)]*) Z' /proc/[0-9]*/stat 2>/dev/null | tr '\\n' ' ')]\"\n\
         python3 -c 'import socket; print(\"connect\", socket.socket().connect_ex((\"127.0.0.1\", {SERVER_PORT})))'",
        SERVER_PORT / 10,
        SERVER_PORT % 10
    );
    let first = [
        terminal_call(
            "mkdir -p sub && cd sub && export PROBE_VAR=kept && echo served-from-sub > index.html",
        ),
        terminal_call("pwd; echo VAR=$PROBE_VAR"),
        background_call(&format!(
            "exec python3 -m http.server {SERVER_PORT} --bind 127.0.0.1"
        )),
        terminal_call(&fetch),
    ];
    let (model, url) = model_scripting(&setup, move |seen| match (seen.task, seen.results.len()) {
        (0, turn) if turn < first.len() => first[turn].clone(),
        (1, 0) => terminal_call(&after),
        _ => text_reply("done"),
    })
    .await;
    setup
        .create_one_batch_at("state", &url, 2, 1, long_conversations(&json!({})))
        .await;
    setup.succeeded_in_one_pod("state", 2).await;
    assert_eq!(model.request_count(), 5 + 2, "no turn lost or redone");
    let results = results_by_task(&setup.storage.run_dir(setup.ns(), "state"));
    let first = &results[&0];
    assert_eq!(first.len(), 4, "{first:#?}");
    assert_eq!(first[0]["exit_code"], 0, "{first:#?}");
    let state = first[1]["output"].as_str().unwrap_or_default();
    assert!(
        state.ends_with("/sub\nVAR=kept"),
        "cd and export persist: {first:#?}"
    );
    assert_eq!(
        first[2]["output"], "Background process started",
        "{first:#?}"
    );
    assert!(first[2]["session_id"].is_string(), "{first:#?}");
    assert_eq!(
        first[3]["output"], "served-from-sub",
        "the server answered a later call: {first:#?}"
    );
    let second = &results[&1];
    let probe = second[0]["output"].as_str().unwrap_or_default();
    assert!(
        probe.contains("left=[]"),
        "the server outlived its conversation: {probe}"
    );
    assert!(probe.contains("zombies=[]"), "{probe}");
    assert!(
        probe.contains("connect 111"),
        "something still listens: {probe}"
    );
}

/// The secret and the token of the neighbour conversation in the spying probe.
const NEIGHBOUR_SECRET: &str = "neighbour-private-7c21";
const NEIGHBOUR_TOKEN: &str = "tok-5f3a9c08";

/// What the attacking conversation's background job runs in the sandbox container: the would-be
/// survivors of [`ORPHANS_PROBE`] (`setsid`, `nohup`, a double fork, `setsid -f`, a daemon);
/// writes outside its workspace; and, once the neighbour's job (`sleep 987951`) is there, reads
/// of the neighbour's environment, working directory, memory and workspace, a write into its
/// output and a `SIGKILL`.
const ATTACK_JOB: &str = r#"m=98790
setsid sleep ${m}1 &
nohup sleep ${m}2 >/dev/null 2>&1 &
( (sleep ${m}3 &) & )
setsid -f sleep ${m}4
python3 -c 'import os, sys
if os.fork(): sys.exit()
os.setsid()
if os.fork(): sys.exit()
os.chdir("/")
os.closerange(0, 3)
os.execvp("sleep", ["sleep", sys.argv[1]])' ${m}5
for f in ../planted /tmp/planted /planted /sandbox/planted /dev/shm/planted; do
  (echo x > $f) 2>/dev/null && echo "wrote=$f"
done
n=
for i in $(seq 600); do
  n=$(grep -a -l '98795[1]' /proc/[0-9]*/cmdline 2>/dev/null | head -n 1 | cut -d/ -f3)
  [ -n "$n" ] && break
  sleep 0.1
done
echo "neighbour=[$n]"
echo "environ=[$(tr '\0' ' ' < /proc/$n/environ 2>&1)]"
echo "cwd=[$(ls /proc/$n/cwd/ 2>&1)]"
echo "secret=[$(cat /proc/$n/cwd/secret.txt 2>&1)]"
echo "mem=[$(head -c 16 /proc/$n/mem 2>&1 | od -c | head -n 1)]"
echo "siblings=[$(cat ../*/secret.txt 2>&1)]"
echo "fd=[$( (echo injected > /proc/$n/fd/1) 2>&1; echo $?)]"
echo "signal=[$(kill -KILL $n 2>&1; echo $?)]"
sleep 1
echo "running=$(grep -a -l "${m}[1-5]" /proc/[0-9]*/cmdline 2>/dev/null | wc -l)"
echo attack-done"#;

/// Background jobs that try to outlive, escape or spy on a neighbour fail in a real pod: three
/// conversations in the sandbox container of one pod, two at a time. The attacker's job starts
/// would-be survivors, writes outside its workspace and, while the neighbour's own job runs,
/// reads the neighbour's environment, directory, memory and files, writes into its output and
/// kills it. None of it works: the neighbour's secret and token appear in none of the
/// attacker's results, the neighbour's job runs on with its output untouched and its workspace
/// holds only its own file; and the third conversation, after the attacker's, finds none of its
/// survivors and no zombie. Every turn once (3 + 5 + 2 model requests), one record each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn background_jobs_that_try_to_outlive_escape_or_spy_fail_in_a_real_pod() {
    let setup = Setup::new("pods-jobs").await;
    let attacker_done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = std::sync::Arc::clone(&attacker_done);
    let (model, url) = model_scripting(&setup, move |seen| {
        use std::sync::atomic::Ordering::SeqCst;
        match (seen.task, seen.results.len()) {
            (0, 0) => background_call(ATTACK_JOB),
            (0, 1) => process_call(
                &json!({"action": "wait", "session_id": seen.job(0), "timeout": 120}),
            ),
            (0, _) => {
                done.store(true, SeqCst);
                text_reply("done")
            }
            (1, 0) => terminal_call(&format!(
                "echo {NEIGHBOUR_SECRET} > secret.txt && export NEIGHBOUR_TOKEN={NEIGHBOUR_TOKEN} && echo ready"
            )),
            (1, 1) => background_call("exec sleep 987951"),
            // Long enough for the attacker's job, which waits for this one's.
            (1, 2) => terminal_call("sleep 25; ls; cat secret.txt; echo token=$NEIGHBOUR_TOKEN"),
            (1, 3) => process_call(&json!({"action": "poll", "session_id": seen.job(1)})),
            (2, 0) => {
                assert!(done.load(SeqCst), "the third conversation started before the attacker's ended");
                terminal_call(ORPHANS_PROBE)
            }
            _ => text_reply("done"),
        }
    })
    .await;
    setup
        .create_one_batch_at("jobs", &url, 3, 2, long_conversations(&json!({})))
        .await;
    setup.succeeded_in_one_pod("jobs", 3).await;
    assert!(attacker_done.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(model.request_count(), 3 + 5 + 2, "no turn lost or redone");
    let results = results_by_task(&setup.storage.run_dir(setup.ns(), "jobs"));

    let attacker = &results[&0];
    assert_eq!(attacker.len(), 2, "{attacker:#?}");
    let waited = &attacker[1];
    assert_eq!(waited["status"], "exited", "{waited:#}");
    let attack = waited["output"].as_str().unwrap_or_default();
    eprintln!("the attacker's job:\n{attack}");
    assert!(attack.contains("attack-done"), "{attack}");
    assert!(
        !attack.contains("neighbour=[]"),
        "the attacker's job never saw the neighbour's: {attack}"
    );
    assert!(
        attack.contains("running=5"),
        "every would-be survivor started: {attack}"
    );
    assert!(
        !attack.contains("wrote="),
        "a write outside the workspace: {attack}"
    );
    for secret in [NEIGHBOUR_SECRET, NEIGHBOUR_TOKEN] {
        assert!(
            !attacker
                .iter()
                .any(|result| result.to_string().contains(secret)),
            "the attacker saw the neighbour's {secret}: {attack}"
        );
    }
    assert!(
        attack.contains("signal=[") && !attack.contains("signal=[0]"),
        "{attack}"
    );

    let neighbour = &results[&1];
    assert_eq!(neighbour.len(), 4, "{neighbour:#?}");
    assert_eq!(
        neighbour[2]["output"],
        format!("secret.txt\n{NEIGHBOUR_SECRET}\ntoken={NEIGHBOUR_TOKEN}"),
        "the neighbour's workspace holds its own file only: {neighbour:#?}"
    );
    let polled = &neighbour[3];
    assert_eq!(
        polled["status"], "running",
        "the neighbour's job was killed: {polled:#}"
    );
    assert_eq!(
        polled["output_preview"], "",
        "written into the neighbour's output: {polled:#}"
    );

    let after = results[&2][0]["output"].as_str().unwrap_or_default();
    assert!(
        after.contains("left=[]"),
        "the attacker's processes outlived it: {after}"
    );
    assert!(after.contains("zombies=[]"), "{after}");
    assert!(after.contains("running=5"), "{after}");
}

/// A runaway background job is stopped at its limit in a real pod, with the reason in what the
/// process tool says of it, and a neighbour conversation running at the same time in the same
/// sandbox container does its work as if alone: an output flood, a fork bomb and a memory hog,
/// each a job of one conversation. The conversation's shell answers afterwards and nothing of
/// the fork bomb is left. Every turn once (8 + 2 model requests), one record each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runaway_background_job_is_stopped_at_its_limit_in_a_real_pod() {
    let setup = Setup::new("pods-runaway").await;
    let jobs = [
        "yes flooding",
        "f(){ if [ $1 -lt 9 ]; then f $(($1+1)) & f $(($1+1)) & fi; sleep 987961; }; f 0",
        // Grows an array by 1 MiB a step: past the limit for many checks before the
        // allocation limit (twice the memory limit) would refuse it, whatever the load. (A
        // doubling buffer can cross from the limit to twice it between two checks, and then
        // ends on its own allocation failure; a string grown by `y="$y$x"` copies all of itself
        // each step, and took over 30 s to reach 256 MiB on a loaded machine.)
        "x=$(head -c 1048576 /dev/zero | tr '\\0' a); a=(); while :; do a+=(\"$x\"); done",
    ];
    let neighbour = "for i in $(seq 20); do echo $i > n$i; sleep 0.1; done; cat n* | wc -l";
    let (model, url) = model_scripting(&setup, move |seen| match (seen.task, seen.results.len()) {
        (0, turn @ 0..3) => background_call(jobs[turn]),
        (0, turn @ 3..6) => process_call(
            &json!({"action": "wait", "session_id": seen.job(turn - 3), "timeout": 120}),
        ),
        (0, 6) => terminal_call(
            "echo \"alive bombs=$(grep -a -l '98796[1]' /proc/[0-9]*/cmdline 2>/dev/null | wc -l)\"",
        ),
        (1, 0) => terminal_call(neighbour),
        _ => text_reply("done"),
    })
    .await;
    let limits = json!({"limits": {"processes": 64, "memoryBytes": 128 << 20}});
    setup
        .create_one_batch_at(
            "runaway",
            &url,
            2,
            2,
            long_conversations(&json!({"sandbox": limits})),
        )
        .await;
    setup.succeeded_in_one_pod("runaway", 2).await;
    assert_eq!(model.request_count(), 8 + 2, "no turn lost or redone");
    let results = results_by_task(&setup.storage.run_dir(setup.ns(), "runaway"));
    let runaway = &results[&0];
    assert_eq!(runaway.len(), 7, "{runaway:#?}");
    for (waited, reason) in runaway[3..6].iter().zip([
        "of output and was stopped",
        "the sandbox's process limit (64 processes",
        "the sandbox's memory limit (128 MiB",
    ]) {
        assert_eq!(waited["status"], "exited", "{waited:#}");
        assert_eq!(waited["termination_source"], "sandbox.limit", "{waited:#}");
        let why = waited["stopped_reason"].as_str().unwrap_or_default();
        assert!(why.contains(reason), "{reason:?}: {waited:#}");
    }
    assert_eq!(runaway[6]["output"], "alive bombs=0", "{runaway:#?}");
    assert_eq!(
        results[&1][0],
        json!({"output": "20", "exit_code": 0, "error": null}),
        "the neighbour did its work as if alone"
    );
}

/// A batch pod whose container is killed (SIGKILL) mid-batch is replaced by the Job controller on the same
/// index; the new pod resumes from the records on the volume: every prompt exactly once, and fewer
/// model requests than redoing the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_pod_killed_mid_batch_is_replaced_and_resumes() {
    let setup = Setup::new("pods-kill").await;
    let model = scripted_model(Duration::from_millis(700), "echo hi").await;
    let prompts = 6;
    setup
        .create_one_batch("kill", &model, prompts, 1, json!({}))
        .await;
    let victim = setup.running_batch_pod("kill-gen-1", "kill", 2).await;
    let written = batch_records(&setup.storage.run_dir(setup.ns(), "kill"), 0).len();
    let before = model.request_count();
    kill_container(&victim);

    let run = setup.finished("kill", Duration::from_secs(300)).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let pods = pods_of_index(&setup.pods, "kill-gen-1", 0).await;
    assert_eq!(pods.len(), 2, "{:#?}", pod_summary(&setup.pods).await);
    let killed = pods
        .iter()
        .find(|p| p.name_any() == victim.name_any())
        .expect("the killed pod");
    assert_eq!(terminated(killed).map(|t| t.0), Some(137), "SIGKILL");
    let (indexes, failed) = setup.prompt_indexes("kill");
    assert_eq!(failed, 0);
    assert_eq!(
        indexes,
        (0..prompts as u64).collect::<Vec<u64>>(),
        "every prompt once"
    );
    let requests = model.request_count();
    eprintln!(
        "{written} records before the kill, {before} requests then, {requests} in all \
         (redoing the batch: {})",
        before + 2 * prompts
    );
    assert!(
        requests < before + 2 * prompts,
        "{requests} model requests: the replacement redid finished conversations"
    );
    let replacement = &pods
        .iter()
        .find(|p| p.name_any() != victim.name_any())
        .expect("a replacement");
    let logs = setup
        .pods
        .logs(&replacement.name_any(), &LogParams::default())
        .await
        .expect("logs of the replacement");
    assert!(logs.contains("resumed"), "logs:\n{logs}");
}

/// A 401 from the model ends the run `Failed` with reason `ModelUnauthorized` (the worker's own, from
/// its termination message) through the worker's real exit code 78 and the Job's pod failure
/// policy, without spending the rest of the dataset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_401_from_the_model_fails_the_run_through_the_exit_code() {
    let setup = Setup::new("pods-401").await;
    let model = ScriptedServer::start_with_default_on(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        [],
        Step::error(401, "invalid_api_key", "Incorrect API key provided"),
    )
    .await;
    setup
        .create_scripted(
            "unauthorized",
            &setup.model_url(&model),
            10,
            &json!({"batchSize": 2, "workers": 1, "concurrency": 1, "retry": {"perBatch": 3}}),
        )
        .await;
    let run = setup
        .finished("unauthorized", Duration::from_secs(300))
        .await;
    assert_eq!(phase_of(&run), Some(Phase::Failed), "{:#?}", run.status);
    assert_eq!(
        condition(&run, "Failed"),
        Some(("True".to_owned(), "ModelUnauthorized".to_owned()))
    );
    let codes: BTreeSet<i32> = setup
        .pods
        .list(&kube::api::ListParams::default().labels("job-name=unauthorized-gen-1"))
        .await
        .expect("list the batch pods")
        .items
        .iter()
        .filter_map(|p| terminated(p).map(|t| t.0))
        .collect();
    assert_eq!(
        codes,
        BTreeSet::from([78]),
        "{:#?}",
        pod_summary(&setup.pods).await
    );
    // One pod, one attempt at one conversation: no retry of a 401, no other batch started.
    assert_eq!(
        model.request_count(),
        1,
        "the rest of the dataset was not spent"
    );
}

/// A scripted model on every address whose calls (a terminal call, then a final answer, 300 ms
/// each) report 100 input and 100 output tokens.
async fn model_of_priced_calls() -> ScriptedServer {
    let usage = json!({"prompt_tokens": 100, "completion_tokens": 100, "total_tokens": 200});
    let mut tool_call = terminal_call("true");
    tool_call["usage"] = usage.clone();
    let mut final_answer = text_reply("done");
    final_answer["usage"] = usage;
    ScriptedServer::start_fixed_latency_on(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        FixedLatency {
            latency: Duration::from_millis(300),
            tool_call,
            final_answer,
        },
    )
    .await
}

/// Run `name` once it is held at its budget and no pod of its first generation Job runs.
async fn held_with_no_pod_running(setup: &Setup, name: &str) -> TrajectoryRun {
    let job_pods = format!("job-name={name}-gen-1");
    wait_until(
        "the run held at its budget with no batch pod running",
        Duration::from_secs(300),
        || async {
            let run = setup.runs.get(name).await.ok()?;
            let suspended = condition(&run, "Suspended")?;
            let running = setup
                .pods
                .list(&ListParams::default().labels(&job_pods))
                .await
                .ok()?
                .items
                .iter()
                .any(|pod| {
                    matches!(
                        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Running" | "Pending")
                    )
                });
            (suspended == ("True".to_owned(), "BudgetExhausted".to_owned()) && !running)
                .then_some(run)
        },
    )
    .await
}

/// Four pods of 32 conversations each against a budget worth 100 model calls: together they
/// spend no more than the budget (plus what pods growing their allowances at the same moment may
/// each take for one conversation); the run is then held `Suspended` with reason
/// `BudgetExhausted`, its Job suspended and no pod left running. Raising the budget finishes it
/// with every record once: the model is asked again only for the conversations not recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_pods_hold_one_budget_and_raising_it_finishes_the_run_with_every_record_once() {
    const PROMPTS: usize = 160;
    const WORKERS: usize = 4;
    // Each call is priced at exactly 0.001 USD (100 input tokens at $2/M, 100 output at $8/M):
    // the budget is worth 100 calls, 50 conversations.
    const CALL_COST: f64 = 0.001;
    const BUDGET: f64 = 0.1;
    let setup = Setup::new("pods-budget").await;
    let model = model_of_priced_calls().await;
    let model_spec = |max_cost: f64| {
        json!({
            "baseUrl": setup.model_url(&model), "name": "scripted", "maxAttempts": 2,
            "requestTimeoutSeconds": 10,
            "pricing": {"input": 2.0, "output": 8.0},
            "budget": {"maxCost": max_cost},
        })
    };
    setup
        .create_scripted(
            "budget",
            &setup.model_url(&model),
            PROMPTS,
            &json!({"batchSize": PROMPTS / WORKERS, "workers": WORKERS, "concurrency": 32,
                    "model": model_spec(BUDGET)}),
        )
        .await;

    let held = held_with_no_pod_running(&setup, "budget").await;
    let jobs: Api<Job> = Api::namespaced(setup.client.clone(), setup.ns());
    let job = jobs.get("budget-gen-1").await.expect("the generation Job");
    assert_eq!(job.spec.and_then(|spec| spec.suspend), Some(true));
    assert_ne!(phase_of(&held), Some(Phase::Failed), "{:#?}", held.status);
    let run_dir = setup.storage.run_dir(setup.ns(), "budget");
    let recorded: usize = (0..4)
        .map(|batch| batch_records(&run_dir, batch).len())
        .sum();
    let asked = model.request_count();
    #[allow(clippy::cast_precision_loss)] // a few hundred calls
    let spent = asked as f64 * CALL_COST;
    eprintln!("held: {asked} model calls ({spent:.3} USD of {BUDGET}), {recorded} records");
    // Pods growing their allowances at one moment may each take one conversation's worth of
    // the same rest: at most (workers - 1) conversations past the budget.
    let slack = (WORKERS - 1) as f64 * 2.0 * CALL_COST;
    assert!(
        spent <= BUDGET + slack + 1e-9,
        "{asked} calls: spent {spent} past the budget {BUDGET} and {slack}"
    );
    assert!(recorded < PROMPTS, "the budget stopped nothing");
    // The status shows what the pods said was spent as they stopped.
    let shown = shown_cost(&held);
    assert!(
        shown > BUDGET / 2.0 && shown <= spent + 1e-9,
        "status.cost.spent {shown} against {spent} asked"
    );
    assert!(
        spent + WORKERS as f64 * 2.0 * CALL_COST > BUDGET,
        "held at {spent} with room for more than one conversation a pod"
    );

    // Raised: the same Job runs on; every prompt ends with one record, and the model is asked
    // only for the conversations that had none.
    setup
        .runs
        .patch(
            "budget",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"model": model_spec(1.0)}})),
        )
        .await
        .expect("raise the budget");
    let run = setup.finished("budget", Duration::from_secs(300)).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let (indexes, failed) = setup.prompt_indexes("budget");
    assert_eq!(
        (indexes, failed),
        ((0..PROMPTS as u64).collect::<Vec<u64>>(), 0),
        "every prompt once"
    );
    assert_eq!(
        model.request_count() - asked,
        2 * (PROMPTS - recorded),
        "after the raise: two calls for each conversation without a record, none for the others"
    );
    assert_eq!(
        condition(&run, "Suspended"),
        Some(("False".to_owned(), "Resumed".to_owned()))
    );
    // Merged: every call the pods were answered, each conversation's two at least.
    #[allow(clippy::cast_precision_loss)] // a few hundred calls
    let asked = model.request_count() as f64 * CALL_COST;
    let spent = shown_cost(&run);
    assert!(
        spent >= 2.0 * PROMPTS as f64 * CALL_COST - 1e-9 && spent <= asked + 1e-9,
        "status.cost.spent {spent} against {asked} asked"
    );
}

/// `status.cost.spent` of `run`, in USD.
fn shown_cost(run: &TrajectoryRun) -> f64 {
    let cost = run.status.as_ref().and_then(|status| status.cost.as_ref());
    cost.and_then(|cost| cost.spent.parse().ok())
        .unwrap_or_else(|| panic!("no status.cost: {:#?}", run.status))
}

/// Requests a minute the provider of the shared-limit test allows, and the run's limit.
const PROVIDER_LIMIT: usize = 300;

/// The pods of a run keep to one provider limit through a real Gubernator while pods come and go:
/// Envoy's local rate limit (429 past 300 requests a minute) in front of a scripted model that
/// records when each request reached it; 32 batches run by 4 pods, then 2, then 6 (`workers`
/// changed mid-run). Over any 60 s the model got at most the limit and, while the run was at
/// full speed, at least 90 % of it; the provider refused nothing, and no record failed. The six
/// pods have more than a minute of work at the limit: with less, the busiest minute reached back
/// into the two pods' stretch, where pods starting leave the limit unused, and measured that.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_coming_and_going_keep_to_one_provider_limit_through_gubernator() {
    const PROMPTS: usize = 320;
    let setup = Setup::new("pods-limits").await;
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = Arc::clone(&arrivals);
    let model = ScriptedServer::start_responding(move |body| {
        seen.lock().unwrap().push(Instant::now());
        let answered = body["messages"]
            .as_array()
            .is_some_and(|messages| messages.iter().any(|m| m["role"] == "assistant"));
        Step::ok(if answered {
            text_reply("done")
        } else {
            terminal_call("true")
        })
    })
    .await;
    let provider = SheddingProxy::rate_limited_on(
        "0.0.0.0",
        &model.address().to_string(),
        // A tenth of the limit at once: the bucket refills a second's worth at a time, and a
        // bucket no bigger than the run's own burst (a twentieth) refuses what a smooth 300 a
        // minute sends just before a refill.
        RateLimit {
            max_tokens: 30,
            per_second: 5,
            told: false,
        },
    );
    let gubernator = Gubernator::start("0.0.0.0");
    let gubernator_port = gubernator.url.rsplit_once(':').expect("host:port").1;
    let model_spec = json!({
        "baseUrl": format!("http://{}:{}/v1", setup.node.ip, provider.port()),
        "name": "scripted", "maxAttempts": 2, "requestTimeoutSeconds": 10,
        "limits": {
            "requestsPerMinute": PROVIDER_LIMIT,
            "gubernator": {"url": format!("http://{}:{gubernator_port}", setup.node.ip),
                           "key": "provider-key"},
        },
    });
    setup
        .create_scripted(
            "limits",
            "unused",
            PROMPTS,
            &json!({"batchSize": 10, "workers": 4, "concurrency": 8, "model": model_spec}),
        )
        .await;

    // Pods come and go: 4, then 2, then 6 at once.
    let mut running_pods = Vec::new();
    let mut workers_changed = Vec::new();
    let started = Instant::now();
    let run = loop {
        let run = setup.runs.get("limits").await.expect("get the run");
        if phase_of(&run).is_some_and(Phase::is_finished) {
            break run;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "not finished: {:#?}; pods {:#?}",
            run.status,
            pod_summary(&setup.pods).await
        );
        running_pods.push(running_batch_pods(&setup, "limits").await);
        let elapsed = started.elapsed().as_secs();
        for (at, workers) in [(40, 2), (75, 6)] {
            if elapsed >= at && !workers_changed.contains(&workers) {
                workers_changed.push(workers);
                set_workers(&setup, "limits", workers).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let (indexes, failed) = setup.prompt_indexes("limits");
    assert_eq!(
        (indexes, failed),
        ((0..PROMPTS as u64).collect::<Vec<u64>>(), 0),
        "every prompt once, none failed"
    );
    let counts = provider.counts();
    let mut arrivals = arrivals.lock().unwrap().clone();
    arrivals.sort();
    let busiest = most_in_any(&arrivals, Duration::from_secs(60));
    eprintln!(
        "{} requests in {:?}; busiest 60 s: {busiest} (limit {PROVIDER_LIMIT}); provider: \
         {counts:?}; running batch pods over time: {running_pods:?}",
        arrivals.len(),
        started.elapsed()
    );
    assert_eq!(counts.rate_limited, 0, "the provider refused none");
    assert_eq!(
        arrivals.len(),
        2 * PROMPTS,
        "every request reached the model once"
    );
    assert!(busiest <= PROVIDER_LIMIT, "{busiest} requests in 60 s");
    assert!(
        busiest * 10 >= PROVIDER_LIMIT * 9,
        "goodput {busiest} of {PROVIDER_LIMIT} a minute"
    );
    let most = running_pods.iter().copied().max().unwrap_or(0);
    assert!(most >= 5, "pods were added: {running_pods:?}");
}

/// Batch pods of run `name` running now.
async fn running_batch_pods(setup: &Setup, name: &str) -> usize {
    let pods = setup
        .pods
        .list(&ListParams::default())
        .await
        .expect("list the pods")
        .items;
    pods.iter()
        .filter(|pod| pod.name_any().starts_with(&format!("{name}-gen-")))
        .filter(|pod| pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .count()
}

async fn set_workers(setup: &Setup, name: &str, workers: u32) {
    setup
        .runs
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"workers": workers}})),
        )
        .await
        .expect("change the run's workers");
}

/// The most of `arrivals` (sorted) within any `window`.
fn most_in_any(arrivals: &[Instant], window: Duration) -> usize {
    arrivals
        .iter()
        .enumerate()
        .map(|(first, start)| arrivals[first..].partition_point(|at| *at < *start + window))
        .max()
        .unwrap_or(0)
}

/// An evicted running pod (the Eviction API: SIGTERM, the worker stops cleanly) is not counted as a
/// failure: with no retry allowed, the Job still replaces it and the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicted_running_pod_is_not_counted_as_a_failure() {
    let setup = Setup::new("pods-evict").await;
    let model = scripted_model(Duration::from_millis(700), "echo hi").await;
    setup
        .create_scripted(
            "evict",
            &setup.model_url(&model),
            4,
            &json!({"batchSize": 4, "workers": 1, "concurrency": 1,
                    "retry": {"perBatch": 0, "maxFailedBatches": 0}}),
        )
        .await;
    let victim = setup.running_batch_pod("evict-gen-1", "evict", 1).await;
    setup
        .pods
        .evict(&victim.name_any(), &EvictParams::default())
        .await
        .expect("evict the running batch pod");
    let run = setup.finished("evict", Duration::from_secs(300)).await;
    assert_eq!(phase_of(&run), Some(Phase::Succeeded), "{:#?}", run.status);
    let jobs: Api<Job> = Api::namespaced(setup.client.clone(), setup.ns());
    let status = jobs
        .get("evict-gen-1")
        .await
        .expect("gen-1")
        .status
        .expect("a status");
    assert_eq!(
        status.failed_indexes.as_deref().unwrap_or(""),
        "",
        "{status:#?}"
    );
    assert_eq!(status.completed_indexes.as_deref(), Some("0"));
    assert_eq!(run.status.as_ref().and_then(|s| s.attempt), Some(1));
    let (indexes, failed) = setup.prompt_indexes("evict");
    assert_eq!((indexes, failed), ((0..4).collect::<Vec<u64>>(), 0));
}

/// The chart's values for the real node: the test images, the node's toleration and selector, and
/// the API server's address on the bridge as `KUBERNETES_SERVICE_HOST`/`PORT` (no kube-proxy: the
/// `kubernetes` Service's `ClusterIP` leads nowhere). Namespaced, and without the cluster-wide
/// admission policy, so that nothing outlives the test's namespace.
fn chart_values_for_the_real_node(api: &kube::Config) -> Value {
    let host = api
        .cluster_url
        .host()
        .expect("the API server URL has a host");
    let port = api
        .cluster_url
        .port_u16()
        .expect("the API server URL has a port");
    assert!(
        host != "127.0.0.1" && host != "localhost",
        "the API server is at {}, on loopback, out of a pod's reach: start the cluster with \
         `scripts/cluster/up.sh --real-node`, which puts it on the bridge address",
        api.cluster_url
    );
    let (repository, tag) = OPERATOR_IMAGE.rsplit_once(':').expect("name:tag");
    let (worker_repository, worker_tag) = WORKER_IMAGE.rsplit_once(':').expect("name:tag");
    json!({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "worker": {"image": {"repository": worker_repository, "tag": worker_tag}},
        "scope": "Namespace",
        "admissionPolicy": {"enabled": false},
        "logFormat": "pretty",
        "nodeSelector": {"type": "real"},
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
        "extraEnv": [
            {"name": "KUBERNETES_SERVICE_HOST", "value": host},
            {"name": "KUBERNETES_SERVICE_PORT", "value": port.to_string()},
        ],
    })
}

/// Waits until the operator's pod of `release` is Ready on the real node; panics with its status
/// and logs when it is not within `timeout`.
async fn operator_pod_ready(setup: &Setup, release: &str, timeout: Duration) -> Pod {
    let selector = format!("app.kubernetes.io/instance={release}");
    let deadline = Instant::now() + timeout;
    loop {
        let list = setup
            .pods
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .expect("list the operator's pods");
        let ready = list.items.iter().find(|pod| {
            pod.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        if let Some(pod) = ready {
            return pod.clone();
        }
        if Instant::now() > deadline {
            let mut logs = String::new();
            for pod in &list.items {
                let text = setup
                    .pods
                    .logs(&pod.name_any(), &LogParams::default())
                    .await
                    .unwrap_or_else(|e| format!("(no logs: {e})"));
                let _ = writeln!(logs, "--- {}:\n{text}", pod.name_any());
            }
            panic!(
                "the operator's pod was not Ready on the real node within {timeout:?}; pods \
                 {:#?}\nlogs:\n{logs}",
                list.items.iter().map(|p| &p.status).collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The chart installs the operator, which runs in its own image (the test build's, imported into
/// the node) in a pod on the real node and reaches the API server at the bridge address; the
/// quickstart run it drives succeeds in real pods with one valid record per prompt. Then the
/// release uninstalls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_chart_installs_the_operator_in_its_own_image_and_a_run_succeeds_in_pods() {
    let setup = Setup::without_operator("pods-chart").await;
    real_node_with(&setup.client, OPERATOR_IMAGE).await;
    let (model_url, model_name) = model_server_for_pods(&setup.node);
    let values = chart_values_for_the_real_node(&trajectory_tests::config().await);
    let release = "traj";
    let started = Instant::now();
    helm::install(release, setup.ns(), &values).unwrap_or_else(|e| panic!("{e}"));
    let pod = operator_pod_ready(&setup, release, Duration::from_secs(120)).await;
    eprintln!(
        "the operator's pod {} was Ready {:?} after helm install",
        pod.name_any(),
        started.elapsed()
    );
    let spec = pod.spec.clone().expect("a pod spec");
    assert_eq!(spec.node_name.as_deref(), Some(setup.node.name.as_str()));
    let container = &spec.containers[0];
    assert_eq!(container.image.as_deref(), Some(OPERATOR_IMAGE));
    assert_eq!(container.image_pull_policy.as_deref(), Some("IfNotPresent"));

    setup.storage.add_dataset(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/quickstart/datasets/quickstart.jsonl"),
    );
    Box::pin(setup.run_the_quickstart(&model_url, &model_name)).await;
    // Every Job pod ran the worker image the chart passed to the operator.
    let images: BTreeSet<String> = setup
        .pods
        .list(&kube::api::ListParams::default().labels("job-name"))
        .await
        .expect("list the run's pods")
        .items
        .iter()
        .filter_map(|p| p.spec.as_ref()?.containers.first()?.image.clone())
        .collect();
    assert_eq!(images, BTreeSet::from([WORKER_IMAGE.to_owned()]));

    helm::uninstall(release, setup.ns()).unwrap_or_else(|e| panic!("{e}"));
    let left = setup
        .pods
        .list(
            &kube::api::ListParams::default()
                .labels(&format!("app.kubernetes.io/instance={release}")),
        )
        .await
        .expect("list the operator's pods");
    assert!(
        left.items
            .iter()
            .all(|p| p.metadata.deletion_timestamp.is_some()),
        "the operator's pod is going after helm uninstall"
    );
}

//! Runs in real pods on the local cluster's real node (`scripts/cluster/up.sh --real-node`): the
//! node, the test images imported into its containerd (`scripts/images/build.sh --test`), a
//! `hostPath` `PersistentVolume` shared by every pod of a run, and a model the pods reach at the
//! host's bridge address.
//!
//! Nothing here skips: a missing node, image or model server panics, naming the command that
//! provides it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, Config, ResourceExt};
use serde_json::{Value, json};
use trajectory_operator::api::TrajectoryRun;

use crate::{config, unique_name, wait_until};

/// How to get everything these tests need.
pub const HOW_TO_RUN: &str = "build the test images and run the tests with a real node that \
     imports them: `scripts/images/build.sh --test && TRAJ_NODE_IMAGES=\"out/images/test/\
     trajectory-worker-test.tar out/images/test/trajectory-operator-test.tar\" MODEL_SERVER_HOST=0.0.0.0 scripts/model-server/with-model-server.sh \
     scripts/cluster/with-cluster.sh --real-node cargo test -p trajectory-tests --test real_pods` \
     (scripts/test.sh does all of it)";

/// The node's taint: only pods that tolerate it land on the real node.
pub const TAINT_KEY: &str = "trajectory.dev/real-node";

/// The worker image `scripts/images/build.sh --test` builds from the test build's binaries.
pub const WORKER_IMAGE: &str = "trajectory.local/trajectory-worker:test";

/// The operator image `scripts/images/build.sh --test` builds from the test build's binaries.
pub const OPERATOR_IMAGE: &str = "trajectory.local/trajectory-operator:test";

/// The uid and gid both images run as.
pub const NONROOT: u32 = 65532;

/// The registry the real node pulls task images from (`scripts/cluster/node-up.sh` starts it and
/// pushes `scripts/registry/task-images.sh`'s images into it). Panics, saying `how_to_run`, when
/// the cluster has none.
pub fn registry(how_to_run: &str) -> String {
    std::env::var("TRAJ_CLUSTER_REGISTRY")
        .unwrap_or_else(|_| panic!("TRAJ_CLUSTER_REGISTRY is not set: {how_to_run}"))
}

/// The same registry as [`registry`], at the host's address on the pod network: where pods reach
/// it (a run's build pods pull from it and push to it), and the node pulls from it too.
pub fn pod_registry(how_to_run: &str) -> String {
    std::env::var("TRAJ_CLUSTER_POD_REGISTRY")
        .unwrap_or_else(|_| panic!("TRAJ_CLUSTER_POD_REGISTRY is not set: {how_to_run}"))
}

/// The Ready node labelled `type=real`.
#[derive(Debug, Clone)]
pub struct RealNode {
    pub name: String,
    /// Its `InternalIP`: the host's address on the pod network (the bridge), where pods reach the
    /// host's servers.
    pub ip: String,
    /// The image references containerd reports to the kubelet.
    pub images: Vec<String>,
}

/// The Ready real node. Panics, saying how to start one, when there is none.
pub async fn real_node(client: &Client, how_to_run: &str) -> RealNode {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().labels("type=real"))
        .await
        .expect("list nodes");
    let names: Vec<String> = list.items.iter().map(ResourceExt::name_any).collect();
    let ready = list.items.into_iter().find(|node| {
        node.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    });
    let Some(node) = ready else {
        panic!("no real node (label type=real) is Ready (found: {names:?}); {how_to_run}");
    };
    let status = node.status.clone().unwrap_or_default();
    let ip = status
        .addresses
        .unwrap_or_default()
        .into_iter()
        .find(|a| a.type_ == "InternalIP")
        .map_or_else(
            || panic!("real node {} has no InternalIP", node.name_any()),
            |a| a.address,
        );
    let images = status
        .images
        .unwrap_or_default()
        .into_iter()
        .flat_map(|image| image.names.unwrap_or_default())
        .collect();
    RealNode {
        name: node.name_any(),
        ip,
        images,
    }
}

/// The real node, checked to hold `image` (the kubelet lists containerd's images in the node's
/// status). Panics, naming the build and import commands, when the image is missing.
pub async fn real_node_with(client: &Client, image: &str) -> RealNode {
    let node = real_node(client, HOW_TO_RUN).await;
    // The kubelet reports new images within its node status period (10 s).
    wait_until(
        &format!(
            "image {image} on the real node {} (not imported: {HOW_TO_RUN})",
            node.name
        ),
        Duration::from_secs(30),
        || async {
            let node = real_node(client, HOW_TO_RUN).await;
            node.images.iter().any(|name| name == image).then_some(node)
        },
    )
    .await
}

/// The spec's `podTemplate` for the real node: tolerate its taint, select it, and use the imported
/// image without a registry.
pub fn pod_template() -> Value {
    json!({
        "imagePullPolicy": "IfNotPresent",
        "nodeSelector": {"type": "real"},
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    })
}

/// A host directory owned by 65532 (the pods' user: a `hostPath` volume ignores `fsGroup`), bound
/// through a `hostPath` `PersistentVolume` to a claim in the test's namespace. The volume is
/// deleted on drop; the directory is kept when the test failed (its path is printed).
#[derive(Debug)]
pub struct SharedStorage {
    pub dir: PathBuf,
    pub claim: String,
    pv: String,
    config: Config,
}

impl SharedStorage {
    pub async fn create(client: &Client, namespace: &str, prefix: &str) -> Self {
        let name = unique_name(prefix);
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(dir.join("datasets")).expect("create the shared directory");
        for path in [dir.clone(), dir.join("datasets")] {
            std::os::unix::fs::chown(&path, Some(NONROOT), Some(NONROOT))
                .unwrap_or_else(|e| panic!("chown {} to {NONROOT}: {e}", path.display()));
        }
        let claim = "shared".to_owned();
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"trajectory-tests": "true"}},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": dir.to_str().expect("a UTF-8 path"), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            }
        }))
        .expect("a PersistentVolume");
        let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": name,
                "resources": {"requests": {"storage": "1Gi"}},
            }
        }))
        .expect("a PersistentVolumeClaim");
        Api::<PersistentVolume>::all(client.clone())
            .create(&PostParams::default(), &pv)
            .await
            .unwrap_or_else(|e| panic!("create PersistentVolume {name}: {e}"));
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
        claims
            .create(&PostParams::default(), &pvc)
            .await
            .unwrap_or_else(|e| panic!("create PersistentVolumeClaim {claim}: {e}"));
        let storage = Self {
            dir,
            claim,
            pv: name,
            config: config().await,
        };
        wait_until(
            "the claim to be Bound to its hostPath volume",
            Duration::from_secs(60),
            || async {
                let pvc = claims.get(&storage.claim).await.ok()?;
                (pvc.status?.phase.as_deref() == Some("Bound")).then_some(())
            },
        )
        .await;
        storage
    }

    /// Copies `file` into `datasets/` on the volume, readable by the pods.
    pub fn add_dataset(&self, file: &Path) {
        let target = self
            .dir
            .join("datasets")
            .join(file.file_name().expect("a file name"));
        std::fs::copy(file, &target)
            .unwrap_or_else(|e| panic!("copy {} into the volume: {e}", file.display()));
        std::os::unix::fs::chown(&target, Some(NONROOT), Some(NONROOT)).expect("chown the dataset");
    }

    /// Copies the directory `dir` (a folder of Harbor tasks) to `datasets/<name>` on the
    /// volume, modes kept, readable by the pods.
    pub fn add_dataset_dir(&self, dir: &Path, name: &str) {
        fn copy(from: &Path, to: &Path) {
            std::fs::create_dir_all(to)
                .unwrap_or_else(|e| panic!("make {} on the volume: {e}", to.display()));
            std::os::unix::fs::chown(to, Some(NONROOT), Some(NONROOT)).expect("chown the dataset");
            for entry in std::fs::read_dir(from).expect("read the dataset's directory") {
                let entry = entry.expect("a directory entry");
                let target = to.join(entry.file_name());
                if entry.file_type().expect("a file type").is_dir() {
                    copy(&entry.path(), &target);
                } else {
                    std::fs::copy(entry.path(), &target).unwrap_or_else(|e| {
                        panic!("copy {} into the volume: {e}", entry.path().display())
                    });
                    std::os::unix::fs::chown(&target, Some(NONROOT), Some(NONROOT))
                        .expect("chown the dataset");
                }
            }
        }
        copy(dir, &self.dir.join("datasets").join(name));
    }

    /// Writes `prompts` prompts to `datasets/prompts.jsonl` on the volume (see
    /// [`crate::e2e::write_dataset`]), readable by the pods.
    pub fn write_prompts(&self, prompts: usize) {
        crate::e2e::write_dataset(&self.dir, prompts);
        let path = self.dir.join("datasets/prompts.jsonl");
        std::os::unix::fs::chown(&path, Some(NONROOT), Some(NONROOT)).expect("chown the dataset");
    }

    /// The spec's `storage` for this claim.
    pub fn spec(&self) -> Value {
        json!({"volume": {"persistentVolumeClaim": {"claimName": self.claim}}})
    }

    /// The output directory of run `name` in `namespace`.
    pub fn run_dir(&self, namespace: &str, name: &str) -> PathBuf {
        self.dir.join("runs").join(namespace).join(name)
    }
}

impl Drop for SharedStorage {
    fn drop(&mut self) {
        let name = self.pv.clone();
        let deleted = crate::on_own_runtime(self.config.clone(), |client| async move {
            let volumes: Api<PersistentVolume> = Api::all(client);
            match volumes.delete(&name, &DeleteParams::background()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        });
        if let Err(e) = deleted {
            eprintln!("warning: deleting PersistentVolume {}: {e}", self.pv);
        }
        if std::thread::panicking() {
            eprintln!(
                "keeping the storage of the failed test: {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The quickstart run of `examples/quickstart/run.yaml` as a cluster runs it: the model `model` at
/// `model_url`, the shared `storage`, the real node's pod template.
pub fn quickstart_run(model_url: &str, model: &str, storage: &SharedStorage) -> TrajectoryRun {
    let mut run: Value =
        serde_yaml::from_str(include_str!("../../examples/quickstart/run.yaml")).expect("run.yaml");
    let spec = run["spec"].as_object_mut().expect("a spec");
    spec.insert("storage".into(), storage.spec());
    spec.insert("podTemplate".into(), pod_template());
    spec["model"]["baseUrl"] = json!(model_url);
    spec["model"]["name"] = json!(model);
    serde_json::from_value(run).expect("a valid TrajectoryRun")
}

/// The llama.cpp model server of `scripts/model-server` as the pods reach it: its port from
/// `MODEL_BASE_URL`, on the real node's bridge address. Panics unless it listens where pods reach it
/// (`MODEL_SERVER_HOST` 0.0.0.0 or the bridge address).
pub fn model_server_for_pods(node: &RealNode) -> (String, String) {
    let base = std::env::var("MODEL_BASE_URL")
        .unwrap_or_else(|_| panic!("MODEL_BASE_URL is not set; {HOW_TO_RUN}"));
    let name = std::env::var("MODEL_NAME")
        .unwrap_or_else(|_| panic!("MODEL_NAME is not set; {HOW_TO_RUN}"));
    let host = std::env::var("MODEL_SERVER_HOST").unwrap_or_default();
    assert!(
        host == "0.0.0.0" || host == node.ip,
        "the model server listens on {host:?}, out of the pods' reach; {HOW_TO_RUN}"
    );
    let port = base
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|port| port.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no port in MODEL_BASE_URL={base}"));
    (format!("http://{}:{port}/v1", node.ip), name)
}

/// The pods of `job` with completion index `index`, oldest first.
pub async fn pods_of_index(pods: &Api<Pod>, job: &str, index: u32) -> Vec<Pod> {
    let mut list = pods
        .list(&ListParams::default().labels(&format!(
            "job-name={job},batch.kubernetes.io/job-completion-index={index}"
        )))
        .await
        .expect("list the index's pods")
        .items;
    list.sort_by_key(|pod| pod.metadata.creation_timestamp.clone());
    list
}

/// The worker container's terminated state of `pod`: (exit code, reason, message).
pub fn terminated(pod: &Pod) -> Option<(i32, String, String)> {
    let state = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .terminated
        .clone()?;
    Some((
        state.exit_code,
        state.reason.unwrap_or_default(),
        state.message.unwrap_or_default(),
    ))
}

/// SIGKILLs every process of the running container of `pod`, from the host: the processes whose
/// cgroup path names the container id. Returns how many were killed.
pub fn kill_container(pod: &Pod) -> usize {
    let killed = kill_container_if_running(pod);
    assert!(
        killed > 0,
        "no process of pod {}'s worker on this host",
        pod.name_any()
    );
    killed
}

/// As [`kill_container`], for a pod whose worker may have just ended: 0 when it had.
pub fn kill_container_if_running(pod: &Pod) -> usize {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.as_deref())
        .and_then(|id| id.split_once("://").map(|(_, id)| id.to_owned()))
        .unwrap_or_else(|| panic!("pod {} has no running container", pod.name_any()));
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        if cgroup.contains(&id) {
            pids.push(pid.to_string());
        }
    }
    if pids.is_empty() {
        return 0;
    }
    let status = std::process::Command::new("kill")
        .arg("-KILL")
        .args(&pids)
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -KILL {pids:?}: {status}");
    pids.len()
}

/// Checks the structure every Hermes record has, whatever the model said; returns its
/// `prompt_index`.
pub fn check_record(record: &Value) -> u64 {
    let turns = record["conversations"]
        .as_array()
        .unwrap_or_else(|| panic!("a record has conversations: {record}"));
    assert_eq!(turns[0]["from"], "system", "{record}");
    assert!(
        turns[0]["value"]
            .as_str()
            .unwrap_or_default()
            .contains("<tools>\n[{\"name\": "),
        "{record}"
    );
    assert_eq!(turns[1]["from"], "human", "{record}");
    for turn in &turns[2..] {
        let from = turn["from"].as_str().unwrap_or_default();
        assert!(
            matches!(from, "gpt" | "tool" | "human"),
            "unexpected role {from}: {record}"
        );
    }
    record["prompt_index"]
        .as_u64()
        .unwrap_or_else(|| panic!("a record has a prompt_index: {record}"))
}

/// The JSON lines of `path` (none when it does not exist).
pub fn jsonl_lines(path: &Path) -> Vec<Value> {
    match std::fs::read_to_string(path) {
        Ok(text) => text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("reading {}: {e}", path.display()),
    }
}

/// The whole record lines of every records file of `batch` in the run directory `run_dir` (one per
/// writer: each pod that ran the batch), one file after another; a torn tail of a writer still at
/// work, or killed, is not a record.
pub fn batch_records(run_dir: &Path, batch: u32) -> Vec<Value> {
    let run_dir = trajectory_worker::storage::RunDir::new(run_dir);
    let files = run_dir
        .records_files(batch)
        .unwrap_or_else(|e| panic!("listing batch {batch}'s files: {e}"));
    let read = trajectory_worker::storage::read_files_lines_into(
        files.iter().map(|file| file.records.as_path()),
        Vec::new(),
    )
    .unwrap_or_else(|e| panic!("reading batch {batch}'s files: {e}"));
    read.lines
        .iter()
        .map(|&(start, end)| {
            serde_json::from_slice(&read.data[start..end])
                .unwrap_or_else(|e| panic!("bad record of batch {batch}: {e}"))
        })
        .collect()
}

/// Counts of the pods' phases, for failure messages.
pub async fn pod_summary(pods: &Api<Pod>) -> BTreeMap<String, String> {
    pods.list(&ListParams::default())
        .await
        .map(|list| {
            list.items
                .iter()
                .map(|pod| {
                    let phase = pod
                        .status
                        .as_ref()
                        .and_then(|s| s.phase.clone())
                        .unwrap_or_default();
                    (pod.name_any(), format!("{phase} {:?}", terminated(pod)))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until nothing of the conversations of `namespace` is left on the real node, and panics
/// naming what is when it does not go within two minutes: no task container (`task-<i>`) of its
/// pods in containerd (the kubelet removes a deleted pod's containers, and their writable layers
/// with them) and no process on this host whose command line holds `command_line` (a background
/// job a conversation left).
pub async fn assert_nothing_left_on_node(namespace: &str, command_line: &[&str]) {
    let cluster = std::env::var("TRAJ_CLUSTER_DIR").unwrap_or("/tmp/trajectory-cluster".into());
    let socket = Path::new(&cluster).join("node/containerd/containerd.sock");
    let filter = format!(
        "labels.\"io.kubernetes.pod.namespace\"=={namespace},\
         labels.\"io.kubernetes.container.name\"~=^task-"
    );
    let needle: Vec<u8> = command_line.join("\0").into_bytes();
    let mut left = String::new();
    let gone = wait_until_or_none(Duration::from_secs(120), || {
        let listed = std::process::Command::new("ctr")
            .arg("--address")
            .arg(&socket)
            .args(["-n", "k8s.io", "containers", "ls", "-q", &filter])
            .output()
            .expect("run ctr (scripts/cluster/install-node.sh installs it)");
        assert!(
            listed.status.success(),
            "ctr containers ls: {}",
            String::from_utf8_lossy(&listed.stderr)
        );
        let containers = String::from_utf8_lossy(&listed.stdout).trim().to_owned();
        let processes = processes_with(&needle);
        left = format!("containers {containers:?}, processes {processes:?}");
        containers.is_empty() && processes.is_empty()
    })
    .await;
    assert!(gone, "left on the node two minutes after the run: {left}");
}

/// The pids of this host whose command line holds `needle` (arguments joined by NUL).
fn processes_with(needle: &[u8]) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let command_line = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if command_line
            .windows(needle.len())
            .any(|window| window == needle)
        {
            found.push(pid);
        }
    }
    found
}

/// Polls `done` every second for at most `wait`: whether it came true.
async fn wait_until_or_none(wait: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = std::time::Instant::now() + wait;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() > until {
            return false;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

//! Real pods on the real node of the local cluster (`scripts/cluster/up.sh --real-node`): a kubelet,
//! containerd and runc running containers of an image imported without a registry.
//!
//! Needs that node; fails (does not skip) without it:
//! `scripts/cluster/with-cluster.sh --real-node cargo test -p trajectory-tests --test real_node`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{LogParams, PostParams};
use serde_json::json;
use trajectory_tests::real_pods::{RealNode, TAINT_KEY, real_node, registry};
use trajectory_tests::{TestNamespace, client, unique_name, wait_until};

const HOW_TO_RUN: &str = "run the tests with a real node: `scripts/cluster/with-cluster.sh \
     --real-node cargo test -p trajectory-tests --test real_node`";

/// A value set in `scripts/cluster/lib.sh` (`NAME=value`), so the test uses what the scripts import.
fn cluster_setting(name: &str) -> String {
    include_str!("../../scripts/cluster/lib.sh")
        .lines()
        .find_map(|line| line.trim().strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("scripts/cluster/lib.sh sets {name}"))
        .trim()
        .to_owned()
}

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> Self {
        let path = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Python's `http.server` serving `dir` on `bind`, on a port it picked; killed on drop.
struct HostServer {
    child: Child,
    port: u16,
}

impl HostServer {
    fn start(bind: &str, dir: &Path) -> Self {
        let mut child = Command::new("python3")
            .args([
                "-u",
                "-m",
                "http.server",
                "0",
                "--bind",
                bind,
                "--directory",
            ])
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start python3 -m http.server (python3 on PATH)");
        // "Serving HTTP on 10.88.0.1 port 41235 (http://10.88.0.1:41235/) ..."
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("read http.server's first line");
        let port = line
            .split_whitespace()
            .skip_while(|word| *word != "port")
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("http.server on {bind} printed {line:?}, no port"));
        Self { child, port }
    }
}

impl Drop for HostServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The proof pod: on the real node, the imported busybox image (`IfNotPresent`: no registry), a
/// hostPath volume; fetches the token from the host's server at `host_url`, writes it into the
/// volume, and checks that the host's loopback server (`loopback_url`) is not reachable from the pod.
fn proof_pod(name: &str, shared: &Path, host_url: &str, loopback_url: &str) -> Pod {
    let script = format!(
        "echo \"hello from pod $(hostname)\"\n\
         wget -q -O /shared/fetched.txt {host_url}\n\
         echo \"fetched from the host: $(cat /shared/fetched.txt)\"\n\
         if timeout 5 wget -q -O- {loopback_url}; then echo 'reached the host loopback'; exit 3; fi\n\
         echo 'the host loopback is not reachable from the pod'\n"
    );
    pod_on_the_real_node(
        name,
        &json!({
            "name": "proof",
            "image": cluster_setting("NODE_BUSYBOX_IMAGE"),
            "imagePullPolicy": "IfNotPresent",
            "command": ["/bin/sh", "-c", script],
            "volumeMounts": [{ "name": "shared", "mountPath": "/shared" }]
        }),
        &json!([{
            "name": "shared",
            "hostPath": { "path": shared.to_str().expect("utf-8 path"), "type": "Directory" }
        }]),
    )
}

/// A pod of one container that runs once on the real node (tolerating its taint).
fn pod_on_the_real_node(
    name: &str,
    container: &serde_json::Value,
    volumes: &serde_json::Value,
) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "nodeSelector": { "type": "real" },
            "tolerations": [{ "key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule" }],
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            "volumes": volumes,
        }
    }))
    .expect("pod manifest")
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

#[tokio::test]
async fn a_pod_runs_on_the_real_node_reaches_the_host_and_writes_to_a_host_path() {
    let client = client().await;
    let RealNode {
        name: node,
        ip: host_ip,
        ..
    } = real_node(&client, HOW_TO_RUN).await;
    let ns = TestNamespace::create(&client, "real-node").await;

    let token = unique_name("token");
    let www = TempDir::new("real-node-www");
    std::fs::write(www.0.join("token.txt"), &token).expect("write token");
    let shared = TempDir::new("real-node-shared");
    // Pods reach the host at the node's InternalIP (the bridge address); a server bound to the host's
    // 127.0.0.1 is out of their reach, as their 127.0.0.1 is their own.
    let host = HostServer::start(&host_ip, &www.0);
    let loopback = HostServer::start("127.0.0.1", &www.0);
    let host_url = format!("http://{host_ip}:{}/token.txt", host.port);
    let loopback_url = format!("http://127.0.0.1:{}/token.txt", loopback.port);

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let name = "proof";
    pods.create(
        &PostParams::default(),
        &proof_pod(name, &shared.0, &host_url, &loopback_url),
    )
    .await
    .expect("create the proof pod");
    let pod = wait_until(
        "the proof pod to finish on the real node",
        Duration::from_secs(120),
        || async {
            let pod = pods.get(name).await.ok()?;
            matches!(phase(&pod), "Succeeded" | "Failed").then_some(pod)
        },
    )
    .await;
    let logs = pods
        .logs(name, &LogParams::default())
        .await
        .expect("kubectl logs of the proof pod (API server -> kubelet)");
    assert_eq!(
        phase(&pod),
        "Succeeded",
        "proof pod ended {}; logs:\n{logs}\nstatus: {:#?}",
        phase(&pod),
        pod.status
    );
    assert_eq!(
        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(node.as_str())
    );
    assert!(logs.contains("hello from pod proof"), "logs:\n{logs}");
    assert!(
        logs.contains(&format!("fetched from the host: {token}")),
        "logs:\n{logs}"
    );
    assert!(
        logs.contains("the host loopback is not reachable from the pod"),
        "logs:\n{logs}"
    );
    let written = std::fs::read_to_string(shared.0.join("fetched.txt")).expect("the pod's file");
    assert_eq!(
        written, token,
        "the pod wrote the token into the hostPath volume"
    );
}

#[tokio::test]
async fn a_pod_that_does_not_tolerate_the_taint_stays_on_the_kwok_nodes() {
    let client = client().await;
    let node = real_node(&client, HOW_TO_RUN).await.name;
    let ns = TestNamespace::create(&client, "real-node-taint").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": "anywhere" },
        "spec": { "containers": [{ "name": "c", "image": "example.invalid/none:1" }] }
    }))
    .expect("pod manifest");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    let bound = wait_until(
        "the pod to be scheduled",
        Duration::from_secs(60),
        || async { pods.get("anywhere").await.ok()?.spec?.node_name },
    )
    .await;
    assert_ne!(
        bound, node,
        "an untolerating pod landed on the tainted real node"
    );
    assert!(bound.starts_with("kwok-node-"), "scheduled on {bound}");
}

/// A pod on the real node running `command` in `image`, pulled from its registry every time
/// (`Always`), in the image's own working directory.
fn task_pod(name: &str, image: &str, command: &[&str]) -> Pod {
    pod_on_the_real_node(
        name,
        &json!({
            "name": "task",
            "image": image,
            "imagePullPolicy": "Always",
            "command": command,
        }),
        &json!([]),
    )
}

/// The messages of the Events of the pod `name` with `reason`.
async fn event_messages(client: &kube::Client, ns: &str, name: &str, reason: &str) -> Vec<String> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), ns);
    let selector = format!("involvedObject.name={name},reason={reason}");
    events
        .list(&kube::api::ListParams::default().fields(&selector))
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter_map(|event| event.message)
        .collect()
}

/// Task images as datasets name them: pushed to a real registry without Docker (glibc with bash,
/// busybox, one without a shell) and pulled by the node over the network. Each pod sees its own
/// image's marker file and starts in its image's working directory; an image without a shell cannot
/// start a shell; an image that is not in the registry is an image pull error naming it.
#[tokio::test]
async fn task_images_are_pulled_from_a_registry_and_start_in_their_own_working_directory() {
    let client = client().await;
    let node = real_node(&client, HOW_TO_RUN).await;
    let registry = registry(HOW_TO_RUN);
    let ns = TestNamespace::create(&client, "task-images").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let glibc = format!("{registry}/tasks/glibc:1");
    let busybox = format!("{registry}/tasks/busybox:1");
    let noshell = format!("{registry}/tasks/noshell:1");
    let missing = format!("{registry}/tasks/missing:1");
    for image in [&glibc, &busybox, &noshell] {
        assert!(
            !node.images.contains(image),
            "{image} is on the node before any pod asked for it: {:?}",
            node.images
        );
    }
    let report = "echo marker=$(cat /task/marker) pwd=$(pwd) files=$(ls | head -n 1)";
    for (name, image, shell) in [
        ("glibc", &glibc, "/bin/bash"),
        ("busybox", &busybox, "/bin/sh"),
    ] {
        pods.create(
            &PostParams::default(),
            &task_pod(name, image, &[shell, "-c", report]),
        )
        .await
        .expect("create a task pod");
    }
    pods.create(
        &PostParams::default(),
        &task_pod("noshell", &noshell, &["/bin/sh", "-c", "true"]),
    )
    .await
    .expect("create the pod without a shell");
    pods.create(
        &PostParams::default(),
        &task_pod("missing", &missing, &["/bin/sh"]),
    )
    .await
    .expect("create the pod of a missing image");

    for (name, image, expected) in [
        ("glibc", &glibc, "marker=glibc pwd=/testbed files=README.md"),
        ("busybox", &busybox, "marker=busybox pwd=/work files="),
    ] {
        let pod = ended(&pods, name, &["Succeeded", "Failed"]).await;
        let logs = pods.logs(name, &LogParams::default()).await.expect("logs");
        assert_eq!(
            phase(&pod),
            "Succeeded",
            "{name}: {logs}\n{:#?}",
            pod.status
        );
        assert_eq!(logs.trim(), expected, "{name}");
        let pulled = event_messages(&client, ns.name(), name, "Pulled").await;
        assert!(
            pulled.iter().any(|message| {
                message.contains("Successfully pulled") && message.contains(image.as_str())
            }),
            "{name}: the kubelet pulled {image}: {pulled:?}"
        );
    }

    let terminated = first_container_state(ended(&pods, "noshell", &["Failed"]).await)
        .and_then(|state| state.terminated)
        .expect("the container without a shell terminated");
    assert!(
        terminated
            .message
            .as_deref()
            .unwrap_or("")
            .contains("/bin/sh"),
        "{terminated:?}"
    );

    let waiting = wait_until(
        "the pod of a missing image to fail its pull",
        Duration::from_secs(60),
        || async {
            let waiting = first_container_state(pods.get("missing").await.ok()?)?.waiting?;
            matches!(
                waiting.reason.as_deref(),
                Some("ErrImagePull" | "ImagePullBackOff")
            )
            .then_some(waiting)
        },
    )
    .await;
    assert!(
        waiting.message.as_deref().unwrap_or("").contains(&missing),
        "{waiting:?}"
    );
}

/// The pod `name` once its phase is one of `phases`.
async fn ended(pods: &Api<Pod>, name: &str, phases: &[&str]) -> Pod {
    wait_until(
        &format!("the pod {name} to end {phases:?}"),
        Duration::from_secs(120),
        || async {
            let pod = pods.get(name).await.ok()?;
            phases.contains(&phase(&pod)).then_some(pod)
        },
    )
    .await
}

/// The state of a pod's first container.
fn first_container_state(pod: Pod) -> Option<k8s_openapi::api::core::v1::ContainerState> {
    pod.status?.container_statuses?.into_iter().next()?.state
}

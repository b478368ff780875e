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
use trajectory_tests::real_pods::{RealNode, TAINT_KEY, real_node};
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
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "nodeSelector": { "type": "real" },
            "tolerations": [{ "key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule" }],
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "proof",
                "image": cluster_setting("NODE_BUSYBOX_IMAGE"),
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script],
                "volumeMounts": [{ "name": "shared", "mountPath": "/shared" }]
            }],
            "volumes": [{
                "name": "shared",
                "hostPath": { "path": shared.to_str().expect("utf-8 path"), "type": "Directory" }
            }]
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

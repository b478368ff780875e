//! A real Kueue beside the test control plane, as Kueue's own integration tests run it: the
//! manager (built from its Go module by `scripts/kueue/build.sh`, or the binary `TRAJ_KUEUE`
//! names) runs as a process of this machine with the `batch/job` integration alone, its CRDs
//! (the module's `config/components/crd/bases`) applied to the cluster, and its webhooks served on
//! loopback with a self-signed certificate and registered by URL from the module's own webhook
//! manifest, kept to the Job and Kueue kinds.
//!
//! One Kueue per test binary, started by the first test that asks ([`Kueue::shared`]) and ended
//! with the binary: it runs under a shell that kills it once its standard input (a pipe this
//! process holds) closes. The Job webhooks are scoped to namespaces labelled [`NAMESPACE_LABEL`]
//! ([`Kueue::namespace`] makes them), so that the other tests' Jobs never meet a webhook whose
//! server may be gone.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OnceCell;
use trajectory_testkit::installed;

use crate::sidecar::{FIELD_MANAGER, Sidecar, apply, apply_crds, free_port};
use crate::{TestNamespace, wait_until};

/// The label of namespaces whose Jobs Kueue's Job webhooks see.
pub const NAMESPACE_LABEL: &str = "trajectories.dev/kueue-test";

/// The Workload API the tests read (Kueue's stored version).
pub const WORKLOAD_VERSION: &str = "v1beta2";

/// A running Kueue.
#[derive(Debug)]
pub struct Kueue {
    pub process: Sidecar,
    _dir: tempfile::TempDir,
}

impl Kueue {
    /// The binary's Kueue, started on first use. Panics when it cannot start: a test that needs
    /// it must fail loudly.
    pub async fn shared(client: &Client) -> &'static Self {
        static KUEUE: OnceCell<Kueue> = OnceCell::const_new();
        KUEUE.get_or_init(|| Self::start(client)).await
    }

    async fn start(client: &Client) -> Self {
        let binary = installed("TRAJ_KUEUE", "kueue/build.sh", "--print-path");
        let source = installed("TRAJ_KUEUE_SRC", "kueue/build.sh", "--print-src");
        apply_crds(client, &[source.join("config/components/crd/bases")]).await;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        apply(
            &namespaces,
            "kueue-system",
            &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}}),
        )
        .await;

        let dir = tempfile::tempdir().expect("temp dir");
        let certs = dir.path().join("certs");
        let ca = make_certificates(&certs);
        // Kueue 0.19 reads its metrics certificate from a fixed directory when it does not
        // manage its certificates itself.
        let metrics = Path::new("/etc/kueue/metrics/certs");
        std::fs::create_dir_all(metrics).expect("Kueue's metrics certificate directory");
        for file in ["tls.crt", "tls.key"] {
            std::fs::copy(certs.join(file), metrics.join(file)).expect("copy a certificate");
        }
        let (webhook, health, metrics_port) = (free_port(), free_port(), free_port());
        let config = dir.path().join("kueue.yaml");
        std::fs::write(
            &config,
            format!(
                "apiVersion: config.kueue.x-k8s.io/v1beta2\n\
                 kind: Configuration\n\
                 namespace: kueue-system\n\
                 health: {{healthProbeBindAddress: 127.0.0.1:{health}}}\n\
                 metrics: {{bindAddress: 127.0.0.1:{metrics_port}}}\n\
                 webhook: {{host: 127.0.0.1, port: {webhook}, certDir: {}}}\n\
                 leaderElection: {{leaderElect: false}}\n\
                 internalCertManagement: {{enable: false}}\n\
                 manageJobsWithoutQueueName: false\n\
                 integrations: {{frameworks: [\"batch/job\"]}}\n",
                certs.display()
            ),
        )
        .expect("write Kueue's configuration");
        let kubeconfig = std::env::var("KUBECONFIG").expect("KUBECONFIG names the test cluster");
        let process = Sidecar::start(
            "Kueue",
            &binary,
            &[
                "--config".as_ref(),
                config.as_os_str(),
                "--kubeconfig".as_ref(),
                kubeconfig.as_ref(),
                "--feature-gates=VisibilityOnDemand=false".as_ref(),
                "--zap-log-level=2".as_ref(),
            ],
            std::iter::empty::<(&str, &str)>(),
            dir.path().join("kueue.log"),
            (health, "/readyz"),
        )
        .await;
        register_webhooks(client, &source, webhook, &ca).await;
        Self { process, _dir: dir }
    }

    /// A test namespace whose Jobs Kueue manages, with a `LocalQueue` named `queue` admitting
    /// into a `ClusterQueue` of the namespace's name, of `cpu` and `memory` quota in one flavor
    /// (`nodeLabels` injected into the pods it admits), preempting lower priorities within it.
    pub async fn namespace(
        &self,
        client: &Client,
        prefix: &str,
        queue: &str,
        quota: (&str, &str),
        node_labels: &Value,
    ) -> TestNamespace {
        let namespace = TestNamespace::create(client, prefix).await;
        let name = namespace.name().to_owned();
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {NAMESPACE_LABEL: "true"}}})),
            )
            .await
            .expect("label the namespace for Kueue");
        let flavor = format!("{name}-flavor");
        apply(
            &kueue_api(client, "ResourceFlavor", None),
            &flavor,
            &json!({
                "apiVersion": format!("kueue.x-k8s.io/{WORKLOAD_VERSION}"), "kind": "ResourceFlavor",
                "metadata": {"name": flavor, "labels": {"trajectory-tests": "true"}},
                "spec": {"nodeLabels": node_labels},
            }),
        )
        .await;
        self.set_quota(client, &name, quota).await;
        apply(
            &kueue_api(client, "LocalQueue", Some(&name)),
            queue,
            &json!({
                "apiVersion": format!("kueue.x-k8s.io/{WORKLOAD_VERSION}"), "kind": "LocalQueue",
                "metadata": {"name": queue, "namespace": name},
                "spec": {"clusterQueue": name},
            }),
        )
        .await;
        namespace
    }

    /// Sets the `cpu` and `memory` quota of the namespace's `ClusterQueue` (made by
    /// [`Kueue::namespace`]).
    pub async fn set_quota(&self, client: &Client, namespace: &str, (cpu, memory): (&str, &str)) {
        apply(
            &kueue_api(client, "ClusterQueue", None),
            namespace,
            &json!({
                "apiVersion": format!("kueue.x-k8s.io/{WORKLOAD_VERSION}"), "kind": "ClusterQueue",
                "metadata": {"name": namespace, "labels": {"trajectory-tests": "true"}},
                "spec": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [{
                        "coveredResources": ["cpu", "memory"],
                        "flavors": [{"name": format!("{namespace}-flavor"), "resources": [
                            {"name": "cpu", "nominalQuota": cpu},
                            {"name": "memory", "nominalQuota": memory},
                        ]}],
                    }],
                },
            }),
        )
        .await;
    }
}

/// The API of one of Kueue's kinds, in `namespace` or cluster-wide.
pub fn kueue_api(client: &Client, kind: &str, namespace: Option<&str>) -> Api<DynamicObject> {
    let lower = kind.to_lowercase();
    let plural = if lower.ends_with('s') {
        format!("{lower}es")
    } else {
        format!("{lower}s")
    };
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", WORKLOAD_VERSION, kind),
        &plural,
    );
    match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// The Workloads of `namespace`.
pub async fn workloads(client: &Client, namespace: &str) -> Vec<DynamicObject> {
    kueue_api(client, "Workload", Some(namespace))
        .list(&kube::api::ListParams::default())
        .await
        .map(|list| list.items)
        .unwrap_or_default()
}

/// Whether a Workload's condition `type_` holds.
pub fn holds(workload: &DynamicObject, type_: &str) -> bool {
    workload.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == type_ && c["status"] == "True")
}

/// The name of the Job a Workload admits.
pub fn job_of(workload: &DynamicObject) -> String {
    workload
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|owner| owner.kind == "Job")
        .map(|owner| owner.name.clone())
        .unwrap_or_default()
}

/// A CA and a serving certificate for `127.0.0.1` (`tls.crt`, `tls.key`) in `dir`; returns the
/// CA's PEM.
fn make_certificates(dir: &Path) -> Vec<u8> {
    std::fs::create_dir_all(dir).expect("the certificates' directory");
    let openssl = |args: &[&str]| {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &["-days", "2", "-subj", "/CN=kueue-test-ca"],
            &["-keyout", "ca.key", "-out", "ca.crt"],
        ]
        .concat(),
    );
    openssl(
        &[
            &["req"][..],
            &ec,
            &[
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                "tls.key",
                "-out",
                "tls.csr",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .expect("write the extensions");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "tls.crt",
    ]);
    std::fs::read(dir.join("ca.crt")).expect("the CA")
}

/// Registers Kueue's Job and Kueue-kind webhooks from its own manifest, by URL on loopback; the
/// Job webhooks only for namespaces labelled [`NAMESPACE_LABEL`].
async fn register_webhooks(client: &Client, source: &Path, port: u16, ca: &[u8]) {
    let path = source.join("config/components/webhook/manifests.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let ca_bundle = base64::engine::general_purpose::STANDARD.encode(ca);
    for document in serde_yaml::Deserializer::from_str(&text) {
        let mut config = Value::deserialize(document).expect("a webhook configuration");
        let Some(kind) = config["kind"].as_str().map(str::to_owned) else {
            continue;
        };
        let webhooks: Vec<Value> = config["webhooks"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|webhook| {
                let service_path = webhook["clientConfig"]["service"]["path"].as_str()?;
                let job = service_path.ends_with("-batch-v1-job");
                if !job && !service_path.contains("-kueue-x-k8s-io-") {
                    return None;
                }
                let mut webhook = webhook.clone();
                webhook["clientConfig"] = json!({
                    "url": format!("https://127.0.0.1:{port}{service_path}"),
                    "caBundle": ca_bundle,
                });
                if job {
                    webhook["namespaceSelector"] =
                        json!({"matchLabels": {NAMESPACE_LABEL: "true"}});
                }
                Some(webhook)
            })
            .collect();
        let name = format!("trajectory-tests-{}", kind.to_lowercase());
        config["metadata"] = json!({"name": name});
        config["webhooks"] = Value::Array(webhooks);
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            &kind,
        ));
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        apply(&api, &name, &config).await;
    }
    // The API server may take a moment to call a webhook just registered: wait until a
    // ResourceFlavor is refused or admitted through it (either answer means it is reachable).
    let flavors = kueue_api(client, "ResourceFlavor", None);
    wait_until(
        "Kueue's webhooks to answer",
        Duration::from_secs(30),
        || async {
            let probe = json!({
                "apiVersion": format!("kueue.x-k8s.io/{WORKLOAD_VERSION}"), "kind": "ResourceFlavor",
                "metadata": {"name": "trajectory-tests-webhook-probe"},
            });
            let params = PatchParams {
                dry_run: true,
                ..PatchParams::apply(FIELD_MANAGER).force()
            };
            flavors
                .patch(
                    "trajectory-tests-webhook-probe",
                    &params,
                    &Patch::Apply(&probe),
                )
                .await
                .ok()
        },
    )
    .await;
}

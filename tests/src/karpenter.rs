//! A real Karpenter beside the test control plane: its kwok provider (`sigs.k8s.io/karpenter/kwok`,
//! built from its Go module by `scripts/karpenter/build.sh`, or the binary `TRAJ_KARPENTER`
//! names), the node autoscaler its own end-to-end tests run, with its CRDs (the module's
//! `kwok/charts/crds` and `kwok/apis/crds`) applied to the cluster. It creates a kwok node for a
//! pod no node fits (annotated `kwok.x-k8s.io/node`, so the cluster's kwok keeps it Ready, see
//! `scripts/cluster/up.sh`), and removes nodes it consolidates or whose `NodeClaim` is deleted,
//! draining their pods through the eviction API first.
//!
//! One Karpenter per test binary ([`Karpenter::shared`]), a [`Sidecar`]. Each test gets a
//! `NodePool` of its own ([`Karpenter::pool`]) whose nodes carry the test-kubelet's node label
//! with the pool's name as value: only pods selecting that value land there, and the other tests'
//! pods (selecting [`crate::e2e::NO_NODE`]) match no pool, so Karpenter leaves them Pending.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::OnceCell;
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_testkit::installed;
use trajectory_testkit::scripted_server::ScriptedServer;

use crate::e2e::{
    ControllerGuard, Kubelet, NO_NODE, Scratch, assert_succeeded_once, create_run,
    model_with_latency, phase_of, start_controller_in, write_dataset,
};
use crate::sidecar::{Sidecar, apply, apply_crds, free_port};
use crate::{TestNamespace, client, install_crds};

/// The kwok instance types a test pool offers: two CPUs each, so that a pod requesting more
/// than one CPU gets a node of its own.
pub const NODE_CPUS: &str = "2";

/// A running Karpenter.
#[derive(Debug)]
pub struct Karpenter {
    pub process: Sidecar,
    _dir: tempfile::TempDir,
}

/// How a test's `NodePool` scales.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// The pool's `limits.cpu`: Karpenter creates no node past it.
    pub cpu_limit: String,
    /// `disruption.consolidateAfter`.
    pub consolidate_after: String,
    /// How many empty nodes Karpenter may remove at once (a `disruption.budgets` entry for the
    /// reason `Empty`, Karpenter's default of `10%` kept for the other reasons); `None`: the
    /// default for every reason, which removes one node at a time from a pool of fewer than 20.
    pub empty_budget: Option<String>,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            cpu_limit: "16".to_owned(),
            consolidate_after: "0s".to_owned(),
            empty_budget: None,
        }
    }
}

impl Karpenter {
    /// The binary's Karpenter, started on first use. Panics when it cannot start: a test that
    /// needs it must fail loudly.
    pub async fn shared(client: &Client) -> &'static Self {
        static KARPENTER: OnceCell<Karpenter> = OnceCell::const_new();
        KARPENTER.get_or_init(|| Self::start(client)).await
    }

    async fn start(client: &Client) -> Self {
        let binary = installed("TRAJ_KARPENTER", "karpenter/build.sh", "--print-path");
        install_karpenter_crds(client).await;
        // The node class every test pool names; the kwok provider needs nothing of it.
        apply(
            &karpenter_api(client, "karpenter.kwok.sh", "v1alpha1", "KWOKNodeClass"),
            "trajectory-tests",
            &json!({
                "apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass",
                "metadata": {"name": "trajectory-tests"},
            }),
        )
        .await;
        let dir = tempfile::tempdir().expect("temp dir");
        let (health, metrics) = (free_port(), free_port());
        let kubeconfig = std::env::var("KUBECONFIG").expect("KUBECONFIG names the test cluster");
        let process = Sidecar::start(
            "Karpenter",
            &binary,
            &[
                "--disable-leader-election".as_ref(),
                format!("--health-probe-port={health}").as_ref(),
                format!("--metrics-port={metrics}").as_ref(),
                // Pending pods are gathered for a second (its default) and at most two (ten
                // by default) before nodes are created for them: a test waits less.
                "--batch-idle-duration=1s".as_ref(),
                "--batch-max-duration=2s".as_ref(),
                "--log-level=debug".as_ref(),
            ],
            [("KUBECONFIG", kubeconfig)],
            dir.path().join("karpenter.log"),
            (health, "/readyz"),
        )
        .await;
        Self { process, _dir: dir }
    }

    /// A `NodePool` named `name` whose kwok nodes (on-demand, [`NODE_CPUS`] CPUs) carry the
    /// test-kubelet's node label with value `name`, deleted when the guard drops.
    pub async fn pool(&self, client: &Client, name: &str, settings: &PoolSettings) -> PoolGuard {
        self.set_pool(client, name, settings).await;
        PoolGuard {
            client: client.clone(),
            name: name.to_owned(),
        }
    }

    /// Applies pool `name` with `settings` (made by [`Karpenter::pool`]).
    pub async fn set_pool(&self, client: &Client, name: &str, settings: &PoolSettings) {
        // Karpenter applies the most restrictive budget of those that match a reason: the
        // default's 10% must leave out `Empty` for a larger budget of empty nodes to count.
        let budgets = match &settings.empty_budget {
            None => vec![json!({"nodes": "10%"})],
            Some(nodes) => vec![
                json!({"nodes": nodes, "reasons": ["Empty"]}),
                json!({"nodes": "10%", "reasons": ["Drifted", "Underutilized"]}),
            ],
        };
        apply(
            &karpenter_api(client, "karpenter.sh", "v1", "NodePool"),
            name,
            &json!({
                "apiVersion": "karpenter.sh/v1", "kind": "NodePool",
                "metadata": {"name": name, "labels": {"trajectory-tests": "true"}},
                "spec": {
                    "template": {
                        "metadata": {"labels": {NO_NODE.0: name}},
                        "spec": {
                            "nodeClassRef": {
                                "group": "karpenter.kwok.sh", "kind": "KWOKNodeClass",
                                "name": "trajectory-tests",
                            },
                            "requirements": [
                                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
                                {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]},
                                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                                {"key": "karpenter.kwok.sh/instance-family", "operator": "In", "values": ["c"]},
                                {"key": "karpenter.kwok.sh/instance-cpu", "operator": "In", "values": [NODE_CPUS]},
                            ],
                        },
                    },
                    "limits": {"cpu": settings.cpu_limit},
                    "disruption": {
                        "consolidationPolicy": "WhenEmptyOrUnderutilized",
                        "consolidateAfter": settings.consolidate_after,
                        "budgets": budgets,
                    },
                },
            }),
        )
        .await;
    }
}

/// Applies Karpenter's CRDs (`NodePool`, `NodeClaim`, ...: no webhooks) and its kwok provider's
/// (`KWOKNodeClass`) from the module's source.
pub async fn install_karpenter_crds(client: &Client) {
    let source = installed("TRAJ_KARPENTER_SRC", "karpenter/build.sh", "--print-src");
    apply_crds(
        client,
        &[
            source.join("kwok/charts/crds"),
            source.join("kwok/apis/crds"),
        ],
    )
    .await;
}

/// Deletes the test's `NodePool` on drop (Karpenter then removes its nodes), also when the test
/// fails.
pub struct PoolGuard {
    pub client: Client,
    pub name: String,
}

impl std::fmt::Debug for PoolGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolGuard")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl PoolGuard {
    /// The node selector of pods that land on the pool's nodes.
    pub fn node_selector(&self) -> Value {
        json!({NO_NODE.0: self.name})
    }
}

impl Drop for PoolGuard {
    fn drop(&mut self) {
        let (client, name) = (self.client.clone(), self.name.clone());
        // Drop cannot await: delete on a thread of its own runtime.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let _ = karpenter_api(&client, "karpenter.sh", "v1", "NodePool")
                    .delete(&name, &DeleteParams::default())
                    .await;
            });
        })
        .join();
    }
}

/// The API of one of Karpenter's cluster-scoped kinds.
pub fn karpenter_api(
    client: &Client,
    group: &str,
    version: &str,
    kind: &str,
) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    Api::all_with(client.clone(), &resource)
}

/// The nodes of pool `name` (by the node label its template sets).
pub async fn pool_nodes(client: &Client, name: &str) -> Vec<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .list(&ListParams::default().labels(&format!("{}={name}", NO_NODE.0)))
        .await
        .map(|list| list.items)
        .unwrap_or_default()
}

/// The `NodeClaims` of pool `name`.
pub async fn pool_claims(client: &Client, name: &str) -> Vec<DynamicObject> {
    karpenter_api(client, "karpenter.sh", "v1", "NodeClaim")
        .list(&ListParams::default().labels(&format!("karpenter.sh/nodepool={name}")))
        .await
        .map(|list| list.items)
        .unwrap_or_default()
}

/// Whether a node is Ready.
pub fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The names of `nodes`.
pub fn names(nodes: &[Node]) -> Vec<String> {
    nodes.iter().map(ResourceExt::name_any).collect()
}

/// Waits until pool `name` has no node left (Karpenter consolidated them away), up to `timeout`;
/// returns how long it took.
pub async fn wait_for_no_nodes(client: &Client, name: &str, timeout: Duration) -> Duration {
    let start = std::time::Instant::now();
    crate::wait_until(
        &format!("pool {name}'s nodes to be removed"),
        timeout,
        || async { pool_nodes(client, name).await.is_empty().then_some(()) },
    )
    .await;
    start.elapsed()
}

/// What each worker pod asks: more than half of a node's [`NODE_CPUS`],
/// so that every pod running at once needs a node of its own.
pub const POD_CPU: &str = "1200m";
pub const TIMEOUT: Duration = Duration::from_secs(240);

/// A namespace with its own `NodePool`, a controller acting on it, a scripted model, and storage
/// with 10 prompts (4 batches of 3 in [`run_spec`]).
pub struct Autoscaled {
    pub client: Client,
    pub karpenter: &'static Karpenter,
    pub namespace: TestNamespace,
    pub pool: PoolGuard,
    pub model: ScriptedServer,
    pub scratch: Scratch,
    pub runs: Api<TrajectoryRun>,
    /// The worker's command line the kubelet runs each pod as (the `e2e-worker` binary).
    pub worker: PathBuf,
    _controller: ControllerGuard,
}

/// What one drive of a run saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// Every node of the pool seen, by name.
    pub nodes: BTreeSet<String>,
    /// The most Ready nodes of the pool at once.
    pub most_at_once: usize,
    /// When the first node of the pool was Ready, from the run's creation.
    pub first_node: Option<Duration>,
}

impl std::fmt::Debug for Autoscaled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Autoscaled")
            .field("namespace", &self.namespace.name())
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl Autoscaled {
    /// Each model call takes `latency`, so that a batch is still running when a test acts on it.
    pub async fn new(
        prefix: &str,
        settings: &PoolSettings,
        latency: Duration,
        worker: PathBuf,
    ) -> Self {
        let client = client().await;
        install_crds(&client).await;
        let karpenter = Karpenter::shared(&client).await;
        let namespace = TestNamespace::create(&client, prefix).await;
        let pool = karpenter.pool(&client, namespace.name(), settings).await;
        let runs = Api::namespaced(client.clone(), namespace.name());
        let scratch = Scratch::new();
        write_dataset(&scratch.storage(), 10);
        let controller = start_controller_in(&client, namespace.name());
        Self {
            client,
            karpenter,
            namespace,
            pool,
            model: model_with_latency(latency).await,
            scratch,
            runs,
            worker,
            _controller: controller,
        }
    }

    /// A setup with the default pool, and the run `name` created in it, one conversation at a time
    /// per pod, with `extra` in its spec; each model call takes `latency`.
    pub async fn with_run(
        prefix: &str,
        latency: Duration,
        (name, extra): (&str, &Value),
        worker: PathBuf,
    ) -> (Self, Kubelet) {
        let setup = Self::new(prefix, &PoolSettings::default(), latency, worker).await;
        let mut spec = json!({"concurrency": 1});
        for (key, value) in extra.as_object().into_iter().flatten() {
            spec[key] = value.clone();
        }
        let kubelet = setup.create(name, &spec).await;
        (setup, kubelet)
    }

    pub fn ns(&self) -> &str {
        self.namespace.name()
    }

    /// Creates the run `name` with `extra` in its spec ([`crate::e2e::run_spec`]'s otherwise), its pods selecting
    /// the pool and asking [`POD_CPU`]; returns a kubelet that plays them on the pool's nodes.
    pub async fn create(&self, name: &str, extra: &Value) -> Kubelet {
        let spec = json!({
            "podTemplate": {
                "nodeSelector": self.pool.node_selector(),
                "resources": {"requests": {"cpu": POD_CPU, "memory": "256Mi"}},
            },
        });
        create_run(&self.runs, &self.model.base_url(), name, spec, extra).await;
        let mut kubelet = Kubelet::new(&self.client, self.ns(), name, &self.scratch);
        kubelet.worker_binary = Some(self.worker.clone());
        kubelet.on_nodes = true;
        kubelet
    }

    /// Plays the run's pods on the pool's nodes until `done` holds of the run, watching the pool's
    /// nodes; `act` is called each round with the run and what was seen so far.
    pub async fn drive<D, A>(
        &self,
        kubelet: &Kubelet,
        seen: &mut Seen,
        done: D,
        mut act: A,
    ) -> TrajectoryRun
    where
        D: Fn(&TrajectoryRun) -> bool,
        A: AsyncFnMut(&TrajectoryRun, &Seen),
    {
        let start = Instant::now();
        loop {
            kubelet.play_pending().await;
            let nodes = pool_nodes(&self.client, self.pool.name.as_str()).await;
            let up: Vec<_> = nodes.iter().filter(|node| ready(node)).collect();
            if !up.is_empty() && seen.first_node.is_none() {
                seen.first_node = Some(start.elapsed());
            }
            seen.most_at_once = seen.most_at_once.max(up.len());
            seen.nodes.extend(names(&nodes));
            let run = self.runs.get(&kubelet.run).await.expect("get the run");
            assert_ne!(
                phase_of(&run),
                Some(Phase::Failed),
                "{:#?}; played {:#?}{}",
                run.status,
                kubelet.played(),
                self.context()
            );
            if done(&run) {
                return run;
            }
            act(&run, seen).await;
            assert!(
                start.elapsed() < TIMEOUT,
                "the run did not get there within {TIMEOUT:?}: {:#?}; played {:#?}{}",
                run.status,
                kubelet.played(),
                self.context()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Checks that the run succeeded with every prompt once (20 model requests, no batch counted
    /// as failed) and that every pod the kubelet played ran on a node of the pool.
    pub fn assert_succeeded_on_the_pool(
        &self,
        run: &TrajectoryRun,
        kubelet: &Kubelet,
        seen: &Seen,
    ) {
        assert_succeeded_once(run, kubelet, self.model.request_count(), &self.context());
        for played in kubelet.played() {
            let node = played.node.clone().unwrap_or_default();
            assert!(
                seen.nodes.contains(&node),
                "pod {} ran on {node:?}, not on a node of the pool {:?}",
                played.pod,
                seen.nodes
            );
        }
    }

    pub fn context(&self) -> String {
        format!("; Karpenter: {}", self.karpenter.process.log_tail())
    }
}

/// Whether the run succeeded.
pub fn succeeded(run: &TrajectoryRun) -> bool {
    phase_of(run) == Some(Phase::Succeeded)
}

//! Harness for tests against a real Kubernetes control plane: the one `scripts/cluster/up.sh` starts
//! (kube-apiserver, kube-controller-manager, kube-scheduler and kwok's fake nodes, built from source).
//!
//! - [`client`] connects through `KUBECONFIG` and panics with instructions when no cluster is up.
//! - [`TestNamespace`] creates a unique namespace and deletes it on drop, also when the test fails.
//! - [`wait_until`] and [`wait_for_object`] wait for a condition with a timeout and say what they waited
//!   for when it runs out.
//!
//! - [`install_crds`] applies the generated CRD file; [`e2e`] drives a run end to end (an in-process
//!   controller and a test-kubelet running the worker's real steps, in the test's process or as
//!   processes of the worker's command line, the crate's `e2e-worker` binary).
//! - [`children`] builds a run's Jobs with the operator's own builder, without a controller.
//! - [`helm`] renders the Helm chart with the helm binary `scripts/helm/build.sh` builds.
//! - [`kueue`] runs a real Kueue beside the cluster (`scripts/kueue/build.sh`) for queued runs, and
//!   [`karpenter`] Karpenter with its kwok provider (`scripts/karpenter/build.sh`) for autoscaled
//!   ones, each a [`sidecar`] process.
//! - [`real_pods`] runs in real pods on the real node (`scripts/cluster/up.sh --real-node`): the
//!   node and its imported images, a shared `hostPath` volume, the model as pods reach it.
//!
//! Run the tests with a cluster that lives only as long as the run:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests`.

pub mod children;
pub mod crds;
pub mod e2e;
pub mod helm;
pub mod karpenter;
pub mod kueue;
pub mod real_pods;
pub mod sidecar;

pub use crds::install_crds;

use std::fmt::Debug;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{DeleteParams, PostParams};
use kube::config::KubeConfigOptions;
use kube::runtime::wait::{Condition, await_condition};
use kube::{Api, Client, Config, Resource};
use serde_json::json;

/// How to get a cluster, for messages of failed connections.
pub const HOW_TO_START: &str = "start the local control plane with `eval \"$(scripts/cluster/up.sh)\"` \
     (it builds the binaries once, then prints `export KUBECONFIG=...`), or run the tests through \
     `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests`";

/// The Kubernetes version the cluster scripts pin (`K8S_VERSION` in `scripts/cluster/versions.env`).
pub fn pinned_kubernetes_version() -> &'static str {
    include_str!("../../scripts/cluster/versions.env")
        .lines()
        .find_map(|line| line.trim().strip_prefix("K8S_VERSION="))
        .expect("scripts/cluster/versions.env sets K8S_VERSION")
        .trim()
}

/// The client configuration from `KUBECONFIG`. Panics, saying how to start a cluster, when it is unset
/// or unreadable.
pub async fn config() -> Config {
    let Some(path) = std::env::var_os("KUBECONFIG") else {
        panic!("KUBECONFIG is not set: {HOW_TO_START}");
    };
    match Config::from_kubeconfig(&KubeConfigOptions::default()).await {
        Ok(config) => config,
        Err(e) => panic!(
            "cannot read KUBECONFIG={}: {e}; {HOW_TO_START}",
            path.display()
        ),
    }
}

/// A client for the cluster in `KUBECONFIG`, checked to answer. Panics, saying how to start a
/// cluster, when `KUBECONFIG` is unset or its API server is unreachable.
pub async fn client() -> Client {
    let config = config().await;
    let server = config.cluster_url.clone();
    let client = Client::try_from(config)
        .unwrap_or_else(|e| panic!("cannot build a client for {server}: {e}; {HOW_TO_START}"));
    match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
        Ok(Ok(_)) => client,
        Ok(Err(e)) => {
            panic!("the API server {server} from KUBECONFIG is unreachable: {e}; {HOW_TO_START}")
        }
        Err(elapsed) => panic!(
            "the API server {server} from KUBECONFIG did not answer ({elapsed}); {HOW_TO_START}"
        ),
    }
}

/// A name no other test of this or a concurrent run uses: `PREFIX-<pid>-<counter>-<time>`, at most
/// 63 characters (DNS label).
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() % 1_000_000_000);
    let suffix = format!("-{}-{n}-{micros}", std::process::id());
    let keep = 63usize.saturating_sub(suffix.len()).min(prefix.len());
    format!("{}{suffix}", &prefix[..keep]).to_lowercase()
}

/// A namespace for one test, created with a unique name and deleted on drop (also when the test
/// panics). Namespaces are labelled `trajectory-tests=true` so left-overs are easy to find.
#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    config: Config,
}

impl TestNamespace {
    /// Creates the namespace and waits for its `default` `ServiceAccount` (made by the controller
    /// manager), without which pods cannot be created in it.
    pub async fn create(client: &Client, prefix: &str) -> Self {
        let name = unique_name(prefix);
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": { "name": name, "labels": { "trajectory-tests": "true" } }
        }))
        .expect("namespace manifest");
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        let guard = Self {
            name,
            config: config().await,
        };
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &guard.name);
        wait_until(
            &format!("ServiceAccount default in namespace {}", guard.name),
            Duration::from_secs(30),
            || async { accounts.get_opt("default").await.ok().flatten() },
        )
        .await;
        guard
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let name = self.name.clone();
        let deleted = on_own_runtime(self.config.clone(), |client| async move {
            let namespaces: Api<Namespace> = Api::all(client);
            let params = DeleteParams::background();
            let delete = namespaces.delete(&name, &params);
            match tokio::time::timeout(Duration::from_secs(10), delete).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(kube::Error::Api(status))) if status.code == 404 => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(elapsed) => Err(elapsed.to_string()),
            }
        });
        if let Err(e) = deleted {
            eprintln!("warning: deleting test namespace {}: {e}", self.name);
        }
    }
}

/// Runs `work` with a client of `config` to the end, from a thread with its own runtime: for `Drop`,
/// which cannot await, while the test's runtime may be the current thread (and a client's
/// connection task lives on the runtime that created it).
pub fn on_own_runtime<F, Fut>(config: Config, work: F) -> Result<(), String>
where
    F: FnOnce(Client) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), String>>,
{
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async move {
            let client = Client::try_from(config).map_err(|e| e.to_string())?;
            work(client).await
        })
    })
    .join()
    .unwrap_or_else(|_| Err("the thread panicked".to_owned()))
}

/// Polls `check` every 200 ms until it returns `Some`, and returns that value. Panics after
/// `timeout`, naming `what`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Watches the object `name` until `condition` holds, and returns it. Panics after `timeout` with
/// the object's last state.
pub async fn wait_for_object<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    timeout: Duration,
    condition: impl Condition<K>,
) -> Option<K>
where
    K: Clone + Debug + Send + serde::de::DeserializeOwned + Resource + 'static,
{
    match tokio::time::timeout(timeout, await_condition(api.clone(), name, condition)).await {
        Ok(Ok(object)) => object,
        Ok(Err(e)) => panic!("watching {name} for {what}: {e}"),
        Err(_) => {
            let last = api.get_opt(name).await;
            panic!("timed out after {timeout:?} waiting for {name}: {what}; last seen: {last:#?}")
        }
    }
}

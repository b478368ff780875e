//! The Helm chart `charts/trajectory-operator`, rendered by the helm `scripts/helm/build.sh` builds
//! (`TRAJ_HELM`).
//!
//! Rendered: it ships exactly the CRD and admission policy `trajectory-operator crd` prints; its
//! version and default images are the workspace's; every value is documented; `values.schema.json`
//! refuses bad values and names them; two replicas get a `PodDisruptionBudget`; the namespaced scope
//! grants nothing cluster-wide.
//!
//! Installed on the real control plane (server-side dry run, then for real) into a namespace that
//! enforces the `restricted` Pod Security Standard: the chart's Deployment gets its pod (kwok's nodes
//! run it), and the operator — in process, authenticated as the chart's `ServiceAccount` with a
//! `TokenRequest` token, configured from the Deployment's environment, leader election included —
//! drives a run to `Succeeded` with the test-kubelet, every Job pod admitted by the namespace. The
//! RBAC is exactly enough: every (verb, resource) the operator requested (its own request counter)
//! is granted, every one granted was requested or is one of four grants with a stated reason, and
//! what the chart does not grant is refused (Secrets, pods, deleting Jobs; in the namespaced scope,
//! anything outside the namespace).
//!
//! Needs helm and, for the install, a running cluster:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test chart`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, ServiceAccount};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::config::AuthInfo;
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, oneshot};
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::crd;
use trajectory_operator::leader::LeaseConfig;
use trajectory_operator::metrics::Metrics;
use trajectory_operator::reconcile::children::labels;
use trajectory_operator::service::{self, Exit};
use trajectory_operator::settings::Settings;
use trajectory_tests::e2e::{
    Kubelet, Scratch, model, phase_events, phase_of, run_spec, write_dataset,
};
use trajectory_tests::helm::{CHART_DIR, assert_refused, documents, object, template};
use trajectory_tests::{TestNamespace, client, config, install_crds, unique_name, wait_until};

const CRD_KINDS: [&str; 3] = [
    "CustomResourceDefinition",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

fn rendered(release: &str, namespace: &str, sets: &[&str]) -> Vec<Value> {
    documents(
        &template(release, namespace, sets)
            .unwrap_or_else(|e| panic!("helm template {release} with {sets:?} failed:\n{e}")),
    )
}

fn chart_file(path: &str) -> String {
    let path = format!("{CHART_DIR}/{path}");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The documents of a YAML stream as text, split at `---` lines; the text before the first one
/// (the header) must be comments only.
fn split_stream(text: &str, what: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    for line in text.lines() {
        if line == "---" {
            parts.push(String::new());
        } else if let Some(part) = parts.last_mut() {
            part.push_str(line);
            part.push('\n');
        }
    }
    let header = parts.remove(0);
    assert!(
        header.lines().all(|line| line.starts_with('#')),
        "{what}: only comments may come before the first document, found:\n{header}"
    );
    parts
}

fn env_of(deployment: &Value) -> BTreeMap<String, Value> {
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("the operator container's env")
        .iter()
        .map(|e| (e["name"].as_str().unwrap_or_default().to_owned(), e.clone()))
        .collect()
}

fn env_value(env: &BTreeMap<String, Value>, name: &str) -> String {
    env.get(name)
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("the Deployment sets no value for {name}: {env:#?}"))
        .to_owned()
}

#[test]
fn the_chart_ships_exactly_the_crd_and_admission_policy_the_operator_prints() {
    let printed = crd::yaml();
    let printed_texts = split_stream(&printed, "`trajectory-operator crd`");
    assert_eq!(printed_texts.len(), 3, "CRD, policy, binding");
    let regenerate = "regenerate with scripts/helm/generate.sh";

    // Helm's crds/ may hold CustomResourceDefinitions only (`helm lint` refuses anything else), so
    // the policy and its binding come from a file the templates include.
    let crds = split_stream(
        &chart_file("crds/trajectories.dev_trajectoryruns.yaml"),
        "crds/",
    );
    assert!(
        crds == printed_texts[..1],
        "the chart's crds/trajectories.dev_trajectoryruns.yaml is not the CRD `trajectory-operator crd` prints; {regenerate}"
    );
    let policy = split_stream(&chart_file("files/admission-policy.yaml"), "files/");
    assert!(
        policy == printed_texts[1..],
        "the chart's files/admission-policy.yaml is not the policy `trajectory-operator crd` prints; {regenerate}"
    );

    // What helm renders (crds/ included) is exactly those three objects.
    let shipped = |sets: &[&str]| -> Vec<Value> {
        rendered("trajectory-operator", "trajectory-system", sets)
            .into_iter()
            .filter(|o| CRD_KINDS.iter().any(|kind| o["kind"] == *kind))
            .collect()
    };
    assert_eq!(shipped(&[]), documents(&printed));
    // Without the policy (a second release of the namespaced scope), only the CRD.
    assert_eq!(
        shipped(&["admissionPolicy.enabled=false"]),
        documents(&printed)[..1]
    );
}

#[test]
fn the_chart_version_and_default_images_are_the_workspace_version() {
    let version = env!("CARGO_PKG_VERSION");
    let chart: Value = serde_yaml::from_str(&chart_file("Chart.yaml")).expect("Chart.yaml");
    assert_eq!(chart["version"], version, "Chart.yaml version");
    assert_eq!(chart["appVersion"], version, "Chart.yaml appVersion");

    let objects = rendered("trajectory-operator", "trajectory-system", &[]);
    let deployment = object(&objects, "Deployment", "trajectory-operator");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        format!("ghcr.io/trajectory-operator/trajectory-operator:{version}")
    );
    let worker_image = format!("ghcr.io/trajectory-operator/trajectory-worker:{version}");
    assert_eq!(
        env_value(&env_of(deployment), "TRAJ_WORKER_IMAGE"),
        worker_image
    );
    // An operator started without the chart runs the same workers (the image build tags no
    // `latest`).
    assert_eq!(
        trajectory_operator::settings::Settings::default().worker_image,
        worker_image
    );
}

/// Paths (`a.b.c`) of the properties the schema declares, with their descriptions.
fn schema_properties(schema: &Value, prefix: &str, out: &mut BTreeMap<String, String>) {
    if let Some(properties) = schema["properties"].as_object() {
        for (name, property) in properties {
            let path = format!("{prefix}{name}");
            let description = property["description"].as_str().unwrap_or_default();
            out.insert(path.clone(), description.to_owned());
            schema_properties(property, &format!("{path}."), out);
        }
    }
}

#[test]
fn every_value_is_documented_in_values_yaml_and_the_schema() {
    let schema: Value =
        serde_json::from_str(&chart_file("values.schema.json")).expect("values.schema.json");
    let mut declared = BTreeMap::new();
    schema_properties(&schema, "", &mut declared);
    let undescribed: Vec<&String> = declared
        .iter()
        .filter(|(_, d)| d.trim().is_empty())
        .map(|(p, _)| p)
        .collect();
    assert!(
        undescribed.is_empty(),
        "values.schema.json: no description for {undescribed:?}"
    );

    // Every key of values.yaml that the schema declares has a comment right above it.
    let values = chart_file("values.yaml");
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut previous = "";
    let mut seen = BTreeSet::new();
    let mut uncommented = Vec::new();
    for (number, line) in values.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let key = trimmed
            .split_once(':')
            .map(|(key, _)| key)
            .filter(|_| !trimmed.starts_with('#') && !trimmed.starts_with('-'))
            .filter(|key| key.chars().all(|c| c.is_ascii_alphanumeric()) && !key.is_empty());
        if let Some(key) = key {
            stack.retain(|(level, _)| *level < indent);
            let path = stack
                .iter()
                .map(|(_, k)| k.as_str())
                .chain([key])
                .collect::<Vec<_>>()
                .join(".");
            if declared.contains_key(&path) {
                seen.insert(path.clone());
                if !previous.trim_start().starts_with('#') {
                    uncommented.push(format!("values.yaml:{}: {path}", number + 1));
                }
            }
            stack.push((indent, key.to_owned()));
        }
        if !trimmed.is_empty() {
            previous = line;
        }
    }
    assert!(
        uncommented.is_empty(),
        "values without a comment: {uncommented:#?}"
    );
    let missing: Vec<&String> = declared
        .keys()
        .filter(|path| *path != "global" && !seen.contains(*path))
        .collect();
    assert!(
        missing.is_empty(),
        "declared in values.schema.json but without a default in values.yaml: {missing:?}"
    );
}

#[test]
fn values_schema_refuses_bad_values_and_names_them() {
    let cases = [
        ("replicaCount=3", "/replicaCount"),
        ("replicaCount=0", "/replicaCount"),
        ("scope=Everywhere", "/scope"),
        ("logFormat=xml", "/logFormat"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("image.repository=Not A Repo", "/image/repository"),
        ("worker.image.digest=md5:abc", "/worker/image/digest"),
        ("httpPort=80", "/httpPort"),
        (
            "metrics.serviceMonitor.interval=soon",
            "/metrics/serviceMonitor/interval",
        ),
        // A typo is refused rather than silently ignored.
        ("replicas=2", "'replicas'"),
        ("leaderElection.enable=false", "'enable'"),
        // Relations between values are checked by the templates.
        (
            "leaderElection.leaseGraceSeconds=15",
            "leaderElection.leaseGraceSeconds",
        ),
        (
            "replicaCount=2,leaderElection.enabled=false",
            "leaderElection.enabled",
        ),
        ("serviceAccount.create=false", "serviceAccount.name"),
    ];
    for (set, named) in cases {
        assert_refused(
            template("bad", "default", &[set]),
            &format!("--set {set}"),
            named,
        );
    }
}

#[test]
fn two_replicas_get_a_disruption_budget_and_the_namespaced_scope_grants_nothing_cluster_wide() {
    let kinds = |objects: &[Value]| -> Vec<String> {
        objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let single = rendered("op", "ops", &[]);
    assert!(!kinds(&single).contains(&"PodDisruptionBudget".to_owned()));

    let pair = rendered("op", "ops", &["replicaCount=2"]);
    let deployment = object(&pair, "Deployment", "op-trajectory-operator");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let budget = object(&pair, "PodDisruptionBudget", "op-trajectory-operator");
    assert_eq!(budget["spec"]["minAvailable"], 1);
    assert_eq!(
        budget["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );

    let cluster_role = object(&single, "ClusterRole", "op-trajectory-operator");
    let namespaced = rendered("op", "ops", &["scope=Namespace"]);
    let cluster_scoped: BTreeSet<String> = namespaced
        .iter()
        .filter(|o| o["metadata"]["namespace"].is_null())
        .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        cluster_scoped,
        CRD_KINDS.iter().map(|k| (*k).to_owned()).collect(),
        "the namespaced scope renders nothing cluster-scoped but the API"
    );
    let role = object(&namespaced, "Role", "op-trajectory-operator");
    assert_eq!(role["metadata"]["namespace"], "ops");
    assert_eq!(role["rules"], cluster_role["rules"], "the same rules");
    let binding = object(&namespaced, "RoleBinding", "op-trajectory-operator");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    let env = env_of(object(&namespaced, "Deployment", "op-trajectory-operator"));
    assert_eq!(
        env["TRAJ_WATCH_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert!(
        !env_of(object(&single, "Deployment", "op-trajectory-operator"))
            .contains_key("TRAJ_WATCH_NAMESPACE")
    );
}

/// The cluster tests run one at a time: the operator of the cluster scope acts on every
/// namespace, and must not meet the runs of another test.
static CLUSTER: Mutex<()> = Mutex::const_new(());

/// A client authenticated as the `ServiceAccount` `name` of `namespace`.
async fn client_as(admin: &Client, namespace: &str, name: &str) -> Client {
    Client::try_from(config_as(admin, namespace, name).await)
        .expect("a client for the ServiceAccount")
}

/// The test's client configuration with the credentials of the `ServiceAccount` `name` of
/// `namespace` (a `TokenRequest` token) instead of its own.
async fn config_as(admin: &Client, namespace: &str, name: &str) -> kube::Config {
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    let request: TokenRequest =
        serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))
            .expect("a TokenRequest");
    let token: TokenRequest = accounts
        .create_subresource("token", name, &PostParams::default(), &request)
        .await
        .unwrap_or_else(|e| {
            panic!("requesting a token for ServiceAccount {namespace}/{name}: {e}")
        });
    let token = token
        .status
        .and_then(|status| status.token)
        .expect("a token in the TokenRequest's status");
    let mut config = config().await;
    config.auth_info = AuthInfo {
        token: Some(token.into()),
        ..AuthInfo::default()
    };
    config
}

/// The operator's requests to the API server so far in this process, by (verb, resource), from
/// its `trajectory_operator_api_requests_total` counter (what its counting client sent).
fn api_requests() -> BTreeMap<(String, String), f64> {
    let text = Metrics::default().encode();
    let label = |labels: &str, name: &str| -> String {
        labels
            .split(',')
            .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
            .and_then(|value| value.strip_suffix('"'))
            .unwrap_or_else(|| panic!("no label {name} in {labels}"))
            .to_owned()
    };
    text.lines()
        .filter_map(|line| line.strip_prefix("trajectory_operator_api_requests_total{"))
        .map(|line| {
            let (labels, value) = line.split_once("} ").expect("labels, then the value");
            let count: f64 = value.trim().parse().expect("a count");
            ((label(labels, "verb"), label(labels, "resource")), count)
        })
        .collect()
}

/// Every (verb, resource) the rendered Roles and `ClusterRoles` grant.
fn granted(objects: &[Value]) -> BTreeSet<(String, String)> {
    let mut granted = BTreeSet::new();
    for role in objects
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "ClusterRole")
    {
        for rule in role["rules"].as_array().expect("rules") {
            for resource in rule["resources"].as_array().expect("resources") {
                for verb in rule["verbs"].as_array().expect("verbs") {
                    granted.insert((
                        verb.as_str().expect("a verb").to_owned(),
                        resource.as_str().expect("a resource").to_owned(),
                    ));
                }
            }
        }
    }
    granted
}

/// Granted but never requested as such, each for a reason the request counter cannot show.
const GRANTED_UNREQUESTED: [(&str, &str, &str); 8] = [
    (
        "create",
        "jobs",
        "server-side apply of a new Job is a PATCH the API server authorises as create",
    ),
    (
        "create",
        "configmaps",
        "server-side apply of a new ConfigMap is a PATCH the API server authorises as create",
    ),
    (
        "update",
        "trajectoryruns/finalizers",
        "checked by the OwnerReferencesPermissionEnforcement admission plugin, not requested",
    ),
    (
        "patch",
        "events",
        "kube's Recorder patches an Event only when the same one repeats",
    ),
    (
        "delete",
        "jobs",
        "only a run whose rows name images deletes Jobs (real_node.rs runs one)",
    ),
    (
        "delete",
        "configmaps",
        "only a run whose rows name images deletes ConfigMaps, with their Jobs",
    ),
    (
        "list",
        "workloads",
        "only a run naming a Kueue queue reads its Workloads (kueue.rs runs them)",
    ),
    (
        "patch",
        "workloads",
        "only a queued run that is suspended or held deactivates its Workloads (kueue.rs)",
    ),
];

/// Asserts that `result` is the API server's 403.
fn assert_forbidden<T: std::fmt::Debug>(what: &str, result: kube::Result<T>) {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

/// Applies the rendered objects by server-side apply: all as a dry run first, then for real.
/// Cluster-scoped RBAC objects are owned by the test's namespace, so that they go with it.
async fn apply(admin: &Client, objects: &[Value], owner: &Namespace) {
    for dry_run in [true, false] {
        for object in objects {
            let mut object: DynamicObject =
                serde_json::from_value(object.clone()).expect("a Kubernetes object");
            let types = object.types.clone().expect("apiVersion and kind");
            let gvk = GroupVersionKind::try_from(&types).expect("a valid apiVersion");
            let resource = ApiResource::from_gvk(&gvk);
            let api: Api<DynamicObject> = match object.metadata.namespace.as_deref() {
                Some(namespace) => Api::namespaced_with(admin.clone(), namespace, &resource),
                None => Api::all_with(admin.clone(), &resource),
            };
            if types.kind.starts_with("ClusterRole") {
                object.metadata.owner_references = Some(vec![
                    serde_json::from_value(json!({
                        "apiVersion": "v1", "kind": "Namespace",
                        "name": owner.name_any(), "uid": owner.uid().expect("a uid"),
                    }))
                    .expect("an owner reference"),
                ]);
            }
            let name = object.name_any();
            let mut params = PatchParams::apply("trajectory-tests-chart").force();
            params.dry_run = dry_run;
            api.patch(&name, &params, &Patch::Apply(&object))
                .await
                .unwrap_or_else(|e| {
                    panic!("applying {} {name} (dry run: {dry_run}): {e}", types.kind)
                });
        }
    }
}

/// Waits for the operator's pod (the `Deployment` → `ReplicaSet` → pod chain is admitted by the
/// restricted namespace; kwok runs it) and the `Deployment` to be available; names the
/// `ReplicaSet`'s conditions when the namespace refused the pod.
async fn wait_for_the_operator_pod(admin: &Client, ns: &str, release: &str, fullname: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let selector = format!("app.kubernetes.io/instance={release}");
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), ns);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let list = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .expect("list the operator's pods");
        if list
            .items
            .iter()
            .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            // A pod the namespace refuses shows as the ReplicaSet's ReplicaFailure condition.
            let sets: Api<ReplicaSet> = Api::namespaced(admin.clone(), ns);
            let conditions: Vec<_> = sets
                .list(&ListParams::default().labels(&selector))
                .await
                .expect("list the operator's ReplicaSets")
                .items
                .into_iter()
                .flat_map(|set| set.status.and_then(|s| s.conditions).unwrap_or_default())
                .map(|c| format!("{}: {}", c.type_, c.message.unwrap_or_default()))
                .collect();
            panic!(
                "the operator's pod did not run in the restricted namespace within 60 s; \
                 pods {:?}; ReplicaSet conditions {conditions:#?}",
                list.items
                    .iter()
                    .map(ResourceExt::name_any)
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_until(
        "the Deployment to be available",
        Duration::from_secs(60),
        || async {
            let deployment = deployments.get(fullname).await.ok()?;
            (deployment.status?.available_replicas? >= 1).then_some(())
        },
    )
    .await;
}

/// The worker `ServiceAccount` mounts no token and may do nothing.
async fn assert_the_worker_account_may_do_nothing(admin: &Client, ns: &str, fullname: &str) {
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let worker_account = format!("{fullname}-worker");
    let worker = accounts
        .get(&worker_account)
        .await
        .expect("the worker ServiceAccount");
    assert_eq!(worker.automount_service_account_token, Some(false));
    let as_worker = client_as(admin, ns, &worker_account).await;
    assert_forbidden(
        "the worker listing pods",
        Api::<Pod>::namespaced(as_worker.clone(), ns)
            .list(&ListParams::default())
            .await,
    );
    assert_forbidden(
        "the worker reading runs",
        Api::<TrajectoryRun>::namespaced(as_worker, ns)
            .list(&ListParams::default())
            .await,
    );
}

/// Every pod of the run `charted` (plan, 4 batches, merge) was admitted without a `ServiceAccount`
/// token: the worker needs no API access.
async fn assert_every_run_pod_ran_without_a_token(pods: &Api<Pod>) {
    let run_pods = pods
        .list(&ListParams::default().labels(&format!("{}=charted", labels::RUN)))
        .await
        .expect("list the run's pods");
    assert!(
        run_pods.items.len() >= 6,
        "plan, 4 batches, merge: {}",
        run_pods.items.len()
    );
    // The admission chain mounted no token volume.
    for pod in &run_pods.items {
        let volumes = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.clone())
            .unwrap_or_default();
        let projected: Vec<&str> = volumes
            .iter()
            .filter(|v| v.projected.is_some())
            .map(|v| v.name.as_str())
            .collect();
        assert!(
            projected.is_empty(),
            "pod {} got a token volume: {projected:?}",
            pod.name_any()
        );
    }
}

/// What the operator requested since `requests_before` is granted by the chart's `objects`, and
/// what is granted was requested (or is one of the few grants a request counter cannot see, each
/// with its reason).
fn assert_granted_is_what_was_requested(
    requests_before: &BTreeMap<(String, String), f64>,
    objects: &[Value],
) {
    let requests_after = api_requests();
    let requested: BTreeSet<(String, String)> = requests_after
        .iter()
        .filter(|(key, count)| **count > requests_before.get(*key).copied().unwrap_or(0.0))
        .map(|(key, _)| key.clone())
        // Discovery and other non-resource URLs: readable by every authenticated user.
        .filter(|(_, resource)| !resource.starts_with('/'))
        .collect();
    let granted = granted(objects);
    let ungranted: Vec<_> = requested.difference(&granted).collect();
    assert!(
        ungranted.is_empty(),
        "requested but not granted: {ungranted:?}"
    );
    let unexplained: Vec<_> = granted
        .difference(&requested)
        .filter(|(verb, resource)| {
            !GRANTED_UNREQUESTED
                .iter()
                .any(|(v, r, _)| v == verb && r == resource)
        })
        .collect();
    assert!(
        unexplained.is_empty(),
        "granted but never requested: {unexplained:?} (requested: {requested:?})"
    );
}

/// Beyond what the operator needs, nothing: Secrets, pods, replacing objects.
async fn assert_nothing_beyond_what_the_operator_needs(operator: &Client, ns: &str) {
    assert_forbidden(
        "the operator listing Secrets cluster-wide",
        Api::<Secret>::all(operator.clone())
            .list(&ListParams::default())
            .await,
    );
    assert_forbidden(
        "the operator reading a Secret",
        Api::<Secret>::namespaced(operator.clone(), ns)
            .get("anything")
            .await,
    );
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "intruder"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }))
    .expect("a pod");
    assert_forbidden(
        "the operator creating a pod",
        Api::<Pod>::namespaced(operator.clone(), ns)
            .create(&PostParams::default(), &pod)
            .await,
    );
    // It deletes Jobs (a run whose rows name images cleans up its finished ones), never pods.
    assert_forbidden(
        "the operator deleting a pod",
        Api::<Pod>::namespaced(operator.clone(), ns)
            .delete("intruder", &DeleteParams::default())
            .await,
    );
    assert_forbidden(
        "the operator changing a run's spec",
        Api::<TrajectoryRun>::namespaced(operator.clone(), ns)
            .patch(
                "charted",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"workers": 1}})),
            )
            .await,
    );
}

/// The operator's settings and Lease as the chart's Deployment sets them (its environment; the
/// downward API's namespace), for the operator run in process.
fn operator_settings(objects: &[Value], ns: &str, fullname: &str) -> (Settings, LeaseConfig) {
    let env = env_of(object(objects, "Deployment", fullname));
    assert_eq!(env_value(&env, "TRAJ_LEADER_ELECTION"), "true");
    let seconds = |name: &str| {
        Duration::from_secs(env_value(&env, name).parse().expect("a number of seconds"))
    };
    let lease = LeaseConfig {
        name: env_value(&env, "TRAJ_LEASE_NAME"),
        // POD_NAMESPACE: the downward API's metadata.namespace.
        namespace: ns.to_owned(),
        identity: format!("{fullname}-in-process"),
        duration: seconds("TRAJ_LEASE_DURATION_SECONDS"),
        grace: seconds("TRAJ_LEASE_GRACE_SECONDS"),
    };
    // The other settings (more may come) keep the operator's defaults, as in the Deployment.
    #[allow(clippy::needless_update)]
    let settings = Settings {
        worker_image: env_value(&env, "TRAJ_WORKER_IMAGE"),
        worker_log_format: env_value(&env, "TRAJ_LOG_FORMAT"),
        watch_namespace: env
            .contains_key("TRAJ_WATCH_NAMESPACE")
            .then(|| ns.to_owned()),
        ..Settings::default()
    };
    (settings, lease)
}

/// Renders the chart with `sets`, installs it in a new namespace that enforces the `restricted`
/// Pod Security Standard, checks its operator pod and its `ServiceAccounts`, then runs the operator
/// in process as the chart's `ServiceAccount` with the Deployment's settings and drives a run to
/// `Succeeded`.
///
/// Returns the namespace (deleted on drop, and with it the cluster-scoped RBAC objects it owns)
/// and the operator's client, for the checks of the scope.
async fn install_and_run(sets: &[&str]) -> (TestNamespace, Client) {
    let admin = client().await;
    install_crds(&admin).await;
    let namespace = TestNamespace::create(&admin, "chart").await;
    let ns = namespace.name().to_owned();
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let restricted = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    let owner = namespaces
        .patch(&ns, &PatchParams::default(), &Patch::Merge(&restricted))
        .await
        .expect("label the namespace restricted");

    let release = unique_name("c");
    let fullname = format!("{release}-trajectory-operator");
    let objects = rendered(&release, &ns, sets);
    apply(&admin, &objects, &owner).await;

    wait_for_the_operator_pod(&admin, &ns, &release, &fullname).await;

    assert_the_worker_account_may_do_nothing(&admin, &ns, &fullname).await;

    // The operator as the chart configures it: its ServiceAccount, its Deployment's environment.
    let operator =
        trajectory_operator::metrics::counted_client(config_as(&admin, &ns, &fullname).await)
            .expect("a counting client for the operator's ServiceAccount");
    let requests_before = api_requests();
    let (settings, lease) = operator_settings(&objects, &ns, &fullname);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let (stop, stopped) = oneshot::channel::<()>();
    let service = tokio::spawn(service::run(
        operator.clone(),
        settings,
        listener,
        Some(lease.clone()),
        async {
            let _ = stopped.await;
        },
    ));

    let model = model().await;
    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 10);
    let runs: Api<TrajectoryRun> = Api::namespaced(admin.clone(), &ns);
    let created = runs
        .create(
            &PostParams::default(),
            &TrajectoryRun::new("charted", run_spec(&model.base_url(), &json!({}))),
        )
        .await
        .expect("create the run");
    let kubelet = Kubelet::new(&admin, &ns, "charted", &scratch);
    let run = kubelet
        .serve_until("the run to finish", Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    assert_eq!(
        phase_of(&run),
        Some(Phase::Succeeded),
        "status {:#?}; played {:#?}",
        run.status,
        kubelet.played()
    );

    // Every Job pod the operator created was admitted by the restricted namespace.
    let stages: BTreeSet<String> = kubelet.played().into_iter().map(|p| p.mode).collect();
    assert_eq!(
        stages,
        ["batch", "merge", "plan"].map(String::from).into(),
        "a pod of every stage ran"
    );
    assert_every_run_pod_ran_without_a_token(&Api::namespaced(admin.clone(), &ns)).await;
    // The Events of every phase change were published with the chart's permissions.
    let uid = created.uid().expect("a uid");
    assert_eq!(
        phase_events(&admin, &ns, &uid).await,
        ["Planning", "Running", "Merging", "Succeeded"],
    );
    // The operator led through the chart's Lease.
    let leases: Api<Lease> = Api::namespaced(admin.clone(), &ns);
    let held = leases.get(&lease.name).await.expect("the leader Lease");
    assert_eq!(
        held.spec.and_then(|s| s.holder_identity),
        Some(lease.identity.clone())
    );

    let _ = stop.send(());
    let exit = tokio::time::timeout(Duration::from_secs(30), service)
        .await
        .expect("the operator stops within 30 s")
        .expect("the operator task does not panic")
        .expect("the operator ends without error");
    assert_eq!(exit, Exit::Stopped);

    // Exactly enough.
    assert_granted_is_what_was_requested(&requests_before, &objects);

    assert_nothing_beyond_what_the_operator_needs(&operator, &ns).await;
    (namespace, operator)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn installed_cluster_wide_in_a_restricted_namespace_the_chart_runs_a_run_with_its_rbac() {
    let _one_at_a_time = CLUSTER.lock().await;
    let (_namespace, operator) = Box::pin(install_and_run(&[])).await;
    // Cluster-wide: the runs and Jobs of every namespace.
    Api::<TrajectoryRun>::all(operator.clone())
        .list(&ListParams::default())
        .await
        .expect("the operator lists runs in every namespace");
    Api::<Job>::all(operator)
        .list(&ListParams::default())
        .await
        .expect("the operator lists Jobs in every namespace");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn installed_namespaced_the_operator_can_do_nothing_outside_its_namespace() {
    let _one_at_a_time = CLUSTER.lock().await;
    let (_namespace, operator) = Box::pin(install_and_run(&["scope=Namespace"])).await;
    assert_forbidden(
        "the namespaced operator listing runs cluster-wide",
        Api::<TrajectoryRun>::all(operator.clone())
            .list(&ListParams::default())
            .await,
    );
    assert_forbidden(
        "the namespaced operator listing Jobs in another namespace",
        Api::<Job>::namespaced(operator.clone(), "default")
            .list(&ListParams::default())
            .await,
    );
    assert_forbidden(
        "the namespaced operator creating a ConfigMap in another namespace",
        Api::<ConfigMap>::namespaced(operator, "default")
            .patch(
                "trajectory-intruder",
                &PatchParams::apply("intruder"),
                &Patch::Apply(json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "trajectory-intruder"},
                })),
            )
            .await,
    );
}

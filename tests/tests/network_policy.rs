//! The `NetworkPolicy` of run pods: the model's tool calls run in them and are untrusted, so nothing
//! may connect in and out they reach only DNS, the model endpoint and the configured tool backends.
//! The chart renders it (`networkPolicy.*`, rendered by the helm `scripts/helm/build.sh` builds,
//! `TRAJ_HELM`) and `examples/networkpolicy/networkpolicy.yaml` ships it standalone.
//!
//! Rendered: none by default, one per run namespace when enabled; every CIDR that contains the
//! metadata address 169.254.169.254 or a cluster range excepts it; what would reach the metadata
//! address or allow nothing but DNS is refused; the example is the policy the chart renders from
//! `examples/networkpolicy/values.yaml`.
//!
//! On the real API server, the chart's policy (those values: the vLLM Service's pods in `inference`
//! on 8000, a search API on 443) and the example are created and read back unchanged, their rules
//! hold as read back (no ingress, both policy types, DNS on 53, the metadata address excepted from
//! every broad block), and their `podSelector` selects exactly the pods of a run's Jobs as the
//! operator's builder makes them (every stage and label variant), not the other pods of the
//! namespace. Enforcement is the CNI's; the local cluster has none, so no packet is tested here.
//!
//! Needs helm and, for the API server, a running cluster:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test network_policy`.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use trajectory_operator::api::TrajectoryRun;
use trajectory_operator::reconcile::validate::{Validation, validate};
use trajectory_operator::settings::Settings;
use trajectory_tests::children::jobs_of_every_stage;
use trajectory_tests::e2e::{NO_NODE, run_spec};
use trajectory_tests::helm::{assert_refused, documents, template, template_with_values};
use trajectory_tests::{TestNamespace, client};

const METADATA: &str = "169.254.169.254/32";
/// `networkPolicy.clusterCIDRs`' default in values.yaml.
const DEFAULT_CLUSTER_CIDRS: [&str; 4] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
];

fn example_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/networkpolicy")
}

fn read_yaml(file: &str) -> Value {
    let path = example_dir().join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `examples/networkpolicy/values.yaml`, the typical values, for the run namespaces `namespaces`.
fn example_values(namespaces: &[&str]) -> Value {
    let mut values = read_yaml("values.yaml");
    values["networkPolicy"]["namespaces"] = json!(namespaces);
    values
}

/// The `NetworkPolicy` objects the chart renders with `values` in the release namespace `ops`.
fn chart_policies(values: &Value) -> Vec<Value> {
    let text = template_with_values("op", "ops", values)
        .unwrap_or_else(|e| panic!("helm template with {values} failed:\n{e}"));
    documents(&text)
        .into_iter()
        .filter(|o| o["kind"] == "NetworkPolicy")
        .collect()
}

/// `a.b.c.d/n` as (address, prefix length).
fn cidr(text: &str) -> (u32, u32) {
    let (address, prefix) = text
        .split_once('/')
        .unwrap_or_else(|| panic!("{text} is not a CIDR"));
    let address: Ipv4Addr = address
        .parse()
        .unwrap_or_else(|e| panic!("{text}: not IPv4: {e}"));
    let prefix: u32 = prefix
        .parse()
        .unwrap_or_else(|e| panic!("{text}: bad prefix: {e}"));
    assert!(prefix <= 32, "{text}: prefix over 32");
    (u32::from(address), prefix)
}

/// Whether the range `outer` contains the range `inner` (or is it).
fn contains(outer: &str, inner: &str) -> bool {
    let ((outer, outer_prefix), (inner, inner_prefix)) = (cidr(outer), cidr(inner));
    let mask = u32::MAX.checked_shl(32 - outer_prefix).unwrap_or(0);
    inner_prefix >= outer_prefix && inner & mask == outer & mask
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| item.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The rules every run-pod policy must keep, checked on `policy` as rendered or read back:
/// both policy types and no ingress rule (nothing connects in); every egress rule names its peers
/// and ports (a rule without `to` or `ports` allows every destination or port); DNS on UDP and
/// TCP 53 to the kube-dns pods of kube-system; no ipBlock reaches the metadata address, and every
/// range of `cluster_cidrs` inside an ipBlock is excepted from it.
fn assert_egress_is_restricted(policy: &Value, cluster_cidrs: &[&str]) {
    let spec = &policy["spec"];
    let types: BTreeSet<String> = strings(&spec["policyTypes"]).into_iter().collect();
    assert_eq!(
        types,
        BTreeSet::from(["Egress".to_owned(), "Ingress".to_owned()]),
        "policyTypes: {spec:#}"
    );
    assert!(
        spec["ingress"].as_array().is_none_or(Vec::is_empty),
        "an ingress rule lets connections in: {:#}",
        spec["ingress"]
    );
    let rules = spec["egress"].as_array().expect("egress rules");
    for rule in rules {
        assert!(
            rule["to"].as_array().is_some_and(|to| !to.is_empty()),
            "an egress rule without `to` allows every destination: {rule:#}"
        );
        assert!(
            rule["ports"].as_array().is_some_and(|p| !p.is_empty()),
            "an egress rule without `ports` allows every port: {rule:#}"
        );
    }

    let dns = rules.iter().find(|rule| {
        rule["to"].as_array().into_iter().flatten().any(|peer| {
            peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "kube-system"
                && peer["podSelector"]["matchLabels"]["k8s-app"] == "kube-dns"
        })
    });
    let dns = dns.unwrap_or_else(|| panic!("no egress rule to the kube-dns pods: {rules:#?}"));
    for protocol in ["UDP", "TCP"] {
        assert!(
            dns["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["port"] == 53 && p["protocol"] == protocol),
            "DNS is not allowed on {protocol} 53: {dns:#}"
        );
    }

    let blocks = rules
        .iter()
        .flat_map(|rule| rule["to"].as_array().into_iter().flatten())
        .filter_map(|peer| peer.get("ipBlock"));
    for block in blocks {
        let range = block["cidr"].as_str().expect("an ipBlock's cidr");
        let except = strings(&block["except"]);
        let excepted = |inner: &str| except.iter().any(|e| contains(e, inner));
        assert!(
            !contains(range, METADATA) || excepted(METADATA),
            "ipBlock {range} reaches the metadata address {METADATA}: {block:#}"
        );
        for cluster in cluster_cidrs {
            assert!(
                !contains(range, cluster) || range == *cluster || excepted(cluster),
                "ipBlock {range} reaches the cluster range {cluster}: {block:#}"
            );
        }
    }
}

/// Every destination of the values' `networkPolicy.egress` has a rule: its peer (the CIDR, or the
/// selectors) with exactly its ports.
fn assert_every_destination_is_allowed(policy: &Value, values: &Value) {
    let rules = policy["spec"]["egress"].as_array().expect("egress rules");
    for destination in values["networkPolicy"]["egress"]
        .as_array()
        .expect("networkPolicy.egress")
    {
        let matches = |peer: &Value| match destination["cidr"].as_str() {
            Some(range) => peer["ipBlock"]["cidr"] == range,
            None => {
                peer["namespaceSelector"] == destination["namespaceSelector"]
                    && peer["podSelector"] == destination["podSelector"]
            }
        };
        assert!(
            rules.iter().any(|rule| {
                rule["ports"] == destination["ports"]
                    && rule["to"].as_array().into_iter().flatten().any(matches)
            }),
            "no egress rule for {}: {rules:#?}",
            destination["description"]
        );
    }
}

#[test]
fn the_chart_renders_no_policy_by_default_and_one_per_run_namespace_when_enabled() {
    let defaults = documents(&template("op", "ops", &[]).expect("helm template"));
    assert!(
        !defaults.iter().any(|o| o["kind"] == "NetworkPolicy"),
        "a NetworkPolicy by default"
    );

    let policies = chart_policies(&example_values(&["research", "team-b"]));
    let placed: Vec<(&Value, &Value)> = policies
        .iter()
        .map(|p| (&p["metadata"]["namespace"], &p["metadata"]["name"]))
        .collect();
    assert_eq!(
        placed,
        [
            (&json!("research"), &json!("op-trajectory-operator-runs")),
            (&json!("team-b"), &json!("op-trajectory-operator-runs")),
        ]
    );
    assert_eq!(policies[0]["spec"], policies[1]["spec"]);
    for policy in &policies {
        assert_egress_is_restricted(policy, &DEFAULT_CLUSTER_CIDRS);
    }

    // No namespace given: the release namespace, where the runs of the namespaced scope live.
    let release = chart_policies(&example_values(&[]));
    assert_eq!(release.len(), 1);
    assert_eq!(release[0]["metadata"]["namespace"], "ops");
}

#[test]
fn every_cidr_excepts_the_metadata_address_and_the_cluster_ranges_inside_it() {
    let destination = |range: &str| {
        json!({"description": format!("to {range}"), "cidr": range,
               "ports": [{"protocol": "TCP", "port": 443}]})
    };
    let ranges = [
        "0.0.0.0/0",
        "10.0.0.0/8",
        "169.254.0.0/16",
        "203.0.113.0/24",
        "10.244.1.0/24",
    ];
    let cluster = ["10.96.0.0/12", "10.244.0.0/16"];
    let values = json!({"networkPolicy": {
        "enabled": true,
        "egress": ranges.map(destination),
        "clusterCIDRs": cluster,
    }});
    let policies = chart_policies(&values);
    assert_eq!(policies.len(), 1);
    assert_egress_is_restricted(&policies[0], &cluster);
    assert_every_destination_is_allowed(&policies[0], &values);

    let except_of = |range: &str| -> Vec<String> {
        let block = policies[0]["spec"]["egress"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|rule| rule["to"].as_array().into_iter().flatten())
            .find(|peer| peer["ipBlock"]["cidr"] == range)
            .unwrap_or_else(|| panic!("no ipBlock {range}"));
        strings(&block["ipBlock"]["except"])
    };
    assert_eq!(
        except_of("0.0.0.0/0"),
        [METADATA, "10.96.0.0/12", "10.244.0.0/16"]
    );
    assert_eq!(except_of("10.0.0.0/8"), ["10.96.0.0/12", "10.244.0.0/16"]);
    assert_eq!(except_of("169.254.0.0/16"), [METADATA]);
    // Outside every denied range: nothing to except.
    assert!(except_of("203.0.113.0/24").is_empty());
    // Inside a cluster range, listed on purpose: allowed as it is.
    assert!(except_of("10.244.1.0/24").is_empty());
}

#[test]
fn the_chart_refuses_a_policy_that_reaches_the_metadata_address_or_allows_only_dns() {
    let with =
        |destination: Value| json!({"networkPolicy": {"enabled": true, "egress": [destination]}});
    let port = json!([{"protocol": "TCP", "port": 80}]);
    let cases = [
        (
            "the metadata address itself",
            with(json!({"description": "imds", "cidr": METADATA, "ports": port})),
            "networkPolicy.egress[0] (imds): 169.254.169.254/32 is the cloud metadata address",
        ),
        (
            "no destination",
            json!({"networkPolicy": {"enabled": true}}),
            "networkPolicy.egress: list at least the model endpoint",
        ),
        (
            "a CIDR and selectors in one destination",
            with(json!({"description": "both", "cidr": "0.0.0.0/0",
                        "podSelector": {"matchLabels": {"a": "b"}}, "ports": port})),
            "/networkPolicy/egress/0",
        ),
        (
            "no ports (every port)",
            with(json!({"description": "all ports", "cidr": "203.0.113.0/24"})),
            "missing property 'ports'",
        ),
        (
            "no description",
            with(json!({"cidr": "203.0.113.0/24", "ports": port})),
            "missing property 'description'",
        ),
        (
            "an IPv6 range (the except list is computed for IPv4 only)",
            with(json!({"description": "v6", "cidr": "::/0", "ports": port})),
            "/networkPolicy/egress/0/cidr",
        ),
        (
            "a bad cluster range",
            json!({"networkPolicy": {"clusterCIDRs": ["10.0.0.0/33"]}}),
            "/networkPolicy/clusterCIDRs/0",
        ),
    ];
    for (what, values, named) in cases {
        assert_refused(
            template_with_values("bad", "default", &values),
            &format!("{what} ({values})"),
            named,
        );
    }
}

#[test]
fn the_example_is_the_policy_the_chart_renders_from_the_example_values() {
    let example = read_yaml("networkpolicy.yaml");
    let charted = chart_policies(&example_values(&["research"]));
    assert_eq!(
        example["spec"], charted[0]["spec"],
        "examples/networkpolicy/networkpolicy.yaml and the chart with values.yaml beside it differ"
    );
    assert_egress_is_restricted(&example, &DEFAULT_CLUSTER_CIDRS);
    assert_every_destination_is_allowed(&example, &example_values(&["research"]));
}

/// `matchLabels` and `matchExpressions` as a label selector string: `a=b,c in (d,e),!f`.
fn selector_string(selector: &Value) -> String {
    let mut terms: Vec<String> = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(key, value)| format!("{key}={}", value.as_str().expect("a label value")))
        .collect();
    for expression in selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let key = expression["key"].as_str().expect("a key");
        let values = strings(&expression["values"]).join(",");
        terms.push(match expression["operator"].as_str() {
            Some("In") => format!("{key} in ({values})"),
            Some("NotIn") => format!("{key} notin ({values})"),
            Some("Exists") => key.to_owned(),
            Some("DoesNotExist") => format!("!{key}"),
            other => panic!("unknown selector operator {other:?}"),
        });
    }
    terms.join(",")
}

/// Creates a pod of every Job the operator builds for a run in `ns` (the Job's pod template, kept
/// Pending by a node selector no node matches) and three pods that are not a run's: the storage
/// shell of examples/storage, the operator's own pod, and a pod that copies only the name label.
/// Returns the names of the run's pods.
async fn create_run_pods_and_others(client: &Client, ns: &str) -> BTreeSet<String> {
    let mut run = TrajectoryRun::new(
        "netpol",
        run_spec("http://vllm.inference:8000/v1", &json!({})),
    );
    run.metadata.namespace = Some(ns.to_owned());
    run.metadata.uid = Some("6f1c2d1e-0000-4000-8000-00000000a11c".to_owned());
    let Ok(Validation::Valid(valid)) = validate(&run) else {
        panic!("the run is valid");
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut run_pods = BTreeSet::new();
    for job in jobs_of_every_stage(&valid, &Settings::default()) {
        let template = job.spec.expect("a Job spec").template;
        let name = format!("{}-pod", job.metadata.name.expect("a Job name"));
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..template.metadata.unwrap_or_default()
            },
            spec: template.spec,
            status: None,
        };
        pods.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("creating the run pod {name}: {e}"));
        run_pods.insert(name);
    }
    let others = [
        ("trajectories-shell", json!({})),
        (
            "operator",
            json!({"app.kubernetes.io/name": "trajectory-operator",
                   "app.kubernetes.io/managed-by": "Helm"}),
        ),
        (
            "name-only",
            json!({"app.kubernetes.io/name": "trajectory-worker"}),
        ),
    ];
    for (name, labels) in others {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "containers": [{"name": "c", "image": "busybox"}],
                "nodeSelector": {NO_NODE.0: NO_NODE.1},
            },
        }))
        .expect("a pod");
        pods.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("creating the pod {name}: {e}"));
    }
    run_pods
}

/// Creates `policy` in a new namespace (server-side apply, strict field validation), reads it back
/// and checks it: unchanged, its rules as [`assert_egress_is_restricted`] says, and its
/// `podSelector`, evaluated by the API server, selects exactly the run's pods.
async fn check_on_the_api_server(what: &str, mut policy: Value, values: &Value) {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "netpol").await;
    let ns = namespace.name();
    policy["metadata"]["namespace"] = json!(ns);
    let name = policy["metadata"]["name"]
        .as_str()
        .expect("a name")
        .to_owned();
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), ns);
    policies
        .patch(
            &name,
            &PatchParams::apply("trajectory-tests-netpol").validation_strict(),
            &Patch::Apply(&policy),
        )
        .await
        .unwrap_or_else(|e| panic!("the API server refuses {what}: {e}"));
    let stored = serde_json::to_value(policies.get(&name).await.expect("read the policy back"))
        .expect("a policy as JSON");
    assert_eq!(
        stored["spec"], policy["spec"],
        "{what}: the API server changed the spec"
    );
    assert_egress_is_restricted(&stored, &DEFAULT_CLUSTER_CIDRS);
    assert_every_destination_is_allowed(&stored, values);

    let run_pods = create_run_pods_and_others(&client, ns).await;
    let selector = selector_string(&stored["spec"]["podSelector"]);
    let selected: BTreeSet<String> = Api::<Pod>::namespaced(client, ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .unwrap_or_else(|e| panic!("listing pods with {selector:?}: {e}"))
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(
        selected, run_pods,
        "{what}: its podSelector ({selector:?}) does not select exactly the run's pods"
    );
}

#[tokio::test]
async fn the_charts_policy_is_accepted_by_the_api_server_and_selects_exactly_the_run_pods() {
    let values = example_values(&["placeholder"]);
    let policy = chart_policies(&values).remove(0);
    Box::pin(check_on_the_api_server(
        "the chart's NetworkPolicy",
        policy,
        &values,
    ))
    .await;
}

#[tokio::test]
async fn the_example_policy_is_accepted_by_the_api_server_and_selects_exactly_the_run_pods() {
    Box::pin(check_on_the_api_server(
        "examples/networkpolicy/networkpolicy.yaml",
        read_yaml("networkpolicy.yaml"),
        &example_values(&[]),
    ))
    .await;
}

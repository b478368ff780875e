//! Smoke tests proving the local control plane is the real thing: the API server's CEL validation,
//! the Job controller with kwok's fake nodes, the garbage collector and `ServiceAccount` tokens.
//! Needs a running cluster: `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests`.

use std::time::Duration;

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::conditions;
use kube::{Api, Client, Config, ResourceExt};
use serde_json::json;
use trajectory_tests::{
    TestNamespace, client, pinned_kubernetes_version, wait_for_object, wait_until,
};

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("manifest matches its type")
}

#[tokio::test]
async fn api_server_reports_the_pinned_kubernetes_version() {
    let client = client().await;
    let info = client.apiserver_version().await.expect("GET /version");
    assert_eq!(
        info.git_version,
        format!("v{}", pinned_kubernetes_version())
    );
    let (major, minor) = pinned_kubernetes_version()
        .split_once('.')
        .map(|(major, rest)| (major, rest.split('.').next().unwrap_or_default()))
        .expect("K8S_VERSION is major.minor.patch");
    assert_eq!((info.major.as_str(), info.minor.as_str()), (major, minor));
}

#[tokio::test]
async fn crd_cel_validation_rule_refuses_a_bad_object_with_the_rules_message() {
    const MESSAGE: &str = "spec.min must not exceed spec.max";
    let client = client().await;
    let ns = TestNamespace::create(&client, "cel").await;

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition = from_json(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "ranges.smoke.trajectory.test" },
        "spec": {
            "group": "smoke.trajectory.test",
            "scope": "Namespaced",
            "names": { "plural": "ranges", "singular": "range", "kind": "Range" },
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "required": ["min", "max"],
                        "properties": {
                            "min": { "type": "integer" },
                            "max": { "type": "integer" }
                        },
                        "x-kubernetes-validations": [
                            { "rule": "self.min <= self.max", "message": MESSAGE }
                        ]
                    } }
                } }
            }]
        }
    }));
    crds.patch(
        "ranges.smoke.trajectory.test",
        &PatchParams::apply("trajectory-tests").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("apply the CRD");
    wait_for_object(
        &crds,
        "ranges.smoke.trajectory.test",
        "CRD Established",
        Duration::from_secs(30),
        conditions::is_crd_established(),
    )
    .await;

    let gvk = GroupVersionKind::gvk("smoke.trajectory.test", "v1", "Range");
    let ranges: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns.name(),
        &ApiResource::from_gvk_with_plural(&gvk, "ranges"),
    );
    let range = |name: &str, min: i64, max: i64| -> DynamicObject {
        from_json(json!({
            "apiVersion": "smoke.trajectory.test/v1",
            "kind": "Range",
            "metadata": { "name": name },
            "spec": { "min": min, "max": max }
        }))
    };

    // A valid object is stored: the type is served and the rule does not refuse everything.
    // (An Established CRD can take a moment before its endpoint answers, hence the retry on 404.)
    wait_until(
        "a valid Range to be created",
        Duration::from_secs(30),
        || async {
            match ranges
                .create(&PostParams::default(), &range("good", 1, 2))
                .await
            {
                Ok(_) => Some(()),
                Err(kube::Error::Api(status)) if status.code == 404 => None,
                Err(e) => panic!("creating a valid Range: {e}"),
            }
        },
    )
    .await;

    let refused = ranges
        .create(&PostParams::default(), &range("bad", 5, 1))
        .await
        .expect_err("the API server must refuse min > max");
    let kube::Error::Api(status) = refused else {
        panic!("expected an API error, got {refused}");
    };
    assert_eq!(status.code, 422, "{status:?}");
    assert!(status.message.contains(MESSAGE), "{status:?}");
    assert!(
        ranges.get_opt("bad").await.expect("GET bad").is_none(),
        "the refused object must not be stored"
    );
}

#[tokio::test]
async fn indexed_job_completes_every_index_on_kwok_nodes() {
    let client = client().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let kwok_nodes = nodes
        .list(&ListParams::default().labels("type=kwok"))
        .await
        .expect("list nodes");
    assert!(
        !kwok_nodes.items.is_empty(),
        "no kwok nodes: start the cluster with KWOK_NODES >= 1 (scripts/cluster/up.sh --nodes 2)"
    );

    let ns = TestNamespace::create(&client, "job").await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns.name());
    let job: Job = from_json(json!({
        "metadata": { "name": "indexed" },
        "spec": {
            "completionMode": "Indexed",
            "completions": 5,
            "parallelism": 2,
            "backoffLimit": 0,
            "template": { "spec": {
                "restartPolicy": "Never",
                // Never pulled: kwok only pretends to run containers.
                "containers": [{ "name": "main", "image": "trajectory.invalid/noop:0" }]
            } }
        }
    }));
    jobs.create(&PostParams::default(), &job)
        .await
        .expect("create the Job");

    let done = wait_for_object(
        &jobs,
        "indexed",
        "completedIndexes 0-4 and condition Complete",
        Duration::from_secs(120),
        |job: Option<&Job>| {
            let complete = conditions::is_job_completed();
            job.and_then(|j| j.status.as_ref())
                .is_some_and(|s| s.completed_indexes.as_deref() == Some("0-4"))
                && kube::runtime::wait::Condition::matches_object(&complete, job)
        },
    )
    .await
    .expect("the Job exists");
    let status = done.status.expect("Job status");
    assert_eq!(status.succeeded, Some(5));
    assert_eq!(status.failed.unwrap_or(0), 0);

    // The pods ran on kwok's fake nodes and kwok marked them Succeeded.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let pods = pods
        .list(&ListParams::default().labels("job-name=indexed"))
        .await
        .expect("list the Job's pods");
    assert!(pods.items.len() >= 5, "{} pods", pods.items.len());
    for pod in &pods.items {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        assert!(
            node.is_some_and(|n| n.starts_with("kwok-node-")),
            "pod {} on {node:?}",
            pod.name_any()
        );
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        assert_eq!(phase, Some("Succeeded"), "pod {}", pod.name_any());
    }
}

#[tokio::test]
async fn garbage_collector_deletes_the_dependent_of_a_deleted_owner() {
    let client = client().await;
    let ns = TestNamespace::create(&client, "gc").await;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns.name());

    let owner = maps
        .create(
            &PostParams::default(),
            &from_json(json!({ "metadata": { "name": "owner" }, "data": { "k": "v" } })),
        )
        .await
        .expect("create the owner");
    let owner_uid = owner.uid().expect("owner uid");
    let dependent = maps
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {
                    "name": "dependent",
                    "ownerReferences": [{
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "name": "owner",
                        "uid": owner_uid
                    }]
                }
            })),
        )
        .await
        .expect("create the dependent");
    let dependent_uid = dependent.uid().expect("dependent uid");

    maps.delete("owner", &DeleteParams::background())
        .await
        .expect("delete the owner");
    wait_for_object(
        &maps,
        "dependent",
        "the garbage collector to delete it",
        Duration::from_secs(60),
        conditions::is_deleted(&dependent_uid),
    )
    .await;
}

#[tokio::test]
async fn service_account_token_authenticates_as_its_service_account() {
    let client = client().await;
    let ns = TestNamespace::create(&client, "token").await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns.name());
    let request: TokenRequest = from_json(json!({ "spec": { "audiences": [] } }));
    let token = accounts
        .create_token_request("default", &PostParams::default(), &request)
        .await
        .expect("TokenRequest for default")
        .status
        .expect("TokenRequest status")
        .token;

    // The same cluster, authenticated only by the signed token.
    let mut kubeconfig = serde_json::to_value(Kubeconfig::read().expect("read KUBECONFIG"))
        .expect("kubeconfig as JSON");
    for user in kubeconfig["users"].as_array_mut().expect("users") {
        user["user"] = json!({ "token": token });
    }
    let kubeconfig: Kubeconfig = from_json(kubeconfig);
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("config with the token");
    let as_account = Client::try_from(config).expect("client with the token");
    let review: SelfSubjectReview = from_json(json!({}));
    let review = Api::<SelfSubjectReview>::all(as_account)
        .create(&PostParams::default(), &review)
        .await
        .expect("SelfSubjectReview with the token");
    let user = review.status.and_then(|s| s.user_info).expect("user info");
    assert_eq!(
        user.username.as_deref(),
        Some(format!("system:serviceaccount:{}:default", ns.name()).as_str())
    );
}

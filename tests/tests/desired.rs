//! The operator's desired children as the real API server sees them: the Jobs and `ConfigMap`s it
//! builds are valid objects, and their pods pass the restricted Pod Security Standard enforced on
//! the namespace. Needs a running cluster:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test desired`.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use trajectory_operator::api::{TrajectoryRun, TrajectoryRunSpec};
use trajectory_operator::reconcile::build;
use trajectory_operator::reconcile::children::Component;
use trajectory_operator::reconcile::decide::{Pending, Shard, Tasks};
use trajectory_operator::reconcile::validate::{Validation, validate};
use trajectory_operator::settings::Settings;
use trajectory_tests::{TestNamespace, client};
use trajectory_worker::spec::RunSpec;

/// A run as if read from the API server (a uid), in `namespace`, with a volume and a pod template.
fn stored_run(namespace: &str) -> TrajectoryRun {
    let spec: RunSpec = serde_json::from_value(json!({
        "dataset": {"path": "datasets/coding.jsonl"},
        "model": {
            "baseUrl": "http://vllm:8000/v1",
            "name": "hermes",
            "apiKeySecretRef": {"name": "llm-key", "key": "api-key"},
        },
        "storage": {"volume": {"persistentVolumeClaim": {"claimName": "trajectories"}}},
        "queueName": "team-a",
        "podTemplate": {
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            "nodeSelector": {"type": "kwok"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }))
    .expect("a valid spec");
    let mut run = TrajectoryRun::new("coding-v1", TrajectoryRunSpec::from(spec));
    run.metadata.namespace = Some(namespace.to_owned());
    run.metadata.uid = Some("6f1c2d1e-0000-4000-8000-000000000001".to_owned());
    run
}

#[tokio::test]
async fn desired_jobs_and_their_pods_are_accepted_under_the_restricted_standard() {
    let client = client().await;
    let namespace = namespace_enforcing(&client, "desired-restricted", "restricted").await;

    let run = stored_run(namespace.name());
    let Ok(Validation::Valid(valid)) = validate(&run) else {
        panic!("the run is valid");
    };
    let settings = Settings::default();
    let pending = Pending::new(vec![3, 4, 9]).expect("three batches");
    let jobs = [
        build::plan_job(&valid, &settings, 1, false),
        build::generation_job(
            &valid,
            &settings,
            &Shard {
                attempt: 2,
                shard: 0,
                pending: pending.clone(),
                exists: false,
                parallelism: run.spec.run.workers,
                tasks: Tasks::Sandbox,
                held: false,
                prefer_node: None,
                task_resources: None,
            },
        ),
        build::merge_job(&valid, &settings, 1, false),
    ];
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let job_api: Api<Job> = Api::namespaced(client.clone(), namespace.name());
    for job in &jobs {
        let name = job.name_any();
        job_api
            .create(&dry_run, job)
            .await
            .unwrap_or_else(|e| panic!("the API server refused Job {name}: {e}"));
        dry_run_pod(&client, namespace.name(), job)
            .await
            .unwrap_or_else(|e| {
                panic!("the pod of Job {name} breaks the restricted standard: {e}")
            });
    }

    let maps: Api<ConfigMap> = Api::namespaced(client, namespace.name());
    let map = build::plan_config_map(&valid, Component::generation(2), Some(&pending));
    maps.create(&dry_run, &map)
        .await
        .expect("the API server accepts the plan ConfigMap");
}

/// A namespace enforcing the Pod Security Standard `level`.
async fn namespace_enforcing(client: &kube::Client, prefix: &str, level: &str) -> TestNamespace {
    let namespace = TestNamespace::create(client, prefix).await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            namespace.name(),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {
                "pod-security.kubernetes.io/enforce": level,
                "pod-security.kubernetes.io/enforce-version": "latest",
            }}})),
        )
        .await
        .expect("label the namespace");
    namespace
}

/// The pod of `job`, created as a dry run in `namespace`: Pod Security admission enforces on
/// pods, not on Jobs, so the template is checked as a pod.
async fn dry_run_pod(client: &kube::Client, namespace: &str, job: &Job) -> kube::Result<Pod> {
    let template = job.spec.as_ref().expect("a Job spec").template.clone();
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(format!("{}-probe", job.name_any())),
            ..template.metadata.unwrap_or_default()
        },
        spec: template.spec,
        status: None,
    };
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&dry_run, &pod)
        .await
}

/// Task containers run as their image's user (root in SWE-style images) with a writable root
/// filesystem: a pod of them passes the baseline standard and not the restricted one, as
/// `docs/task-environments.md` says; the pod recording an unavailable image's rows runs nothing
/// of theirs and passes the restricted standard.
#[tokio::test]
async fn task_container_pods_need_the_baseline_standard_and_the_unavailable_ones_do_not() {
    let client = client().await;
    let restricted = namespace_enforcing(&client, "desired-tasks-restricted", "restricted").await;
    let baseline = namespace_enforcing(&client, "desired-tasks-baseline", "baseline").await;
    let job_of = |namespace: &str, tasks: Tasks| {
        let run = stored_run(namespace);
        let Ok(Validation::Valid(valid)) = validate(&run) else {
            panic!("the run is valid");
        };
        build::generation_job(
            &valid,
            &Settings::default(),
            &Shard {
                attempt: 1,
                shard: 1,
                pending: Pending::new(vec![1, 2]).expect("two batches"),
                exists: false,
                parallelism: 1,
                tasks,
                held: false,
                prefer_node: None,
                task_resources: None,
            },
        )
    };
    let image = || Tasks::Image("registry.local/swe/task:1".to_owned());
    let refused = dry_run_pod(
        &client,
        restricted.name(),
        &job_of(restricted.name(), image()),
    )
    .await
    .expect_err("restricted refuses task containers");
    assert!(refused.to_string().contains("runAsNonRoot"), "{refused}");
    dry_run_pod(&client, baseline.name(), &job_of(baseline.name(), image()))
        .await
        .unwrap_or_else(|e| panic!("baseline accepts task containers: {e}"));
    let unavailable = Tasks::Unavailable {
        image: "registry.local/swe/task:1".to_owned(),
        why: "manifest unknown".to_owned(),
        build_failed: false,
    };
    dry_run_pod(
        &client,
        restricted.name(),
        &job_of(restricted.name(), unavailable),
    )
    .await
    .unwrap_or_else(|e| panic!("restricted accepts the unavailable rows' pod: {e}"));
}

/// A build pod's `build` container runs buildah privileged, as `docs/task-environments.md` and
/// `docs/security.md` say: the baseline standard refuses it, the privileged one admits it; its
/// `build-context` container alone would pass restricted.
#[tokio::test]
async fn build_pods_need_the_privileged_standard() {
    let client = client().await;
    let baseline = namespace_enforcing(&client, "desired-builds-baseline", "baseline").await;
    let privileged = namespace_enforcing(&client, "desired-builds-privileged", "privileged").await;
    let job_of = |namespace: &str| {
        let mut run = stored_run(namespace);
        run.spec.run.dataset = serde_json::from_value(
            json!({"path": "tasks/terminal-bench-2", "format": "HarborTasks"}),
        )
        .expect("a dataset");
        run.spec.run.sandbox.builds = serde_json::from_value(
            json!({"repository": "registry.local:5000/envs", "pushSecret": "push"}),
        )
        .expect("builds");
        let Ok(Validation::Valid(valid)) = validate(&run) else {
            panic!("the run is valid");
        };
        build::build_job::build_job(&valid, &Settings::default(), (1, 3), false)
    };
    let refused = dry_run_pod(&client, baseline.name(), &job_of(baseline.name()))
        .await
        .expect_err("baseline refuses the build container");
    assert!(refused.to_string().contains("privileged"), "{refused}");
    dry_run_pod(&client, privileged.name(), &job_of(privileged.name()))
        .await
        .unwrap_or_else(|e| panic!("privileged admits the build pod: {e}"));
}

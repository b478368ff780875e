//! Every example under `examples/` is valid on a real API server (the local control plane, with the
//! generated `crds/` installed):
//!
//! - each `TrajectoryRun` is accepted by the CRD's schema, CEL rules and admission policy
//!   (server-side apply, dry run, strict field validation: an unknown field is an error), passes the
//!   operator's own spec checks, and the `ConfigMap` and Jobs the operator would create from it are
//!   accepted too (so `spec.podTemplate` and `spec.storage.volume` are valid pod settings);
//! - a run without `spec.storage.volume` is a local run file: the worker's own loader must accept it;
//! - every other object is dry-run applied the same way when the API server serves its kind (Kueue's
//!   kinds are listed as not checked when Kueue is not installed).
//!
//! Failures name the file and the document. Needs a running cluster:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test examples`.

use std::path::{Path, PathBuf};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::discovery::{Scope, pinned_kind};
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::Value;
use trajectory_operator::api::TrajectoryRun;
use trajectory_operator::reconcile::build;
use trajectory_operator::reconcile::children::Component;
use trajectory_operator::reconcile::validate::{Validation, validate};
use trajectory_operator::settings::Settings;
use trajectory_tests::children::jobs_of_every_stage;
use trajectory_tests::karpenter::install_karpenter_crds;
use trajectory_tests::kueue::Kueue;
use trajectory_tests::{TestNamespace, client, install_crds};
use trajectory_worker::run::RunFile;

const FIELD_MANAGER: &str = "trajectory-tests-examples";

/// The repository's `examples/` directory.
fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Every YAML file below `dir`, sorted, recursively.
fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml")
        {
            out.push(path);
        }
    }
}

/// `examples/vllm/run.yaml, document 1`.
fn place(file: &Path, index: usize) -> String {
    let relative = file.strip_prefix(examples_dir()).map_or_else(
        |_| file.display().to_string(),
        |p| format!("examples/{}", p.display()),
    );
    format!("{relative}, document {}", index + 1)
}

/// The documents of a YAML file that are Kubernetes objects (`apiVersion` and `kind`), by index.
/// Panics, naming the file and document, on a YAML error.
fn objects(file: &Path) -> Vec<(usize, Value)> {
    let text =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    serde_yaml::Deserializer::from_str(&text)
        .enumerate()
        .filter_map(|(index, document)| {
            let value = Value::deserialize(document)
                .unwrap_or_else(|e| panic!("{}: not valid YAML: {e}", place(file, index)));
            (value.get("apiVersion").is_some() && value.get("kind").is_some())
                .then_some((index, value))
        })
        .collect()
}

/// Moves a namespaced object into the test namespace (examples name their own or none).
fn in_namespace(mut object: Value, namespace: &str) -> Value {
    object["metadata"]["namespace"] = Value::String(namespace.to_owned());
    object
}

fn object_name(object: &Value) -> Result<String, String> {
    object["metadata"]["name"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| "metadata.name is missing".to_owned())
}

fn dry_apply() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER)
        .dry_run()
        .validation_strict()
}

/// Checks one `TrajectoryRun`: the API server accepts it, the operator's spec checks pass, and the
/// objects the operator makes of it are accepted. Returns whether it is a local run file.
async fn check_run(
    client: &Client,
    namespace: &str,
    file: &Path,
    documents: usize,
    object: Value,
) -> Result<bool, String> {
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), namespace);
    let name = object_name(&object)?;
    let run = runs
        .patch(
            &name,
            &dry_apply(),
            &Patch::Apply(in_namespace(object, namespace)),
        )
        .await
        .map_err(|e| format!("the API server refuses the run: {e}"))?;
    let violations = run.spec.run.validate();
    if !violations.is_empty() {
        let list: Vec<_> = violations.iter().map(ToString::to_string).collect();
        return Err(format!(
            "the operator refuses the spec: {}",
            list.join("; ")
        ));
    }
    if run.spec.run.storage.volume.is_none() {
        // Without a volume the operator cannot run it; it must be a run file for `local`.
        if documents != 1 {
            return Err("a run without spec.storage.volume (a local run file) must be the only document of its file".into());
        }
        RunFile::load(file).map_err(|e| format!("not a valid local run file: {e}"))?;
        return Ok(true);
    }

    let valid = match validate(&run) {
        Ok(Validation::Valid(valid)) => valid,
        Ok(Validation::Refused(message)) => {
            return Err(format!("the operator refuses the spec: {message}"));
        }
        Err(e) => return Err(format!("the operator cannot build its children: {e}")),
    };
    let settings = Settings::default();
    let config_map: ConfigMap = build::plan_config_map(&valid, Component::Plan { round: 1 }, None);
    let jobs = jobs_of_every_stage(&valid, &settings);
    let create = PostParams {
        dry_run: true,
        field_manager: Some(FIELD_MANAGER.to_owned()),
    };
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    config_maps
        .create(&create, &config_map)
        .await
        .map_err(|e| {
            format!("the API server refuses the plan ConfigMap the operator makes: {e}")
        })?;
    let job_api: Api<Job> = Api::namespaced(client.clone(), namespace);
    for job in &jobs {
        let job_name = job.metadata.name.clone().unwrap_or_default();
        job_api.create(&create, job).await.map_err(|e| {
            format!("the API server refuses the Job {job_name} the operator makes: {e}")
        })?;
    }
    Ok(false)
}

/// Dry-run applies any other object. `Ok(false)`: the API server does not serve its kind.
async fn check_object(client: &Client, namespace: &str, object: Value) -> Result<bool, String> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind = object["kind"].as_str().unwrap_or_default().to_owned();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, &kind);
    let Ok((resource, capabilities)) = pinned_kind(client, &gvk).await else {
        return Ok(false);
    };
    let name = object_name(&object)?;
    let (api, object): (Api<DynamicObject>, Value) = match capabilities.scope {
        Scope::Namespaced => (
            Api::namespaced_with(client.clone(), namespace, &resource),
            in_namespace(object, namespace),
        ),
        Scope::Cluster => (Api::all_with(client.clone(), &resource), object),
    };
    api.patch(&name, &dry_apply(), &Patch::Apply(object))
        .await
        .map_err(|e| format!("the API server refuses this {kind}: {e}"))?;
    Ok(true)
}

#[tokio::test]
async fn every_example_is_accepted_by_the_api_server_and_the_operator() {
    let client = client().await;
    install_crds(&client).await;
    // So that the Karpenter NodePool of examples/karpenter/ is checked against its own schema,
    // and the Kueue queues of examples/kueue/ by Kueue's own webhooks (which a Kueue of another
    // test binary, gone since, may have left registered).
    install_karpenter_crds(&client).await;
    Kueue::shared(&client).await;
    let namespace = TestNamespace::create(&client, "examples").await;
    let ns = namespace.name();

    let mut files = Vec::new();
    yaml_files(&examples_dir(), &mut files);
    let (mut cluster_runs, mut local_runs, mut others) = (Vec::new(), Vec::new(), Vec::new());
    let (mut not_served, mut failures) = (Vec::new(), Vec::new());
    for file in &files {
        let documents = objects(file);
        let count = documents.len();
        for (index, object) in documents {
            let place = place(file, index);
            let kind = object["kind"].as_str().unwrap_or_default().to_owned();
            if kind == "TrajectoryRun" {
                match check_run(&client, ns, file, count, object).await {
                    Ok(true) => local_runs.push(place),
                    Ok(false) => cluster_runs.push(place),
                    Err(e) => failures.push(format!("{place}: {e}")),
                }
            } else {
                match check_object(&client, ns, object).await {
                    Ok(true) => others.push(format!("{place} ({kind})")),
                    Ok(false) => not_served.push(format!("{place} ({kind})")),
                    Err(e) => failures.push(format!("{place}: {e}")),
                }
            }
        }
    }
    eprintln!("cluster runs checked: {cluster_runs:#?}");
    eprintln!("local run files checked: {local_runs:#?}");
    eprintln!("other objects checked: {others:#?}");
    eprintln!("kinds this API server does not serve (not checked): {not_served:#?}");
    assert!(
        failures.is_empty(),
        "invalid examples:\n{}",
        failures.join("\n")
    );
    // The examples this test exists for: a failure to find them must not pass silently.
    for expected in [
        "examples/quickstart/run.yaml",
        "examples/vllm/run.yaml",
        "examples/kueue/run.yaml",
        "examples/spot/run.yaml",
        "examples/resume/run.yaml",
        "examples/karpenter/run.yaml",
    ] {
        assert!(
            cluster_runs
                .iter()
                .chain(&local_runs)
                .any(|place| place.starts_with(expected)),
            "{expected} was not checked; found {files:?}"
        );
    }
    for kind in [
        "(Deployment)",
        "(NetworkPolicy)",
        "(NodePool)",
        "(ClusterQueue)",
        "(LocalQueue)",
    ] {
        assert!(
            others.iter().any(|place| place.contains(kind)),
            "no {kind} was checked (the vLLM Deployment, examples/networkpolicy/, examples/karpenter/, examples/kueue/): {others:?}"
        );
    }
}

/// The check refuses what it should: a typo in a run, an invalid pod setting and a bad value.
#[tokio::test]
async fn an_invalid_example_is_refused_with_its_place() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "examples-bad").await;
    let ns = namespace.name();
    let dir = tempfile_dir();
    let run = |spec: &str| {
        format!(
            "apiVersion: trajectories.dev/v1alpha1\nkind: TrajectoryRun\nmetadata: {{name: bad}}\nspec:\n  dataset: {{path: d.jsonl}}\n  model: {{baseUrl: 'http://m:8000/v1', name: m}}\n  storage: {{volume: {{emptyDir: {{}}}}}}\n{spec}"
        )
    };
    let cases = [
        ("unknown field", run("  batchSzie: 5\n"), "batchSzie"),
        (
            "pod template typo",
            run("  podTemplate: {nodeSelectors: {pool: spot}}\n"),
            "nodeSelectors",
        ),
        (
            "bad toleration",
            run("  podTemplate: {tolerations: [{key: spot, operator: Sometimes}]}\n"),
            "operator",
        ),
        ("bound", run("  workers: 0\n"), "workers"),
    ];
    for (what, text, needle) in cases {
        let file = dir.join(format!("{}.yaml", what.replace(' ', "-")));
        std::fs::write(&file, &text).expect("write the example");
        let (index, object) = objects(&file).pop().expect("one object");
        let error = check_run(&client, ns, &file, 1, object)
            .await
            .expect_err(&format!("{what}: {} was accepted", place(&file, index)));
        assert!(error.contains(needle), "{what}: {error}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A scratch directory for the bad examples.
fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(trajectory_tests::unique_name("examples-bad"));
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

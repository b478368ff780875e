//! Argo CD and Flux (`examples/gitops`): the Argo CD health check `health.lua`, run by a Lua 5.1
//! interpreter (Argo CD runs gopher-lua, which implements Lua 5.1) on the objects of real runs,
//! every version the operator wrote on the real control plane: `Planning`, `Running` and `Merging`
//! are Progressing, `Succeeded` is Healthy, `Failed` is Degraded, a suspended run is Suspended, and
//! a spec the operator has not yet acted on is Progressing. `kubectl wait --for=condition=Succeeded`
//! returns once a run succeeded (and `--for=condition=Failed` once one failed).
//!
//! Without a cluster: the `argocd-cm` snippet embeds `health.lua` verbatim, the chart values of the
//! Argo CD Application and the Flux `HelmRelease` pass the chart's schema, and every file parses.
//! With one, the API server accepts the run kept in Git (server-side dry run).
//!
//! Needs a running cluster for the runs:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test gitops`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use mlua::serde::SerializeOptions;
use mlua::{Lua, LuaSerdeExt, Table};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use trajectory_operator::api::{Phase, TrajectoryRun};
use trajectory_operator::settings::Settings;
use trajectory_tests::e2e::{
    Kubelet, Scratch, model, phase_of, run_spec, start_controller_with, write_dataset,
};
use trajectory_tests::helm::{documents, template_with_values};
use trajectory_tests::{
    TestNamespace, client, install_crds, pinned_kubernetes_version, wait_until,
};
use trajectory_worker::contract::exit;

const GITOPS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/gitops");

fn read(path: &str) -> String {
    let path = format!("{GITOPS}/{path}");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// What `health.lua` says of `object`, as Argo CD runs it: the object as the global `obj` (JSON
/// null as nil), the returned table's `status` and `message`.
fn health(object: &Value) -> (String, String) {
    let lua = Lua::new();
    let options = SerializeOptions::new()
        .serialize_none_to_null(false)
        .serialize_unit_to_null(false);
    let obj = lua
        .to_value_with(object, options)
        .expect("the object as a Lua value");
    lua.globals().set("obj", obj).expect("set obj");
    let hs: Table = lua
        .load(read("argocd/health.lua"))
        .set_name("health.lua")
        .eval()
        .unwrap_or_else(|e| panic!("health.lua failed on {object:#}: {e}"));
    let field = |name: &str| -> String {
        hs.get::<Option<String>>(name)
            .unwrap_or_else(|e| panic!("health.lua's {name} is not a string: {e}"))
            .unwrap_or_default()
    };
    (field("status"), field("message"))
}

fn health_of(run: &TrajectoryRun) -> (String, String) {
    health(&serde_json::to_value(run).expect("a run as JSON"))
}

fn suspended(run: &TrajectoryRun) -> bool {
    run.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Suspended" && c.status == "True")
    })
}

/// The health Argo CD should show for a run's object.
fn expected_health(run: &TrajectoryRun) -> &'static str {
    let Some(status) = run.status.as_ref().filter(|s| s.phase.is_some()) else {
        return "Progressing";
    };
    if status.observed_generation < run.metadata.generation {
        return "Progressing";
    }
    match status.phase {
        Some(Phase::Succeeded) => "Healthy",
        Some(Phase::Failed) => "Degraded",
        _ if suspended(run) => "Suspended",
        _ => "Progressing",
    }
}

#[test]
fn the_argocd_cm_snippet_embeds_health_lua_verbatim() {
    let config: Value = serde_yaml::from_str(&read("argocd/argocd-cm.yaml")).expect("argocd-cm");
    assert_eq!(config["kind"], "ConfigMap");
    assert_eq!(config["metadata"]["name"], "argocd-cm");
    let embedded = config["data"]["resource.customizations.health.trajectories.dev_TrajectoryRun"]
        .as_str()
        .expect("the TrajectoryRun health check in argocd-cm's data");
    assert!(
        embedded == read("argocd/health.lua"),
        "examples/gitops/argocd/argocd-cm.yaml does not embed health.lua as it is: copy it in again"
    );
}

#[test]
fn the_chart_values_of_the_argocd_application_and_the_flux_helm_release_pass_the_schema() {
    let application: Value =
        serde_yaml::from_str(&read("argocd/operator.yaml")).expect("the Application");
    assert_eq!(application["kind"], "Application");
    assert_eq!(
        application["spec"]["source"]["path"], "charts/trajectory-operator",
        "the Application installs the chart of this repository"
    );
    let release: Value =
        serde_yaml::from_str(&read("flux/operator/helmrelease.yaml")).expect("the HelmRelease");
    assert_eq!(release["kind"], "HelmRelease");
    assert_eq!(
        release["spec"]["chart"]["spec"]["chart"],
        "./charts/trajectory-operator"
    );
    let version = format!("v{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(application["spec"]["source"]["targetRevision"], version);
    let source: Value = serde_yaml::from_str(&read("flux/source.yaml")).expect("the GitRepository");
    assert_eq!(source["spec"]["ref"]["tag"], version);

    for (what, values) in [
        (
            "the Application's valuesObject",
            &application["spec"]["source"]["helm"]["valuesObject"],
        ),
        ("the HelmRelease's values", &release["spec"]["values"]),
    ] {
        if let Err(message) =
            template_with_values("trajectory-operator", "trajectory-system", values)
        {
            panic!("{what} do not pass the chart's schema:\n{message}");
        }
    }
}

#[test]
fn every_gitops_file_parses_and_names_its_kind() {
    for path in [
        "argocd/argocd-cm.yaml",
        "argocd/operator.yaml",
        "argocd/runs.yaml",
        "flux/source.yaml",
        "flux/kustomizations.yaml",
        "flux/operator/kustomization.yaml",
        "flux/operator/namespace.yaml",
        "flux/operator/helmrelease.yaml",
        "trajectory-runs/kustomization.yaml",
        "trajectory-runs/run.yaml",
    ] {
        let objects = documents(&read(path));
        assert!(!objects.is_empty(), "{path}: no document");
        for object in objects {
            assert!(
                object["apiVersion"].is_string() && object["kind"].is_string(),
                "{path}: a document without apiVersion and kind: {object:#}"
            );
        }
    }
    // The Kustomizations list files that exist.
    for dir in ["trajectory-runs", "flux/operator"] {
        let kustomization: Value =
            serde_yaml::from_str(&read(&format!("{dir}/kustomization.yaml"))).expect("YAML");
        for resource in kustomization["resources"].as_array().expect("resources") {
            let file = format!("{GITOPS}/{dir}/{}", resource.as_str().expect("a path"));
            assert!(std::path::Path::new(&file).is_file(), "{file} is missing");
        }
    }
}

/// `kubectl` of the local control plane: `TRAJ_CLUSTER_KUBECTL` (set by `with-cluster.sh`), else
/// where `scripts/cluster/build.sh` caches it.
fn kubectl() -> PathBuf {
    let path = std::env::var_os("TRAJ_CLUSTER_KUBECTL").map_or_else(
        || {
            let cache = std::env::var_os("TRAJ_CACHE_DIR").map_or_else(
                || {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/trajectory-operator")
                },
                PathBuf::from,
            );
            cache.join(format!("k8s/v{}/bin/kubectl", pinned_kubernetes_version()))
        },
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "no kubectl at {} (TRAJ_CLUSTER_KUBECTL): build the control plane with scripts/cluster/build.sh",
        path.display()
    );
    path
}

/// Starts `kubectl wait --for=condition=CONDITION trun/NAME` in the background.
fn kubectl_wait(namespace: &str, name: &str, condition: &str) -> tokio::process::Child {
    tokio::process::Command::new(kubectl())
        .args(["wait", "--namespace", namespace, "--timeout=120s"])
        .arg(format!("--for=condition={condition}"))
        .arg(format!("trun/{name}"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start kubectl wait")
}

async fn finished(child: tokio::process::Child, what: &str) -> String {
    let output = tokio::time::timeout(Duration::from_secs(150), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not return"))
        .expect("kubectl wait ran");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The run kept in Git is one the API server accepts.
async fn assert_the_run_kept_in_git_is_accepted(runs: &Api<TrajectoryRun>) {
    let kept: TrajectoryRun =
        serde_yaml::from_str(&read("trajectory-runs/run.yaml")).expect("trajectory-runs/run.yaml");
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    runs.create(&dry_run, &kept).await.unwrap_or_else(|e| {
        panic!("the API server refuses examples/gitops/trajectory-runs/run.yaml: {e}")
    });
}

/// Every version of every run, as a watch delivers them, until the task is aborted.
fn record_every_version(
    runs: &Api<TrajectoryRun>,
) -> (Arc<Mutex<Vec<TrajectoryRun>>>, JoinHandle<()>) {
    let seen: Arc<Mutex<Vec<TrajectoryRun>>> = Arc::default();
    let recorder = tokio::spawn({
        let seen = seen.clone();
        let stream = watcher(runs.clone(), watcher::Config::default()).applied_objects();
        async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(Ok(run)) = stream.next().await {
                seen.lock().expect("not poisoned").push(run);
            }
        }
    });
    (seen, recorder)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_lua_on_every_phase_of_real_runs_and_kubectl_wait_for_their_conditions() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "gitops").await;
    let ns = namespace.name();
    #[allow(clippy::needless_update)]
    let settings = Settings {
        watch_namespace: Some(ns.to_owned()),
        ..Settings::default()
    };
    let _controller = start_controller_with(&client, settings);
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);

    assert_the_run_kept_in_git_is_accepted(&runs).await;
    let model = model().await;

    let (seen, recorder) = record_every_version(&runs);
    let versions_of = |name: &str| -> Vec<TrajectoryRun> {
        seen.lock()
            .expect("not poisoned")
            .iter()
            .filter(|run| run.name_any() == name)
            .cloned()
            .collect()
    };

    // One run to Succeeded, one to Failed (its plan pod exits with the permanent configuration
    // error code), one suspended from the start.
    let create = |name: &'static str, extra: Value| {
        let runs = runs.clone();
        let base_url = model.base_url();
        async move {
            runs.create(
                &PostParams::default(),
                &TrajectoryRun::new(name, run_spec(&base_url, &extra)),
            )
            .await
            .unwrap_or_else(|e| panic!("create the run {name}: {e}"))
        }
    };
    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 10);
    create("succeeds", json!({})).await;
    let wait_succeeded = kubectl_wait(ns, "succeeds", "Succeeded");
    create("fails", json!({})).await;
    let wait_failed = kubectl_wait(ns, "fails", "Failed");
    create("paused", json!({"suspend": true})).await;

    let kubelet = Kubelet::new(&client, ns, "succeeds", &scratch);
    let succeeded = kubelet
        .serve_until("the run to finish", Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    assert_eq!(
        phase_of(&succeeded),
        Some(Phase::Succeeded),
        "{succeeded:#?}"
    );

    let mut failing = Kubelet::new(&client, ns, "fails", &scratch);
    failing.crash = Box::new(|mode, _, _| (mode == "plan").then_some(exit::PERMANENT_CONFIG));
    let failed = failing
        .serve_until("the run to fail", Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await;
    assert_eq!(phase_of(&failed), Some(Phase::Failed), "{failed:#?}");

    wait_until(
        "the suspended run's Suspended condition",
        Duration::from_secs(60),
        || async { runs.get("paused").await.ok().filter(suspended) },
    )
    .await;

    // kubectl wait reads the conditions the operator writes.
    let printed = finished(wait_succeeded, "kubectl wait --for=condition=Succeeded").await;
    assert!(
        printed.contains("trajectoryrun.trajectories.dev/succeeds condition met"),
        "{printed}"
    );
    finished(wait_failed, "kubectl wait --for=condition=Failed").await;

    // A spec change the operator has not yet acted on: the API server's answer to the change,
    // with the new generation and the old status.
    let changed = runs
        .patch(
            "paused",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"workers": 3}})),
        )
        .await
        .expect("change the suspended run's workers");

    // Let the watch catch up with the last writes, then judge every version it saw.
    wait_until(
        "the watch to see every run finish",
        Duration::from_secs(30),
        || async {
            let done = |name: &str, phase: Phase| {
                versions_of(name)
                    .iter()
                    .any(|run| phase_of(run) == Some(phase))
            };
            (done("succeeds", Phase::Succeeded) && done("fails", Phase::Failed)).then_some(())
        },
    )
    .await;
    recorder.abort();

    let versions = seen.lock().expect("not poisoned").clone();
    assert_health_of_every_version(&versions, &changed, &failed);
}

/// health.lua judges every version the watch saw (and `changed`, a spec change not yet acted on)
/// as its phase says, with a message; every phase and outcome was judged on a real object; the
/// Degraded message of `failed` names its reason.
fn assert_health_of_every_version(
    versions: &[TrajectoryRun],
    changed: &TrajectoryRun,
    failed: &TrajectoryRun,
) {
    let mut judged = Vec::new();
    for run in versions.iter().chain([changed]) {
        let (status, message) = health_of(run);
        assert_eq!(
            status,
            expected_health(run),
            "health.lua on {} in phase {:?} (message {message:?}); status {:#?}",
            run.name_any(),
            phase_of(run),
            run.status
        );
        assert!(
            !message.is_empty(),
            "health.lua gave no message for {run:#?}"
        );
        judged.push((
            run.name_any(),
            phase_of(run),
            suspended(run),
            status,
            message,
        ));
    }
    // Every phase and outcome was judged on a real object.
    let covered = |name: &str, phase: Option<Phase>, health: &str| {
        judged
            .iter()
            .any(|(n, p, _, h, _)| n == name && *p == phase && h == health)
    };
    for (name, phase, health) in [
        ("succeeds", Some(Phase::Planning), "Progressing"),
        ("succeeds", Some(Phase::Running), "Progressing"),
        ("succeeds", Some(Phase::Merging), "Progressing"),
        ("succeeds", Some(Phase::Succeeded), "Healthy"),
        ("fails", Some(Phase::Failed), "Degraded"),
        ("paused", Some(Phase::Planning), "Suspended"),
    ] {
        assert!(
            covered(name, phase, health),
            "no version of {name} in {phase:?} judged {health}: {judged:#?}"
        );
    }
    let (status, message) = health_of(changed);
    assert_eq!(status, "Progressing");
    assert!(message.contains("latest spec"), "{message}");
    let (_, message) = health_of(failed);
    assert!(
        message.contains("WorkerConfigError") || message.contains("PlanFailed"),
        "the Degraded message names the reason: {message}"
    );
}

#[test]
fn health_lua_on_an_object_the_operator_has_not_seen() {
    // The exact edge case of a run created a moment ago: no status at all (a literal object,
    // named as such; the cluster test judges the real ones).
    let fresh = json!({
        "apiVersion": "trajectories.dev/v1alpha1", "kind": "TrajectoryRun",
        "metadata": {"name": "fresh", "generation": 1}, "spec": {},
    });
    assert_eq!(health(&fresh).0, "Progressing");
}

//! Argo CD and Flux (`examples/gitops`), judged by their own code: `scripts/gitops-health` is a
//! small Go program built from Flux's kstatus module (github.com/fluxcd/cli-utils, what
//! kustomize-controller's health checks read) and Argo CD's health code (github.com/argoproj/argo-cd
//! `util/lua` through gitops-engine's `health.GetResourceHealth`, as the application controller calls
//! it). The Argo CD health check runs as a script from `argocd-cm` does: without Lua's `string` and
//! `math` libraries.
//!
//! On the real control plane, every version the operator wrote of three runs (one through
//! `Planning`, `Running` and `Merging` to `Succeeded`, one `Failed`, one suspended), the suspended
//! one as created before the operator ran, a spec change not yet acted on and a run held in
//! deletion by a finalizer are judged by both: Flux reads a run in progress until the operator has
//! observed it (the CRD defaults `status.observedGeneration` to -1), `Succeeded` Current, `Failed`
//! Failed, a suspended run in progress, a deleting one Terminating; Argo CD reads Progressing,
//! Healthy, Degraded, Suspended, and "Pending deletion". The same test captures Argo CD's fixtures
//! (`resource_customizations/trajectories.dev/TrajectoryRun/testdata`, upstream's layout) from those
//! runs and fails when they drift (regenerate with `TRAJ_UPDATE_FIXTURES=1`); `kubectl wait
//! --for=condition=Succeeded` returns once a run succeeded (and `--for=condition=Failed` once one
//! failed).
//!
//! Without a cluster: every case of `health_test.yaml` passes Argo CD's code with `argocd-cm`'s
//! libraries (and with the open ones of upstream's `TestLuaHealthScript`), a script that calls
//! `string.format` is refused under `argocd-cm`'s, the three copies of `health.lua` are one text,
//! the chart values of the Argo CD Application and the Flux `HelmRelease` pass the chart's schema,
//! and every file parses. With a cluster, the API server accepts the run kept in Git (server-side
//! dry run).
//!
//! Needs a running cluster for the runs:
//! `scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test gitops`.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde::Deserialize;
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

/// Argo CD's health check in upstream's layout (`resource_customizations/<group>/<Kind>/`), the
/// source of the two copies `argocd/health.lua` and `argocd/argocd-cm.yaml`.
const UPSTREAM: &str = "argocd/resource_customizations/trajectories.dev/TrajectoryRun";

/// The finalizer that holds a run in deletion long enough to judge it.
const HOLD: &str = "tests.trajectories.dev/hold";

fn read(path: &str) -> String {
    let path = format!("{GITOPS}/{path}");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

fn health_lua() -> PathBuf {
    PathBuf::from(format!("{GITOPS}/{UPSTREAM}/health.lua"))
}

/// The `gitops-health` program: `TRAJ_GITOPS_HEALTH` (scripts/test.sh exports it), else what
/// `scripts/gitops-health/build.sh --print-path` builds or finds cached. Panics, with the build's
/// output, when it cannot be had: these tests judge nothing without it.
fn gitops_health() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        trajectory_testkit::installed(
            "TRAJ_GITOPS_HEALTH",
            "gitops-health/build.sh",
            "--print-path",
        )
    })
}

/// What Flux's or Argo CD's code says of an object.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
struct Verdict {
    status: String,
    message: String,
}

/// `gitops-health ARGS` on `object`: its verdict, or what it printed when it refused.
fn judge(args: &[&OsStr], object: &Value) -> Result<Verdict, String> {
    let mut child = Command::new(gitops_health())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", gitops_health().display()));
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(object.to_string().as_bytes())
        .expect("write the object to gitops-health");
    let output = child.wait_with_output().expect("gitops-health ran");
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "gitops-health printed no verdict ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    }))
}

/// Flux's health of `object` (kstatus).
fn kstatus(object: &Value) -> Verdict {
    judge(&["kstatus".as_ref()], object)
        .unwrap_or_else(|e| panic!("kstatus failed on {object:#}: {e}"))
}

/// Argo CD's health of `object` with `script` as its health check from `argocd-cm`: Lua's
/// `string` and `math` closed. `Err` is Argo CD's error (it shows the resource as Unknown).
fn argocd_health(script: &Path, object: &Value) -> Result<Verdict, String> {
    judge(&["argocd-health".as_ref(), script.as_os_str()], object)
}

/// [`argocd_health`] as Argo CD runs its built-in scripts and upstream's `TestLuaHealthScript`:
/// every library open.
fn argocd_health_with_open_libs(script: &Path, object: &Value) -> Result<Verdict, String> {
    judge(
        &[
            "argocd-health".as_ref(),
            script.as_os_str(),
            "--open-libs".as_ref(),
        ],
        object,
    )
}

fn health_of(run: &TrajectoryRun) -> Verdict {
    let object = serde_json::to_value(run).expect("a run as JSON");
    argocd_health(&health_lua(), &object)
        .unwrap_or_else(|e| panic!("health.lua failed on {object:#}: {e}"))
}

fn kstatus_of(run: &TrajectoryRun) -> Verdict {
    kstatus(&serde_json::to_value(run).expect("a run as JSON"))
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
    if run.metadata.deletion_timestamp.is_some() {
        // gitops-engine says so before any health check runs.
        return "Progressing";
    }
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

/// The health Flux should read of a run's object (kstatus): Terminating once deleted; in progress
/// until the operator has observed the spec; then by phase, a suspended run being in progress (its
/// `Ready` is False; see examples/gitops/README.md).
fn expected_kstatus(run: &TrajectoryRun) -> &'static str {
    if run.metadata.deletion_timestamp.is_some() {
        return "Terminating";
    }
    let Some(status) = run.status.as_ref() else {
        // No status at all: kstatus knows no condition and says Current. The CRD's default status
        // keeps a live run from ever looking like this.
        return "Current";
    };
    if status.observed_generation != run.metadata.generation {
        return "InProgress";
    }
    match status.phase {
        Some(Phase::Succeeded) => "Current",
        Some(Phase::Failed) => "Failed",
        _ => "InProgress",
    }
}

#[test]
fn health_lua_is_one_text_in_the_upstream_folder_beside_argocd_cm_and_in_argocd_cm() {
    let source = read(&format!("{UPSTREAM}/health.lua"));
    assert!(
        read("argocd/health.lua") == source,
        "examples/gitops/argocd/health.lua differs from {UPSTREAM}/health.lua (the source): copy it again"
    );
    let config: Value = serde_yaml::from_str(&read("argocd/argocd-cm.yaml")).expect("argocd-cm");
    assert_eq!(config["kind"], "ConfigMap");
    assert_eq!(config["metadata"]["name"], "argocd-cm");
    let embedded = config["data"]["resource.customizations.health.trajectories.dev_TrajectoryRun"]
        .as_str()
        .expect("the TrajectoryRun health check in argocd-cm's data");
    assert!(
        embedded == source,
        "examples/gitops/argocd/argocd-cm.yaml does not embed {UPSTREAM}/health.lua as it is: copy it in again"
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

/// What the cluster test saw of its runs, besides every version the watch delivered.
struct Stages {
    /// Every version of every run, as the watch delivered them.
    versions: Vec<TrajectoryRun>,
    /// The suspended run as created, before the operator ran.
    unseen: TrajectoryRun,
    /// The suspended run once the operator marked it so.
    suspended: TrajectoryRun,
    /// The suspended run's spec changed, as the API server answered the change.
    changed: TrajectoryRun,
    succeeded: TrajectoryRun,
    failed: TrajectoryRun,
    /// The succeeded run deleted while a finalizer holds it.
    deleting: TrajectoryRun,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flux_and_argo_cd_judge_every_stage_of_real_runs_and_kubectl_waits_for_their_conditions() {
    let client = client().await;
    install_crds(&client).await;
    let namespace = TestNamespace::create(&client, "gitops").await;
    let ns = namespace.name();
    let runs: Api<TrajectoryRun> = Api::namespaced(client.clone(), ns);

    assert_the_run_kept_in_git_is_accepted(&runs).await;
    let model = model().await;

    let (seen, recorder) = record_every_version(&runs);

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
    // The suspended one first, while no operator runs: a run as it is before anyone acted on it.
    create("paused", json!({"suspend": true})).await;
    let unseen = runs.get("paused").await.expect("read the new run");
    assert_eq!(
        unseen.status.as_ref().and_then(|s| s.observed_generation),
        Some(-1),
        "the CRD defaults a new run's status to observedGeneration -1: {:#?}",
        unseen.status
    );

    #[allow(clippy::needless_update)]
    let settings = Settings {
        watch_namespace: Some(ns.to_owned()),
        ..Settings::default()
    };
    let _controller = start_controller_with(&client, settings);

    let scratch = Scratch::new();
    write_dataset(&scratch.storage(), 10);
    create("succeeds", json!({})).await;
    let wait_succeeded = kubectl_wait(ns, "succeeds", "Succeeded");
    create("fails", json!({})).await;
    let wait_failed = kubectl_wait(ns, "fails", "Failed");

    let succeeded = play_to_the_end(&Kubelet::new(&client, ns, "succeeds", &scratch)).await;
    assert_eq!(
        phase_of(&succeeded),
        Some(Phase::Succeeded),
        "{succeeded:#?}"
    );

    let mut failing = Kubelet::new(&client, ns, "fails", &scratch);
    failing.crash = Box::new(|mode, _, _| (mode == "plan").then_some(exit::PERMANENT_CONFIG));
    let failed = play_to_the_end(&failing).await;
    assert_eq!(phase_of(&failed), Some(Phase::Failed), "{failed:#?}");

    let suspended_run = wait_until(
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
            let seen = seen.lock().expect("not poisoned");
            let done = |name: &str, phase: Phase| {
                seen.iter()
                    .any(|run| run.name_any() == name && phase_of(run) == Some(phase))
            };
            (done("succeeds", Phase::Succeeded) && done("fails", Phase::Failed)).then_some(())
        },
    )
    .await;
    recorder.abort();

    let deleting = deleted_while_held(&runs, "succeeds").await;

    let stages = Stages {
        versions: seen.lock().expect("not poisoned").clone(),
        unseen,
        suspended: suspended_run,
        changed,
        succeeded,
        failed,
        deleting,
    };
    assert_argocd_health_of_every_stage(&stages);
    assert_kstatus_of_every_stage(&stages);
    check_the_captured_fixtures(&stages, ns);
}

/// Plays the pods of `kubelet`'s run until it succeeded or failed.
async fn play_to_the_end(kubelet: &Kubelet) -> TrajectoryRun {
    let what = format!("the run {} to finish", kubelet.run);
    kubelet
        .serve_until(&what, Duration::from_secs(120), |run| {
            matches!(phase_of(run), Some(Phase::Succeeded | Phase::Failed))
        })
        .await
}

/// `name` deleted while the finalizer [`HOLD`] holds it, as read then; the finalizer is removed
/// again at once (before anything is asserted) and the run is gone.
async fn deleted_while_held(runs: &Api<TrajectoryRun>, name: &str) -> TrajectoryRun {
    runs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": [HOLD]}})),
    )
    .await
    .unwrap_or_else(|e| panic!("add a finalizer to {name}: {e}"));
    let deleted = runs.delete(name, &DeleteParams::default()).await;
    let read = runs.get(name).await;
    runs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap_or_else(|e| panic!("remove the finalizer of {name}: {e}"));
    deleted.unwrap_or_else(|e| panic!("delete {name}: {e}"));
    let deleting = read.unwrap_or_else(|e| panic!("read {name} in deletion: {e}"));
    assert!(
        deleting.metadata.deletion_timestamp.is_some(),
        "{name} is not being deleted: {:#?}",
        deleting.metadata
    );
    wait_until(
        &format!("{name} to be gone once its finalizer is"),
        Duration::from_secs(30),
        || async { matches!(runs.get_opt(name).await, Ok(None)).then_some(()) },
    )
    .await;
    deleting
}

/// Argo CD judges every stage as its phase says, with a message: every version the watch saw,
/// the run before the operator saw it, a spec change not yet acted on, a run in deletion. Every
/// phase and outcome was judged on a real object; the Degraded message of the failed run names
/// its reason.
fn assert_argocd_health_of_every_stage(stages: &Stages) {
    let mut judged = Vec::new();
    let extra = [&stages.unseen, &stages.changed, &stages.deleting];
    for run in stages.versions.iter().chain(extra) {
        let Verdict { status, message } = health_of(run);
        assert_eq!(
            status,
            expected_health(run),
            "Argo CD's health of {} in phase {:?} (message {message:?}); status {:#?}",
            run.name_any(),
            phase_of(run),
            run.status
        );
        assert!(!message.is_empty(), "Argo CD gave no message for {run:#?}");
        judged.push((run.name_any(), phase_of(run), status, message));
    }
    // Every phase and outcome was judged on a real object.
    let covered = |name: &str, phase: Option<Phase>, health: &str| {
        judged
            .iter()
            .any(|(n, p, h, _)| n == name && *p == phase && h == health)
    };
    for (name, phase, health) in [
        ("paused", None, "Progressing"),
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
    let Verdict { status, message } = health_of(&stages.changed);
    assert_eq!(status, "Progressing");
    assert!(message.contains("latest spec"), "{message}");
    let Verdict { message, .. } = health_of(&stages.failed);
    assert!(
        message.contains("WorkerConfigError") || message.contains("PlanFailed"),
        "the Degraded message names the reason: {message}"
    );
    assert_eq!(
        health_of(&stages.deleting),
        Verdict {
            status: "Progressing".into(),
            message: "Pending deletion".into()
        }
    );
}

/// Flux (kstatus) reads every stage as [`expected_kstatus`] says: a run in progress until the
/// operator observed it, Current once succeeded, Failed once failed, in progress while suspended,
/// Terminating in deletion; every one of those was read on a real object.
fn assert_kstatus_of_every_stage(stages: &Stages) {
    let mut judged = Vec::new();
    let extra = [&stages.unseen, &stages.changed, &stages.deleting];
    for run in stages.versions.iter().chain(extra) {
        let Verdict { status, message } = kstatus_of(run);
        assert_eq!(
            status,
            expected_kstatus(run),
            "kstatus of {} in phase {:?} (message {message:?}); status {:#?}",
            run.name_any(),
            phase_of(run),
            run.status
        );
        assert!(!message.is_empty(), "kstatus gave no message for {run:#?}");
        judged.push((run.name_any(), phase_of(run), suspended(run), status));
    }
    let covered = |name: &str, phase: Option<Phase>, paused: bool, health: &str| {
        judged
            .iter()
            .any(|(n, p, s, h)| n == name && *p == phase && *s == paused && h == health)
    };
    for (name, phase, paused, health) in [
        ("paused", None, false, "InProgress"),
        ("succeeds", Some(Phase::Planning), false, "InProgress"),
        ("succeeds", Some(Phase::Running), false, "InProgress"),
        ("succeeds", Some(Phase::Merging), false, "InProgress"),
        ("succeeds", Some(Phase::Succeeded), false, "Current"),
        ("fails", Some(Phase::Failed), false, "Failed"),
        ("paused", Some(Phase::Planning), true, "InProgress"),
    ] {
        assert!(
            covered(name, phase, paused, health),
            "no version of {name} in {phase:?} (suspended: {paused}) read {health}: {judged:#?}"
        );
    }
    assert_eq!(
        kstatus_of(&stages.unseen),
        Verdict {
            status: "InProgress".into(),
            message: "TrajectoryRun generation is 1, but latest observed generation is -1".into()
        },
        "a run the operator has not seen"
    );
    let generation = stages.changed.metadata.generation.expect("a generation");
    assert_eq!(
        kstatus_of(&stages.changed),
        Verdict {
            status: "InProgress".into(),
            message: format!(
                "TrajectoryRun generation is {generation}, but latest observed generation is {}",
                generation - 1
            )
        },
        "a spec change not yet acted on"
    );
    assert_eq!(
        kstatus_of(&stages.deleting),
        Verdict {
            status: "Terminating".into(),
            message: "Resource scheduled for deletion".into()
        }
    );
}

/// The testdata of `health_test.yaml`: the objects of the runs at each stage, captured from the
/// cluster test.
fn captured_fixtures(stages: &Stages) -> Vec<(&'static str, Value)> {
    let json = |run: &TrajectoryRun| serde_json::to_value(run).expect("a run as JSON");
    let first_in = |phase: Phase| {
        stages
            .versions
            .iter()
            .find(|run| run.name_any() == "succeeds" && phase_of(run) == Some(phase))
            .unwrap_or_else(|| panic!("the watch saw no version of succeeds in {phase:?}"))
    };
    let mut fresh = json(&stages.unseen);
    fresh.as_object_mut().expect("an object").remove("status");
    vec![
        // As the API server keeps a run without the CRD's status default (a CRD older than it).
        ("fresh", fresh),
        ("unobserved", json(&stages.unseen)),
        ("planning", json(first_in(Phase::Planning))),
        ("running", json(first_in(Phase::Running))),
        ("merging", json(first_in(Phase::Merging))),
        ("suspended", json(&stages.suspended)),
        ("succeeded", json(&stages.succeeded)),
        ("failed", json(&stages.failed)),
        ("spec_edited", json(&stages.changed)),
    ]
}

const FIXTURE_HEADER: &str = "# Captured from a live run by tests/tests/gitops.rs; regenerate with\n\
    #   TRAJ_UPDATE_FIXTURES=1 scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test gitops\n";

/// A captured object as a fixture that does not change from one capture to the next: without
/// what the API server assigns (uid, resourceVersion, managedFields...), in namespace `research`
/// (also where messages and paths name the test's namespace), the model at the address of
/// examples/gitops, every timestamp the same, pod names with the same random suffix, and the
/// output's size (its records hold timings) a round number.
fn as_fixture(object: &Value, namespace: &str) -> String {
    fn same_strings(value: &mut Value, namespace: &str) {
        match value {
            Value::String(text) if text.parse::<Timestamp>().is_ok() => {
                "2026-01-01T00:00:00Z".clone_into(text);
            }
            Value::String(text) => *text = same_pod_names(&text.replace(namespace, "research")),
            Value::Object(map) => map.values_mut().for_each(|v| same_strings(v, namespace)),
            Value::Array(items) => items.iter_mut().for_each(|v| same_strings(v, namespace)),
            _ => {}
        }
    }
    let mut object = object.clone();
    let metadata = object["metadata"].as_object_mut().expect("metadata");
    metadata.retain(|key, _| matches!(key.as_str(), "name" | "generation" | "labels"));
    metadata.insert("namespace".to_owned(), json!("research"));
    object["spec"]["model"]["baseUrl"] = json!("http://vllm.inference:8000/v1");
    if let Some(output) = object
        .pointer_mut("/status/output")
        .and_then(Value::as_object_mut)
    {
        output.insert("bytes".to_owned(), json!(100_000));
    }
    same_strings(&mut object, namespace);
    let yaml = serde_yaml::to_string(&object).expect("an object as YAML");
    // Quoted, as kubectl writes them: a YAML 1.1 reader takes a plain one for a timestamp.
    let yaml = yaml.replace(": 2026-01-01T00:00:00Z", ": '2026-01-01T00:00:00Z'");
    format!("{FIXTURE_HEADER}{yaml}")
}

/// `text` with the random suffix of every pod it names (`research/<job>-<5 characters>`, as
/// the Job controller names pods) replaced by `xxxxx`.
fn same_pod_names(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            let Some(pod) = word.strip_prefix("research/") else {
                return word.to_owned();
            };
            match pod.rsplit_once('-') {
                Some((job, suffix))
                    if suffix.len() == 5 && suffix.bytes().all(|b| b.is_ascii_alphanumeric()) =>
                {
                    format!("research/{job}-xxxxx")
                }
                _ => word.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The fixtures on disk are what this run captured; `TRAJ_UPDATE_FIXTURES=1` writes them.
fn check_the_captured_fixtures(stages: &Stages, namespace: &str) {
    let update = std::env::var_os("TRAJ_UPDATE_FIXTURES").is_some_and(|v| v == "1");
    let dir = format!("{GITOPS}/{UPSTREAM}/testdata");
    let mut stale = Vec::new();
    for (name, object) in captured_fixtures(stages) {
        let path = format!("{dir}/{name}.yaml");
        let text = as_fixture(&object, namespace);
        if update {
            std::fs::create_dir_all(&dir).expect("create the testdata directory");
            std::fs::write(&path, &text).unwrap_or_else(|e| panic!("write {path}: {e}"));
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            stale.push(format!("{path}; captured now:\n{text}"));
        }
    }
    assert!(
        stale.is_empty(),
        "Argo CD's fixtures differ from what the runs show now; regenerate them with\n  \
         TRAJ_UPDATE_FIXTURES=1 scripts/cluster/with-cluster.sh cargo test -p trajectory-tests --test gitops\n\
         and check health_test.yaml still holds:\n{}",
        stale.join("\n")
    );
}

/// One case of upstream's `health_test.yaml`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthCase {
    health_status: Verdict,
    input_path: String,
}

#[derive(Debug, Deserialize)]
struct HealthTests {
    tests: Vec<HealthCase>,
}

/// The cases of `health_test.yaml`, each with its object (read as upstream's test reads it: the
/// YAML file as an object).
fn health_cases() -> Vec<(HealthCase, Value)> {
    let tests: HealthTests = serde_yaml::from_str(&read(&format!("{UPSTREAM}/health_test.yaml")))
        .expect("health_test.yaml");
    tests
        .tests
        .into_iter()
        .map(|case| {
            let object: Value =
                serde_yaml::from_str(&read(&format!("{UPSTREAM}/{}", case.input_path)))
                    .unwrap_or_else(|e| panic!("{}: {e}", case.input_path));
            (case, object)
        })
        .collect()
}

#[test]
fn every_case_of_health_test_yaml_passes_argo_cds_own_health_code_without_open_libs() {
    let cases = health_cases();
    // Every stage has its case, and every fixture is a case.
    let inputs: BTreeSet<&str> = cases.iter().map(|(c, _)| c.input_path.as_str()).collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(format!("{GITOPS}/{UPSTREAM}/testdata"))
        .expect("the testdata directory")
        .map(|entry| {
            format!(
                "testdata/{}",
                entry.expect("an entry").file_name().to_string_lossy()
            )
        })
        .collect();
    assert_eq!(
        inputs,
        on_disk.iter().map(String::as_str).collect(),
        "health_test.yaml names every file of testdata/ once"
    );
    for stage in [
        "fresh",
        "unobserved",
        "planning",
        "running",
        "merging",
        "suspended",
        "succeeded",
        "failed",
        "spec_edited",
    ] {
        assert!(
            inputs.contains(format!("testdata/{stage}.yaml").as_str()),
            "no case for {stage}"
        );
    }
    for (case, object) in &cases {
        // argocd-cm's libraries, as a user installs the check.
        let verdict = argocd_health(&health_lua(), object)
            .unwrap_or_else(|e| panic!("{}: Argo CD refused health.lua: {e}", case.input_path));
        assert_eq!(verdict, case.health_status, "{}", case.input_path);
        // Every library, as upstream's TestLuaHealthScript runs the folder.
        let verdict = argocd_health_with_open_libs(&health_lua(), object)
            .unwrap_or_else(|e| panic!("{}: Argo CD refused health.lua: {e}", case.input_path));
        assert_eq!(
            verdict, case.health_status,
            "{} (open libs)",
            case.input_path
        );
    }
}

#[test]
fn kstatus_reads_the_captured_stages_as_flux_would() {
    for (case, object) in health_cases() {
        let run: TrajectoryRun = serde_json::from_value(object.clone())
            .unwrap_or_else(|e| panic!("{} is not a TrajectoryRun: {e}", case.input_path));
        let verdict = kstatus(&object);
        assert_eq!(
            verdict.status,
            expected_kstatus(&run),
            "{}: {verdict:?}",
            case.input_path
        );
    }
    // The pitfall the CRD's status default removes: a run without any status reads Current.
    let (_, fresh) = health_cases()
        .into_iter()
        .find(|(case, _)| case.input_path == "testdata/fresh.yaml")
        .expect("the fresh case");
    assert_eq!(kstatus(&fresh).status, "Current");
}

#[test]
fn argocd_cm_semantics_refuse_a_script_that_uses_string_format() {
    // The harness runs Argo CD's own code: Lua's string library is closed to a script from
    // argocd-cm, open to a built-in one.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let script = dir.path().join("health.lua");
    std::fs::write(
        &script,
        "local hs = {}\nhs.status = \"Healthy\"\nhs.message = string.format(\"%d batches\", 4)\nreturn hs\n",
    )
    .expect("write the script");
    let run = json!({
        "apiVersion": "trajectories.dev/v1alpha1", "kind": "TrajectoryRun",
        "metadata": {"name": "any", "generation": 1}, "spec": {},
    });
    let refused =
        argocd_health(&script, &run).expect_err("string.format under argocd-cm's libraries");
    assert!(
        refused.contains("attempt to index a non-table object(nil) with key 'format'"),
        "{refused}"
    );
    assert_eq!(
        argocd_health_with_open_libs(&script, &run).expect("string.format with open libraries"),
        Verdict {
            status: "Healthy".into(),
            message: "4 batches".into()
        }
    );
}

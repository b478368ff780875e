//! Helm for tests: the binary `scripts/helm/build.sh` builds (`TRAJ_HELM`), and the chart
//! `charts/trajectory-operator` rendered by it.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;

/// The chart's directory.
pub const CHART_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/trajectory-operator");

/// The Helm version `scripts/helm/version.env` pins.
pub fn pinned_helm_version() -> &'static str {
    include_str!("../../scripts/helm/version.env")
        .lines()
        .find_map(|line| line.trim().strip_prefix("HELM_VERSION="))
        .expect("scripts/helm/version.env sets HELM_VERSION")
        .trim()
}

/// The helm binary: `TRAJ_HELM`, else where `scripts/helm/build.sh` caches the pinned version.
/// Panics, saying how to build it, when there is none.
pub fn helm() -> PathBuf {
    const HOW: &str = "build it with `scripts/helm/build.sh` and `export TRAJ_HELM=\"$(scripts/helm/build.sh --print-path)\"` \
                       (scripts/test.sh does both)";
    if let Some(path) = std::env::var_os("TRAJ_HELM") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "TRAJ_HELM={} is not a file; {HOW}",
            path.display()
        );
        return path;
    }
    let cache = std::env::var_os("TRAJ_CACHE_DIR").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/trajectory-operator")
        },
        PathBuf::from,
    );
    let cached = cache.join(format!("helm/v{}/bin/helm", pinned_helm_version()));
    assert!(
        cached.is_file(),
        "no helm: TRAJ_HELM is unset and {} does not exist; {HOW}",
        cached.display()
    );
    cached
}

/// `helm template RELEASE CHART --namespace NAMESPACE --include-crds --set S...`: the rendered
/// manifests, or helm's error output when it refuses.
pub fn template(release: &str, namespace: &str, sets: &[&str]) -> Result<String, String> {
    let args: Vec<OsString> = sets
        .iter()
        .flat_map(|set| [OsString::from("--set"), OsString::from(set)])
        .collect();
    run_template(release, namespace, &args)
}

/// Asserts that helm refused to render (`rendered` is [`template`]'s or
/// [`template_with_values`]'s result for the values `what` describes) with an error naming
/// `named`.
pub fn assert_refused(rendered: Result<String, String>, what: &str, named: &str) {
    match rendered {
        Ok(_) => panic!("helm template accepted {what}"),
        Err(message) => assert!(
            message.contains(named),
            "{what}: the error does not name {named:?}:\n{message}"
        ),
    }
}

/// [`template`] with `values` (a JSON object) as a values file, as Argo CD or Flux pass them.
pub fn template_with_values(
    release: &str,
    namespace: &str,
    values: &Value,
) -> Result<String, String> {
    let file = std::env::temp_dir().join(format!("{}.json", crate::unique_name("helm-values")));
    // JSON is YAML: helm reads it as a values file.
    std::fs::write(&file, values.to_string())
        .unwrap_or_else(|e| panic!("writing {}: {e}", file.display()));
    let rendered = run_template(
        release,
        namespace,
        &[OsString::from("--values"), file.clone().into_os_string()],
    );
    let _ = std::fs::remove_file(&file);
    rendered
}

fn run_template(release: &str, namespace: &str, args: &[OsString]) -> Result<String, String> {
    let helm = helm();
    let output = Command::new(&helm)
        .args(["template", release, CHART_DIR, "--namespace", namespace])
        .arg("--include-crds")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", helm.display()));
    if output.status.success() {
        Ok(String::from_utf8(output.stdout).expect("helm prints UTF-8"))
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// The YAML documents of a stream, without empty (comment-only) ones.
pub fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|document| Value::deserialize(document).expect("a YAML document"))
        .filter(|value| !value.is_null())
        .collect()
}

/// The rendered object of `kind` named `name`.
pub fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let names: Vec<String> = objects
                .iter()
                .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
                .collect();
            panic!("the chart renders no {kind} {name}; it renders {names:?}")
        })
}

/// `helm ARGS...` against the cluster of `KUBECONFIG`: its output, or its error output when it
/// fails.
pub fn run(args: &[&OsStr]) -> Result<String, String> {
    let helm = helm();
    let output = Command::new(&helm)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", helm.display()));
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "helm {args:?} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// `helm install RELEASE CHART --namespace NAMESPACE --skip-crds --values VALUES` (`values` a JSON
/// object): the release of the chart in this repository. The CRDs are skipped: the tests apply
/// them (`crate::install_crds`), and Helm never upgrades CRDs it finds.
pub fn install(release: &str, namespace: &str, values: &Value) -> Result<String, String> {
    let file = std::env::temp_dir().join(format!("{}.json", crate::unique_name("helm-values")));
    std::fs::write(&file, values.to_string())
        .unwrap_or_else(|e| panic!("writing {}: {e}", file.display()));
    let installed = run(&[
        OsStr::new("install"),
        OsStr::new(release),
        OsStr::new(CHART_DIR),
        OsStr::new("--namespace"),
        OsStr::new(namespace),
        OsStr::new("--skip-crds"),
        OsStr::new("--values"),
        file.as_os_str(),
    ]);
    let _ = std::fs::remove_file(&file);
    installed
}

/// `helm uninstall RELEASE --namespace NAMESPACE --wait`.
pub fn uninstall(release: &str, namespace: &str) -> Result<String, String> {
    run(&["uninstall", release, "--namespace", namespace, "--wait"].map(OsStr::new))
}

//! A controller that runs beside the test control plane as a process of this machine, as the
//! integration tests of Kueue and Karpenter run theirs: its CRDs applied from its module's source,
//! the process started under a shell that kills it once its standard input (a pipe this process
//! holds) closes, so that it ends with the test binary however that ends, and its health endpoint
//! waited on.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::runtime::wait::conditions;
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::Value;

use crate::wait_for_object;

pub const FIELD_MANAGER: &str = "trajectory-tests-sidecar";

/// A running controller process.
#[derive(Debug)]
pub struct Sidecar {
    /// The shell that ends the controller when its standard input closes: held, never waited on.
    _supervisor: Child,
    /// Its log file.
    pub log: PathBuf,
}

impl Sidecar {
    /// Starts `binary` with `args` and `env`, its output in `log`, and waits until
    /// `http://127.0.0.1:{health}{path}` answers 200. Panics with the log when it exits first or is
    /// not ready within 60 s: a test that needs it must fail loudly.
    pub async fn start<I, K, V>(
        name: &str,
        binary: &Path,
        args: &[&OsStr],
        env: I,
        log: PathBuf,
        (health, path): (u16, &str),
    ) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        // Kueue logs to standard error, Karpenter to standard output: both go to the log.
        let output = std::fs::File::create(&log).expect("the controller's log");
        let errors = output.try_clone().expect("a second handle on the log");
        // The shell waits on its standard input: when this process ends, the pipe closes and the
        // shell kills the controller.
        let mut supervisor = Command::new("bash")
            .args([
                "-c",
                r#""$0" "$@" & child=$!; cat >/dev/null; kill "$child"; wait "$child""#,
            ])
            .arg(binary)
            .args(args)
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(output)
            .stderr(errors)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let ready = wait_ready(name, &mut supervisor, health, path, &log);
        tokio::time::timeout(Duration::from_secs(60), ready)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{name} was not ready within 60 s: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        Self {
            _supervisor: supervisor,
            log,
        }
    }

    /// The last lines of the controller's log, for a failing test's message.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// Waits until the health endpoint answers 200; panics with the log when the process exits first.
async fn wait_ready(name: &str, supervisor: &mut Child, health: u16, path: &str, log: &Path) {
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], health));
    loop {
        if let Some(status) = supervisor.try_wait().expect("wait on the controller") {
            panic!(
                "{name} exited ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        let answer = crate::e2e::http_get(address, path).await;
        if answer.is_some_and(|response| response.starts_with("HTTP/1.1 200")) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Server-side applies `object` as `name` (forcing this harness's ownership).
pub async fn apply<K>(api: &Api<K>, name: &str, object: &Value)
where
    K: Clone + std::fmt::Debug + serde::de::DeserializeOwned + serde::Serialize,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .unwrap_or_else(|e| panic!("applying {name}: {e}"));
}

/// Applies every CRD of the YAML files in `dirs` and waits until each is established.
pub async fn apply_crds(client: &Client, dirs: &[PathBuf]) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut names = Vec::new();
    for dir in dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            for document in serde_yaml::Deserializer::from_str(&text) {
                let value = Value::deserialize(document)
                    .unwrap_or_else(|e| panic!("a CRD in {}: {e}", file.display()));
                if value.is_null() {
                    continue;
                }
                let name = value["metadata"]["name"]
                    .as_str()
                    .expect("a named CRD")
                    .to_owned();
                apply(&crds, &name, &value).await;
                names.push(name);
            }
        }
    }
    for name in names {
        wait_for_object(
            &crds,
            &name,
            "Established",
            Duration::from_secs(30),
            conditions::is_crd_established(),
        )
        .await;
    }
}

/// A port free on loopback a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

//! Fixtures for the run-mode tests: a run directory with a dataset and a run file, built with
//! sensible defaults and `with_*` adjustments.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    FixedLatency, ScriptedServer, text_reply, tool_call_reply,
};
use trajectory_worker::contract::BatchSummary;
use trajectory_worker::model::{ModelClient, ModelSettings};
use trajectory_worker::run::batch::{Engine, Shutdown, run_batch, shutdown_channel};
use trajectory_worker::run::manifest::Manifest;
use trajectory_worker::run::{RunError, RunFile, RunLocation};

/// A run on disk: `<dir>/run.yaml`, `<dir>/datasets/prompts.jsonl`, outputs under `<dir>/out`.
pub struct RunFixture {
    pub dir: tempfile::TempDir,
    pub spec: Value,
}

impl RunFixture {
    /// `prompts` valid prompts, batch size 4, against `base_url`.
    pub fn new(base_url: &str, prompts: usize) -> Self {
        let lines: Vec<String> = (0..prompts)
            .map(|i| json!({"prompt": format!("task number {i}"), "row": i}).to_string())
            .collect();
        Self::with_lines(base_url, &lines)
    }

    pub fn with_lines(base_url: &str, lines: &[String]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("datasets")).unwrap();
        let mut data = lines.join("\n");
        data.push('\n');
        std::fs::write(dir.path().join("datasets/prompts.jsonl"), data).unwrap();
        let spec = json!({
            "dataset": {"path": "datasets/prompts.jsonl"},
            "batchSize": 4,
            "workers": 2,
            "concurrency": 4,
            "distribution": "terminal_only",
            "seed": 7,
            "model": {"baseUrl": base_url, "name": "scripted", "maxAttempts": 3, "requestTimeoutSeconds": 10},
            "agent": {"maxTurns": 3, "promptTimeoutSeconds": 60},
            "storage": {"outputPath": "out"},
        });
        let fixture = Self { dir, spec };
        fixture.write_run_file();
        fixture
    }

    pub fn with(mut self, pointer: &str, value: Value) -> Self {
        let (parent, key) = pointer.rsplit_once('/').expect("a JSON pointer with a key");
        self.spec.pointer_mut(parent).expect("parent exists")[key] = value;
        self.write_run_file();
        self
    }

    fn write_run_file(&self) {
        let file = json!({
            "apiVersion": "trajectories.dev/v1alpha1",
            "kind": "TrajectoryRun",
            "metadata": {"name": "fixture"},
            "spec": self.spec,
        });
        std::fs::write(self.run_file(), serde_yaml::to_string(&file).unwrap()).unwrap();
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }
    pub fn run_file(&self) -> PathBuf {
        self.dir.path().join("run.yaml")
    }
    pub fn dataset(&self) -> PathBuf {
        self.dir.path().join("datasets/prompts.jsonl")
    }
    pub fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }
    pub fn workspaces(&self) -> PathBuf {
        self.dir.path().join("workspaces")
    }

    pub fn location(&self) -> RunLocation {
        let run_file = RunFile::load(&self.run_file()).expect("the fixture's run file is valid");
        RunLocation {
            storage_root: self.root().to_path_buf(),
            plan: run_file.to_plan(),
        }
    }

    pub fn engine(&self) -> Engine {
        Engine::new(&self.location().plan.spec, self.workspaces()).expect("engine")
    }

    /// [`Self::engine`] with retries 10 ms apart (the spec's backoff starts at a second).
    pub fn engine_with_fast_retries(&self) -> Engine {
        let spec = self.location().plan.spec;
        let mut settings = ModelSettings::from_spec(&spec.model, None).expect("model settings");
        settings.retry.base_delay = Duration::from_millis(10);
        settings.retry.max_delay = Duration::from_millis(200);
        let client = ModelClient::new(settings).expect("client");
        Engine::with_client(&spec, self.workspaces(), client).expect("engine")
    }

    /// The JSON lines of an output file.
    pub fn lines(&self, name: &str) -> Vec<Value> {
        let text = std::fs::read_to_string(self.out().join(name)).unwrap_or_default();
        text.lines()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|err| panic!("bad line {line:?}: {err}"))
            })
            .collect()
    }
}

/// A server that answers each conversation with one terminal call, then a final answer.
pub async fn terminal_server(latency: Duration) -> ScriptedServer {
    ScriptedServer::start_fixed_latency(FixedLatency {
        latency,
        tool_call: tool_call_reply("terminal", &json!({"command": "echo hi"})),
        final_answer: text_reply("done"),
    })
    .await
}

/// Runs batch 0 of the fixture in this process with `engine`.
pub async fn batch_zero(fixture: &RunFixture, engine: &Engine) -> Result<BatchSummary, RunError> {
    let location = fixture.location();
    let manifest = Manifest::require(&location.run_dir()).expect("the fixture was planned");
    run_batch(engine, &location, &manifest, 0, &no_shutdown(), &|_| {}).await
}

/// A shutdown signal that never fires.
pub fn no_shutdown() -> Shutdown {
    let (trigger, shutdown) = shutdown_channel();
    std::mem::forget(trigger);
    shutdown
}

/// (`prompt_index`, sample) of each line.
pub fn keys(lines: &[Value]) -> Vec<(u64, u64)> {
    lines
        .iter()
        .map(|line| {
            (
                line["prompt_index"].as_u64().unwrap(),
                line["sample"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// A filesystem mounted for a test, unmounted when dropped (declare it after the fixture whose
/// directory it is mounted in, so it goes first).
pub struct Mount(PathBuf);

impl Mount {
    /// A tmpfs of `bytes` at `at`. The test suite runs as root (CI and `scripts/test.sh` do); a
    /// process that may not mount fails the test, naming why, rather than passing unchecked.
    pub fn tmpfs(at: &Path, bytes: u64) -> Self {
        std::fs::create_dir_all(at).unwrap();
        let size = format!("size={bytes}");
        Self::run(&["-t", "tmpfs", "-o", &size, "tmpfs"], at)
    }

    /// `at` itself, bound over itself read-only.
    pub fn read_only(at: &Path) -> Self {
        let mount = Self::run(&["--bind"], at);
        assert!(
            mount.remount("remount,bind,ro"),
            "cannot remount {} read-only",
            at.display()
        );
        mount
    }

    /// Changes the options of the mount (`remount,size=...`).
    pub fn remount(&self, options: &str) -> bool {
        std::process::Command::new("mount")
            .args(["-o", options])
            .arg(&self.0)
            .status()
            .is_ok_and(|status| status.success())
    }

    fn run(args: &[&str], at: &Path) -> Self {
        let mut command = std::process::Command::new("mount");
        command.args(args);
        // A bind mount names its source, then the mount point.
        if args == ["--bind"] {
            command.arg(at);
        }
        let ok = command
            .arg(at)
            .status()
            .is_ok_and(|status| status.success());
        assert!(
            ok,
            "cannot mount at {} ({args:?}): the storage-fault tests need root, as the test suite runs",
            at.display()
        );
        Self(at.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

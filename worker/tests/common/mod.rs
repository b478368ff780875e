//! Fixtures for the run-mode tests: a run directory with a dataset and a run file, built with
//! sensible defaults and `with_*` adjustments.

#![allow(dead_code)]

pub mod batches;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use nix::sys::signal::Signal;

use serde_json::{Value, json};
use trajectory_testkit::scripted_server::{
    FixedLatency, ReceivedRequest, ScriptedServer, Step, first_user_message, text_reply,
    tool_call_reply, tool_calls_reply,
};
use trajectory_worker::contract::BatchSummary;
use trajectory_worker::model::{ModelClient, ModelSettings};
use trajectory_worker::run::batch::{Engine, Shutdown, run_batch, shutdown_channel};
use trajectory_worker::run::local::{LocalOptions, ProgressMode};
use trajectory_worker::run::manifest::Manifest;
use trajectory_worker::run::{RunError, RunFile, RunLocation};
use trajectory_worker::storage::RecordsFile;
use trajectory_worker::tools::browser::ConversationBrowser;
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{ToolContext, ToolLimits, Workspace};

pub const WORKER: &str = env!("CARGO_BIN_EXE_trajectory-worker");

/// The `trajectory-executor` cargo builds beside the worker binary (the workspace's tests build
/// it), with Landlock where the kernel has it.
pub fn sandbox() -> Sandbox {
    local_sandbox(LandlockMode::Auto)
}

/// A local sandbox (an executor a command), with the executor built.
pub fn local_sandbox(landlock: LandlockMode) -> Sandbox {
    trajectory_testkit::executor::built();
    Sandbox::local(landlock)
}

/// The tool context of a conversation working in `workspace` (which must exist), with default
/// limits and the sandbox above.
pub fn tool_context(workspace: &Path) -> ToolContext {
    ToolContext {
        workspace: Workspace::new(workspace).expect("the workspace exists"),
        limits: ToolLimits::default(),
        sandbox: sandbox(),
        browser: ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    }
}

/// Options of a `local` run of `fixture`'s run file, with line progress and the sandbox above.
pub fn local_options(fixture: &RunFixture) -> LocalOptions {
    LocalOptions {
        run_file: fixture.run_file(),
        storage: None,
        bucket: trajectory_worker::storage::BucketOptions::default(),
        base_url: None,
        oracle: false,
        workspace_root: fixture.workspaces(),
        sandbox: sandbox(),
        path_dropped: Vec::new(),
        progress: ProgressMode::Lines,
    }
}

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
        // The run's conversations run their tools under it.
        trajectory_testkit::executor::built();
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

    /// The shipped quickstart (`examples/quickstart/run.yaml` and its dataset) as a fixture:
    /// its spec as it is but for the model's URL and where the dataset and outputs live.
    pub fn quickstart(base_url: &str) -> Self {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart");
        let dataset = std::fs::read_to_string(examples.join("datasets/quickstart.jsonl"))
            .expect("the quickstart's dataset");
        let lines: Vec<String> = dataset.lines().map(str::to_owned).collect();
        let run: Value = serde_yaml::from_str(
            &std::fs::read_to_string(examples.join("run.yaml")).expect("the quickstart's run file"),
        )
        .expect("the quickstart's run file is YAML");
        let mut fixture = Self::with_lines(base_url, &lines);
        fixture.spec = run["spec"].clone();
        fixture.spec["model"]["baseUrl"] = json!(base_url);
        fixture.spec["dataset"]["path"] = json!("datasets/prompts.jsonl");
        fixture.spec["storage"] = json!({"outputPath": "out"});
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
        write_run_file_at(&self.run_file(), &self.spec);
    }

    /// A second run file `name` of the same run (same output), with one field changed: an
    /// operational one such as `/concurrency`, for a process that runs the run differently.
    pub fn variant_run_file(&self, name: &str, pointer: &str, value: Value) -> PathBuf {
        let (parent, key) = pointer.rsplit_once('/').expect("a JSON pointer with a key");
        let mut spec = self.spec.clone();
        spec.pointer_mut(parent).expect("parent exists")[key] = value;
        let path = self.dir.path().join(name);
        write_run_file_at(&path, &spec);
        path
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
            store: trajectory_worker::storage::Store::Volume,
            plan: run_file.to_plan(),
        }
    }

    pub fn engine(&self) -> Engine {
        let mut engine =
            Engine::new(&self.location().plan.spec, self.workspaces()).expect("engine");
        engine.sandbox = sandbox();
        engine
    }

    /// [`Self::engine`] with retries 10 ms apart (the spec's backoff starts at a second).
    pub fn engine_with_fast_retries(&self) -> Engine {
        let spec = self.location().plan.spec;
        let mut settings = ModelSettings::from_spec(&spec.model, None).expect("model settings");
        settings.retry.base_delay = Duration::from_millis(10);
        settings.retry.max_delay = Duration::from_millis(200);
        let client = ModelClient::new(settings).expect("client");
        let mut engine = Engine::with_client(&spec, self.workspaces(), client).expect("engine");
        engine.sandbox = sandbox();
        engine
    }

    /// Every records file of `batch`, as resume and merge find them.
    pub fn records_files(&self, batch: u32) -> Vec<RecordsFile> {
        self.location()
            .run_dir()
            .records_files(batch)
            .expect("the batch's files can be listed")
    }

    /// The JSON lines of every records file of `batch`, one file after another; a line that does
    /// not parse (a torn tail too) fails the test. Duplicates across writers are all returned.
    pub fn batch_lines(&self, batch: u32) -> Vec<Value> {
        self.records_files(batch)
            .iter()
            .flat_map(|file| parse_lines(&file.records))
            .collect()
    }

    /// The JSON lines of every `OpenAI`-form file of `batch`, in the order of [`Self::batch_lines`].
    pub fn batch_openai_lines(&self, batch: u32) -> Vec<Value> {
        self.records_files(batch)
            .iter()
            .flat_map(|file| parse_lines(&file.openai))
            .collect()
    }

    /// The JSON lines of an output file.
    pub fn lines(&self, name: &str) -> Vec<Value> {
        parse_lines(&self.out().join(name))
    }
}

/// Writes the fixture's run file, with `spec`, at `path`.
fn write_run_file_at(path: &Path, spec: &Value) {
    let file = json!({
        "apiVersion": "trajectories.dev/v1alpha1",
        "kind": "TrajectoryRun",
        "metadata": {"name": "fixture"},
        "spec": spec,
    });
    std::fs::write(path, serde_yaml::to_string(&file).unwrap()).unwrap();
}

/// The JSON lines of a file (none when it does not exist); a line that does not parse fails the
/// test.
pub fn parse_lines(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|err| panic!("bad line {line:?}: {err}"))
        })
        .collect()
}

/// Checks that every complete line of every records file of `batch` parses; a torn tail is
/// allowed only where a kill may have left one (readers skip it). Returns the number of whole
/// lines.
pub fn assert_batch_whole_lines(
    fixture: &RunFixture,
    batch: u32,
    torn_tail_allowed: bool,
) -> usize {
    fixture
        .records_files(batch)
        .iter()
        .map(|file| assert_whole_lines(&file.records, torn_tail_allowed))
        .sum()
}

/// Checks that every complete line of `path` parses; a torn tail is allowed only where a kill may
/// have left one. Returns the number of whole lines.
pub fn assert_whole_lines(path: &Path, torn_tail_allowed: bool) -> usize {
    let data = std::fs::read(path).unwrap_or_default();
    let ends_whole = data.is_empty() || data.ends_with(b"\n");
    assert!(
        torn_tail_allowed || ends_whole,
        "{} ends with a torn line",
        path.display()
    );
    let whole = match data.iter().rposition(|&b| b == b'\n') {
        Some(end) => &data[..end],
        None => return 0,
    };
    let mut count = 0;
    for line in whole.split(|&b| b == b'\n') {
        serde_json::from_slice::<Value>(line)
            .unwrap_or_else(|err| panic!("{}: bad line: {err}", path.display()));
        count += 1;
    }
    count
}

/// The worker binary on the fixture's storage, with run file `run_file`, its termination message
/// at `termination_log`.
pub fn worker_command(
    fixture: &RunFixture,
    run_file: &Path,
    termination_log: &Path,
    args: &[&str],
) -> Command {
    let mut command = Command::new(WORKER);
    command
        .args(args)
        .arg("--run-file")
        .arg(run_file)
        .arg("--storage-root")
        .arg(fixture.root())
        .env("TRAJ_TERMINATION_LOG", termination_log)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // Only `batch` runs conversations and so takes a workspace root.
    if args[0] == "batch" {
        command.arg("--workspace-root").arg(fixture.workspaces());
    }
    command
}

/// A step of the run (`plan`, `batch 0`, `merge`) on `prefix` of the bucket `trajectories` of
/// `server`, reached at `endpoint` (the server's own, or a proxy's), as a pod runs it: its
/// termination message at `<fixture>/termination-log-<name>`, its stderr piped.
pub fn spawn_on_bucket(
    fixture: &RunFixture,
    (server, endpoint): (&trajectory_testkit::versitygw::Versitygw, &str),
    prefix: &str,
    name: &str,
    args: &[&str],
) -> std::process::Child {
    let mut command = Command::new(WORKER);
    command
        .args(args)
        .arg("--run-file")
        .arg(fixture.run_file())
        .args(["--storage-root", &format!("s3://trajectories/{prefix}")])
        .args(["--s3-endpoint", endpoint, "--s3-path-style"]);
    // Only `batch` runs conversations and so takes a workspace root.
    if args[0] == "batch" {
        command.arg("--workspace-root").arg(fixture.workspaces());
    }
    command
        .envs(server.credentials())
        .env(
            "TRAJ_TERMINATION_LOG",
            fixture.root().join(format!("termination-log-{name}")),
        )
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the worker binary starts")
}

/// Starts the worker binary on the fixture, its termination message in `<dir>/termination-log`.
pub fn spawn_worker(fixture: &RunFixture, args: &[&str]) -> std::process::Child {
    worker_command(
        fixture,
        &fixture.run_file(),
        &fixture.root().join("termination-log"),
        args,
    )
    .spawn()
    .expect("the worker binary starts")
}

/// Runs the worker binary on the fixture to its end; its stderr is shown when it fails.
pub async fn worker(fixture: &RunFixture, args: &[&str]) -> std::process::ExitStatus {
    let output = wait(spawn_worker(fixture, args)).await;
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    }
    output.status
}

/// Waits for a child process without blocking the runtime that serves its model.
pub async fn wait(child: std::process::Child) -> std::process::Output {
    tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap()
}

/// Sends `signal` to the child after `delay`, then waits for it.
pub async fn signal_after(
    child: std::process::Child,
    delay: Duration,
    signal: Signal,
) -> std::process::Output {
    tokio::time::sleep(delay).await;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, signal).unwrap();
    wait(child).await
}

/// Runs `batch 0` of the fixture in the worker binary and `SIGKILL`s it after each of
/// `delays` until one run finishes (successfully, or the test fails), checking after each kill
/// that the batch's files hold whole lines only. Returns the number of kills; fails the test when
/// the batch has not finished within `within`.
pub async fn kill_batch_until_done(
    fixture: &RunFixture,
    mut delays: impl Iterator<Item = Duration>,
    within: Duration,
) -> u32 {
    let (mut kills, started) = (0, std::time::Instant::now());
    loop {
        let mut child = spawn_worker(fixture, &["batch", "0"]);
        tokio::time::sleep(delays.next().expect("a delay for every attempt")).await;
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "batch exited with {status}");
            return kills;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
        assert!(started.elapsed() < within, "the batch never finished");
        assert_batch_whole_lines(fixture, 0, true);
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

/// The image of a chat request: its MIME type and decoded bytes.
pub fn sent_image(request: &ReceivedRequest) -> (String, Vec<u8>) {
    let part = &request.body["messages"][0]["content"][1];
    assert_eq!(part["type"], "image_url", "{part}");
    let url = part["image_url"]["url"].as_str().expect("a data URL");
    let (head, data) = url.split_once(";base64,").expect("a base64 data URL");
    let mime = head.strip_prefix("data:").expect("a data URL").to_owned();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("valid base64");
    (mime, bytes)
}

#[allow(
    unused_imports,
    reason = "each test binary compiles this module; not all of them read tool responses"
)]
pub use trajectory_testkit::long_conversation::tool_responses;

/// A `trajectory-executor serve` of a test's own, as in a generation pod's sandbox container:
/// `root` is its workspace root; its socket and its sessions' directories are in a temporary
/// directory of its own. Killed when dropped.
pub struct SandboxServer {
    process: std::process::Child,
    dir: tempfile::TempDir,
}

impl SandboxServer {
    pub fn start(root: &Path) -> Self {
        Self::start_with(root, &[])
    }

    /// As in a container of a task image: its files are readable (`--image-readable`).
    pub fn start_in_task_image(root: &Path) -> Self {
        Self::start_with(root, &["--image-readable"])
    }

    fn start_with(root: &Path, flags: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sessions")).unwrap();
        let mut command = Self::command(&dir);
        command
            .arg("--workspace-root")
            .arg(root)
            .arg("--session-root")
            .arg(dir.path().join("sessions"))
            .args(flags)
            .env_clear();
        Self::spawn(dir, &mut command)
    }

    /// As a task container's (`serve --task`): started in `start_dir` (the image's working
    /// directory) with the environment `env` (the image's).
    pub fn start_task_container(start_dir: &Path, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut command = Self::command(&dir);
        command
            .arg("--task")
            .current_dir(start_dir)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .envs(env.iter().copied());
        Self::spawn(dir, &mut command)
    }

    /// `trajectory-executor serve` listening in `dir`, before its other flags.
    fn command(dir: &tempfile::TempDir) -> Command {
        trajectory_testkit::executor::built();
        let mut command = Command::new(trajectory_worker::tools::sandbox::find_executor());
        command
            .args(["serve", "--socket"])
            .arg(dir.path().join("executor.sock"));
        command
    }

    /// Starts `command` and waits until it listens in `dir`.
    fn spawn(dir: tempfile::TempDir, command: &mut Command) -> Self {
        let server = Self {
            process: command
                .spawn()
                .expect("starting trajectory-executor serve (built with the workspace's tests)"),
            dir,
        };
        // As the worker's start-up probe does: requests go out once the server listens.
        // (A connection that sends nothing is refused by the server as a bad request.)
        let listening = std::time::Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(server.socket()).is_err() {
            assert!(
                std::time::Instant::now() < listening,
                "trajectory-executor serve did not listen"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        server
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("executor.sock")
    }

    /// Where the sessions' private directories are made.
    pub fn sessions(&self) -> PathBuf {
        self.dir.path().join("sessions")
    }

    /// A sandbox that sends everything to this server.
    pub fn sandbox(&self, landlock: LandlockMode) -> Sandbox {
        Sandbox::pod(self.socket(), landlock)
    }
}

impl Drop for SandboxServer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Every process whose environment has a variable `var` for which `matches` holds, with its
/// pid and command line (arguments joined by spaces).
pub fn processes_with_env(matches: impl Fn(&[u8]) -> bool) -> Vec<(i32, String)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<i32>().ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            if !environ.split(|&byte| byte == 0).any(&matches) {
                return None;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            Some((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")))
        })
        .collect()
}

/// A model that answers each task with the terminal calls `calls` names for it, then a final
/// answer.
pub fn scripted_model(calls: fn(&str) -> Vec<(&'static str, Value)>) -> impl Fn(&Value) -> Step {
    move |body| {
        let answered = body["messages"].as_array().is_some_and(|messages| {
            messages
                .iter()
                .any(|message| message["role"] == "assistant")
        });
        if answered {
            return Step::ok(text_reply("done"));
        }
        let calls: Vec<(&str, Value)> = calls(first_user_message(body))
            .into_iter()
            .map(|(name, arguments)| (name, Value::String(arguments.to_string())))
            .collect();
        Step::ok(tool_calls_reply(&calls))
    }
}

pub fn terminal(command: &str) -> (&'static str, Value) {
    ("terminal", json!({"command": command}))
}

/// Three tool calls, then an answer: four turns a conversation.
pub fn four_turns(body: &Value) -> Step {
    let turns = body["messages"].as_array().map_or(0, |messages| {
        messages.iter().filter(|m| m["role"] == "assistant").count()
    });
    if turns < 3 {
        let (name, arguments) = terminal("true");
        Step::ok(tool_calls_reply(&[(
            name,
            Value::String(arguments.to_string()),
        )]))
    } else {
        Step::ok(text_reply("done"))
    }
}

/// A scripted server answering `four_turns`, and when each request reached it.
pub async fn recording_four_turns() -> (
    ScriptedServer,
    std::sync::Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
) {
    let arrivals: std::sync::Arc<std::sync::Mutex<Vec<std::time::Instant>>> =
        std::sync::Arc::default();
    let seen = std::sync::Arc::clone(&arrivals);
    let server = ScriptedServer::start_responding(move |body| {
        seen.lock().unwrap().push(std::time::Instant::now());
        four_turns(body)
    })
    .await;
    (server, arrivals)
}

/// Asserts that no `window`s of `arrivals` (sorted) hold more requests than a limit of 600 a
/// minute lets through (`spec.model.limits`: a burst of 30, then 570 a minute), for windows of
/// each of `seconds`.
pub fn assert_within_600_a_minute(arrivals: &[std::time::Instant], seconds: &[usize]) {
    for &seconds in seconds {
        let window = std::time::Duration::from_secs(seconds as u64);
        let most = arrivals
            .iter()
            .map(|start| {
                arrivals
                    .iter()
                    .filter(|at| **at >= *start && **at < *start + window)
                    .count()
            })
            .max()
            .unwrap_or(0);
        let allowed = 30 + (seconds * 570).div_ceil(60) + 1;
        assert!(
            most <= allowed,
            "{most} requests within {seconds} s, more than the {allowed} a limit of 600 a minute \
             lets through"
        );
    }
}

/// The real model server's base URL (`MODEL_BASE_URL`, which `scripts/test.sh` exports); a test
/// that needs it fails saying how to start it.
pub fn model_server() -> String {
    std::env::var("MODEL_BASE_URL").unwrap_or_else(|_| {
        panic!(
            "MODEL_BASE_URL is not set: this test needs the real llama.cpp model server. Start it with \
             `scripts/model-server/start.sh && source /tmp/trajectory-model-server/env`, or run the whole \
             suite with `scripts/test.sh`"
        )
    })
}

/// The model the real model server serves (`MODEL_NAME`).
pub fn model_name() -> String {
    std::env::var("MODEL_NAME").unwrap_or_else(|_| "smollm2-135m-instruct-q4_1".to_owned())
}

/// The turn log's lines of batch 0, over every writer.
pub fn logged_turns(fixture: &RunFixture) -> usize {
    let dir = fixture.out().join("batches/batch-000000");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .ends_with(".turns.jsonl")
        })
        .map(|entry| assert_whole_lines(&entry.path(), true))
        .sum()
}

/// The example Harbor task directories (`examples/harbor-tasks`).
pub fn harbor_examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/harbor-tasks")
}

/// Copies the directory `from` to `to`, modes kept.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

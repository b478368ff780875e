//! The terminal tool end to end: each command runs under the real executor (`trajectory-executor`),
//! so these are tests of the sandboxed path the worker takes. The escape attempts are in
//! `sandbox_probes.rs`.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::SandboxServer;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde_json::{Value, json};
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::sandbox::{LandlockMode, Limits, Sandbox};
use trajectory_worker::tools::{Tool, ToolContext, ToolLimits, ToolOutcome, Workspace, terminal};

/// Where a test's commands run: under an executor the test starts for each command, as in a local
/// run, or sent to a `trajectory-executor serve` of the test's own, as in a generation pod.
#[derive(Debug, Clone, Copy)]
enum Where {
    Local,
    Pod,
}

/// Every test below runs in both places.
macro_rules! in_both_places {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test]
                async fn local() {
                    super::$name(super::Where::Local).await;
                }
                #[tokio::test]
                async fn pod() {
                    super::$name(super::Where::Pod).await;
                }
            }
        )*
    };
}

/// A tool context, and the sandbox server it uses (stopped with it).
struct TestContext {
    context: ToolContext,
    _server: Option<SandboxServer>,
}

impl std::ops::Deref for TestContext {
    type Target = ToolContext;
    fn deref(&self) -> &ToolContext {
        &self.context
    }
}

fn context(place: Where, dir: &Path, limits: ToolLimits) -> TestContext {
    let (sandbox, server) = match place {
        Where::Local => (Sandbox::local(LandlockMode::Auto), None),
        Where::Pod => {
            let server = SandboxServer::start(dir);
            (server.sandbox(LandlockMode::Auto), Some(server))
        }
    };
    TestContext {
        context: ToolContext {
            workspace: Workspace::new(dir).unwrap(),
            limits,
            sandbox,
            browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
        },
        _server: server,
    }
}

fn tool() -> Arc<dyn Tool> {
    terminal::tools(&ToolsSpec::default()).remove(0)
}

async fn call(ctx: &ToolContext, args: Value) -> ToolOutcome {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    tool().call(args, ctx).await
}

fn ok(outcome: ToolOutcome) -> Value {
    match outcome {
        ToolOutcome::Ok(value) => value,
        ToolOutcome::Err(message) => panic!("expected success, got error: {message}"),
    }
}

/// Whether a process has finished (gone, or a zombie waiting for a reaper that may not exist
/// in a container without an init).
fn process_is_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

async fn assert_process_gone(pid: i32) {
    assert_process_gone_within(pid, Duration::from_secs(2)).await;
}

async fn assert_process_gone_within(pid: i32, time: Duration) {
    let until = std::time::Instant::now() + time;
    while std::time::Instant::now() < until {
        if process_is_gone(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Do not leave the stray process behind if the assertion fails.
    let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
    panic!("process {pid} is still running after {time:?}");
}

fn read_pid(dir: &Path) -> i32 {
    read_pid_file(&dir.join("pid"))
}

fn read_pid_file(file: &Path) -> i32 {
    std::fs::read_to_string(file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .parse()
        .unwrap()
}

async fn command_output_and_exit_code_are_returned(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(
        &ctx,
        json!({"command": "echo out; echo err >&2; echo again"}),
    )
    .await);
    assert_eq!(
        result,
        json!({"output": "out\nerr\nagain\n", "exit_code": 0, "error": null})
    );
}

async fn non_zero_exit_code_is_a_result_not_an_error(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let outcome = call(&ctx, json!({"command": "echo failing; exit 3"})).await;
    assert_eq!(
        outcome,
        ToolOutcome::Ok(json!({"output": "failing\n", "exit_code": 3, "error": null}))
    );
    assert_eq!(
        outcome.into_content(),
        r#"{"output":"failing\n","exit_code":3,"error":null}"#
    );
}

async fn command_killed_by_a_signal_reports_128_plus_the_signal(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(&ctx, json!({"command": "kill -9 $$"})).await);
    assert_eq!(result["exit_code"], 137);
}

async fn command_runs_in_the_workspace_with_home_there_and_a_dumb_terminal(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(
        &ctx,
        json!({"command": "pwd; echo $HOME; echo $TERM; touch made"}),
    )
    .await);
    let root = ctx.workspace.root().display();
    assert_eq!(result["output"], format!("{root}\n{root}\ndumb\n"));
    assert!(dir.path().join("made").exists());
}

async fn worker_environment_is_not_passed_to_commands(place: Where) {
    // Cargo sets these for the test process, standing in for the worker's secrets.
    assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(&ctx, json!({"command": "env"})).await);
    let output = result["output"].as_str().unwrap();
    assert!(!output.contains("CARGO_PKG_NAME"), "{output}");
    assert!(output.contains("PATH="), "{output}");
}

async fn stdin_is_empty(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(&ctx, json!({"command": "cat; echo done"})).await);
    assert_eq!(result["output"], "done\n");
}

async fn timeout_kills_the_whole_process_group(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let limits = ToolLimits {
        command_timeout: Duration::from_secs(1),
        ..ToolLimits::default()
    };
    let ctx = context(place, dir.path(), limits);
    let started = std::time::Instant::now();
    let result = ok(call(
        &ctx,
        json!({"command": "echo started; sleep 30 & echo $! > pid; wait"}),
    )
    .await);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        result,
        json!({"output": "started\n", "exit_code": null, "error": "command timed out after 1s"})
    );
    assert_process_gone(read_pid(dir.path())).await;
}

async fn requested_timeout_is_capped_by_the_limit(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let limits = ToolLimits {
        command_timeout: Duration::from_secs(1),
        ..ToolLimits::default()
    };
    let ctx = context(place, dir.path(), limits);
    let result = ok(call(&ctx, json!({"command": "sleep 30", "timeout": 1000})).await);
    assert_eq!(result["error"], "command timed out after 1s");
}

async fn shorter_requested_timeout_is_honoured(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let started = std::time::Instant::now();
    let result = ok(call(&ctx, json!({"command": "sleep 30", "timeout": "1"})).await);
    assert_eq!(result["error"], "command timed out after 1s");
    assert!(started.elapsed() < Duration::from_secs(10));
}

async fn dropping_the_call_kills_the_process_group(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let tool = tool();
    let Value::Object(args) = json!({"command": "sleep 30 & echo $! > pid; wait"}) else {
        unreachable!()
    };
    let call = tool.call(args, &ctx);
    let pid_file = dir.path().join("pid");
    let cancelled = tokio::time::timeout(Duration::from_secs(5), async {
        tokio::select! {
            _ = call => panic!("the command should still be running"),
            () = async {
                while std::fs::read_to_string(&pid_file).map_or(true, |text| !text.ends_with('\n')) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            } => {}
        }
    })
    .await;
    assert!(cancelled.is_ok(), "the pid file never appeared");
    assert_process_gone(read_pid(dir.path())).await;
}

async fn background_process_does_not_outlive_the_command(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let started = std::time::Instant::now();
    let result = ok(call(
        &ctx,
        json!({"command": "sleep 30 & echo $! > pid; echo bye"}),
    )
    .await);
    assert_eq!(
        result,
        json!({"output": "bye\n", "exit_code": 0, "error": null})
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_process_gone(read_pid(dir.path())).await;
}

/// A command that kills its own executor (the OOM killer's `SIGKILL`, or the command itself: they
/// share a uid and a Landlock domain) leaves nothing running in a pod: the server, the executor's
/// reaper, kills the orphans — a `setsid` one, and a subshell with a child of its own — as they
/// are re-parented to it. (Not yet locally, where they would go to the worker's reaper.)
#[tokio::test]
async fn a_command_that_kills_its_executor_leaves_nothing_running_in_a_pod() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(Where::Pod, dir.path(), ToolLimits::default());
    let started = std::time::Instant::now();
    let result = ok(call(
        &ctx,
        json!({"command": "setsid sleep 30 >/dev/null 2>&1 & echo $! > pid; \
                           (sleep 30 & echo $! > pid2; wait) >/dev/null 2>&1 & echo $! > pid3; \
                           sleep 0.2; kill -9 $PPID; sleep 30"}),
    )
    .await);
    assert_eq!(
        result["exit_code"], 137,
        "the executor was killed: {result}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{result}");
    for file in ["pid", "pid2", "pid3"] {
        assert_process_gone(read_pid_file(&dir.path().join(file))).await;
    }
}

/// A command that stops its executor (`SIGSTOP`, which a stopped process cannot catch) is still
/// ended when the worker hangs up on a timeout: the server continues and then kills the executor,
/// and its orphans with it.
#[tokio::test]
async fn a_command_that_stops_its_executor_is_ended_on_its_timeout_in_a_pod() {
    let dir = tempfile::tempdir().unwrap();
    let limits = ToolLimits {
        command_timeout: Duration::from_secs(1),
        ..ToolLimits::default()
    };
    let ctx = context(Where::Pod, dir.path(), limits);
    let result = ok(call(
        &ctx,
        json!({"command": "sleep 30 >/dev/null 2>&1 & echo $! > pid; \
                           while kill -STOP $PPID; do sleep 0.01; done"}),
    )
    .await);
    assert_eq!(result["error"], "command timed out after 1s", "{result}");
    // The server's grace for the executor, and some.
    assert_process_gone_within(read_pid(dir.path()), Duration::from_secs(5)).await;
}

async fn large_output_keeps_head_and_tail_within_the_cap(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let limits = ToolLimits {
        max_output_bytes: 100,
        ..ToolLimits::default()
    };
    let ctx = context(place, dir.path(), limits);
    // Far more than a pipe buffer holds: the command must not block on a full pipe.
    let result = ok(call(&ctx, json!({"command": "seq 1 200000"})).await);
    assert_eq!(result["exit_code"], 0);
    let output = result["output"].as_str().unwrap();
    assert!(output.starts_with("1\n2\n3\n"), "{output}");
    assert!(output.ends_with("199999\n200000\n"), "{output}");
    let total: usize = (1..=200_000).map(|n: u32| n.to_string().len() + 1).sum();
    assert!(output.contains(&format!("\n... [{} bytes elided] ...\n", total - 100)));
    assert!(output.len() < 200);
}

async fn missing_or_empty_command_is_an_error(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    assert_eq!(
        call(&ctx, json!({})).await,
        ToolOutcome::Err("missing required argument `command`".to_owned())
    );
    assert_eq!(
        call(&ctx, json!({"command": "  "})).await,
        ToolOutcome::Err("argument `command` is empty".to_owned())
    );
    assert!(matches!(
        call(&ctx, json!({"command": "true", "timeout": "soon"})).await,
        ToolOutcome::Err(message) if message.contains("timeout")
    ));
}

/// Small limits, so that the offenders below stay cheap on a shared test machine.
const TEST_LIMITS: Limits = Limits {
    processes: 64,
    memory_bytes: 256 << 20,
    workspace_bytes: 64 << 20,
};

/// Two conversations of one worker (one executor server, in a pod), side by side under
/// [`TEST_LIMITS`]: one runs an offending command, the other ordinary work at the same time.
struct Neighbours {
    offender: ToolContext,
    neighbour: ToolContext,
    _server: Option<SandboxServer>,
    _root: tempfile::TempDir,
}

impl Neighbours {
    fn new(place: Where) -> Self {
        let root = tempfile::tempdir().unwrap();
        let (sandbox, server) = match place {
            Where::Local => (Sandbox::local(LandlockMode::Auto), None),
            Where::Pod => {
                let server = SandboxServer::start(root.path());
                (server.sandbox(LandlockMode::Auto), Some(server))
            }
        };
        let sandbox = sandbox.with_limits(TEST_LIMITS);
        let conversation = |name: &str| {
            let dir = root.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            ToolContext {
                workspace: Workspace::new(&dir).unwrap(),
                // The safety net: whatever the executor does, the command ends within a minute.
                limits: ToolLimits {
                    command_timeout: Duration::from_secs(60),
                    ..ToolLimits::default()
                },
                sandbox: sandbox.clone(),
                browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
            }
        };
        Self {
            offender: conversation("offender"),
            neighbour: conversation("neighbour"),
            _server: server,
            _root: root,
        }
    }

    /// Runs `offending` in one conversation while the other forks, writes and sleeps for about
    /// two seconds. The neighbour must finish as if alone, the offender be stopped [`QUICKLY`]
    /// with an error that starts with `reason`, and nothing of it be left running. Returns the
    /// offender's error.
    async fn run(&self, offending: &str, reason: &str) -> String {
        let neighbour_work =
            "for i in $(seq 20); do echo $i > n$i; sleep 0.1; done; cat n* | wc -l; echo done";
        let started = std::time::Instant::now();
        let (offended, neighbour) = tokio::join!(
            async {
                let outcome = call(&self.offender, json!({"command": offending})).await;
                (outcome, started.elapsed())
            },
            call(&self.neighbour, json!({"command": neighbour_work})),
        );
        let neighbour = ok(neighbour);
        assert_eq!(
            neighbour,
            json!({"output": "20\ndone\n", "exit_code": 0, "error": null})
        );
        let (outcome, took) = offended;
        let ToolOutcome::Err(error) = outcome else {
            panic!("the offending command was not stopped: {outcome:?}");
        };
        let left = processes_in(self.offender.workspace.root());
        assert!(left.is_empty(), "processes left running: {left:?}");
        eprintln!("stopped after {took:?}: {error}");
        assert!(error.starts_with(reason), "{error}");
        assert!(took < QUICKLY, "{took:?}");
        error
    }
}

/// Live processes whose working directory is `dir`.
fn processes_in(dir: &Path) -> Vec<String> {
    let dir = dir.canonicalize().unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|entry| std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd == dir))
        .map(|entry| entry.file_name().display().to_string())
        .filter(|pid| pid.parse().is_ok_and(|pid| !process_is_gone(pid)))
        .collect()
}

/// Within seconds even on a loaded two-core machine; the figures are printed.
const QUICKLY: Duration = Duration::from_secs(20);

async fn fork_bomb_is_stopped_at_the_process_limit(place: Where) {
    let neighbours = Neighbours::new(place);
    // A fork bomb bounded, as a safety net, at depth 9 (at most 1,023 shells): it passes the
    // limit of 64 long before.
    let bomb = "f(){ if [ $1 -lt 9 ]; then f $(($1+1)) & f $(($1+1)) & fi; sleep 300; }; f 0";
    neighbours
        .run(
            bomb,
            "the command exceeded the sandbox's process limit (64 processes",
        )
        .await;
}

async fn memory_hog_is_stopped_at_the_memory_limit(place: Where) {
    let neighbours = Neighbours::new(place);
    // Four processes, none of them past the per-process ceiling (twice the limit) before their
    // sum passes the limit: the whole command is what is limited.
    let hog = "echo hogging; for i in 1 2 3 4; do head -c 2G /dev/zero | tail & done; wait";
    let error = neighbours
        .run(
            hog,
            "the command exceeded the sandbox's memory limit (256 MiB",
        )
        .await;
    assert!(
        error.ends_with("Output before it was stopped:\nhogging"),
        "{error}"
    );
}

async fn disk_filler_is_stopped_at_the_workspace_limit(place: Where) {
    let neighbours = Neighbours::new(place);
    let filler = "for i in $(seq 100); do head -c 4M /dev/zero > f$i; done; echo never";
    neighbours
        .run(
            filler,
            "the command exceeded the sandbox's workspace limit (64 MiB",
        )
        .await;
    let written: u64 = std::fs::read_dir(neighbours.offender.workspace.root())
        .unwrap()
        .flatten()
        .map(|file| file.metadata().unwrap().len())
        .sum();
    // Stopped on the way: the limit is passed by what one check interval (at most 100 ms) lets
    // it write, far less than the 400 MiB it was after even on a loaded machine.
    eprintln!("written before the stop: {} MiB", written >> 20);
    assert!(written < 300 << 20, "{written} bytes were written");
}

async fn one_huge_file_stops_at_the_workspace_limit_and_can_be_deleted(place: Where) {
    let neighbours = Neighbours::new(place);
    neighbours
        .run(
            "yes > fill; echo after",
            "the command exceeded the sandbox's workspace limit (64 MiB",
        )
        .await;
    let fill = neighbours.offender.workspace.root().join("fill");
    assert_eq!(std::fs::metadata(&fill).unwrap().len(), (64 << 20) + 1);
    // The workspace is past its limit, but a command that does not grow it runs, so the model
    // can make room.
    let cleaned = ok(call(
        &neighbours.offender,
        json!({"command": "ls; rm fill; echo room"}),
    )
    .await);
    assert_eq!(cleaned["output"], "fill\nroom\n");
    let again = ok(call(
        &neighbours.offender,
        json!({"command": "head -c 1M /dev/zero > f; echo ok"}),
    )
    .await);
    assert_eq!(again["output"], "ok\n");
}

in_both_places!(
    fork_bomb_is_stopped_at_the_process_limit,
    memory_hog_is_stopped_at_the_memory_limit,
    disk_filler_is_stopped_at_the_workspace_limit,
    one_huge_file_stops_at_the_workspace_limit_and_can_be_deleted,
);

in_both_places!(
    command_output_and_exit_code_are_returned,
    non_zero_exit_code_is_a_result_not_an_error,
    command_killed_by_a_signal_reports_128_plus_the_signal,
    command_runs_in_the_workspace_with_home_there_and_a_dumb_terminal,
    worker_environment_is_not_passed_to_commands,
    stdin_is_empty,
    timeout_kills_the_whole_process_group,
    requested_timeout_is_capped_by_the_limit,
    shorter_requested_timeout_is_honoured,
    dropping_the_call_kills_the_process_group,
    background_process_does_not_outlive_the_command,
    large_output_keeps_head_and_tail_within_the_cap,
    missing_or_empty_command_is_an_error,
);

//! The terminal toolset end to end: the conversation's shell and its background jobs run under
//! the real executor (`trajectory-executor`), so these are tests of the sandboxed path the worker
//! takes, locally and through a sandbox server as in a pod. The escape attempts are in
//! `sandbox_probes.rs`, the comparison with the reference's recorded outputs in
//! `terminal_golden.rs`.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::SandboxServer;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde_json::{Value, json};
use trajectory_worker::spec::ToolsSpec;
use trajectory_worker::tools::sandbox::{LandlockMode, Limits};
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
        Where::Local => (common::local_sandbox(LandlockMode::Auto), None),
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
            terminal: trajectory_worker::tools::terminal::Terminal::default(),
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

/// Calls the process tool.
async fn process(ctx: &ToolContext, args: Value) -> Value {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    ok(terminal::tools(&ToolsSpec::default())
        .remove(1)
        .call(args, ctx)
        .await)
}

/// Starts `command` as a background job; its session id.
async fn start_job(ctx: &ToolContext, command: &str) -> String {
    let started = ok(call(ctx, json!({"command": command, "background": true})).await);
    assert_eq!(started["output"], "Background process started", "{started}");
    assert_eq!(started["exit_code"], 0, "{started}");
    assert!(
        started["pid"].as_i64().is_some_and(|pid| pid > 0),
        "{started}"
    );
    started["session_id"].as_str().unwrap().to_owned()
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

/// The pid a background job writes into `file` (`echo $$ > file`), once it is there whole: the
/// shell creates the file before `echo` writes into it, so an empty file is not yet an answer.
async fn written_pid(file: &Path) -> i32 {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(file)
            && let Some(pid) = text.strip_suffix('\n').and_then(|pid| pid.parse().ok())
        {
            return pid;
        }
        assert!(
            std::time::Instant::now() < until,
            "{} holds no pid after 30 s",
            file.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
        json!({"output": "out\nerr\nagain", "exit_code": 0, "error": null})
    );
}

async fn non_zero_exit_code_is_a_result_not_an_error(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let outcome = call(&ctx, json!({"command": "echo failing; exit 3"})).await;
    assert_eq!(
        outcome,
        ToolOutcome::Ok(json!({"output": "failing", "exit_code": 3, "error": null}))
    );
    assert_eq!(
        outcome.into_content(),
        r#"{"output":"failing","exit_code":3,"error":null}"#
    );
    // `exit` ended the shell; the next command gets a new one, and is told so.
    let again = ok(call(&ctx, json!({"command": "echo again"})).await);
    let again = again["output"].as_str().unwrap();
    assert!(
        again.starts_with("[The shell ended in an earlier command"),
        "{again}"
    );
    assert!(again.ends_with("]\nagain"), "{again}");
    let quiet = ok(call(&ctx, json!({"command": "echo quiet"})).await);
    assert_eq!(quiet["output"], "quiet");
}

async fn command_killed_by_a_signal_reports_128_plus_the_signal(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(&ctx, json!({"command": "sleep 30 & kill -9 $!; wait $!"})).await);
    assert_eq!(result["exit_code"], 137);
    // The shell itself killed: the result says so the same way, and the next call has a shell.
    let result = ok(call(&ctx, json!({"command": "kill -9 $$"})).await);
    assert_eq!(result["exit_code"], 137);
    let up = ok(call(&ctx, json!({"command": "echo up"})).await);
    assert!(up["output"].as_str().unwrap().ends_with("]\nup"), "{up}");
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
    assert_eq!(result["output"], format!("{root}\n{root}\ndumb"));
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
    let result = ok(call(&ctx, json!({"command": "cat; read line; echo done $?"})).await);
    assert_eq!(result["output"], "done 1");
}

async fn a_timed_out_command_is_killed_and_the_shell_lives_on(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let limits = ToolLimits {
        command_timeout: Duration::from_secs(1),
        ..ToolLimits::default()
    };
    let ctx = context(place, dir.path(), limits);
    ok(call(
        &ctx,
        json!({"command": "export KEPT=yes; mkdir -p sub; cd sub"}),
    )
    .await);
    let started = std::time::Instant::now();
    let result = ok(call(
        &ctx,
        json!({"command": "echo started; sleep 30 & echo $! > pid; wait"}),
    )
    .await);
    assert!(started.elapsed() < Duration::from_secs(10));
    // The reference's shape: exit code 124, the output so far and a note.
    assert_eq!(
        result,
        json!({"output": "started\n\n[Command timed out after 1s]", "exit_code": 124, "error": null})
    );
    assert_process_gone(read_pid(&dir.path().join("sub"))).await;
    let after = ok(call(&ctx, json!({"command": "echo $KEPT; pwd"})).await);
    let sub = ctx.workspace.root().join("sub");
    assert_eq!(after["output"], format!("yes\n{}", sub.display()));
}

async fn a_shell_stuck_in_a_builtin_loop_is_restarted_in_its_directory(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    ok(call(&ctx, json!({"command": "export GONE=1; mkdir -p d; cd d"})).await);
    let result = ok(call(
        &ctx,
        json!({"command": "echo looping; while :; do :; done", "timeout": 1}),
    )
    .await);
    assert_eq!(result["exit_code"], 124, "{result}");
    let output = result["output"].as_str().unwrap();
    assert!(
        output.starts_with("looping\n\n[Command timed out after 1s]"),
        "{output}"
    );
    assert!(output.contains("restarted"), "{output}");
    let after = ok(call(&ctx, json!({"command": "echo \"[$GONE]\"; pwd"})).await);
    let d = ctx.workspace.root().join("d");
    assert_eq!(after["output"], format!("[]\n{}", d.display()));
}

async fn a_timeout_above_the_foreground_maximum_is_refused(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let outcome = call(&ctx, json!({"command": "sleep 30", "timeout": 601})).await;
    assert_eq!(
        outcome,
        ToolOutcome::Err(
            "Foreground timeout 601s exceeds the maximum of 600s. Use background=true for \
             long-running commands."
                .to_owned()
        )
    );
}

async fn shorter_requested_timeout_is_honoured(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let started = std::time::Instant::now();
    let result = ok(call(&ctx, json!({"command": "sleep 30", "timeout": "1"})).await);
    assert_eq!(result["output"], "[Command timed out after 1s]");
    assert_eq!(result["exit_code"], 124);
    assert!(started.elapsed() < Duration::from_secs(10));
}

async fn closing_the_conversation_ends_everything_it_started(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    // A job left running with `&`, one detached with setsid, and a background job.
    let result = ok(call(
        &ctx,
        json!({"command": "sleep 300 & echo $! > pid; setsid sleep 300 & echo $! > pid2; echo ok"}),
    )
    .await);
    assert_eq!(result["output"], "ok");
    start_job(&ctx, "echo $$ > pid3; exec sleep 300").await;
    written_pid(&dir.path().join("pid3")).await;
    for file in ["pid", "pid2", "pid3"] {
        assert!(
            !process_is_gone(read_pid_file(&dir.path().join(file))),
            "{file}"
        );
    }
    let closing = std::time::Instant::now();
    ctx.close().await;
    // Gone when close returns, not eventually: the workspace may be handed on right away.
    for file in ["pid", "pid2", "pid3"] {
        let pid = read_pid_file(&dir.path().join(file));
        assert!(process_is_gone(pid), "{file}: {pid} still runs after close");
    }
    assert!(processes_in(dir.path()).is_empty());
    assert!(closing.elapsed() < Duration::from_secs(10));
}

async fn dropping_the_conversation_ends_everything_it_started(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    ok(call(&ctx, json!({"command": "sleep 300 & echo $! > pid"})).await);
    start_job(&ctx, "echo $$ > pid2; exec sleep 300").await;
    let job = written_pid(&dir.path().join("pid2")).await;
    drop(ctx);
    assert_process_gone_within(read_pid(dir.path()), Duration::from_secs(5)).await;
    assert_process_gone_within(job, Duration::from_secs(5)).await;
}

async fn a_job_left_running_with_an_ampersand_lives_until_the_conversation_ends(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let result = ok(call(
        &ctx,
        json!({"command": "sleep 300 & echo $! > pid; echo bye"}),
    )
    .await);
    assert_eq!(
        result,
        json!({"output": "bye", "exit_code": 0, "error": null})
    );
    let pid = read_pid(dir.path());
    ok(call(&ctx, json!({"command": "true"})).await);
    assert!(!process_is_gone(pid), "the job ended with its command");
    ctx.close().await;
    assert!(process_is_gone(pid));
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
    let outcome = call(
        &ctx,
        json!({"command": "setsid sleep 30 >/dev/null 2>&1 & echo $! > pid; \
                           (sleep 30 & echo $! > pid2; wait) >/dev/null 2>&1 & echo $! > pid3; \
                           sleep 0.2; kill -9 $PPID; sleep 30"}),
    )
    .await;
    // The executor held the connection: its death is the sandbox hanging up.
    let ToolOutcome::Err(result) = outcome else {
        panic!("the executor's death was not reported: {outcome:?}");
    };
    assert!(result.contains("closed the connection"), "{result}");
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
    assert_eq!(result["exit_code"], 124, "{result}");
    assert!(
        result["output"].as_str().unwrap().contains("restarted"),
        "{result}"
    );
    // The server's grace for the executor, and some.
    assert_process_gone_within(read_pid(dir.path()), Duration::from_secs(5)).await;
}

async fn large_output_keeps_head_and_tail_within_the_cap(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let limits = ToolLimits {
        max_output_bytes: 200,
        ..ToolLimits::default()
    };
    let ctx = context(place, dir.path(), limits);
    // Far more than a pipe buffer holds: the command must not block on a full pipe.
    let result = ok(call(&ctx, json!({"command": "seq 1 200000"})).await);
    assert_eq!(result["exit_code"], 0);
    let output = result["output"].as_str().unwrap();
    assert!(output.starts_with("1\n2\n3\n"), "{output}");
    assert!(output.ends_with("199999\n200000"), "{output}");
    let total: usize = (1..=200_000).map(|n: u32| n.to_string().len() + 1).sum();
    assert!(
        output.contains(&format!(
            " chars omitted out of {} total] ...\n\n",
            group(total)
        )),
        "{output}"
    );
    assert!(output.len() <= 200, "{}", output.len());
}

/// `1234567` as `1,234,567`.
fn group(number: usize) -> String {
    let digits = number.to_string();
    let mut grouped = String::new();
    for (at, digit) in digits.chars().enumerate() {
        if at > 0 && (digits.len() - at).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    grouped
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

async fn cd_export_and_workdir_persist_between_calls(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let root = ctx.workspace.root().to_owned();
    let made = ok(call(
        &ctx,
        json!({"command": "mkdir -p sub/deeper && cd sub && export PROBE_VAR=kept && f() { echo fn; }"}),
    )
    .await);
    assert_eq!(made, json!({"output": "", "exit_code": 0, "error": null}));
    let seen = ok(call(&ctx, json!({"command": "pwd; echo VAR=$PROBE_VAR; f"})).await);
    assert_eq!(
        seen["output"],
        format!("{}\nVAR=kept\nfn", root.join("sub").display())
    );
    // `workdir` is where this command runs, and (as the reference's) where the next ones do.
    let deeper = root.join("sub/deeper");
    let moved = ok(call(
        &ctx,
        json!({"command": "pwd", "workdir": deeper.display().to_string()}),
    )
    .await);
    assert_eq!(moved["output"], deeper.display().to_string());
    let stays = ok(call(&ctx, json!({"command": "pwd"})).await);
    assert_eq!(stays["output"], deeper.display().to_string());
    let blocked = ok(call(&ctx, json!({"command": "pwd", "workdir": "/tmp; rm -rf /"})).await);
    assert_eq!(blocked["status"], "blocked");
    assert_eq!(blocked["exit_code"], -1);
}

async fn a_command_that_redirects_the_shell_does_not_silence_the_next(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let hidden = ok(call(&ctx, json!({"command": "exec >log 2>&1; echo hidden"})).await);
    assert_eq!(hidden, json!({"output": "", "exit_code": 0, "error": null}));
    let seen = ok(call(&ctx, json!({"command": "echo seen; cat log"})).await);
    assert_eq!(seen["output"], "seen\nhidden");
}

async fn the_file_tools_follow_the_terminals_directory(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let file_tool = |name: &str| {
        trajectory_worker::tools::file::tools(&ToolsSpec::default())
            .into_iter()
            .find(|tool| tool.spec().name == name)
            .unwrap()
    };
    let file_call = |name: &'static str, args: Value| {
        let tool = file_tool(name);
        let Value::Object(args) = args else {
            unreachable!()
        };
        let ctx = &ctx;
        async move { tool.call(args, ctx).await }
    };
    ok(call(&ctx, json!({"command": "mkdir -p sub && cd sub"})).await);
    ok(file_call("write_file", json!({"path": "rel.txt", "content": "x\n"})).await);
    assert!(dir.path().join("sub/rel.txt").exists());
    let listed = ok(call(
        &ctx,
        json!({"command": "ls rel.txt; cat ../rel.txt 2>&1 | head -c 0"}),
    )
    .await);
    assert_eq!(listed["output"], "rel.txt");
    let read = ok(file_call("read_file", json!({"path": "rel.txt"})).await);
    assert!(read.to_string().contains('x'), "{read}");
    // `..` may climb back to the workspace root, not past it.
    ok(file_call("write_file", json!({"path": "../top.txt", "content": "t"})).await);
    assert!(dir.path().join("top.txt").exists());
    let escaped = file_call("read_file", json!({"path": "../../etc/passwd"})).await;
    assert!(matches!(escaped, ToolOutcome::Err(_)), "{escaped:?}");
    // Where the file tools cannot follow the shell, they say so rather than guess.
    ok(call(&ctx, json!({"command": "cd /"})).await);
    let ToolOutcome::Err(refused) = file_call("read_file", json!({"path": "rel.txt"})).await else {
        panic!("a file tool followed the shell out of the workspace");
    };
    assert!(refused.contains("outside the workspace"), "{refused}");
}

async fn a_server_started_in_the_background_answers_a_later_call(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    std::fs::write(dir.path().join("index.html"), "served from the workspace\n").unwrap();
    let id = start_job(
        &ctx,
        "exec /usr/bin/python3 -u -m http.server 0 --bind 127.0.0.1",
    )
    .await;
    let port = wait_for_output(&ctx, &id, "port ")
        .await
        .split("port ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|port| port.parse::<u16>().ok())
        .expect("the server printed its port");
    let fetched = ok(call(
        &ctx,
        json!({"command": format!("curl -s http://127.0.0.1:{port}/index.html")}),
    )
    .await);
    assert_eq!(fetched["output"], "served from the workspace", "{fetched}");
    let polled = process(&ctx, json!({"action": "poll", "session_id": id})).await;
    assert_eq!(polled["status"], "running", "{polled}");
    // The server logs a request after answering it.
    wait_for_output(&ctx, &id, "GET /index.html").await;
    let log = process(&ctx, json!({"action": "log", "session_id": id})).await;
    assert!(
        log["output"].as_str().unwrap().contains("GET /index.html"),
        "{log}"
    );
    let killed = process(&ctx, json!({"action": "kill", "session_id": id})).await;
    assert_eq!(killed["status"], "killed", "{killed}");
    assert_eq!(killed["termination_source"], "process.kill");
    let after = process(&ctx, json!({"action": "poll", "session_id": id})).await;
    assert_eq!(after["status"], "exited", "{after}");
    assert_eq!(after["exit_code"], -15, "{after}");
    let refused = ok(call(
        &ctx,
        json!({"command": format!("curl -s -m 2 http://127.0.0.1:{port}/ || echo refused")}),
    )
    .await);
    assert_eq!(refused["output"], "refused");
}

/// Polls the job until its output holds `needle`; its output then.
async fn wait_for_output(ctx: &ToolContext, id: &str, needle: &str) -> String {
    for _ in 0..200 {
        let polled = process(ctx, json!({"action": "poll", "session_id": id})).await;
        let preview = polled["output_preview"].as_str().unwrap_or("").to_owned();
        if preview.contains(needle) {
            return preview;
        }
        assert_eq!(polled["status"], "running", "{polled}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{needle:?} never appeared in the job's output");
}

async fn the_process_actions_behave_as_the_references(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    ok(call(
        &ctx,
        json!({"command": "export GREETING=hi; mkdir -p w; cd w"}),
    )
    .await);
    // The job starts where the shell is, with what it exported.
    let id = start_job(&ctx, "echo $GREETING from $(basename $PWD); exec cat").await;
    let wrote = process(
        &ctx,
        json!({"action": "write", "session_id": id, "data": "hello "}),
    )
    .await;
    assert_eq!(wrote, json!({"status": "ok", "bytes_written": 6}));
    let submitted = process(
        &ctx,
        json!({"action": "submit", "session_id": id, "data": "world"}),
    )
    .await;
    assert_eq!(submitted, json!({"status": "ok", "bytes_written": 6}));
    wait_for_output(&ctx, &id, "hello world").await;
    let waited = process(
        &ctx,
        json!({"action": "wait", "session_id": id, "timeout": 1}),
    )
    .await;
    assert_eq!(waited["status"], "timeout", "{waited}");
    assert_eq!(waited["timeout_note"], "Waited 1s, process still running");
    let closed = process(&ctx, json!({"action": "close", "session_id": id})).await;
    assert_eq!(closed, json!({"status": "ok", "message": "stdin closed"}));
    let waited = process(
        &ctx,
        json!({"action": "wait", "session_id": id, "timeout": 999}),
    )
    .await;
    assert_eq!(
        waited,
        json!({
            "status": "exited",
            "command": "echo $GREETING from $(basename $PWD); exec cat",
            "exit_code": 0,
            "completion_reason": "exited",
            "termination_source": "",
            "output": "hi from w\nhello world\n",
            "timeout_note": "Requested wait of 999s was clamped to configured limit of 180s",
        })
    );
    let log = process(
        &ctx,
        json!({"action": "log", "session_id": id, "offset": 1, "limit": 1}),
    )
    .await;
    assert_eq!(log["output"], "hello world");
    assert_eq!(log["total_lines"], 2);
    assert_eq!(log["showing"], "1 lines");
    let late = process(
        &ctx,
        json!({"action": "submit", "session_id": id, "data": "x"}),
    )
    .await;
    assert_eq!(
        late,
        json!({"status": "already_exited", "error": "Process has already finished"})
    );
    let again = process(&ctx, json!({"action": "kill", "session_id": id})).await;
    assert_eq!(again["status"], "already_exited", "{again}");
    assert_eq!(again["exit_code"], 0);
    // A unique prefix of four hex digits names the job too.
    let prefix = &id[..9];
    let polled = process(&ctx, json!({"action": "poll", "session_id": prefix})).await;
    assert_eq!(polled["session_id"], id.as_str(), "{polled}");
    let listed = process(&ctx, json!({"action": "list"})).await;
    let entry = &listed["processes"][0];
    assert_eq!(entry["session_id"], id.as_str(), "{listed}");
    assert_eq!(entry["status"], "exited");
    assert!(entry["cwd"].as_str().unwrap().ends_with("/w"), "{entry}");
    let missing = process(
        &ctx,
        json!({"action": "poll", "session_id": "proc_000000000000"}),
    )
    .await;
    assert_eq!(
        missing,
        json!({"status": "not_found", "error": "No process with ID proc_000000000000"})
    );
    let Value::Object(args) = json!({"action": "poll"}) else {
        unreachable!()
    };
    let process_tool = terminal::tools(&ToolsSpec::default()).remove(1);
    assert_eq!(
        process_tool.call(args, &ctx).await,
        ToolOutcome::Err("session_id is required for poll".to_owned())
    );
}

async fn jobs_are_bounded_and_none_outlives_the_conversation(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(place, dir.path(), ToolLimits::default());
    let mut pids = Vec::new();
    for _ in 0..8 {
        let started = ok(call(
            &ctx,
            json!({"command": "setsid sleep 300 & sleep 300", "background": true}),
        )
        .await);
        pids.push(started["pid"].as_i64().unwrap());
    }
    let ninth = ok(call(&ctx, json!({"command": "sleep 1", "background": true})).await);
    assert_eq!(ninth["exit_code"], -1, "{ninth}");
    assert!(
        ninth["error"].as_str().unwrap().contains("already running"),
        "{ninth}"
    );
    ctx.close().await;
    assert!(
        processes_in(dir.path()).is_empty(),
        "{:?}",
        processes_in(dir.path())
    );
    if matches!(place, Where::Local) {
        for pid in pids {
            assert!(process_is_gone(i32::try_from(pid).unwrap()), "{pid}");
        }
    }
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
            Where::Local => (common::local_sandbox(LandlockMode::Auto), None),
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
                terminal: trajectory_worker::tools::terminal::Terminal::default(),
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
            json!({"output": "20\ndone", "exit_code": 0, "error": null})
        );
        let (outcome, took) = offended;
        let ToolOutcome::Err(error) = outcome else {
            panic!("the offending command was not stopped: {outcome:?}");
        };
        // The stopped command's processes may still be on their way out when the error arrives
        // (the executor sends it, then exits; a hog's pages take a moment to be freed): gone
        // within seconds, not left running.
        let until = std::time::Instant::now() + Duration::from_secs(5);
        let mut left = processes_in(self.offender.workspace.root());
        while !left.is_empty() && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
            left = processes_in(self.offender.workspace.root());
        }
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
    stop_a_fork_bomb(&Neighbours::new(place)).await;
}

/// Nothing is checked while the shell waits for the model; the next command is watched from its
/// first byte as the first was.
async fn a_fork_bomb_after_the_shell_waited_is_stopped(place: Where) {
    let neighbours = Neighbours::new(place);
    let first = ok(call(&neighbours.offender, json!({"command": "echo first"})).await);
    assert_eq!(first["output"], "first");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_a_fork_bomb(&neighbours).await;
}

async fn stop_a_fork_bomb(neighbours: &Neighbours) {
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

/// A shell that waits with a job of its own running (left with `&`) is still watched: the job
/// growing past the memory limit between two calls stops the shell, and the next call is told
/// and runs in a new shell. The next call goes out the moment the job's processes die, while
/// the executor still reaps them and has not yet said why: several rounds, since that moment
/// is short (a call that arrived in it once got the limit's error as if its own command had
/// gone past the limit).
async fn a_job_left_with_an_ampersand_is_watched_while_the_shell_waits(place: Where) {
    const ROUNDS: usize = 6;
    let neighbours = Neighbours::new(place);
    let ctx = &neighbours.offender;
    for round in 0..ROUNDS {
        // The job starts hogging once the test says so, after the call has returned: a fixed
        // delay was once shorter than the call itself on a loaded machine.
        let started = ok(call(
            ctx,
            json!({"command": "(while [ ! -e go ]; do sleep 0.05; done; \
                                head -c 2G /dev/zero | tail) >/dev/null 2>&1 &"}),
        )
        .await);
        assert_eq!(started["exit_code"], 0, "round {round}: {started}");
        std::fs::write(ctx.workspace.root().join("go"), "").unwrap();
        let until = std::time::Instant::now() + QUICKLY;
        while !processes_in(ctx.workspace.root()).is_empty() {
            assert!(
                std::time::Instant::now() < until,
                "round {round}: the job was not stopped while the shell waited"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        std::fs::remove_file(ctx.workspace.root().join("go")).unwrap();
        // The next command runs, in a new shell, and says why the old one is gone.
        let next = ok(call(ctx, json!({"command": "echo next"})).await);
        let next = next["output"].as_str().unwrap();
        assert!(
            next.starts_with(
                "[The shell was stopped after the last call: the command exceeded the sandbox's \
                 memory limit (256 MiB"
            ),
            "round {round}: {next}"
        );
        assert!(next.ends_with("were reset]\nnext"), "round {round}: {next}");
        let again = ok(call(ctx, json!({"command": "echo again"})).await);
        assert_eq!(again["output"], "again", "round {round}");
    }
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
    // Stopped on the way, before the 400 MiB it was after: the limit is passed by what it writes
    // between two checks (100 ms apart, later when the machine is loaded: 300 MiB was once passed
    // while the worker's tests ran beside a build).
    eprintln!("written before the stop: {} MiB", written >> 20);
    assert!(written < 400 << 20, "{written} bytes were written");
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
    // The workspace is past its limit, but a command that does not grow it runs (in a new shell,
    // which it is told), so the model can make room.
    let cleaned = ok(call(
        &neighbours.offender,
        json!({"command": "ls; rm fill; echo room"}),
    )
    .await);
    let cleaned = cleaned["output"].as_str().unwrap();
    assert!(cleaned.starts_with("[The shell ended"), "{cleaned}");
    assert!(cleaned.ends_with("]\nfill\nroom"), "{cleaned}");
    let again = ok(call(
        &neighbours.offender,
        json!({"command": "head -c 1M /dev/zero > f; echo ok"}),
    )
    .await);
    assert_eq!(again["output"], "ok");
}

/// A background job, under an executor of its own, fills the workspace past its limit and is
/// stopped; the workspace stays full. The conversation's shell, started before, blames none of
/// the model's next commands for it: they run, told that the workspace is past its limit, until
/// one makes it grow; once the big file is deleted, commands run as before, with no note.
async fn a_workspace_a_job_filled_can_be_cleaned(place: Where) {
    let neighbours = Neighbours::new(place);
    let ctx = &neighbours.offender;
    let first = ok(call(ctx, json!({"command": "echo started"})).await);
    assert_eq!(first["output"], "started", "{first}");
    let filler = start_job(ctx, "yes > fill").await;
    let waited = process(
        ctx,
        json!({"action": "wait", "session_id": filler, "timeout": 30}),
    )
    .await;
    assert_eq!(waited["termination_source"], "sandbox.limit", "{waited}");
    let fill = ctx.workspace.root().join("fill");
    assert!(std::fs::metadata(&fill).unwrap().len() > 64 << 20);
    let listed = ok(call(ctx, json!({"command": "ls"})).await);
    assert_eq!(listed["exit_code"], 0, "{listed}");
    let listed = listed["output"].as_str().unwrap();
    // The job's file is cut at the limit plus one byte: its size reads as the limit's.
    assert!(
        listed.starts_with(
            "[The workspace is past its limit of 64 MiB: delete files to make room; a command \
             that writes more is stopped]\n"
        ),
        "{listed}"
    );
    assert!(listed.lines().any(|line| line == "fill"), "{listed}");
    let grown = call(ctx, json!({"command": "head -c 1M /dev/zero > more"})).await;
    let ToolOutcome::Err(error) = grown else {
        panic!("a command that grows a full workspace must be stopped: {grown:?}");
    };
    assert!(
        error.starts_with("the command exceeded the sandbox's workspace limit (64 MiB"),
        "{error}"
    );
    let cleaned = ok(call(ctx, json!({"command": "rm fill; echo room"})).await);
    let cleaned = cleaned["output"].as_str().unwrap();
    assert!(cleaned.ends_with("]\nroom"), "{cleaned}");
    assert!(!cleaned.contains("[The workspace"), "{cleaned}");
    assert!(!fill.exists());
    let next = ok(call(ctx, json!({"command": "head -c 1M /dev/zero > f; echo ok"})).await);
    assert_eq!(next["output"], "ok", "{next}");
    assert_eq!(next["exit_code"], 0, "{next}");
}

async fn a_runaway_job_is_stopped_at_its_limit_with_the_reason(place: Where) {
    let neighbours = Neighbours::new(place);
    let ctx = &neighbours.offender;
    let flood = start_job(ctx, "yes flooding").await;
    let bomb = start_job(
        ctx,
        "f(){ if [ $1 -lt 9 ]; then f $(($1+1)) & f $(($1+1)) & fi; sleep 300; }; f 0",
    )
    .await;
    // A steady grower (see real_pods' runaway test for why not a doubling buffer).
    let hog = start_job(
        ctx,
        "x=$(head -c 1048576 /dev/zero | tr '\\0' a); a=(); while :; do a+=(\"$x\"); done",
    )
    .await;
    for (id, reason) in [
        (&flood, "of output and was stopped"),
        (&bomb, "process limit"),
        (&hog, "memory limit"),
    ] {
        let waited = process(
            ctx,
            json!({"action": "wait", "session_id": id, "timeout": 30}),
        )
        .await;
        assert_eq!(waited["status"], "exited", "{waited}");
        assert_eq!(waited["termination_source"], "sandbox.limit", "{waited}");
        let why = waited["stopped_reason"].as_str().unwrap_or_default();
        assert!(why.contains(reason), "{id}: {waited}");
    }
    // The shell of the conversation is not the jobs': it still answers.
    let alive = ok(call(ctx, json!({"command": "echo alive"})).await);
    assert_eq!(alive["output"], "alive");
    ctx.close().await;
    assert!(processes_in(ctx.workspace.root()).is_empty());
}

in_both_places!(
    a_runaway_job_is_stopped_at_its_limit_with_the_reason,
    cd_export_and_workdir_persist_between_calls,
    a_command_that_redirects_the_shell_does_not_silence_the_next,
    the_file_tools_follow_the_terminals_directory,
    a_server_started_in_the_background_answers_a_later_call,
    the_process_actions_behave_as_the_references,
    jobs_are_bounded_and_none_outlives_the_conversation,
);

in_both_places!(
    fork_bomb_is_stopped_at_the_process_limit,
    a_fork_bomb_after_the_shell_waited_is_stopped,
    a_job_left_with_an_ampersand_is_watched_while_the_shell_waits,
    memory_hog_is_stopped_at_the_memory_limit,
    disk_filler_is_stopped_at_the_workspace_limit,
    one_huge_file_stops_at_the_workspace_limit_and_can_be_deleted,
    a_workspace_a_job_filled_can_be_cleaned,
);

in_both_places!(
    command_output_and_exit_code_are_returned,
    non_zero_exit_code_is_a_result_not_an_error,
    command_killed_by_a_signal_reports_128_plus_the_signal,
    command_runs_in_the_workspace_with_home_there_and_a_dumb_terminal,
    worker_environment_is_not_passed_to_commands,
    stdin_is_empty,
    a_timed_out_command_is_killed_and_the_shell_lives_on,
    a_shell_stuck_in_a_builtin_loop_is_restarted_in_its_directory,
    a_timeout_above_the_foreground_maximum_is_refused,
    shorter_requested_timeout_is_honoured,
    closing_the_conversation_ends_everything_it_started,
    dropping_the_conversation_ends_everything_it_started,
    a_job_left_running_with_an_ampersand_lives_until_the_conversation_ends,
    large_output_keeps_head_and_tail_within_the_cap,
    missing_or_empty_command_is_an_error,
);

/// A directory at the top of the filesystem, as a task image's repository is (`/testbed`),
/// holding `README.md`; removed on drop.
struct TopLevelDir(std::path::PathBuf);

impl TopLevelDir {
    fn create() -> Self {
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::path::PathBuf::from(format!(
            "/trajectory-image-probe-{}-{}",
            std::process::id(),
            MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("a directory at / (the tests run as root)");
        std::fs::write(dir.join("README.md"), "the task's repository\n").unwrap();
        Self(dir)
    }
}

impl Drop for TopLevelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// In a container of a task image (`serve --image-readable`) the image's own files are the
/// task's: a command reads them (under Landlock, required), while the other conversations'
/// workspaces, the sessions' directories, `/run` and `/var` stay out of its reach. Without the
/// flag, as on a laptop, the same files are hidden.
#[tokio::test]
async fn in_a_task_image_its_files_are_readable_and_the_other_conversations_are_not() {
    let image_dir = TopLevelDir::create();
    let root = tempfile::tempdir().unwrap();
    for name in ["mine", "neighbour"] {
        std::fs::create_dir(root.path().join(name)).unwrap();
    }
    std::fs::write(root.path().join("neighbour/secret.txt"), "theirs").unwrap();
    let probe = format!(
        "cat {}/README.md 2>&1; cat {}/neighbour/secret.txt 2>&1; ls /var 2>&1 | head -n 1",
        image_dir.0.display(),
        root.path().display()
    );
    for (server, readable) in [
        (SandboxServer::start_in_task_image(root.path()), true),
        (SandboxServer::start(root.path()), false),
    ] {
        let context = ToolContext {
            workspace: Workspace::new(root.path().join("mine")).unwrap(),
            limits: ToolLimits::default(),
            sandbox: server.sandbox(LandlockMode::Required),
            browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
            terminal: trajectory_worker::tools::terminal::Terminal::default(),
        };
        let ToolOutcome::Ok(result) = call(&context, json!({"command": probe})).await else {
            panic!("the probe ran");
        };
        let output = result["output"].as_str().unwrap_or_default().to_owned();
        assert_eq!(
            output.contains("the task's repository"),
            readable,
            "image files readable: {readable}: {output}"
        );
        assert!(!output.contains("theirs"), "{output}");
        let denied = output.matches("Permission denied").count();
        assert_eq!(denied, if readable { 2 } else { 3 }, "{output}");
    }
}

/// A task container (`serve --task`) is one conversation's container of its row's image: the
/// shell starts in the image's working directory (or the row's `cwd`), with the image's
/// environment, and may change the image's files, Landlock required; the executor's own
/// directories stay out of reach.
#[tokio::test]
async fn in_a_task_container_commands_start_in_its_directory_and_change_its_files() {
    let image_dir = TopLevelDir::create();
    std::fs::create_dir(image_dir.0.join("src")).unwrap();
    let server =
        SandboxServer::start_task_container(&image_dir.0, &[("IMAGE_VAR", "from-the-image")]);
    let socket_dir = server.socket().parent().unwrap().to_owned();
    let scratch = tempfile::tempdir().unwrap();
    for (cwd, expected) in [
        (None, image_dir.0.clone()),
        (
            Some(image_dir.0.join("src").display().to_string()),
            image_dir.0.join("src"),
        ),
    ] {
        let context = task_context(&server, cwd, scratch.path());
        let probe = format!(
            "pwd; echo \"var=$IMAGE_VAR\"; echo fixed >> {readme}; ls {socket_dir} 2>&1 | head -n 1",
            readme = image_dir.0.join("README.md").display(),
            socket_dir = socket_dir.display(),
        );
        let result = ok(call(&context, json!({"command": probe})).await);
        let output = result["output"].as_str().unwrap_or_default().to_owned();
        let mut lines = output.lines();
        assert_eq!(lines.next(), Some(expected.to_str().unwrap()), "{output}");
        assert_eq!(lines.next(), Some("var=from-the-image"), "{output}");
        assert!(
            lines
                .next()
                .is_some_and(|line| line.contains("Permission denied")),
            "the socket's directory is private: {output}"
        );
        // The shell keeps its directory between calls, as anywhere.
        let again = ok(call(&context, json!({"command": "cd /; pwd"})).await);
        assert_eq!(again["output"], "/", "{again}");
        let after = ok(call(&context, json!({"command": "pwd"})).await);
        assert_eq!(after["output"], "/", "{after}");
        context.close().await;
    }
    assert_eq!(
        std::fs::read_to_string(image_dir.0.join("README.md")).unwrap(),
        "the task's repository\nfixed\nfixed\n"
    );
}

/// One conversation in the task container `server`, starting in `cwd` (`None`: where the server
/// started), Landlock required; `scratch` stands for the worker's workspace, which it never uses.
fn task_context(server: &SandboxServer, cwd: Option<String>, scratch: &Path) -> ToolContext {
    ToolContext {
        workspace: Workspace::new(scratch).unwrap(),
        limits: ToolLimits::default(),
        sandbox: server
            .sandbox(LandlockMode::Required)
            .in_task_container(server.socket(), cwd),
        browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
        terminal: trajectory_worker::tools::terminal::Terminal::default(),
    }
}

/// Calls the file tool `name`.
async fn file_call(ctx: &ToolContext, name: &str, args: Value) -> ToolOutcome {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    let tools = trajectory_worker::tools::file::tools(&ToolsSpec::default());
    let tool = tools.iter().find(|tool| tool.spec().name == name).unwrap();
    tool.call(args, ctx).await
}

/// In a task container the file tools work on the container's files as its terminal does:
/// absolute paths are the normal case, relative ones start where the commands start (the row's
/// `cwd` or the image's working directory) and then where the shell is; what they write the
/// commands see and the other way round; the executor's own directories stay out of their reach
/// too, Landlock required.
#[tokio::test]
async fn in_a_task_container_the_file_tools_work_on_its_files_as_the_terminal_does() {
    let image_dir = TopLevelDir::create();
    std::fs::create_dir(image_dir.0.join("src")).unwrap();
    let server = SandboxServer::start_task_container(&image_dir.0, &[]);
    let socket_dir = server.socket().parent().unwrap().to_owned();
    let scratch = tempfile::tempdir().unwrap();
    let context = task_context(&server, None, scratch.path());
    let readme = image_dir.0.join("README.md").display().to_string();

    // Before any command, relative paths start in the image's working directory.
    let read = ok(file_call(&context, "read_file", json!({"path": "README.md"})).await);
    assert_eq!(read["content"], "     1|the task's repository", "{read}");
    assert_eq!(
        read["path"], readme,
        "shown as the container's path: {read}"
    );
    let app = image_dir.0.join("src/app.py").display().to_string();
    let written = ok(file_call(
        &context,
        "write_file",
        json!({"path": app, "content": "print('hi')\n"}),
    )
    .await);
    assert_eq!(written["path"], app, "{written}");
    let patched = ok(file_call(
        &context,
        "patch",
        json!({"path": app, "old_string": "hi", "new_string": "patched"}),
    )
    .await);
    assert_eq!(patched["replacements"], 1, "{patched}");
    // The terminal sees what the file tools wrote, and the file tools follow its `cd`.
    let seen = ok(call(&context, json!({"command": "cd src && cat app.py"})).await);
    assert_eq!(seen["output"], "print('patched')", "{seen}");
    ok(call(
        &context,
        json!({"command": "echo made-by-the-shell > shell.txt"}),
    )
    .await);
    let found = ok(file_call(
        &context,
        "search_files",
        json!({"pattern": "made-by", "path": "."}),
    )
    .await);
    assert!(
        found.to_string().contains("shell.txt"),
        "relative paths start where the shell is: {found}"
    );

    // The socket's and the executor's directory stay private, to these calls as to commands.
    let planted = socket_dir.join("planted");
    let refused = file_call(
        &context,
        "write_file",
        json!({"path": planted.display().to_string(), "content": "x"}),
    )
    .await;
    let ToolOutcome::Err(message) = refused else {
        panic!("writing beside the socket was allowed: {refused:?}");
    };
    assert!(message.contains("ermission denied"), "{message}");
    assert!(!planted.exists());
    context.close().await;
    assert_eq!(
        std::fs::read_to_string(image_dir.0.join("src/app.py")).unwrap(),
        "print('patched')\n"
    );
}

/// A file outside the workspace is refused by Landlock; the model is told why, in one note
/// naming the path, where the worker can judge the sandbox (a local run), and only for paths
/// outside what the conversation may read.
#[tokio::test]
async fn a_path_the_sandbox_refuses_is_named_in_a_note_in_a_local_run() {
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("notes.txt");
    std::fs::write(&secret, "private").unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("mine.txt"), "mine").unwrap();
    let ctx = context(Where::Local, dir.path(), ToolLimits::default());
    assert!(
        ctx.sandbox.landlock_enforced(dir.path()).await.unwrap(),
        "this kernel enforces Landlock (the test needs it to mean anything)"
    );
    let expected_note = format!(
        "[The sandbox refused {}: this conversation's commands may read and run programs only in \
         its workspace and the system's directories (/usr, /bin, /etc, /opt, ...). Use programs \
         and files from those instead]",
        secret.display()
    );

    let refused = ok(call(
        &ctx,
        json!({"command": format!("cat {}", secret.display())}),
    )
    .await);
    assert_eq!(
        refused["output"],
        format!(
            "cat: {}: Permission denied\n{expected_note}",
            secret.display()
        ),
        "{refused}"
    );
    assert_eq!(refused["exit_code"], 1, "{refused}");

    // Inside the workspace: read, and a refusal there (a file's mode) is not the sandbox's.
    let mine = ok(call(&ctx, json!({"command": "cat mine.txt"})).await);
    assert_eq!(mine["output"], "mine", "{mine}");
    let inside = ok(call(
        &ctx,
        json!({"command": "echo \"cat: $PWD/mine.txt: Permission denied\""}),
    )
    .await);
    assert!(!inside.to_string().contains("[The sandbox"), "{inside}");

    // A background job's output gets the same note.
    let job = start_job(&ctx, &format!("cat {}", secret.display())).await;
    let waited = process(
        &ctx,
        json!({"action": "wait", "session_id": job, "timeout": 30}),
    )
    .await;
    assert!(
        waited["output"]
            .as_str()
            .is_some_and(|output| output.ends_with(&expected_note)),
        "{waited}"
    );
    ctx.close().await;

    // In a pod the sandbox container's image decides what is readable: no note.
    let pod_dir = tempfile::tempdir().unwrap();
    let pod = context(Where::Pod, pod_dir.path(), ToolLimits::default());
    let in_pod = ok(call(
        &pod,
        json!({"command": format!("cat {}", secret.display())}),
    )
    .await);
    assert!(
        in_pod["output"]
            .as_str()
            .is_some_and(|output| output.ends_with(": Permission denied")),
        "{in_pod}"
    );
    pod.close().await;
}

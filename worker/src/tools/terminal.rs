//! The `terminal` toolset: one tool, `terminal`, that runs a shell command in the conversation's
//! workspace directory.
//!
//! Every command runs in its own process group, so everything it starts — pipelines, background
//! jobs, their children — can be killed at once. The group is killed when the command times out,
//! when the call is dropped (a cancelled conversation), and when the command finishes: no process
//! outlives the call that started it, so nothing leaks into later conversations of the same pod.
//!
//! Output is read while the command runs (a chatty command never blocks on a full pipe) and kept
//! within `max_output_bytes`: the head and a ring of the tail, the middle replaced by a marker.

use std::collections::VecDeque;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Map, Value, json};
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::args::{optional_u64_arg, string_arg};
use super::text::{complete_prefix_len, complete_suffix_start};
use super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "terminal";

/// How long output is still collected after the shell exits while a background process it left
/// behind keeps the pipe open. Long enough to catch output already in flight, short enough that
/// `server &` does not make every call wait for the full timeout.
const EXIT_GRACE: Duration = Duration::from_millis(500);

/// Used when the worker itself has no `PATH` (as in some minimal containers).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Environment variables passed through to commands. Everything else is dropped: the worker's
/// environment carries the model server's API key, and a model running `env` must not copy it into
/// a trajectory.
const PASSED_ENV: [&str; 3] = ["LANG", "LC_ALL", "TZ"];

pub fn tools(config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    vec![Arc::new(TerminalTool::new(
        config.terminal.timeout_seconds,
        config.terminal.max_output_bytes,
    ))]
}

/// Runs `bash -c <command>` in the workspace.
#[derive(Debug)]
struct TerminalTool {
    spec: ToolSpec,
}

impl TerminalTool {
    fn new(timeout_seconds: u64, max_output_bytes: u64) -> Self {
        let description = format!(
            "Run a shell command with bash in this conversation's own working directory, a fresh \
             directory that starts empty and is shared with the file tools (relative paths in \
             read_file/write_file refer to it; HOME points at it too). Returns the combined \
             stdout and stderr, in order, and the exit code; a non-zero exit code is reported, \
             not treated as a failure. The command is non-interactive (stdin is empty, \
             TERM=dumb), so pass flags such as -y to tools that would prompt. It is killed \
             after {timeout_seconds} seconds (a shorter `timeout` may be given). Every process \
             it starts, including background jobs, is stopped when the command returns, so do \
             not rely on servers or daemons staying up between calls. Output beyond \
             {max_output_bytes} bytes is cut from the middle, keeping the beginning and the end; \
             redirect large output to a file and read parts of it instead."
        );
        Self {
            spec: ToolSpec {
                name: "terminal".to_owned(),
                description,
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "command": {
                            "type": "string",
                            "description": "The shell command to run, e.g. `ls -la` or \
                                `python3 script.py > out.txt 2>&1`. Runs with `bash -c` in the \
                                workspace directory; pipes, redirection and `&&` work."
                        },
                        "timeout": {
                            "type": "integer",
                            "minimum": 1,
                            "description": format!(
                                "Seconds to let the command run before it is killed. Optional; \
                                 values above {timeout_seconds} are lowered to {timeout_seconds}."
                            )
                        }
                    },
                    "required": ["command"]
                }),
            },
        }
    }
}

impl Tool for TerminalTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            let command = match string_arg(&args, "command") {
                Ok(command) if command.trim().is_empty() => {
                    return ToolOutcome::Err("argument `command` is empty".to_owned());
                }
                Ok(command) => command,
                Err(message) => return ToolOutcome::Err(message),
            };
            let limit = ctx.limits.command_timeout;
            let timeout = match optional_u64_arg(&args, "timeout") {
                // A zero timeout would kill the command before it starts; treat it as "shortest".
                Ok(Some(seconds)) => Duration::from_secs(seconds.max(1)).min(limit),
                Ok(None) => limit,
                Err(message) => return ToolOutcome::Err(message),
            };
            run(
                command,
                ctx.workspace.root(),
                timeout,
                ctx.limits.max_output_bytes,
            )
            .await
        })
    }
}

/// Runs one command to completion, timeout or cancellation and renders the tool result.
async fn run(command: &str, cwd: &Path, timeout: Duration, max_output_bytes: usize) -> ToolOutcome {
    let (mut child, mut output) = match spawn(command, cwd) {
        Ok(spawned) => spawned,
        Err(err) => return ToolOutcome::Err(format!("could not start the shell: {err}")),
    };
    // Armed before the first await, so a call dropped at any point below still kills the group.
    let _group = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .map(|id| ProcessGroup(Pid::from_raw(id)));

    let deadline = Instant::now() + timeout;
    let mut stop_at = deadline;
    let mut kept = OutputBuffer::new(max_output_bytes);
    let mut buf = vec![0_u8; 64 * 1024];
    let mut output_open = true;
    let mut status: Option<ExitStatus> = None;
    loop {
        tokio::select! {
            read = output.read(&mut buf), if output_open => match read {
                Ok(0) | Err(_) => output_open = false,
                Ok(n) => kept.push(&buf[..n]),
            },
            waited = child.wait(), if status.is_none() => match waited {
                Ok(exit) => {
                    status = Some(exit);
                    stop_at = deadline.min(Instant::now() + EXIT_GRACE);
                }
                Err(err) => {
                    return ToolOutcome::Err(format!("waiting for the command failed: {err}"));
                }
            },
            () = tokio::time::sleep_until(stop_at) => break,
        }
        if status.is_some() && !output_open {
            break;
        }
    }

    let output = kept.render();
    ToolOutcome::Ok(match status {
        Some(exit) => json!({ "output": output, "exit_code": exit_code(exit), "error": null }),
        None => json!({
            "output": output,
            "exit_code": null,
            "error": format!("command timed out after {}s", timeout.as_secs()),
        }),
    })
}

/// Starts `bash -c command` (or `sh` where bash is missing) in its own process group, with stdout
/// and stderr on one pipe so their output interleaves as it would on a terminal.
fn spawn(command: &str, cwd: &Path) -> io::Result<(Child, pipe::Receiver)> {
    match spawn_with("bash", command, cwd) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => spawn_with("sh", command, cwd),
        spawned => spawned,
    }
}

fn spawn_with(shell: &str, command: &str, cwd: &Path) -> io::Result<(Child, pipe::Receiver)> {
    let (reader, writer) = io::pipe()?;
    let writer_for_stderr = writer.try_clone()?;
    let mut cmd = Command::new(shell);
    cmd.arg("-c")
        .arg(command)
        .current_dir(cwd)
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
        )
        .env("HOME", cwd)
        .env("TERM", "dumb")
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::from(writer_for_stderr))
        .process_group(0);
    for name in PASSED_ENV {
        if let Some(value) = std::env::var_os(name) {
            cmd.env(name, value);
        }
    }
    let child = cmd.spawn()?;
    // The command still holds our copies of the pipe's write end; they must be closed here or the
    // read side would never see end-of-file.
    drop(cmd);
    let receiver = pipe::Receiver::from_owned_fd(OwnedFd::from(reader))?;
    Ok((child, receiver))
}

/// A shell reports a command killed by signal N as exit code 128+N; the model knows that
/// convention, so it is used here too rather than a bare `null`.
fn exit_code(status: ExitStatus) -> Option<i32> {
    status
        .code()
        .or_else(|| status.signal().map(|signal| 128 + signal))
}

/// Kills a command's whole process group when dropped.
#[derive(Debug)]
struct ProcessGroup(Pid);

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // ESRCH (the group is already gone) is the normal case after a command that left nothing
        // behind; there is nothing else to do about a failure here either.
        let _ = killpg(self.0, Signal::SIGKILL);
    }
}

/// Keeps the first and last bytes of a stream within a fixed budget, counting what is dropped.
#[derive(Debug)]
struct OutputBuffer {
    head: Vec<u8>,
    head_limit: usize,
    tail: VecDeque<u8>,
    tail_limit: usize,
    total: usize,
}

impl OutputBuffer {
    fn new(limit: usize) -> Self {
        let head_limit = limit / 2;
        Self {
            head: Vec::with_capacity(head_limit.min(64 * 1024)),
            head_limit,
            tail: VecDeque::new(),
            tail_limit: limit - head_limit,
            total: 0,
        }
    }

    fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len();
        let into_head = bytes.len().min(self.head_limit - self.head.len());
        self.head.extend_from_slice(&bytes[..into_head]);
        bytes = &bytes[into_head..];
        if bytes.len() >= self.tail_limit {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - self.tail_limit..]);
        } else {
            let overflow = (self.tail.len() + bytes.len()).saturating_sub(self.tail_limit);
            self.tail.drain(..overflow);
            self.tail.extend(bytes);
        }
    }

    /// The kept bytes as text (lossy UTF-8), with a marker where the middle was dropped.
    fn render(self) -> String {
        let elided = self.total - self.head.len() - self.tail.len();
        let tail: Vec<u8> = self.tail.into();
        if elided == 0 {
            let mut all = self.head;
            all.extend_from_slice(&tail);
            return String::from_utf8_lossy(&all).into_owned();
        }
        // Cut points fall anywhere; drop the partial characters at them instead of showing U+FFFD.
        let head = &self.head[..complete_prefix_len(&self.head)];
        let tail = &tail[complete_suffix_start(&tail)..];
        format!(
            "{}\n... [{elided} bytes elided] ...\n{}",
            String::from_utf8_lossy(head),
            String::from_utf8_lossy(tail)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{ToolLimits, Workspace};

    fn context(dir: &Path, limits: ToolLimits) -> ToolContext {
        ToolContext {
            workspace: Workspace::new(dir).unwrap(),
            limits,
        }
    }

    fn tool() -> TerminalTool {
        TerminalTool::new(60, 16 * 1024)
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
        for _ in 0..100 {
            if process_is_gone(pid) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Do not leave the stray process behind if the assertion fails.
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        panic!("process {pid} is still running");
    }

    fn read_pid(dir: &Path) -> i32 {
        std::fs::read_to_string(dir.join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[tokio::test]
    async fn command_output_and_exit_code_are_returned() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
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

    #[tokio::test]
    async fn non_zero_exit_code_is_a_result_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
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

    #[tokio::test]
    async fn command_killed_by_a_signal_reports_128_plus_the_signal() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
        let result = ok(call(&ctx, json!({"command": "kill -9 $$"})).await);
        assert_eq!(result["exit_code"], 137);
    }

    #[tokio::test]
    async fn command_runs_in_the_workspace_with_home_there_and_a_dumb_terminal() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
        let result = ok(call(
            &ctx,
            json!({"command": "pwd; echo $HOME; echo $TERM; touch made"}),
        )
        .await);
        let root = ctx.workspace.root().display();
        assert_eq!(result["output"], format!("{root}\n{root}\ndumb\n"));
        assert!(dir.path().join("made").exists());
    }

    #[tokio::test]
    async fn worker_environment_is_not_passed_to_commands() {
        // Cargo sets these for the test process, standing in for the worker's secrets.
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
        let result = ok(call(&ctx, json!({"command": "env"})).await);
        let output = result["output"].as_str().unwrap();
        assert!(!output.contains("CARGO_PKG_NAME"), "{output}");
        assert!(output.contains("PATH="), "{output}");
    }

    #[tokio::test]
    async fn stdin_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
        let result = ok(call(&ctx, json!({"command": "cat; echo done"})).await);
        assert_eq!(result["output"], "done\n");
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let limits = ToolLimits {
            command_timeout: Duration::from_secs(1),
            ..ToolLimits::default()
        };
        let ctx = context(dir.path(), limits);
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

    #[tokio::test]
    async fn requested_timeout_is_capped_by_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let limits = ToolLimits {
            command_timeout: Duration::from_secs(1),
            ..ToolLimits::default()
        };
        let ctx = context(dir.path(), limits);
        let result = ok(call(&ctx, json!({"command": "sleep 30", "timeout": 1000})).await);
        assert_eq!(result["error"], "command timed out after 1s");
    }

    #[tokio::test]
    async fn shorter_requested_timeout_is_honoured() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
        let started = std::time::Instant::now();
        let result = ok(call(&ctx, json!({"command": "sleep 30", "timeout": "1"})).await);
        assert_eq!(result["error"], "command timed out after 1s");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[tokio::test]
    async fn dropping_the_call_kills_the_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
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

    #[tokio::test]
    async fn background_process_does_not_outlive_the_command() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
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

    #[tokio::test]
    async fn large_output_keeps_head_and_tail_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let limits = ToolLimits {
            max_output_bytes: 100,
            ..ToolLimits::default()
        };
        let ctx = context(dir.path(), limits);
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

    #[tokio::test]
    async fn missing_or_empty_command_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path(), ToolLimits::default());
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

    #[test]
    fn output_buffer_keeps_everything_under_the_limit() {
        let mut buffer = OutputBuffer::new(10);
        buffer.push(b"hello");
        buffer.push(b"world");
        assert_eq!(buffer.render(), "helloworld");
    }

    #[test]
    fn output_buffer_keeps_head_and_tail_across_many_small_writes() {
        let mut buffer = OutputBuffer::new(6);
        for byte in b"abcdefghijklmnopqrstuvwxyz" {
            buffer.push(&[*byte]);
        }
        assert_eq!(buffer.render(), "abc\n... [20 bytes elided] ...\nxyz");
    }

    #[test]
    fn output_buffer_drops_characters_cut_at_the_edges() {
        let mut buffer = OutputBuffer::new(10);
        buffer.push("ééééé-ééééé".as_bytes());
        let rendered = buffer.render();
        assert!(!rendered.contains('\u{FFFD}'), "{rendered}");
        assert!(rendered.starts_with("éé\n"), "{rendered}");
        assert!(rendered.ends_with("\néé"), "{rendered}");
    }

    #[test]
    fn terminal_tool_is_described_with_its_limits() {
        let tools = tools(&ToolsSpec::default());
        assert_eq!(tools.len(), 1);
        let spec = tools[0].spec();
        assert_eq!(spec.name, "terminal");
        assert_eq!(spec.parameters["required"], json!(["command"]));
        assert!(spec.description.contains("working directory"));
    }
}

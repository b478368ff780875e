//! The `terminal` toolset: one tool, `terminal`, that runs a shell command in the conversation's
//! workspace directory.
//!
//! Every command runs under its own executor ([`super::sandbox`]): a cleared environment, a
//! Landlock domain confined to the workspace, and a reaper that kills everything the command
//! started — pipelines, background jobs, `setsid` and double-forked daemons — when the command
//! finishes. The executor is told to do the same when the command times out and when the call is
//! dropped (a cancelled conversation): no process outlives the call that started it, so nothing
//! leaks into later conversations of the same pod.
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

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Map, Value, json};
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::args::{optional_u64_arg, string_arg};
use super::sandbox::{
    LIMIT_EXIT, LandlockMode, Limits, Place, REFUSED_EXIT, REFUSED_PREFIX, Sandbox, run_in_pod,
};
use super::text::{complete_prefix_len, complete_suffix_start};
use super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::ToolsSpec;
use trajectory_sandbox::protocol::Request;

pub const TOOLSET: &str = "terminal";

/// How long a background process the shell left behind may still write output after the shell
/// exits, before the executor kills it (and the pipe closes). Long enough to catch output already
/// in flight, short enough that `server &` does not make every call wait for the full timeout.
const EXIT_GRACE: Duration = Duration::from_millis(500);

/// How long a timed-out command's executor has to kill and reap what the command started, once
/// asked, before it is killed itself. It needs milliseconds; this bounds a wedged one.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The most output read from the pipe at once: the pipe's own capacity.
const READ_CHUNK: usize = 64 * 1024;

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
                &ctx.sandbox,
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
async fn run(
    sandbox: &Sandbox,
    command: &str,
    cwd: &Path,
    timeout: Duration,
    max_output_bytes: usize,
) -> ToolOutcome {
    let mut kept = OutputBuffer::new(max_output_bytes);
    let ran = match &sandbox.place {
        Place::Local { executor } => {
            let how = (sandbox.landlock, sandbox.limits);
            run_local(executor, how, command, cwd, timeout, &mut kept).await
        }
        Place::Pod { socket } => {
            let request = Request {
                workspace: cwd.display().to_string(),
                command: command.to_owned(),
                landlock: sandbox.landlock,
                grace_ms: u64::try_from(EXIT_GRACE.as_millis()).unwrap_or(u64::MAX),
                limits: sandbox.limits,
            };
            let mut push = |bytes: &[u8]| kept.push(bytes);
            // Past the deadline the future is dropped: the connection closes, and the server
            // ends the command.
            match tokio::time::timeout(timeout, run_in_pod(socket, &request, &mut push)).await {
                Ok(Ok(code)) => Ok(Some(code)),
                Ok(Err(err)) => Err(format!("the sandbox failed: {err}")),
                Err(_) => Ok(None),
            }
        }
    };
    let exit_code = match ran {
        Ok(exit_code) => exit_code,
        Err(message) => return ToolOutcome::Err(message),
    };
    let output = kept.render();
    if exit_code == Some(REFUSED_EXIT)
        && let Some(reason) = output.strip_prefix(REFUSED_PREFIX)
    {
        return ToolOutcome::Err(format!("the command was not run: {}", reason.trim_end()));
    }
    if exit_code == Some(LIMIT_EXIT)
        && let Some((before, reason)) = split_limit_reason(&output)
    {
        return ToolOutcome::Err(limit_error(before, reason));
    }
    ToolOutcome::Ok(match exit_code {
        Some(code) => json!({ "output": output, "exit_code": code, "error": null }),
        None => json!({
            "output": output,
            "exit_code": null,
            "error": format!("command timed out after {}s", timeout.as_secs()),
        }),
    })
}

/// The output of a command the executor stopped at a limit: what the command wrote, and the
/// executor's reason (its last line, after [`REFUSED_PREFIX`]).
fn split_limit_reason(output: &str) -> Option<(&str, &str)> {
    let trimmed = output.trim_end();
    let start = trimmed
        .rfind(&format!("\n{REFUSED_PREFIX}"))
        .map_or(0, |at| at + 1);
    let reason = trimmed[start..].strip_prefix(REFUSED_PREFIX)?;
    (!reason.contains('\n')).then(|| (trimmed[..start].trim_end(), reason))
}

/// The tool error of a command stopped at a limit: the reason first, then the output so far
/// (the model may want to see how far it got).
fn limit_error(before: &str, reason: &str) -> String {
    if before.is_empty() {
        reason.to_owned()
    } else {
        format!("{reason}. Output before it was stopped:\n{before}")
    }
}

/// Runs the command under an executor child of the worker; its output goes into `kept`. Returns
/// the exit code, or `None` if the command timed out.
async fn run_local(
    executor: &Path,
    (landlock, limits): (LandlockMode, Limits),
    command: &str,
    cwd: &Path,
    timeout: Duration,
    kept: &mut OutputBuffer,
) -> Result<Option<i32>, String> {
    let (child, mut output) = spawn(executor, (landlock, limits), command, cwd).map_err(|err| {
        format!(
            "could not start the sandbox ({}): {err}",
            executor.display()
        )
    })?;
    // Armed before the first await, so a call dropped at any point below still ends the command.
    let mut child = Executor(child);

    let deadline = Instant::now() + timeout;
    let mut stop_at = deadline;
    // Not zeroed: `read_buf` fills spare capacity, and most commands print little or nothing.
    let mut buf = Vec::with_capacity(READ_CHUNK);
    let mut output_open = true;
    let mut status: Option<ExitStatus> = None;
    loop {
        tokio::select! {
            read = output.read_buf(&mut buf), if output_open => match read {
                Ok(0) | Err(_) => output_open = false,
                Ok(_) => {
                    kept.push(&buf);
                    buf.clear();
                }
            },
            waited = child.0.wait(), if status.is_none() => match waited {
                Ok(exit) => {
                    status = Some(exit);
                    stop_at = deadline.min(Instant::now() + EXIT_GRACE);
                }
                Err(err) => return Err(format!("waiting for the command failed: {err}")),
            },
            () = tokio::time::sleep_until(stop_at) => break,
        }
        if status.is_some() && !output_open {
            break;
        }
    }
    if status.is_none() {
        child.stop().await;
    }
    Ok(status.and_then(exit_code))
}

/// Starts the executor that runs `bash -c command` (or `sh` where bash is missing) in its own
/// process group, with stdout and stderr on one pipe so their output interleaves as it would on a
/// terminal. The executor's environment is cleared ([`trajectory_sandbox::run::command`]).
fn spawn(
    executor: &Path,
    (landlock, limits): (LandlockMode, Limits),
    command: &str,
    cwd: &Path,
) -> io::Result<(Child, pipe::Receiver)> {
    let (reader, writer) = io::pipe()?;
    let writer_for_stderr = writer.try_clone()?;
    let mut cmd = Command::from(trajectory_sandbox::run::command(
        executor, cwd, landlock, limits, EXIT_GRACE, command,
    ));
    cmd.stdout(Stdio::from(writer))
        .stderr(Stdio::from(writer_for_stderr))
        .process_group(0);
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

/// A running executor; when dropped before it has been reaped (a timeout, a cancelled call), it is
/// asked with `SIGTERM` to kill everything its command started and exit. Not `SIGKILL`: that
/// would leave the command's descendants to the next reaper up.
#[derive(Debug)]
struct Executor(Child);

impl Executor {
    /// Asks the executor to end the command (as dropping it does) and waits until it has, so
    /// that when a timed-out call returns nothing it started is left (the batch may then hand
    /// the workspace to another conversation). One that does not exit within [`STOP_WAIT`] is
    /// killed.
    async fn stop(&mut self) {
        if let Some(pid) = self.0.id().and_then(|id| i32::try_from(id).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if tokio::time::timeout(STOP_WAIT, self.0.wait())
            .await
            .is_err()
        {
            let _ = self.0.kill().await;
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // `id` is `None` once the executor was reaped, so a recycled pid is never signalled.
        if let Some(pid) = self.0.id().and_then(|id| i32::try_from(id).ok()) {
            // ESRCH (it has just exited) is fine; nothing else can be done about a failure here.
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
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
    fn a_limit_reason_is_split_from_the_output_before_it() {
        let output =
            "step 1\nstep 2\n\nsandbox: the command exceeded the sandbox's process limit\n";
        let (before, reason) = split_limit_reason(output).unwrap();
        assert_eq!(before, "step 1\nstep 2");
        assert_eq!(reason, "the command exceeded the sandbox's process limit");
        assert_eq!(
            split_limit_reason("\nsandbox: out of room\n"),
            Some(("", "out of room"))
        );
        // The reason must be the last line: a command's own `sandbox: ` line earlier is output.
        assert_eq!(split_limit_reason("sandbox: x\nmore output\n"), None);
        assert_eq!(split_limit_reason("nothing of the kind"), None);
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

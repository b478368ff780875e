//! Where the terminal tool's commands run: never in the worker's process, always under the
//! `trajectory-executor` of the [`trajectory_sandbox`] crate, which confines each command to its
//! conversation's workspace and ends everything it started (that crate's docs say what each layer
//! guarantees).
//!
//! - **Local** (`trajectory-worker local`, `prompt`, and a `batch` without a sandbox container):
//!   the worker starts `trajectory-executor run` as its child, with a cleared environment, for
//!   each command. The worker marks itself non-dumpable, so its memory and environment stay out
//!   of reach of the commands, which run as the same uid.
//! - **Pod** (a generation Job's pod): the commands run in the pod's sandbox container, whose
//!   `trajectory-executor serve` the worker reaches over a Unix socket on a shared emptyDir. That
//!   container has the run's task image and mounts the workspaces only: no API key, no data
//!   volume, no other container's processes.
//!
//! Long-lived programs (MCP stdio servers, Chromium) run the same ways as sessions
//! ([`Session`]): under the executor, in the sandbox container in a pod. So do a conversation's
//! shell and its background jobs ([`Program`]), in the conversation's workspace.

mod program;
mod session;
pub mod tool_dirs;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use program::{OutputLog, OutputSink, Program, ProgramState};
pub use session::{Ended, Session, SessionEnd};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
pub use trajectory_sandbox::protocol::SessionRequest;
use trajectory_sandbox::protocol::{
    self, FileAnswer, FileRequest, Request, VerifierRequest, VerifierStep,
};
pub use trajectory_sandbox::{
    EXECUTOR_BINARY, LIMIT_EXIT, LandlockMode, Limits, REFUSED_EXIT, REFUSED_PREFIX,
};

/// How long the worker waits for the sandbox container's socket at start-up: the container is
/// started before the worker, but may still be getting ready.
const SOCKET_WAIT: Duration = Duration::from_secs(60);

/// Where commands run, and how confined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    pub place: Place,
    pub landlock: LandlockMode,
    /// What each command may use ([`Limits::DEFAULT`] unless set).
    pub limits: Limits,
    /// Set when the executor serves one conversation in a container of its row's image (a task
    /// container): its commands work in that image's directories, not in a workspace.
    pub task: Option<TaskDir>,
}

/// Where a conversation in a task container starts: the row's `cwd`, or (`None`) the image's own
/// working directory, which only the executor in the container knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskDir(pub Option<String>);

impl TaskDir {
    /// The workspace a request names: the directory, or the empty name the task container's
    /// executor reads as its start directory.
    pub fn workspace(&self) -> &str {
        self.0.as_deref().unwrap_or("")
    }
}

/// Where the executor is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// The `trajectory-executor` binary the worker starts for each command, and the directories
    /// of this machine the commands may read and run programs from besides the system's
    /// (`spec.sandbox.toolDirs`, checked by [`crate::validate`] before a run starts).
    Local {
        executor: PathBuf,
        tool_dirs: Vec<PathBuf>,
    },
    /// The socket of the sandbox container's `trajectory-executor serve`.
    Pod { socket: PathBuf },
}

impl Sandbox {
    /// Commands under the executor binary `executor`, started by the worker.
    pub fn new(executor: impl Into<PathBuf>, landlock: LandlockMode) -> Self {
        Self {
            place: Place::Local {
                executor: executor.into(),
                tool_dirs: Vec::new(),
            },
            landlock,
            limits: Limits::DEFAULT,
            task: None,
        }
    }

    /// Commands under [`find_executor`]'s binary.
    pub fn local(landlock: LandlockMode) -> Self {
        Self::new(find_executor(), landlock)
    }

    /// Commands sent to the sandbox server listening on `socket`.
    pub fn pod(socket: impl Into<PathBuf>, landlock: LandlockMode) -> Self {
        Self {
            place: Place::Pod {
                socket: socket.into(),
            },
            landlock,
            limits: Limits::DEFAULT,
            task: None,
        }
    }

    /// The task container of one conversation whose `trajectory-executor serve --task` listens on
    /// `socket`, starting in `cwd` (`None`: the image's working directory). Its commands get no
    /// workspace limit: the container's ephemeral storage is theirs, and the kubelet limits it.
    #[must_use]
    pub fn in_task_container(self, socket: impl Into<PathBuf>, cwd: Option<String>) -> Self {
        Self {
            place: Place::Pod {
                socket: socket.into(),
            },
            limits: Limits {
                workspace_bytes: 0,
                ..self.limits
            },
            task: Some(TaskDir(cwd)),
            ..self
        }
    }

    /// Where the long-lived programs of a run's tools (MCP stdio servers, Chromium) run: the
    /// pod's sandbox container, when the worker has its socket (the contract's
    /// `TRAJ_SANDBOX_SOCKET`, as the operator sets it), confined as `spec` says; else none (as
    /// the worker's children: local runs).
    pub fn for_sessions(spec: &crate::spec::SandboxSpec) -> Option<Self> {
        let socket = std::env::var_os(crate::contract::env::SANDBOX_SOCKET)?;
        let landlock = match spec.landlock {
            crate::spec::LandlockSetting::Auto => LandlockMode::Auto,
            crate::spec::LandlockSetting::Required => LandlockMode::Required,
            crate::spec::LandlockSetting::Off => LandlockMode::Off,
        };
        Some(Self::pod(PathBuf::from(socket), landlock).with_limits(spec.limits.into()))
    }

    /// The same sandbox with `dirs` readable and their programs runnable by the commands (local
    /// runs; a pod's sandbox container has its image's directories).
    #[must_use]
    pub fn with_tool_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        if let Place::Local { tool_dirs, .. } = &mut self.place {
            *tool_dirs = dirs;
        }
        self
    }

    /// The directories named by [`Sandbox::with_tool_dirs`].
    pub fn tool_dirs(&self) -> &[PathBuf] {
        match &self.place {
            Place::Local { tool_dirs, .. } => tool_dirs,
            Place::Pod { .. } => &[],
        }
    }

    /// What the commands may read besides their workspace, where the worker knows it: a local
    /// run's (the system's directories and [`Sandbox::tool_dirs`]); `None` in a pod, whose
    /// sandbox container's image decides.
    pub fn command_files(&self) -> Option<trajectory_sandbox::ImageFiles> {
        match &self.place {
            Place::Local { tool_dirs, .. } => Some(local_files(tool_dirs)),
            Place::Pod { .. } => None,
        }
    }

    /// The same sandbox with other limits on each command.
    #[must_use]
    pub fn with_limits(self, limits: Limits) -> Self {
        Self { limits, ..self }
    }

    /// Whether the executor's Landlock rules are enforced where the commands run: runs `true`
    /// there with Landlock required (the worker asks once, at start-up). `workspace_root` is
    /// where the workspaces are.
    pub async fn landlock_enforced(&self, workspace_root: &Path) -> std::io::Result<bool> {
        match &self.place {
            Place::Local {
                executor,
                tool_dirs,
            } => {
                let status = tokio::process::Command::from(trajectory_sandbox::run::command(
                    executor,
                    workspace_root,
                    LandlockMode::Required,
                    Limits::NONE,
                    &local_files(tool_dirs),
                    Duration::ZERO,
                    "true",
                ))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .await?;
                Ok(status.success())
            }
            Place::Pod { socket } => {
                let stream = connect_waiting(socket, SOCKET_WAIT).await?;
                let request = Request {
                    workspace: workspace_root.display().to_string(),
                    command: "true".to_owned(),
                    landlock: LandlockMode::Required,
                    grace_ms: 0,
                    limits: Limits::NONE,
                };
                let code = send(stream, &request, &mut |_| {}).await?;
                Ok(code == 0)
            }
        }
    }
}

/// `text` as one word of a POSIX shell.
pub(crate) fn shell_quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// What the commands of a local run may read besides their workspace and the system's.
fn local_files(tool_dirs: &[PathBuf]) -> trajectory_sandbox::ImageFiles {
    if tool_dirs.is_empty() {
        trajectory_sandbox::ImageFiles::Hidden
    } else {
        trajectory_sandbox::ImageFiles::Named(tool_dirs.to_vec())
    }
}

/// What a command run by [`Sandbox::run_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandRun {
    /// The shell's exit code (`128 + N` for a signal N); `None` when it was stopped at its
    /// timeout.
    pub exit_code: Option<i32>,
    /// The last bytes of its output (standard output and error, as written).
    pub output_tail: Vec<u8>,
}

/// How long a command's background processes may still write once its shell exited.
const ONCE_GRACE: Duration = Duration::from_millis(100);

impl Sandbox {
    /// The workspace a request names for a conversation in `workspace`: that directory, or in a
    /// task container the start directory the container knows.
    fn request_workspace(&self, workspace: &Path) -> String {
        match &self.task {
            Some(task) => task.workspace().to_owned(),
            None => workspace.display().to_string(),
        }
    }

    /// Runs `command` once in the conversation's environment (its workspace, or its task
    /// container), confined as its commands are, for at most `timeout`: a command that runs
    /// longer is ended with everything it started. Keeps the last `keep` bytes of its output.
    pub async fn run_once(
        &self,
        workspace: &Path,
        command: &str,
        timeout: Duration,
        keep: usize,
    ) -> std::io::Result<CommandRun> {
        let mut tail = OutputTail::new(keep);
        let exit_code = match &self.place {
            Place::Local {
                executor,
                tool_dirs,
            } => {
                let cmd = trajectory_sandbox::run::command(
                    executor,
                    workspace,
                    self.landlock,
                    self.limits,
                    &local_files(tool_dirs),
                    ONCE_GRACE,
                    command,
                );
                run_local_once(cmd, timeout, &mut tail).await?
            }
            Place::Pod { socket } => {
                let request = Request {
                    workspace: self.request_workspace(workspace),
                    command: command.to_owned(),
                    landlock: self.landlock,
                    grace_ms: u64::try_from(ONCE_GRACE.as_millis()).unwrap_or(u64::MAX),
                    limits: self.limits,
                };
                // Dropping the request at the timeout closes the connection, which ends it.
                match tokio::time::timeout(
                    timeout,
                    run_in_pod(socket, &request, &mut |bytes| tail.push(bytes)),
                )
                .await
                {
                    Ok(code) => Some(code?),
                    Err(_) => None,
                }
            }
        };
        Ok(CommandRun {
            exit_code,
            output_tail: tail.into_bytes(),
        })
    }

    /// Does one step of a verifier's ([`trajectory_sandbox::verifier`]) in the conversation's
    /// environment: its answer, or why the executor refused it.
    pub async fn verifier_step(
        &self,
        workspace: &Path,
        step: VerifierStep,
    ) -> std::io::Result<Result<serde_json::Value, String>> {
        let request = VerifierRequest {
            workspace: self.request_workspace(workspace),
            step,
            landlock: self.landlock,
        };
        match &self.place {
            Place::Local {
                executor,
                tool_dirs,
            } => {
                let cmd = trajectory_sandbox::verifier::command(
                    executor,
                    workspace,
                    self.landlock,
                    &local_files(tool_dirs),
                );
                answer_locally(cmd, &serde_json::to_vec(&request)?).await
            }
            Place::Pod { socket } => {
                answer_in_pod(socket, &protocol::verifier_line(&request), "verifier step").await
            }
        }
    }
}

/// The last bytes of a command's output.
struct OutputTail {
    bytes: Vec<u8>,
    keep: usize,
}

impl OutputTail {
    fn new(keep: usize) -> Self {
        Self {
            bytes: Vec::new(),
            keep,
        }
    }

    fn push(&mut self, more: &[u8]) {
        self.bytes.extend_from_slice(more);
        // Trimmed in steps, not on every push: the copy is paid once per `keep` bytes.
        if self.bytes.len() > 2 * self.keep.max(1) {
            self.bytes.drain(..self.bytes.len() - self.keep);
        }
    }

    fn into_bytes(mut self) -> Vec<u8> {
        if self.bytes.len() > self.keep {
            self.bytes.drain(..self.bytes.len() - self.keep);
        }
        self.bytes
    }
}

/// Runs an executor's command line (`run`) as this process's child: its output into `tail`;
/// its exit code, or `None` when `timeout` passed first, after which the executor is asked
/// (`SIGTERM`) to end the command and everything it started, and waited for.
async fn run_local_once(
    mut cmd: std::process::Command,
    timeout: Duration,
    tail: &mut OutputTail,
) -> std::io::Result<Option<i32>> {
    use std::io::Read as _;
    use std::os::unix::process::ExitStatusExt as _;
    let (mut reader, writer) = std::io::pipe()?;
    cmd.stdout(writer.try_clone()?).stderr(writer);
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()?;
    // The command line held the pipe's writing ends: only the executor's remain open now.
    let keep = tail.keep;
    let reading = tokio::task::spawn_blocking(move || {
        let mut kept = OutputTail::new(keep);
        let mut chunk = [0_u8; 16 * 1024];
        while let Ok(n @ 1..) = reader.read(&mut chunk) {
            kept.push(&chunk[..n]);
        }
        kept.into_bytes()
    });
    let status = if let Ok(status) = tokio::time::timeout(timeout, child.wait()).await {
        Some(status?)
    } else {
        if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        child.wait().await?;
        None
    };
    let output = reading.await.map_err(std::io::Error::other)?;
    tail.push(&output);
    Ok(status.map(|status| {
        status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
    }))
}

/// Starts an executor that answers one request on its standard input (`verifier`) as this
/// process's child, and reads its answer.
async fn answer_locally(
    cmd: std::process::Command,
    request: &[u8],
) -> std::io::Result<Result<serde_json::Value, String>> {
    let mut child = tokio::process::Command::from(cmd)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(request).await?;
    }
    let output = child.wait_with_output().await?;
    if !output.status.success() {
        return Ok(Err(refusal(&output.stderr)));
    }
    parse_answer(&output.stdout)
}

/// The reason in a refused request's output, without the executor's prefix.
fn refusal(said: &[u8]) -> String {
    let said = String::from_utf8_lossy(said);
    said.trim()
        .strip_prefix(REFUSED_PREFIX)
        .unwrap_or(said.trim())
        .to_owned()
}

fn parse_answer(answer: &[u8]) -> std::io::Result<Result<serde_json::Value, String>> {
    match serde_json::from_slice(answer) {
        Ok(FileAnswer::Ok(value)) => Ok(Ok(value)),
        Ok(FileAnswer::Error(message)) => Ok(Err(message)),
        Err(err) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the sandbox sent a bad answer: {err}"),
        )),
    }
}

/// The executor binary: `trajectory-executor` next to this program (an installed pair, or
/// cargo's target directory; a test or bench binary sits one level down, in `deps/`), else the
/// one on `PATH`.
pub fn find_executor() -> PathBuf {
    if let Ok(this) = std::env::current_exe()
        && let Some(dir) = this.parent()
    {
        let beside = [
            dir.join(EXECUTOR_BINARY),
            dir.join("..").join(EXECUTOR_BINARY),
        ];
        if let Some(found) = beside.into_iter().find(|path| path.is_file()) {
            return found;
        }
    }
    PathBuf::from(EXECUTOR_BINARY)
}

/// Connects to `socket`, retrying while it does not exist yet or nobody listens on it.
async fn connect_waiting(socket: &Path, wait: Duration) -> std::io::Result<UnixStream> {
    let until = tokio::time::Instant::now() + wait;
    loop {
        match UnixStream::connect(socket).await {
            Ok(stream) => return Ok(stream),
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) && tokio::time::Instant::now() < until =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => {
                return Err(std::io::Error::new(
                    err.kind(),
                    format!("sandbox socket {}: {err}", socket.display()),
                ));
            }
        }
    }
}

/// Runs one command through the sandbox server on `socket`: each piece of output goes to
/// `output` as it arrives; returns the exit code. Dropping the future (a timeout, a cancelled
/// conversation) closes the connection, which ends the command.
pub async fn run_in_pod(
    socket: &Path,
    request: &Request,
    output: &mut (dyn FnMut(&[u8]) + Send),
) -> std::io::Result<i32> {
    let stream = UnixStream::connect(socket).await.map_err(|err| {
        std::io::Error::new(
            err.kind(),
            format!("sandbox socket {}: {err}", socket.display()),
        )
    })?;
    send(stream, request, output).await
}

/// Runs one file call in the task container whose server listens on `socket`: its result, or the
/// message the model is shown (the container's refusal included).
pub async fn run_file_in_pod(
    socket: &Path,
    request: &FileRequest,
) -> std::io::Result<Result<serde_json::Value, String>> {
    answer_in_pod(socket, &protocol::file_line(request), "file call").await
}

/// Sends one request `line` that is answered like a file call (a JSON answer, or a refusal) to
/// the server on `socket`.
async fn answer_in_pod(
    socket: &Path,
    line: &[u8],
    what: &str,
) -> std::io::Result<Result<serde_json::Value, String>> {
    let mut stream = UnixStream::connect(socket).await.map_err(|err| {
        std::io::Error::new(
            err.kind(),
            format!("sandbox socket {}: {err}", socket.display()),
        )
    })?;
    stream.write_all(line).await?;
    let mut answer = Vec::new();
    let code = receive(stream, &mut |bytes| answer.extend_from_slice(bytes)).await?;
    if code != 0 {
        return Ok(Err(format!("the {what} was refused: {}", refusal(&answer))));
    }
    parse_answer(&answer)
}

async fn send(
    mut stream: UnixStream,
    request: &Request,
    output: &mut (dyn FnMut(&[u8]) + Send),
) -> std::io::Result<i32> {
    let mut line = serde_json::to_vec(request)?;
    line.push(b'\n');
    stream.write_all(&line).await?;
    receive(stream, output).await
}

/// Reads a command's frames: its output to `output`, then its exit code.
async fn receive(
    mut stream: UnixStream,
    output: &mut (dyn FnMut(&[u8]) + Send),
) -> std::io::Result<i32> {
    let mut payload = Vec::new();
    loop {
        let Some((kind, len)) = session::read_frame(&mut stream, &mut payload).await? else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the sandbox closed the connection before the exit frame",
            ));
        };
        match kind {
            protocol::OUTPUT => output(&payload[..len]),
            protocol::EXIT => {
                return protocol::parse_exit(&payload[..len]).ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "the sandbox sent a bad exit frame",
                    )
                });
            }
            other => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the sandbox sent a frame of unknown kind {other}"),
                ));
            }
        }
    }
}

impl From<crate::spec::SandboxLimits> for Limits {
    fn from(spec: crate::spec::SandboxLimits) -> Self {
        Self {
            processes: spec.processes,
            memory_bytes: spec.memory_bytes,
            workspace_bytes: spec.workspace_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_files_default_limits_are_the_executors() {
        let spec = crate::spec::SandboxLimits::default();
        assert_eq!(Limits::from(spec), Limits::DEFAULT);
    }
}

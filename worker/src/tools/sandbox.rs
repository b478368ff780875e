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

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use program::{OutputLog, OutputSink, Program, ProgramState};
pub use session::{Ended, Session, SessionEnd};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
pub use trajectory_sandbox::protocol::SessionRequest;
use trajectory_sandbox::protocol::{self, FileAnswer, FileRequest, Request};
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
    /// The `trajectory-executor` binary the worker starts for each command.
    Local { executor: PathBuf },
    /// The socket of the sandbox container's `trajectory-executor serve`.
    Pod { socket: PathBuf },
}

impl Sandbox {
    /// Commands under the executor binary `executor`, started by the worker.
    pub fn new(executor: impl Into<PathBuf>, landlock: LandlockMode) -> Self {
        Self {
            place: Place::Local {
                executor: executor.into(),
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
            Place::Local { executor } => {
                let status = tokio::process::Command::from(trajectory_sandbox::run::command(
                    executor,
                    workspace_root,
                    LandlockMode::Required,
                    Limits::NONE,
                    &trajectory_sandbox::ImageFiles::Hidden,
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
    let mut stream = UnixStream::connect(socket).await.map_err(|err| {
        std::io::Error::new(
            err.kind(),
            format!("sandbox socket {}: {err}", socket.display()),
        )
    })?;
    stream.write_all(&protocol::file_line(request)).await?;
    let mut answer = Vec::new();
    let code = receive(stream, &mut |bytes| answer.extend_from_slice(bytes)).await?;
    if code != 0 {
        let said = String::from_utf8_lossy(&answer);
        let why = said
            .trim()
            .strip_prefix(REFUSED_PREFIX)
            .unwrap_or(said.trim());
        return Ok(Err(format!("the file call was refused: {why}")));
    }
    match serde_json::from_slice(&answer) {
        Ok(FileAnswer::Ok(value)) => Ok(Ok(value)),
        Ok(FileAnswer::Error(message)) => Ok(Err(message)),
        Err(err) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the sandbox sent a bad file answer: {err}"),
        )),
    }
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

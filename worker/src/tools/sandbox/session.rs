//! A long-lived program under the executor (protocol version 2, [`trajectory_sandbox::session`]):
//! an MCP stdio server or Chromium, confined like a command, whose streams the worker reads and
//! writes as ordinary async streams.
//!
//! ```text
//!  worker                                        executor (pod: in the sandbox container)
//!  stdio: DuplexStream ─► pump ── i / c ──► socket ──► the program's stdin / fd 3
//!  cdp:   DuplexStream ◄─ demux ◄─ o / c / e / x ─────── its stdout / fd 4 / stderr / exit
//! ```
//!
//! The session ends when its primary stream (`cdp` for a session with a `DevTools` pipe, else
//! `stdio`) is dropped or shut down: the connection closes, and the executor kills the program
//! with everything it started.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;
use trajectory_sandbox::protocol::{self, SessionRequest};

use super::{Place, SOCKET_WAIT, Sandbox, connect_waiting};

/// Bytes buffered in each direction of a session stream inside the worker.
const STREAM_BUFFER: usize = 256 * 1024;

/// Bytes of the program's standard error kept for error messages (the last ones).
const STDERR_TAIL: usize = 4096;

/// A running session.
#[derive(Debug)]
pub struct Session {
    /// Reads the program's standard output, writes its standard input.
    pub stdio: DuplexStream,
    /// Reads its fd 4, writes its fd 3 (with [`SessionRequest::cdp_pipe`]).
    pub cdp: Option<DuplexStream>,
    pub end: SessionEnd,
}

/// How a session ended, and what its program wrote to standard error (a clone stays usable after
/// the streams are handed on).
#[derive(Debug, Clone)]
pub struct SessionEnd {
    exit: watch::Receiver<Option<Ended>>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

/// The end of a session: the program's exit code, or the connection lost without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Exited(i32),
    Lost,
}

impl SessionEnd {
    /// The end, once it came.
    pub fn ended(&self) -> Option<Ended> {
        *self.exit.borrow()
    }

    /// Waits for the end.
    pub async fn wait(&self) -> Ended {
        let mut exit = self.exit.clone();
        match exit.wait_for(Option::is_some).await {
            Ok(ended) => ended.unwrap_or(Ended::Lost),
            Err(_) => Ended::Lost,
        }
    }

    /// The last bytes of the program's standard error, as text.
    pub fn stderr_tail(&self) -> String {
        let tail = self.stderr.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&tail).into_owned()
    }
}

impl Sandbox {
    /// A session request for `argv` with `env`, under this sandbox's Landlock mode and limits.
    pub fn session_request(
        &self,
        argv: Vec<String>,
        env: BTreeMap<String, String>,
    ) -> SessionRequest {
        SessionRequest {
            argv,
            env,
            landlock: self.landlock,
            limits: self.limits,
            cdp_pipe: false,
            workspace: None,
            cwd: None,
        }
    }

    /// Starts `request`'s program: in the sandbox container (a pod), or under an executor of the
    /// worker's own, with a private directory removed when it ends (local).
    pub async fn start_session(&self, request: &SessionRequest) -> std::io::Result<Session> {
        let stream = self.connect_session(request).await?;
        Ok(attach(stream, request.cdp_pipe))
    }

    /// The connection of a new session running `request`: to the sandbox container's server
    /// (a pod), or to an executor of the worker's own (local).
    pub(super) async fn connect_session(
        &self,
        request: &SessionRequest,
    ) -> std::io::Result<UnixStream> {
        match &self.place {
            Place::Pod { socket } => {
                let mut stream = connect_waiting(socket, SOCKET_WAIT).await?;
                stream.write_all(&protocol::session_line(request)).await?;
                Ok(stream)
            }
            Place::Local {
                executor,
                tool_dirs,
            } => start_local(executor, &super::local_files(tool_dirs), request),
        }
    }
}

/// Starts the executor here, on one end of a socket pair; returns the other. A session without
/// a workspace gets a private directory, removed when the executor has ended.
fn start_local(
    executor: &Path,
    files: &trajectory_sandbox::ImageFiles,
    request: &SessionRequest,
) -> std::io::Result<UnixStream> {
    let private = if request.workspace.is_none() {
        Some(
            tempfile::Builder::new()
                .prefix("trajectory-session-")
                .tempdir()?,
        )
    } else {
        None
    };
    let dir = match (&request.workspace, &private) {
        (Some(workspace), _) => std::path::PathBuf::from(workspace),
        (None, Some(private)) => private.path().to_owned(),
        (None, None) => unreachable!("a private directory is made when there is no workspace"),
    };
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    let mut command = tokio::process::Command::from(trajectory_sandbox::session::command(
        executor, &dir, request, files,
    ));
    command
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
            theirs,
        )))
        .process_group(0);
    let mut child = command.spawn().map_err(|err| {
        std::io::Error::new(
            err.kind(),
            format!("cannot start {}: {err}", executor.display()),
        )
    })?;
    // The executor ends when the connection closes; its private directory goes after it.
    tokio::spawn(async move {
        let _ = child.wait().await;
        drop(private);
    });
    UnixStream::from_std(ours)
}

/// Wires the connection to the session's streams.
fn attach(stream: UnixStream, cdp_pipe: bool) -> Session {
    let (read, write) = stream.into_split();
    let (stdio, stdio_inner) = tokio::io::duplex(STREAM_BUFFER);
    let (stdio_from_user, stdio_to_user) = tokio::io::split(stdio_inner);
    let (cdp, cdp_inner) = if cdp_pipe {
        let (user, inner) = tokio::io::duplex(STREAM_BUFFER);
        (Some(user), Some(tokio::io::split(inner)))
    } else {
        (None, None)
    };
    let (cdp_from_user, cdp_to_user) = cdp_inner.map_or((None, None), |(r, w)| (Some(r), Some(w)));
    let (exit_sender, exit) = watch::channel(None);
    let stderr = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(pump(write, stdio_from_user, cdp_from_user));
    tokio::spawn(demux(
        read,
        stdio_to_user,
        cdp_to_user,
        Arc::clone(&stderr),
        exit_sender,
    ));
    Session {
        stdio,
        cdp,
        end: SessionEnd { exit, stderr },
    }
}

/// What the worker writes goes out as frames, until the primary stream ends; then the write
/// half is dropped, which shuts the connection down for the executor.
async fn pump(
    mut socket: OwnedWriteHalf,
    mut stdio: ReadHalf<DuplexStream>,
    mut cdp: Option<ReadHalf<DuplexStream>>,
) {
    let mut stdio_buf = vec![0_u8; protocol::MAX_FRAME_BYTES];
    let mut cdp_buf = vec![0_u8; protocol::MAX_FRAME_BYTES];
    let mut stdio_open = true;
    loop {
        let (kind, read) = tokio::select! {
            read = stdio.read(&mut stdio_buf), if stdio_open => (protocol::STDIN, read),
            read = read_optional(cdp.as_mut(), &mut cdp_buf) => (protocol::CDP, read),
        };
        let payload = match (kind, read) {
            (_, Ok(n)) if n > 0 => {
                if kind == protocol::STDIN {
                    &stdio_buf[..n]
                } else {
                    &cdp_buf[..n]
                }
            }
            // A DevTools session lives as long as its pipe; its standard input may be dropped.
            (protocol::STDIN, _) if cdp.is_some() => {
                stdio_open = false;
                continue;
            }
            _ => return,
        };
        let header = protocol::header(kind, payload.len());
        if socket.write_all(&header).await.is_err() || socket.write_all(payload).await.is_err() {
            return;
        }
    }
}

/// Reads `stream`, or waits forever when there is none.
async fn read_optional(
    stream: Option<&mut ReadHalf<DuplexStream>>,
    buf: &mut [u8],
) -> std::io::Result<usize> {
    match stream {
        Some(stream) => stream.read(buf).await,
        None => std::future::pending().await,
    }
}

/// The executor's frames go to the worker's streams, until the exit frame or the connection's
/// end; the streams then see their end of file.
async fn demux(
    mut socket: OwnedReadHalf,
    mut stdio: WriteHalf<DuplexStream>,
    mut cdp: Option<WriteHalf<DuplexStream>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    exit: watch::Sender<Option<Ended>>,
) {
    let mut payload = Vec::new();
    let ended = loop {
        let Ok(Some((kind, len))) = read_frame(&mut socket, &mut payload).await else {
            break Ended::Lost;
        };
        let bytes = &payload[..len];
        match kind {
            // A reader that went away (the session is ending) just stops receiving.
            protocol::OUTPUT => {
                let _ = stdio.write_all(bytes).await;
            }
            protocol::CDP => {
                if let Some(cdp) = cdp.as_mut() {
                    let _ = cdp.write_all(bytes).await;
                }
            }
            protocol::STDERR => {
                let mut tail = stderr.lock().unwrap_or_else(PoisonError::into_inner);
                tail.extend_from_slice(bytes);
                let excess = tail.len().saturating_sub(STDERR_TAIL);
                tail.drain(..excess);
            }
            protocol::EXIT => {
                break protocol::parse_exit(bytes).map_or(Ended::Lost, Ended::Exited);
            }
            // These programs are reached through their streams only.
            protocol::PID => {}
            _ => break Ended::Lost,
        }
    };
    let _ = stdio.shutdown().await;
    if let Some(cdp) = cdp.as_mut() {
        let _ = cdp.shutdown().await;
    }
    let _ = exit.send(Some(ended));
}

/// One frame into `payload`: its kind and length; `None` at the end of the connection.
pub(super) async fn read_frame(
    socket: &mut (impl AsyncRead + Unpin),
    payload: &mut Vec<u8>,
) -> std::io::Result<Option<(u8, usize)>> {
    let mut header = [0_u8; protocol::HEADER_BYTES];
    match socket.read_exact(&mut header).await {
        Ok(_) => {}
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(err) => return Err(err),
    }
    let (kind, len) = protocol::parse_header(header);
    if len > protocol::MAX_FRAME_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the sandbox sent a frame of {len} bytes"),
        ));
    }
    // Grown to the longest frame seen, not to the longest possible: most frames are a few bytes
    // (a marker, a pid), and a short-lived program should not zero 64 KiB for them.
    if payload.len() < len {
        payload.resize(len, 0);
    }
    socket.read_exact(&mut payload[..len]).await?;
    Ok(Some((kind, len)))
}

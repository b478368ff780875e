//! `trajectory-executor serve`: the sandbox container's entry point (and, with `--task`, a task
//! container's: one conversation in a container of its row's image).
//!
//! It listens on a Unix socket on an emptyDir it shares with the worker container, and runs each
//! command it is sent under its own [`crate::run`] executor in the conversation's workspace (a
//! directory under `--workspace-root`, the workspace volume both containers mount), streaming the
//! output back ([`crate::protocol`]). A session (protocol version 2) gets a private directory
//! of its own under `--session-root` (default: the temporary directory), removed when it ends,
//! or (version 3) the conversation's workspace it names, and an executor of its own
//! ([`crate::session`]) that takes over the connection. A thread per
//! connection; the main thread owns the signals.
//!
//! The server is the container's PID 1 (and a child subreaper, for when it is not), so every
//! process whose parent dies is re-parented to it: it reaps them all (`waitpid(-1)`), and hands the
//! exit codes of the executors it started to the connections that wait for them. A child that is
//! not one of its executors can only come from a command whose executor died before the command
//! did (`SIGKILL`ed by the OOM killer, or by the command itself: the two share a uid and a Landlock
//! domain): the server kills it, with its process group when it leads one, so that nothing
//! outlives its command there either ([`kill_orphans`]). A worker hanging up (a timeout, a
//! cancelled call) asks the executor to end its command, and kills it after
//! [`CANCEL_GRACE`] if it has not (a command can stop its executor with `SIGSTOP`), which ends
//! the command the same way. On `SIGTERM` (the pod ends) it asks every executor to end its
//! command, waits for them, and exits.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::signalfd::SignalFd;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getpgid};

use crate::protocol::{self, Line, SessionRequest, VerifierStep};
use crate::session::write_frame;
use crate::{ImageFiles, REFUSED_EXIT, REFUSED_PREFIX};

/// The subcommand.
pub const SUBCOMMAND: &str = "serve";

/// How long a connection may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the executors get to end their commands when the pod ends.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long an executor asked to end its command (the worker hung up) has before it is killed.
/// It needs milliseconds; this bounds a stopped or wedged one.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// Stack of a connection's thread: it only copies bytes between two descriptors.
const CONNECTION_STACK: usize = 256 * 1024;

#[derive(Debug)]
struct ServeArgs {
    socket: PathBuf,
    workspace_root: PathBuf,
    session_root: PathBuf,
    /// `--image-readable`: the container's image is the task's, and its files are readable.
    image_readable: bool,
    /// `--task`: a task container, one conversation's: its image's files are writable, a
    /// workspace is any directory of them (the empty name: where the server started, the
    /// image's working directory), and commands keep the container's environment.
    task: bool,
}

fn parse_args(mut args: impl Iterator<Item = OsString>) -> Result<ServeArgs, String> {
    let mut socket = None;
    let mut workspace_root = None;
    let mut session_root = std::env::temp_dir();
    let mut image_readable = false;
    let mut task = false;
    while let Some(flag) = args.next() {
        if flag == "--image-readable" {
            image_readable = true;
            continue;
        }
        if flag == "--task" {
            task = true;
            continue;
        }
        let value = args
            .next()
            .ok_or(format!("{} needs a value", flag.display()))?;
        match flag.to_str() {
            Some("--socket") => socket = Some(PathBuf::from(value)),
            Some("--workspace-root") => workspace_root = Some(PathBuf::from(value)),
            Some("--session-root") => session_root = PathBuf::from(value),
            _ => return Err(format!("unknown argument {}", flag.display())),
        }
    }
    let workspace_root = match (workspace_root, task) {
        (Some(root), _) => root,
        // A task container's workspaces are its image's directories.
        (None, true) => PathBuf::from("/"),
        (None, false) => return Err("missing --workspace-root".to_owned()),
    };
    Ok(ServeArgs {
        socket: socket.ok_or("missing --socket")?,
        workspace_root,
        session_root,
        image_readable,
        task,
    })
}

/// The server process; returns its exit code.
pub fn main(args: impl Iterator<Item = OsString>) -> i32 {
    match parse_args(args).and_then(|args| serve(&args)) {
        Ok(()) => 0,
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "trajectory-executor serve: {message}");
            1
        }
    }
}

/// The executors running, by pid, each with the connection waiting for its exit code.
#[derive(Debug, Default)]
struct Executors {
    waiting: HashMap<Pid, Sender<i32>>,
}

type Shared = Arc<Mutex<Executors>>;

fn lock(executors: &Shared) -> std::sync::MutexGuard<'_, Executors> {
    // A connection thread that panicked leaves consistent data behind (one map operation).
    executors.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sends `signal` to executor `pid` if it has not been reaped: under the lock the reaper holds
/// while it reaps, so a pid recycled by then is never signalled.
fn signal_executor(executors: &Shared, pid: Pid, signal: Signal) {
    if lock(executors).waiting.contains_key(&pid) {
        let _ = kill(pid, signal);
    }
}

fn serve(args: &ServeArgs) -> Result<(), String> {
    // Blocked before any thread starts, so every thread inherits the mask and the signals reach
    // only the descriptor.
    let signal_fd =
        crate::run::signal_descriptor(&[Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT])?;
    // As PID 1 it is the reaper anyway; elsewhere (a test, a task image with an init of its own)
    // this keeps the orphans of a dead executor with the server, which kills them.
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|err| format!("cannot become a child subreaper: {err}"))?;

    let workspace_root = args
        .workspace_root
        .canonicalize()
        .map_err(|err| format!("workspace root {}: {err}", args.workspace_root.display()))?;
    let executor = std::env::current_exe().map_err(|err| format!("no /proc/self/exe: {err}"))?;
    // A socket left by an earlier life of this container would make bind fail.
    match std::fs::remove_file(&args.socket) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("cannot remove {}: {err}", args.socket.display()));
        }
        _ => {}
    }
    let listener = UnixListener::bind(&args.socket)
        .map_err(|err| format!("cannot listen on {}: {err}", args.socket.display()))?;
    if args.task {
        // A task container runs as its image's user (root, often), the worker as its own: the
        // socket's volume is shared with the worker alone, and the worker must be able to connect.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&args.socket, std::fs::Permissions::from_mode(0o666))
            .map_err(|err| format!("cannot open {} to the worker: {err}", args.socket.display()))?;
    }

    // The workspaces, the sessions' directories and the executor's own stay private.
    let image_files = if args.task {
        ImageFiles::WritableExcept(vec![executor.clone(), args.socket.clone()])
    } else if args.image_readable {
        ImageFiles::ReadableExcept(vec![
            workspace_root.clone(),
            args.session_root.clone(),
            executor.clone(),
            args.socket.clone(),
        ])
    } else {
        ImageFiles::Hidden
    };
    let start_dir =
        std::env::current_dir().map_err(|err| format!("no working directory: {err}"))?;
    let places = Places {
        executor,
        workspace_root,
        session_root: args.session_root.clone(),
        image_files,
        start_dir,
    };
    let executors: Shared = Arc::default();
    {
        let executors = Arc::clone(&executors);
        std::thread::Builder::new()
            .name("accept".to_owned())
            .spawn(move || accept(&listener, &places, &executors))
            .map_err(|err| format!("cannot start the accept thread: {err}"))?;
    }
    let _ = writeln!(
        std::io::stderr(),
        "trajectory-executor serve: listening on {}",
        args.socket.display()
    );

    loop {
        let Ok(Some(info)) = signal_fd.read_signal() else {
            continue;
        };
        if i32::try_from(info.ssi_signo).ok() == Some(Signal::SIGCHLD as i32) {
            reap(&executors);
        } else {
            shut_down(&signal_fd, &executors);
            return Ok(());
        }
    }
}

/// Where the server finds its executor and puts workspaces and sessions.
#[derive(Debug, Clone)]
struct Places {
    executor: PathBuf,
    workspace_root: PathBuf,
    session_root: PathBuf,
    image_files: ImageFiles,
    /// Where the server started: in a task container, the image's working directory, which a
    /// workspace of the empty name is.
    start_dir: PathBuf,
}

impl Places {
    /// The directory a request's `workspace` names: one under the workspace root; in a task
    /// container, any directory but the private ones, and the empty name is the start directory.
    /// In a task container, makes the top-level directories of a verifier's directories that the
    /// image lacks (`/tests`, `/logs`), which its confined executor could not: Landlock opens
    /// the entries of `/` to it, not `/` itself. Only a missing name directly under `/` is
    /// made, and nothing of the model's can be there (its commands cannot make entries in `/`
    /// either). A directory the sandbox keeps private is refused.
    fn verifier_dirs(&self, step: &VerifierStep) -> Result<(), String> {
        let VerifierStep::Prepare { fresh, .. } = step else {
            return Ok(());
        };
        if !self.image_files.is_task_container() {
            return Ok(());
        }
        for dir in fresh {
            let Some(top) = Path::new(dir)
                .components()
                .nth(1)
                .map(|name| Path::new("/").join(name))
            else {
                continue;
            };
            let private = self
                .image_files
                .private()
                .iter()
                .map(PathBuf::as_path)
                .chain(crate::reach::NEVER_READABLE.iter().map(Path::new))
                .any(|private| private.components().nth(1) == top.components().nth(1));
            if private {
                return Err(format!(
                    "the verifier's directory {dir} lies in {}, which the sandbox keeps private",
                    top.display()
                ));
            }
            match std::fs::create_dir(&top) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(err) => return Err(format!("cannot make {}: {err}", top.display())),
            }
        }
        Ok(())
    }

    fn workspace(&self, requested: &str) -> Result<PathBuf, String> {
        if !self.image_files.is_task_container() {
            return resolve_workspace(&self.workspace_root, requested);
        }
        let requested = if requested.is_empty() {
            self.start_dir.as_path()
        } else {
            Path::new(requested)
        };
        let workspace = requested
            .canonicalize()
            .map_err(|err| format!("cannot work in {}: {err}", requested.display()))?;
        let private = self
            .image_files
            .private()
            .iter()
            .filter_map(|path| path.components().nth(1))
            .any(|top| workspace.components().nth(1) == Some(top));
        if private || !workspace.is_dir() {
            return Err(format!(
                "cannot work in {}: not a directory of the task's image",
                requested.display()
            ));
        }
        Ok(workspace)
    }
}

fn accept(listener: &UnixListener, places: &Places, executors: &Shared) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (places, executors) = (places.clone(), Arc::clone(executors));
        let spawned = std::thread::Builder::new()
            .name("connection".to_owned())
            .stack_size(CONNECTION_STACK)
            .spawn(move || connection(stream, &places, &executors));
        if let Err(err) = spawned {
            // Out of threads: the worker sees its connection closed and reports a tool error.
            let _ = writeln!(std::io::stderr(), "cannot start a connection thread: {err}");
        }
    }
}

/// Reaps every exited child (an executor's exit code goes to its connection, an orphan's
/// nowhere), then kills the orphans. Under the lock throughout: an executor is registered before
/// the reaper can see it, and a reaped pid leaves the map before it can be recycled.
fn reap(executors: &Shared) {
    let mut executors = lock(executors);
    loop {
        let (pid, code) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => (pid, code),
            Ok(WaitStatus::Signaled(pid, signal, _)) => (pid, 128 + signal as i32),
            Ok(WaitStatus::StillAlive) | Err(_) => break,
            Ok(_) => continue,
        };
        if let Some(waiting) = executors.waiting.remove(&pid) {
            let _ = waiting.send(code);
        }
    }
    kill_orphans(&executors);
}

/// `SIGKILL`s every child of the server that is not a running executor, and the process group
/// of each that leads one. Such a child was re-parented here because its executor died first: an
/// executor that ends normally has killed and reaped everything its command started. Each kill
/// re-parents the victim's own children here, and its death brings the next [`reap`], so the
/// whole tree goes, level by level; a process group (the command's shell's, or one a `setsid`
/// made) goes at once, forks in flight included. Only a group the orphan leads: a process can
/// join any group of its session, and a command that joined another conversation's group must
/// not make the server kill that conversation.
///
/// The re-parented children are the main thread's (the kernel gives orphans to the reaper's
/// first live thread), and this runs on it: one read of `/proc/thread-self/children`. The
/// executors are the connection threads' children.
fn kill_orphans(executors: &Executors) {
    let Ok(children) = std::fs::read_to_string("/proc/thread-self/children") else {
        return;
    };
    for pid in children
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
    {
        let pid = Pid::from_raw(pid);
        if executors.waiting.contains_key(&pid) {
            continue;
        }
        // An unreaped child's pid, and so the group it leads, cannot be recycled meanwhile.
        if getpgid(Some(pid)) == Ok(pid) {
            let _ = killpg(pid, Signal::SIGKILL);
        }
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// Asks every executor to end its command, reaps them for at most [`SHUTDOWN_GRACE`], exits.
fn shut_down(signal_fd: &SignalFd, executors: &Shared) {
    for pid in lock(executors).waiting.keys() {
        let _ = kill(*pid, Signal::SIGTERM);
    }
    let until = Instant::now() + SHUTDOWN_GRACE;
    while !lock(executors).waiting.is_empty() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let mut fds = [PollFd::new(signal_fd.as_fd(), PollFlags::POLLIN)];
        if let Ok(1..) = poll(
            &mut fds,
            PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX),
        ) {
            let _ = signal_fd.read_signal();
            reap(executors);
        }
    }
}

/// One command, from its request to its exit frame; or one session, handed to its executor.
fn connection(mut stream: UnixStream, places: &Places, executors: &Shared) {
    let line = read_line(&stream).and_then(|line| Line::parse(&line));
    let outcome = match line {
        Ok(Line::Session(request)) => return session(stream, places, &request, executors),
        Ok(Line::Command(request)) => places.workspace(&request.workspace).and_then(|workspace| {
            let command = crate::run::command(
                &places.executor,
                &workspace,
                request.landlock,
                request.limits,
                &places.image_files,
                Duration::from_millis(request.grace_ms),
                &request.command,
            );
            start(command, None, executors)
        }),
        Ok(Line::File(request)) => places.workspace(&request.workspace).and_then(|workspace| {
            let command = crate::file::command(
                &places.executor,
                &workspace,
                request.landlock,
                &places.image_files,
            );
            let call = serde_json::to_vec(&request).map_err(|err| format!("file call: {err}"))?;
            start(command, Some(&call), executors)
        }),
        Ok(Line::Verifier(request)) => places
            .verifier_dirs(&request.step)
            .and_then(|()| places.workspace(&request.workspace))
            .and_then(|workspace| {
                let command = crate::verifier::command(
                    &places.executor,
                    &workspace,
                    request.landlock,
                    &places.image_files,
                );
                let step =
                    serde_json::to_vec(&request).map_err(|err| format!("verifier step: {err}"))?;
                start(command, Some(&step), executors)
            }),
        Err(message) => Err(message),
    };
    let code = match outcome {
        Ok((pid, output, exited)) => relay(&mut stream, pid, &output, &exited, executors),
        Err(message) => {
            let refusal = format!("{REFUSED_PREFIX}{message}\n");
            let _ = write_frame(&mut stream, protocol::OUTPUT, refusal.as_bytes());
            REFUSED_EXIT
        }
    };
    let _ = write_frame(&mut stream, protocol::EXIT, &protocol::exit_payload(code));
}

/// Reads the request line, and not a byte more: what follows a session's line is already the
/// session's, and goes to its executor with the connection.
fn read_line(stream: &UnixStream) -> Result<Vec<u8>, String> {
    use nix::sys::socket::{MsgFlags, recv};
    stream
        .set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|err| format!("socket: {err}"))?;
    let mut line = Vec::new();
    let mut peeked = vec![0_u8; 64 * 1024];
    loop {
        let n = recv(stream.as_raw_fd(), &mut peeked, MsgFlags::MSG_PEEK)
            .map_err(|err| format!("cannot read the request: {err}"))?;
        if n == 0 {
            break;
        }
        let newline = peeked[..n].iter().position(|&byte| byte == b'\n');
        let take = newline.map_or(n, |at| at + 1);
        (&*stream)
            .read_exact(&mut peeked[..take])
            .map_err(|err| format!("cannot read the request: {err}"))?;
        line.extend_from_slice(&peeked[..take]);
        if newline.is_some() {
            break;
        }
        if line.len() as u64 > protocol::MAX_REQUEST_BYTES {
            return Err(format!(
                "the request line is longer than {} bytes",
                protocol::MAX_REQUEST_BYTES
            ));
        }
    }
    stream
        .set_read_timeout(None)
        .map_err(|err| format!("socket: {err}"))?;
    Ok(line)
}

/// Session directories made by this server, for unique names.
static SESSIONS: AtomicU64 = AtomicU64::new(0);

/// Starts a session's executor on the connection and waits for it: in the conversation's
/// workspace when the request names one, else in a private directory made for it and removed
/// when it ends.
fn session(mut stream: UnixStream, places: &Places, request: &SessionRequest, executors: &Shared) {
    use std::os::unix::process::CommandExt;
    let private = request.workspace.is_none().then(|| {
        places.session_root.join(format!(
            "session-{}-{}",
            std::process::id(),
            SESSIONS.fetch_add(1, Ordering::Relaxed)
        ))
    });
    let started = session_dir(places, request, private.as_deref()).and_then(|dir| {
        let connection = stream.try_clone().map_err(|err| format!("socket: {err}"))?;
        let mut command =
            crate::session::command(&places.executor, &dir, request, &places.image_files);
        command
            .stdin(std::process::Stdio::from(OwnedFd::from(connection)))
            .process_group(0);
        spawn_registered(command, executors).map(|(pid, exited, _)| (pid, exited))
    });
    match started {
        // The executor holds the connection now; this thread only watches for the worker's
        // hang-up and waits to clean up.
        Ok((pid, exited)) => watch_session(&stream, pid, &exited, executors),
        Err(message) => {
            let refusal = format!("{REFUSED_PREFIX}{message}\n");
            let _ = write_frame(&mut stream, protocol::STDERR, refusal.as_bytes());
            let _ = write_frame(
                &mut stream,
                protocol::EXIT,
                &protocol::exit_payload(REFUSED_EXIT),
            );
        }
    }
    if let Some(dir) = private
        && dir.exists()
        && let Err(err) = std::fs::remove_dir_all(&dir)
    {
        let _ = writeln!(std::io::stderr(), "cannot remove {}: {err}", dir.display());
    }
}

/// How often a session's thread looks whether its executor has ended, while the worker is
/// still connected.
const SESSION_CHECK: Duration = Duration::from_secs(1);

/// Waits for a session's executor to end. The executor ends its program when the worker hangs
/// up; one that does not (stopped by its own program with `SIGSTOP`) is asked again, continued,
/// and killed after [`CANCEL_GRACE`], as a command's executor is.
fn watch_session(stream: &UnixStream, pid: Pid, exited: &Receiver<i32>, executors: &Shared) {
    use rustix::event::{PollFd as HangUp, PollFlags as Events, Timespec};
    use std::sync::mpsc::RecvTimeoutError;
    loop {
        match exited.try_recv() {
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
            _ => return,
        }
        // nix has no `POLLRDHUP`: the worker shutting down its side is what is waited for.
        let mut fds = [HangUp::new(stream, Events::RDHUP)];
        let check = Timespec::try_from(SESSION_CHECK).unwrap_or_default();
        match rustix::event::poll(&mut fds, Some(&check)) {
            Ok(1..)
                if fds[0]
                    .revents()
                    .intersects(Events::RDHUP | Events::HUP | Events::ERR) =>
            {
                break;
            }
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            // Nothing to watch with: wait for the executor as before.
            Err(_) => {
                let _ = exited.recv();
                return;
            }
        }
    }
    signal_executor(executors, pid, Signal::SIGTERM);
    signal_executor(executors, pid, Signal::SIGCONT);
    if let Err(RecvTimeoutError::Timeout) = exited.recv_timeout(CANCEL_GRACE) {
        signal_executor(executors, pid, Signal::SIGKILL);
        let _ = exited.recv();
    }
}

/// The session's writable directory: the workspace it names (which must lie under the
/// workspace root), or `private`, created here.
fn session_dir(
    places: &Places,
    request: &SessionRequest,
    private: Option<&Path>,
) -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt;
    match (&request.workspace, private) {
        (Some(workspace), _) => places.workspace(workspace),
        (None, Some(dir)) => std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map(|()| dir.to_owned())
            .map_err(|err| format!("cannot create {}: {err}", dir.display())),
        (None, None) => Err("a session needs a workspace or a private directory".to_owned()),
    }
}

/// Spawns an executor and registers it with the reaper; returns where its exit code arrives, and
/// its standard input when that is piped. The command's own copies of descriptors (pipe ends,
/// the connection) close when it returns.
fn spawn_registered(
    mut command: std::process::Command,
    executors: &Shared,
) -> Result<(Pid, Receiver<i32>, Option<std::process::ChildStdin>), String> {
    let (sender, exited) = channel();
    // Registered under the lock the reaper takes, so its exit cannot be reaped unseen.
    let mut executors = lock(executors);
    let mut child = command
        .spawn()
        .map_err(|err| format!("cannot start the executor: {err}"))?;
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    executors.waiting.insert(pid, sender);
    Ok((pid, exited, child.stdin.take()))
}

/// The workspace directory a request names, which must be the root or lie under it, symlinks
/// resolved.
fn resolve_workspace(root: &Path, requested: &str) -> Result<PathBuf, String> {
    let workspace = Path::new(requested)
        .canonicalize()
        .map_err(|err| format!("workspace {requested}: {err}"))?;
    if !workspace.starts_with(root) || !workspace.is_dir() {
        return Err(format!(
            "workspace {requested} is not a directory under the workspace root {}",
            root.display()
        ));
    }
    Ok(workspace)
}

/// Starts an executor (`command`, a [`crate::run`] or [`crate::file`] one) with its output on a
/// pipe, and writes `input` to its standard input; returns its pid, the pipe's read end and where
/// its exit code will arrive.
fn start(
    mut command: std::process::Command,
    input: Option<&[u8]>,
    executors: &Shared,
) -> Result<(Pid, std::io::PipeReader, Receiver<i32>), String> {
    use std::os::unix::process::CommandExt;
    let (reader, writer) = std::io::pipe().map_err(|err| format!("no pipe: {err}"))?;
    let writer_for_stderr = writer
        .try_clone()
        .map_err(|err| format!("no pipe: {err}"))?;
    command
        .stdout(writer)
        .stderr(writer_for_stderr)
        .process_group(0);
    if input.is_some() {
        command.stdin(std::process::Stdio::piped());
    }
    // `command` holds the pipe's write ends; they close with it, so the read end sees EOF when
    // the executor and its command are gone.
    let (pid, exited, stdin) = spawn_registered(command, executors)?;
    if let (Some(input), Some(mut stdin)) = (input, stdin) {
        // The executor reads all of it before it writes a byte, so this cannot wait on the
        // output; one that died first leaves the error for its exit code to tell.
        let _ = stdin.write_all(input);
    }
    Ok((pid, reader, exited))
}

/// Streams the executor's output to the worker until the executor is gone; returns its exit code.
/// The worker hanging up first ends the command: the executor is asked to (`SIGTERM`, and
/// `SIGCONT` in case the command stopped it), and killed after [`CANCEL_GRACE`], whereupon the
/// reaper kills what is left of the command ([`kill_orphans`]).
fn relay(
    stream: &mut UnixStream,
    pid: Pid,
    output: &std::io::PipeReader,
    exited: &Receiver<i32>,
    executors: &Shared,
) -> i32 {
    let mut buf = vec![0_u8; protocol::MAX_FRAME_BYTES];
    let mut worker_there = true;
    let mut kill_at: Option<Instant> = None;
    let cancel = |worker_there: &mut bool, kill_at: &mut Option<Instant>| {
        if std::mem::replace(worker_there, false) {
            signal_executor(executors, pid, Signal::SIGTERM);
            signal_executor(executors, pid, Signal::SIGCONT);
            *kill_at = Some(Instant::now() + CANCEL_GRACE);
        }
    };
    loop {
        let mut fds = vec![PollFd::new(output.as_fd(), PollFlags::POLLIN)];
        if worker_there {
            fds.push(PollFd::new(stream.as_fd(), PollFlags::POLLIN));
        }
        let timeout = kill_at.map_or(PollTimeout::NONE, |at| {
            PollTimeout::try_from(at.saturating_duration_since(Instant::now()))
                .unwrap_or(PollTimeout::MAX)
        });
        match poll(&mut fds, timeout) {
            Err(Errno::EINTR) => continue,
            Err(_) => break,
            Ok(0) => {
                // The grace is over: the executor is killed, the reaper kills its command.
                signal_executor(executors, pid, Signal::SIGKILL);
                kill_at = None;
                continue;
            }
            Ok(_) => {}
        }
        let output_ready = fds[0].any().unwrap_or(true);
        let worker_spoke = fds.get(1).is_some_and(|fd| fd.any().unwrap_or(true));
        drop(fds);
        if worker_spoke {
            // Nothing is expected after the request: end of file or anything else is a hang-up.
            cancel(&mut worker_there, &mut kill_at);
        }
        if output_ready {
            match (&*output).read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if worker_there && write_frame(stream, protocol::OUTPUT, &buf[..n]).is_err() {
                        cancel(&mut worker_there, &mut kill_at);
                    }
                }
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }
    // The pipe is closed: the executor has ended or is ending.
    exited.recv().unwrap_or(REFUSED_EXIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspaces_outside_the_root_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("c1")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        let under = |name: &str| root.join(name).display().to_string();
        assert_eq!(
            resolve_workspace(&root, &under("c1")).unwrap(),
            root.join("c1")
        );
        assert_eq!(resolve_workspace(&root, &under("")).unwrap(), root);
        for bad in [
            under(".."),
            "/etc".to_owned(),
            under("c1/../.."),
            under("out"),
            under("x"),
        ] {
            assert!(resolve_workspace(&root, &bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn serve_arguments_are_checked() {
        let args = |list: &[&str]| {
            list.iter()
                .map(OsString::from)
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert!(parse_args(args(&["--socket", "/s"])).is_err());
        assert!(parse_args(args(&["--socket"])).is_err());
        assert!(parse_args(args(&["--nope", "x"])).is_err());
        let parsed = parse_args(args(&["--socket", "/s", "--workspace-root", "/w"])).unwrap();
        assert_eq!(parsed.socket, Path::new("/s"));
    }
}

//! `trajectory-executor session`: one long-lived program (an MCP stdio server, Chromium),
//! confined like a command, whose standard streams travel as frames over one connection
//! ([`crate::protocol`], version 2).
//!
//! The caller starts the executor with the connection (a Unix socket) as its standard input and
//! the program's environment as its own (cleared, then what [`command`] sets). The executor
//! confines itself as [`crate::run`] does (no capabilities, `no_new_privs`, Landlock with the
//! system read-only and only the session's private directory writable, the rlimits and the
//! supervisor of its [`Limits`], a child subreaper), starts the program on pipes of its own
//! (and, for Chromium's `--remote-debugging-pipe`, on fds 3 and 4), and relays between the
//! pipes and the connection on one thread. The program never holds the connection itself.
//!
//! Nothing outlives the session: when the program exits, when it goes past a limit, when the
//! caller hangs up or dies, or when the server ends, the executor kills its process group and
//! every other descendant and reaps them.

use std::ffi::OsString;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use nix::sys::signalfd::SignalFd;
use nix::unistd::Pid;

use crate::limits::{Exceeded, Supervisor};
use crate::protocol::{self, SessionRequest};
use crate::run::{
    Confined, Confinement, children_of, confine_executor, kill_all_but, kill_all_descendants,
    lower_priority, on_path, pass_environment, poll_timeout_until, reap_exited,
};
use crate::{ImageFiles, LIMIT_EXIT, REFUSED_EXIT, REFUSED_PREFIX};

/// The subcommand.
pub const SUBCOMMAND: &str = "session";

/// Bytes queued for the program's input pipes past which the connection is not read: a program
/// that does not read its input slows the worker down instead of growing the executor.
const MAX_QUEUED_BYTES: usize = 1 << 20;

/// The command line of an executor running `request`'s program with `dir` as its private
/// directory. Its environment: `PATH` and [`crate::PASSED_ENV`] of this process, `HOME` and
/// `TMPDIR` set to `dir`, then the request's variables (in a task container, this process's
/// whole environment, then the request's variables). The caller sets the standard input to
/// the connection (and may set a process group); the executor's own output goes nowhere.
pub fn command(
    executor: &Path,
    dir: &Path,
    request: &SessionRequest,
    image_files: &ImageFiles,
) -> Command {
    let mut cmd = Command::new(executor);
    cmd.arg(SUBCOMMAND).arg("--dir").arg(dir);
    Confinement::push(request.landlock, request.limits, image_files, &mut cmd);
    if request.cdp_pipe {
        cmd.arg("--cdp-pipe");
    }
    if let Some(cwd) = &request.cwd {
        cmd.arg("--cwd").arg(cwd);
    }
    cmd.arg("--")
        .args(&request.argv)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // A task container's environment is its image's, and holds no secret: the program keeps it.
    if !image_files.is_task_container() {
        cmd.env_clear();
        pass_environment(&mut cmd);
        cmd.env("HOME", dir).env("TMPDIR", dir);
    }
    cmd.envs(&request.env);
    cmd
}

#[derive(Debug)]
struct SessionArgs {
    dir: PathBuf,
    confinement: Confinement,
    parent: Pid,
    cdp_pipe: bool,
    /// Where the program starts, when not in `dir`.
    cwd: Option<PathBuf>,
    argv: Vec<OsString>,
}

fn parse_args(mut args: impl Iterator<Item = OsString>) -> Result<SessionArgs, String> {
    let mut dir = None;
    let mut cdp_pipe = false;
    let mut cwd = None;
    let confinement = Confinement::parse(&mut args, |flag, value| {
        match flag {
            "--dir" => dir = Some(PathBuf::from(value()?)),
            "--cwd" => cwd = Some(PathBuf::from(value()?)),
            "--cdp-pipe" => cdp_pipe = true,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let program: Vec<OsString> = args.collect();
    if program.is_empty() {
        return Err("missing the program after `--`".to_owned());
    }
    let parent = confinement.parent.ok_or("missing --parent")?;
    Ok(SessionArgs {
        dir: dir.ok_or("missing --dir")?,
        confinement,
        parent,
        cdp_pipe,
        cwd,
        argv: program,
    })
}

/// The executor process of a session; returns its exit code (also sent in the [`protocol::EXIT`]
/// frame, when the caller is still there).
pub fn main(args: impl Iterator<Item = OsString>) -> i32 {
    // The connection is the standard input; a copy of it, so that writes go to the same socket.
    // The copy goes above fd 9: fds 3 and 4 are kept for the DevTools pipe.
    let connection = match rustix::io::fcntl_dupfd_cloexec(std::io::stdin(), 10) {
        Ok(fd) => UnixStream::from(fd),
        Err(err) => {
            let _ = writeln!(std::io::stderr(), "{REFUSED_PREFIX}no connection: {err}");
            return REFUSED_EXIT;
        }
    };
    let mut relay = Relay::new(connection);
    let code = match parse_args(args).and_then(|args| relay.run(&args)) {
        Ok(code) => code,
        Err(message) => {
            relay.send(
                protocol::STDERR,
                format!("{REFUSED_PREFIX}{message}\n").as_bytes(),
            );
            REFUSED_EXIT
        }
    };
    relay.send(protocol::EXIT, &protocol::exit_payload(code));
    code
}

/// The program's pipes (the executor's ends) and what is queued for them.
struct Pipes {
    stdin: Option<OwnedFd>,
    stdin_queue: Vec<u8>,
    /// The caller closed the program's standard input: it closes once the queue is written.
    stdin_closing: bool,
    /// The caller asked for a check of the limits.
    check_requested: bool,
    /// A command came after the caller's last check (the shell was idle).
    command_started: bool,
    cdp_in: Option<OwnedFd>,
    cdp_queue: Vec<u8>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    cdp_out: Option<OwnedFd>,
}

struct Relay {
    connection: UnixStream,
    /// The caller asks for the limit checks at the end of each command (a shell's): between
    /// commands the periodic checks pause.
    caller_checks: bool,
    /// A command was sent and its check not yet asked for.
    command_running: bool,
    /// False once the caller hung up (or a write to it failed): nothing more is sent.
    caller_there: bool,
    /// Bytes read from the connection that do not yet make a whole frame.
    incoming: Vec<u8>,
}

impl Relay {
    fn new(connection: UnixStream) -> Self {
        Self {
            connection,
            caller_checks: false,
            command_running: false,
            caller_there: true,
            incoming: Vec::new(),
        }
    }

    /// Sends `payload` as frames of `kind` (one empty frame for an empty payload).
    fn send(&mut self, kind: u8, payload: &[u8]) {
        let mut rest = payload;
        while self.caller_there {
            let (chunk, tail) = rest.split_at(rest.len().min(protocol::MAX_FRAME_BYTES));
            if write_frame(&mut self.connection, kind, chunk).is_err() {
                self.caller_there = false;
            }
            rest = tail;
            if rest.is_empty() {
                return;
            }
        }
    }

    fn run(&mut self, args: &SessionArgs) -> Result<i32, String> {
        // Fds 3 and 4 are held from the start (on /dev/null), so that nothing else takes them
        // before the program's ends of the DevTools pipe are put there.
        let mut reserved = if args.cdp_pipe {
            let open = || {
                std::fs::File::open("/dev/null")
                    .map(OwnedFd::from)
                    .map_err(|err| format!("cannot open /dev/null: {err}"))
            };
            let (three, four) = (open()?, open()?);
            if (three.as_raw_fd(), four.as_raw_fd()) != (3, 4) {
                return Err("fds 3 and 4 are not free for the DevTools pipe".to_owned());
            }
            Some((three, four))
        } else {
            None
        };
        let confined = confine_executor(args.parent, &args.dir, &args.confinement)?;
        let path = confined.command_path(&args.confinement.image_files);
        let Confined {
            signals: signal_fd,
            mut supervisor,
            ..
        } = confined;

        // Close-on-exec: only the program's own ends, put on its descriptors, are inherited; a copy
        // of the writing end of its standard input would keep it from ever seeing its end.
        let pipe = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|err| format!("no pipe: {err}"));
        let (stdin_r, stdin_w) = pipe()?;
        let (stdout_r, stdout_w) = pipe()?;
        let (stderr_r, stderr_w) = pipe()?;
        let mut cdp = None;
        if let Some((three, four)) = reserved.as_mut() {
            let (in_r, in_w) = pipe()?;
            let (out_r, out_w) = pipe()?;
            // dup2 leaves the new descriptors inheritable: the program gets them at 3 and 4.
            nix::unistd::dup2(&in_r, three).map_err(|err| format!("dup2: {err}"))?;
            nix::unistd::dup2(&out_w, four).map_err(|err| format!("dup2: {err}"))?;
            cdp = Some((in_w, out_r));
        }
        for fd in [&stdin_w].into_iter().chain(cdp.as_ref().map(|(w, _)| w)) {
            fcntl(fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
                .map_err(|err| format!("fcntl: {err}"))?;
        }
        let start_in = args.cwd.as_ref().unwrap_or(&args.dir);
        std::env::set_current_dir(start_in)
            .map_err(|err| format!("cannot enter {}: {err}", start_in.display()))?;
        let program = args.argv[0].to_str().map_or_else(
            || PathBuf::from(&args.argv[0]),
            |name| {
                if name.contains('/') {
                    PathBuf::from(name)
                } else {
                    on_path(name, &path)
                }
            },
        );
        let child = {
            use std::os::unix::process::CommandExt;
            Command::new(&program)
                .arg0(&args.argv[0])
                .args(&args.argv[1..])
                .env("PATH", &path)
                .stdin(Stdio::from(stdin_r))
                .stdout(Stdio::from(stdout_w))
                .stderr(Stdio::from(stderr_w))
                .process_group(0)
                .spawn()
                .map_err(|err| format!("cannot start {}: {err}", program.display()))?
        };
        // The program's copies are its own now: ours close, so that its exit is seen as EOF.
        drop(reserved);
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        lower_priority(pid);
        drop(child);
        self.send(protocol::PID, &pid.as_raw().to_be_bytes());
        let (cdp_in, cdp_out) = cdp.map_or((None, None), |(w, r)| (Some(w), Some(r)));
        let mut pipes = Pipes {
            stdin: Some(stdin_w),
            stdin_queue: Vec::new(),
            stdin_closing: false,
            check_requested: false,
            command_started: false,
            cdp_in,
            cdp_queue: Vec::new(),
            stdout: Some(stdout_r),
            stderr: Some(stderr_r),
            cdp_out,
        };
        Ok(self.relay(pid, &signal_fd, &mut supervisor, &mut pipes))
    }

    /// Relays until the program is gone; returns its exit code.
    fn relay(
        &mut self,
        pid: Pid,
        signal_fd: &SignalFd,
        supervisor: &mut Supervisor,
        pipes: &mut Pipes,
    ) -> i32 {
        let mut buf = vec![0_u8; protocol::MAX_FRAME_BYTES];
        // The limits were found exceeded while the shell waited for a command: what its jobs did,
        // not a command of the caller's (one sent since is still unread, and never runs).
        let mut while_waiting = false;
        let (status, exceeded) = loop {
            // A shell between commands, with nothing of its own running, uses nothing that grows:
            // no periodic check while it waits for the next command (its caller asks for one at
            // each command's end).
            let idle = self.caller_checks && !self.command_running && children_of(pid).is_empty();
            let timeout = match supervisor.next_check() {
                Some(at) if !idle => poll_timeout_until(at),
                _ => PollTimeout::NONE,
            };
            let queued = pipes.stdin_queue.len() + pipes.cdp_queue.len();
            let mut fds = vec![PollFd::new(signal_fd.as_fd(), PollFlags::POLLIN)];
            let listen_caller = self.caller_there && queued < MAX_QUEUED_BYTES;
            if listen_caller {
                fds.push(PollFd::new(self.connection.as_fd(), PollFlags::POLLIN));
            }
            let outputs: Vec<(u8, &OwnedFd)> = [
                (protocol::OUTPUT, pipes.stdout.as_ref()),
                (protocol::STDERR, pipes.stderr.as_ref()),
                (protocol::CDP, pipes.cdp_out.as_ref()),
            ]
            .into_iter()
            .filter_map(|(kind, fd)| fd.map(|fd| (kind, fd)))
            .collect();
            fds.extend(
                outputs
                    .iter()
                    .map(|(_, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN)),
            );
            let inputs: Vec<&OwnedFd> = [
                (!pipes.stdin_queue.is_empty()).then_some(pipes.stdin.as_ref()),
                (!pipes.cdp_queue.is_empty()).then_some(pipes.cdp_in.as_ref()),
            ]
            .into_iter()
            .flatten()
            .flatten()
            .collect();
            fds.extend(
                inputs
                    .iter()
                    .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLOUT)),
            );
            if let Err(err) = poll(&mut fds, timeout)
                && err != Errno::EINTR
            {
                break (None, None);
            }
            let ready: Vec<bool> = fds.iter().map(|fd| fd.any().unwrap_or(true)).collect();
            drop(fds);
            let output_kinds: Vec<u8> = outputs.iter().map(|(kind, _)| *kind).collect();
            let mut at = 1;
            if ready[0]
                && let Ok(Some(info)) = signal_fd.read_signal()
            {
                if i32::try_from(info.ssi_signo).ok() != Some(Signal::SIGCHLD as i32) {
                    // Asked to stop: the server ends, or the worker died.
                    break (None, None);
                }
                if let Some(code) = reap_exited(pid) {
                    break (Some(code), None);
                }
            }
            if listen_caller {
                if ready[at] && !self.read_caller(pid, pipes) {
                    self.caller_there = false;
                    break (None, None);
                }
                at += 1;
            }
            for kind in output_kinds {
                if ready[at] {
                    self.forward(kind, pipes, &mut buf);
                }
                at += 1;
            }
            // Before the command reaches the shell, so that the workspace's baseline holds nothing
            // it wrote; most commands are over before their first check, as with one executor each.
            let command_started = std::mem::take(&mut pipes.command_started);
            if command_started {
                supervisor.command_started();
            }
            // Writable inputs (or ones whose reader is gone: the write below says which).
            flush_inputs(pipes);
            if !(command_started || idle)
                && let Some(exceeded) = supervisor.check_if_due()
            {
                while_waiting = self.caller_checks && !self.command_running;
                break (None, Some(exceeded));
            }
            // The caller asks once it has read the end of a command, so everything the command
            // wrote is already relayed.
            if std::mem::take(&mut pipes.check_requested) {
                self.command_running = false;
                if let Some(exceeded) = self.check_at_end(supervisor) {
                    break (None, Some(exceeded));
                }
            }
        };
        kill_all_descendants(pid);
        // Every writer is gone: what is left in the pipes comes out, then end of file.
        for kind in [protocol::OUTPUT, protocol::STDERR, protocol::CDP] {
            while output_fd(pipes, kind).is_some() {
                self.forward(kind, pipes, &mut buf);
            }
        }
        match exceeded.or_else(|| status.and_then(|_| supervisor.check_at_end())) {
            Some(exceeded) => self.stopped_at_limit(&exceeded, while_waiting),
            None => status.unwrap_or(128 + Signal::SIGKILL as i32),
        }
    }

    /// The check the caller asked for at a command's end: the limit the command went past, or
    /// else a [`protocol::CHECKED`] frame.
    fn check_at_end(&mut self, supervisor: &mut Supervisor) -> Option<Exceeded> {
        if let Some(exceeded) = supervisor.check_at_end() {
            return Some(exceeded);
        }
        // A workspace still past its limit that the command did not fill: the model is told, so
        // that it makes room before a command that writes is stopped.
        let note = supervisor
            .past_limit()
            .map(|past| past.to_string())
            .unwrap_or_default();
        self.send(protocol::CHECKED, note.as_bytes());
        None
    }

    /// Tells the caller which limit stopped the program (and, when it came while the shell
    /// waited for a command, that no command of the caller's was running); the exit code.
    fn stopped_at_limit(&mut self, exceeded: &impl std::fmt::Display, while_waiting: bool) -> i32 {
        if while_waiting {
            self.send(protocol::STOPPED_WAITING, &[]);
        }
        self.send(
            protocol::STDERR,
            format!("\n{REFUSED_PREFIX}{exceeded}\n").as_bytes(),
        );
        LIMIT_EXIT
    }

    /// Reads what the caller sent and queues it for the program (or, for an [`protocol::INTERRUPT`],
    /// kills what `program` started); false when the caller hung up or sent something that is not
    /// a frame of a session.
    fn read_caller(&mut self, program: Pid, pipes: &mut Pipes) -> bool {
        let mut chunk = [0_u8; 16 * 1024];
        let n = match self.connection.read(&mut chunk) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        self.incoming.extend_from_slice(&chunk[..n]);
        while self.incoming.len() >= protocol::HEADER_BYTES {
            let mut header = [0_u8; protocol::HEADER_BYTES];
            header.copy_from_slice(&self.incoming[..protocol::HEADER_BYTES]);
            let (kind, len) = protocol::parse_header(header);
            if len > protocol::MAX_FRAME_BYTES {
                return false;
            }
            if self.incoming.len() < protocol::HEADER_BYTES + len {
                break;
            }
            let payload: Vec<u8> = self
                .incoming
                .drain(..protocol::HEADER_BYTES + len)
                .skip(protocol::HEADER_BYTES)
                .collect();
            match kind {
                protocol::STDIN if payload.is_empty() => pipes.stdin_closing = true,
                protocol::STDIN => {
                    pipes.command_started |= self.caller_checks && !self.command_running;
                    self.command_running = true;
                    pipes.stdin_queue.extend_from_slice(&payload);
                }
                protocol::INTERRUPT => kill_all_but(program),
                protocol::CHECK => {
                    self.caller_checks = true;
                    pipes.check_requested = true;
                }
                protocol::CDP if pipes.cdp_in.is_some() => {
                    pipes.cdp_queue.extend_from_slice(&payload);
                }
                _ => return false,
            }
        }
        true
    }

    /// Sends what one output pipe holds as a frame of `kind`; at its end of file, forgets it.
    fn forward(&mut self, kind: u8, pipes: &mut Pipes, buf: &mut [u8]) {
        let slot = match kind {
            protocol::OUTPUT => &mut pipes.stdout,
            protocol::STDERR => &mut pipes.stderr,
            _ => &mut pipes.cdp_out,
        };
        let Some(fd) = slot.as_ref() else { return };
        match nix::unistd::read(fd, buf) {
            Ok(0) => *slot = None,
            Ok(n) => self.send(kind, &buf[..n]),
            Err(Errno::EINTR | Errno::EAGAIN) => {}
            Err(_) => *slot = None,
        }
    }
}

fn output_fd(pipes: &Pipes, kind: u8) -> Option<&OwnedFd> {
    match kind {
        protocol::OUTPUT => pipes.stdout.as_ref(),
        protocol::STDERR => pipes.stderr.as_ref(),
        _ => pipes.cdp_out.as_ref(),
    }
}

/// Writes what is queued for the program's inputs, as far as their pipes take it now. An input
/// whose reader is gone is closed, its queue dropped.
fn flush_inputs(pipes: &mut Pipes) {
    let flush = |fd: &mut Option<OwnedFd>, queue: &mut Vec<u8>| {
        while let Some(pipe) = fd.as_ref()
            && !queue.is_empty()
        {
            match nix::unistd::write(pipe, queue) {
                Ok(n) => {
                    queue.drain(..n);
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => return,
                Err(_) => {
                    *fd = None;
                    queue.clear();
                }
            }
        }
    };
    flush(&mut pipes.stdin, &mut pipes.stdin_queue);
    flush(&mut pipes.cdp_in, &mut pipes.cdp_queue);
    if pipes.stdin_closing && pipes.stdin_queue.is_empty() {
        pipes.stdin = None;
    }
}

/// Writes one frame (the caller's side of the socket is blocking: the worker always reads), in
/// one system call when the socket takes it whole: most frames are a few bytes.
pub(crate) fn write_frame(
    stream: &mut UnixStream,
    kind: u8,
    payload: &[u8],
) -> std::io::Result<()> {
    let header = protocol::header(kind, payload.len());
    let written = loop {
        match stream.write_vectored(&[IoSlice::new(&header), IoSlice::new(payload)]) {
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            written => break written?,
        }
    };
    if let Some(of_payload) = written.checked_sub(header.len()) {
        stream.write_all(&payload[of_payload..])
    } else {
        stream.write_all(&header[written..])?;
        stream.write_all(payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LandlockMode, Limits};
    use std::ffi::OsStr;

    #[test]
    fn session_arguments_round_trip_through_the_command_line() {
        let request = SessionRequest {
            argv: vec!["chromium".to_owned(), "--headless".to_owned()],
            env: std::collections::BTreeMap::from([("K".to_owned(), "v".to_owned())]),
            landlock: LandlockMode::Required,
            limits: Limits {
                processes: 7,
                memory_bytes: 8,
                workspace_bytes: 9,
            },
            cdp_pipe: true,
            workspace: None,
            cwd: Some("/s/sub".to_owned()),
        };
        let image_files = ImageFiles::ReadableExcept(vec!["/workspace".into(), "/tmp".into()]);
        let cmd = command(Path::new("/bin/x"), Path::new("/s"), &request, &image_files);
        let mut given = cmd.get_args().map(OsStr::to_owned);
        assert_eq!(given.next().unwrap(), SUBCOMMAND);
        let parsed = parse_args(given).unwrap();
        assert_eq!(parsed.dir, Path::new("/s"));
        assert_eq!(parsed.confinement.landlock, LandlockMode::Required);
        assert_eq!(parsed.confinement.limits, request.limits);
        assert_eq!(parsed.confinement.image_files, image_files);
        assert!(parsed.cdp_pipe);
        assert_eq!(parsed.cwd.as_deref(), Some(Path::new("/s/sub")));
        assert_eq!(
            parsed.argv,
            [OsStr::new("chromium"), OsStr::new("--headless")]
        );
        let env: Vec<_> = cmd.get_envs().collect();
        assert!(env.contains(&(OsStr::new("K"), Some(OsStr::new("v")))));
        assert!(env.contains(&(OsStr::new("HOME"), Some(OsStr::new("/s")))));
        // No secret on the command line: the variables are in the environment only.
        assert!(!cmd.get_args().any(|arg| arg == "v"));
    }

    #[test]
    fn incomplete_session_arguments_are_refused() {
        use crate::run::tests::args;
        assert!(parse_args(args(&["--dir", "/s", "--parent", "1", "--"])).is_err());
        assert!(parse_args(args(&["--parent", "1", "--", "cat"])).is_err());
        assert!(parse_args(args(&["--dir", "/s", "--", "cat"])).is_err());
        assert!(parse_args(args(&["--dir", "/s", "--parent", "1", "--", "cat"])).is_ok());
    }
}

//! `trajectory-executor run`: one command, confined, and nothing it starts outlives it.
//!
//! The worker (local runs) or the sandbox server (pods) starts one executor per *command*: the
//! tool's contract is "nothing outlives the command", a per-command executor needs no state
//! across commands, and a process of our own between the caller and the shell is the safe way
//! (`unsafe` is forbidden here, so nothing can run between fork and exec) to apply Landlock and to
//! become a reaper.
//!
//! What each layer guarantees, and what it does not:
//! - **Cleared environment.** The executor and the command get `PATH`, `HOME` and `TMPDIR` (the
//!   workspace), `TERM=dumb`, and `LANG`/`LC_ALL`/`TZ` if the worker has them; never the worker's
//!   environment, so no key is in any process the model can reach.
//! - **Non-dumpable worker**: the worker's `/proc/<pid>/environ`, `mem`,
//!   `fd/` are refused to same-uid processes. Its `cmdline` is not hidden: no secret may be passed
//!   on a command line (none is: the key comes from the environment or a key file).
//! - **No capabilities.** The executor drops every capability (bounding set included) and sets
//!   `no_new_privs` before the command starts, so a worker running as root does not lend the
//!   command root's `CAP_SYS_PTRACE` (which overrides non-dumpable), `CAP_DAC_OVERRIDE` or
//!   `CAP_KILL`, and no setuid or file-capability binary gives any back. The uid stays the
//!   worker's: files the worker's uid owns are open to the command where Landlock is off.
//! - **Nothing outlives the command.** The executor is a child subreaper
//!   (`PR_SET_CHILD_SUBREAPER`): whatever the command forks, `setsid`, double fork and `nohup`
//!   included, is re-parented to it, never to init. When the shell exits (after a short grace, so
//!   output already in flight still arrives), when the worker asks (`SIGTERM`: a timeout or a
//!   cancelled conversation) or when the worker dies (`PR_SET_PDEATHSIG`), it `SIGKILL`s its
//!   children, re-reads `/proc/thread-self/children` to catch the ones re-parented meanwhile, and
//!   reaps until it has no child left: no process and no zombie remains. (The parent-death signal
//!   follows the worker *thread* that spawned the executor; the conversations run on the
//!   runtime's worker threads, which live as long as the process.) A `SIGKILL` of the executor
//!   itself (by the OOM killer, or by the command, which shares its uid and Landlock domain)
//!   leaves its descendants to the next reaper up: in a pod the sandbox server, which kills them
//!   ([`crate::serve`]); locally, not covered (whatever reaps the worker's orphans does not kill
//!   them). A PID namespace per command would cover that too, but needs unprivileged user
//!   namespaces, which the restricted Pod Security Standard and many kernels refuse.
//! - **Landlock** (where the kernel has it, ABI 6 asked for, best effort below): the command may
//!   read, write and execute only inside its workspace, read and execute the system (`/usr`,
//!   `/bin`, `/lib*`, `/etc`, `/opt`, `/proc`, `/sys`, `/dev`) and write the harmless devices
//!   (`/dev/null`, `/dev/zero`, `/dev/full`, `/dev/tty`). Everything else is refused: the storage
//!   root (dataset, batches, other runs), other conversations' workspaces, `/tmp`, `/run` and
//!   `/var` (where a pod's Secrets and `ServiceAccount` token are mounted), the home directory. A
//!   Landlock domain also cannot ptrace-attach to processes outside it (other conversations, the
//!   worker) and, from ABI 6, cannot signal them or connect to their abstract Unix sockets. It
//!   does *not* stop reading their `/proc/<pid>/environ` or `maps` (seen on this machine's 6.18
//!   kernel): that is left to the non-dumpable flag and the dropped capabilities. Not covered: network access (the pod's `NetworkPolicy` is the layer
//!   for egress), `/proc/<pid>/cmdline` of other processes (readable: it carries no secret), a
//!   storage root that lies under one of the system paths above, and kernel exploits (use gVisor
//!   or Kata for that). [`LandlockMode`] says what happens on a kernel without it.
//! - **Limits** ([`Limits`]: processes and threads, resident memory, workspace size; see
//!   `limits.rs`). Per process, rlimits the command cannot raise: no core files, `RLIMIT_DATA` at
//!   twice the memory limit, `RLIMIT_FSIZE` at the workspace limit plus one byte. Over the whole
//!   command, a check 10 ms after the start and then every 20, 40, 80, 100 ms: the descendants'
//!   count and their summed `RssAnon + RssShmem`, and the workspace's allocated size (walked only
//!   when `statvfs` says the filesystem grew enough for it to matter), again when the command ends.
//!   Past a limit, everything is killed (the shell's process group first, with one `killpg`) and
//!   the executor exits with [`LIMIT_EXIT`] and a `sandbox: ` line naming the limit after the
//!   command's output. The commands run at nice 19, so that a fork bomb cannot starve the executor
//!   that must stop it. Why no cgroup, PID namespace or `RLIMIT_NPROC`: the restricted Pod Security
//!   Standard gives no capability and a read-only cgroupfs, unprivileged user namespaces are not
//!   available, and `RLIMIT_NPROC` counts every process of the uid (the user's session locally, a
//!   whole node's uid 65532 in pods), not the command's. Not covered: what a command allocates or
//!   writes within one check interval (bounded by the rlimits per process), a `memfd` written but
//!   not mapped, the page cache; in pods, the sandbox container's resource limits are the hard
//!   bound (`spec.sandbox.resources`).

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, path_beneath_rules,
};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal, kill, killpg};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::{Pid, getppid};

use crate::limits::{Supervisor, apply_rlimits};
use crate::reach::{SYSTEM_READ_ONLY, command_path, image_dirs};
use crate::{
    DEFAULT_PATH, ImageFiles, LIMIT_EXIT, LandlockMode, Limits, PASSED_ENV, REFUSED_EXIT,
    REFUSED_PREFIX,
};

/// The subcommand that runs one command confined.
pub const SUBCOMMAND: &str = "run";

/// The Landlock ABI whose features are asked for: filesystem rights up to truncate and ioctl on
/// devices, and the signal and abstract-socket scopes. Older kernels get what they support.
const LANDLOCK_ABI: ABI = ABI::V6;

/// Devices a command may write (and read).
const WRITABLE_DEVICES: [&str; 4] = ["/dev/null", "/dev/zero", "/dev/full", "/dev/tty"];

/// The command line of an executor running `shell -c command` in `workspace`, with `parent`
/// (the caller's pid) as the process it must outlive no longer than. The executor starts with a
/// cleared environment: `PATH` and [`PASSED_ENV`] of the caller, nothing else. The caller sets
/// the standard output and error (stdin is empty) and, if it wants, the process group.
pub fn command(
    executor: &Path,
    workspace: &Path,
    landlock: LandlockMode,
    limits: Limits,
    image_files: &ImageFiles,
    grace: Duration,
    command: &str,
) -> Command {
    let mut cmd = executor_command(
        executor,
        SUBCOMMAND,
        workspace,
        landlock,
        limits,
        image_files,
    );
    cmd.arg("--grace-ms")
        .arg(grace.as_millis().to_string())
        .arg("--")
        .arg(command)
        .stdin(Stdio::null());
    cmd
}

/// The start of every executor's command line that works in a workspace (`run`, `file`,
/// `verifier`): the subcommand, the workspace (also its working directory) and the confinement
/// flags; the caller adds its own flags, then `--`. The environment is cleared but for `PATH`
/// and [`PASSED_ENV`], except in a task container, whose environment is its image's and holds no
/// secret.
pub(crate) fn executor_command(
    executor: &Path,
    subcommand: &str,
    workspace: &Path,
    landlock: LandlockMode,
    limits: Limits,
    image_files: &ImageFiles,
) -> Command {
    let mut cmd = Command::new(executor);
    cmd.arg(subcommand).arg("--workspace").arg(workspace);
    Confinement::push(landlock, limits, image_files, &mut cmd);
    cmd.current_dir(workspace);
    if !image_files.is_task_container() {
        cmd.env_clear();
        pass_environment(&mut cmd);
    }
    cmd
}

/// `PATH` (or [`DEFAULT_PATH`]) and [`PASSED_ENV`] of this process, onto `cmd`.
pub(crate) fn pass_environment(cmd: &mut Command) {
    cmd.env(
        "PATH",
        std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
    );
    for name in PASSED_ENV {
        if let Some(value) = std::env::var_os(name) {
            cmd.env(name, value);
        }
    }
}

/// Whether this kernel enforces the executor's Landlock rules: runs `true` under `executor` with
/// Landlock required, in `workspace` (one exec; the worker asks once, at startup).
pub fn landlock_enforced(executor: &Path, workspace: &Path) -> std::io::Result<bool> {
    let status = command(
        executor,
        workspace,
        LandlockMode::Required,
        Limits::NONE,
        &ImageFiles::Hidden,
        Duration::ZERO,
        "true",
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .status()?;
    Ok(status.success())
}

/// The flag naming [`ImageFiles::Named`]'s directories.
const READABLE_DIRS: &str = "--readable-dirs";

/// The flags of both executors (`run` and `session`): Landlock, the limits, the parent.
#[derive(Debug)]
pub(crate) struct Confinement {
    pub(crate) landlock: LandlockMode,
    pub(crate) limits: Limits,
    pub(crate) image_files: ImageFiles,
    pub(crate) parent: Option<Pid>,
}

impl Confinement {
    /// Before any flag: Landlock where the kernel has it, and flags left out limit nothing.
    pub(crate) fn new() -> Self {
        Self {
            landlock: LandlockMode::Auto,
            limits: Limits::NONE,
            image_files: ImageFiles::Hidden,
            parent: None,
        }
    }

    /// The flags onto `cmd`, with this process as the parent.
    pub(crate) fn push(
        landlock: LandlockMode,
        limits: Limits,
        image_files: &ImageFiles,
        cmd: &mut Command,
    ) {
        // A list that cannot be written down (a ':' in a path) leaves the image hidden: closed.
        let (flag, paths) = match image_files {
            ImageFiles::Hidden => (None, &[][..]),
            ImageFiles::Named(dirs) => (Some(READABLE_DIRS), &dirs[..]),
            ImageFiles::ReadableExcept(private) => (Some("--image-readable-except"), &private[..]),
            ImageFiles::WritableExcept(private) => (Some("--image-writable-except"), &private[..]),
        };
        if let Some(flag) = flag
            && let Ok(paths) = std::env::join_paths(paths)
        {
            cmd.arg(flag).arg(paths);
        }
        cmd.arg("--landlock")
            .arg(landlock.as_str())
            .arg("--max-processes")
            .arg(limits.processes.to_string())
            .arg("--max-memory")
            .arg(limits.memory_bytes.to_string())
            .arg("--max-workspace")
            .arg(limits.workspace_bytes.to_string())
            .arg("--parent")
            .arg(std::process::id().to_string());
    }

    /// Reads `args` up to `--`: each flag one of these, or one `own` takes (it returns false for
    /// one it does not know), a flag's value read with the function it is given.
    pub(crate) fn parse(
        args: &mut impl Iterator<Item = OsString>,
        mut own: impl FnMut(&str, &mut dyn FnMut() -> Result<OsString, String>) -> Result<bool, String>,
    ) -> Result<Self, String> {
        let mut confinement = Self::new();
        loop {
            let flag = args.next().ok_or("missing `--` and what to run")?;
            let mut value = || {
                args.next()
                    .ok_or(format!("{} needs a value", flag.display()))
            };
            let name = flag.to_str();
            if name == Some("--") {
                return Ok(confinement);
            }
            if !(confinement.take(name, &mut value)? || own(name.unwrap_or_default(), &mut value)?)
            {
                return Err(format!("unknown argument {}", flag.display()));
            }
        }
    }

    /// Takes `flag` if it is one of these, its value from `value`; false if it is not.
    fn take(
        &mut self,
        flag: Option<&str>,
        value: impl FnOnce() -> Result<OsString, String>,
    ) -> Result<bool, String> {
        match flag {
            Some("--landlock") => {
                let text = value()?;
                self.landlock = text
                    .to_str()
                    .and_then(LandlockMode::parse)
                    .ok_or(format!("unknown --landlock {}", text.display()))?;
            }
            Some("--max-processes") => {
                self.limits.processes = number("--max-processes", &value()?)?;
            }
            Some("--max-memory") => self.limits.memory_bytes = number("--max-memory", &value()?)?,
            Some("--max-workspace") => {
                self.limits.workspace_bytes = number("--max-workspace", &value()?)?;
            }
            Some("--parent") => self.parent = Some(Pid::from_raw(number("--parent", &value()?)?)),
            Some(READABLE_DIRS) => {
                let dirs: Vec<PathBuf> = std::env::split_paths(&value()?).collect();
                if dirs.iter().any(|dir| !dir.is_absolute()) {
                    return Err(format!("{READABLE_DIRS} takes absolute paths"));
                }
                self.image_files = ImageFiles::Named(dirs);
            }
            Some(flag @ ("--image-readable-except" | "--image-writable-except")) => {
                let private: Vec<PathBuf> = std::env::split_paths(&value()?).collect();
                // Each must name the top-level directory it keeps private.
                if private
                    .iter()
                    .any(|path| !path.is_absolute() || path.parent().is_none())
                {
                    return Err(format!("{flag} takes absolute paths below /"));
                }
                self.image_files = if flag == "--image-readable-except" {
                    ImageFiles::ReadableExcept(private)
                } else {
                    ImageFiles::WritableExcept(private)
                };
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The executor's arguments.
#[derive(Debug)]
struct ExecutorArgs {
    workspace: PathBuf,
    confinement: Confinement,
    grace: Duration,
    /// The worker's pid: while it lives, it is the executor's parent.
    parent: Pid,
    command: OsString,
}

fn parse_args(mut args: impl Iterator<Item = OsString>) -> Result<ExecutorArgs, String> {
    let mut workspace = None;
    let mut grace = Duration::ZERO;
    let confinement = Confinement::parse(&mut args, |flag, value| {
        match flag {
            "--workspace" => workspace = Some(PathBuf::from(value()?)),
            "--grace-ms" => grace = Duration::from_millis(number("--grace-ms", &value()?)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let command = args.next().ok_or("missing the command after `--`")?;
    let parent = confinement.parent.ok_or("missing --parent")?;
    Ok(ExecutorArgs {
        workspace: workspace.ok_or("missing --workspace")?,
        confinement,
        grace,
        parent,
        command,
    })
}

/// The number `text` given to `flag`.
pub(crate) fn number<T: std::str::FromStr>(flag: &str, text: &OsStr) -> Result<T, String> {
    text.to_str()
        .and_then(|text| text.parse().ok())
        .ok_or(format!("bad {flag} {}", text.display()))
}

/// The executor process: `args` are those after the subcommand. Returns the exit code: the
/// shell's, or `128 + N` when a signal N ended it, or [`REFUSED_EXIT`].
pub fn main(args: impl Iterator<Item = OsString>) -> i32 {
    match parse_args(args).and_then(|args| execute(&args)) {
        Ok(code) => code,
        Err(message) => {
            // stderr is the command's output pipe: the model reads why nothing ran.
            let _ = writeln!(std::io::stderr(), "{REFUSED_PREFIX}{message}");
            REFUSED_EXIT
        }
    }
}

/// Blocks `signals` in this thread (and so in every thread it starts later) and returns the
/// descriptor they arrive on instead, closed on exec: handlers would need `unsafe`. Programs
/// started later get an empty mask: std resets it before exec.
pub(crate) fn signal_descriptor(signals: &[Signal]) -> Result<SignalFd, String> {
    let mut set = SigSet::empty();
    for signal in signals {
        set.add(*signal);
    }
    set.thread_block()
        .map_err(|err| format!("cannot block signals: {err}"))?;
    SignalFd::with_flags(&set, SfdFlags::SFD_CLOEXEC).map_err(|err| format!("no signalfd: {err}"))
}

/// An executor once confined ([`confine_executor`]).
pub(crate) struct Confined {
    /// Where the signals that end it early arrive.
    pub(crate) signals: SignalFd,
    /// The supervisor of its limits.
    pub(crate) supervisor: Supervisor,
    /// The kernel enforces its Landlock rules.
    pub(crate) landlock_enforced: bool,
}

impl Confined {
    /// The `PATH` of what it starts: this process's, less the entries Landlock keeps it from
    /// running programs from, after the named tool directories' ([`command_path`]). A shim under
    /// the home directory first on the user's `PATH` would otherwise shadow the system's program
    /// of that name with one the command is refused. Worked out only by the executors that start
    /// a program (a file tool's call starts none).
    pub(crate) fn command_path(&self, image_files: &ImageFiles) -> OsString {
        let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
        command_path(&path, image_files, self.landlock_enforced).path
    }
}

/// What an executor does before it starts anything the model or a tool chose: the signals that
/// end it early on a descriptor, ending with `parent`, a child subreaper, no capabilities,
/// Landlock with `writable` as the one writable directory, the rlimits; and the supervisor of
/// `limits` over `writable`.
pub(crate) fn confine_executor(
    parent: Pid,
    writable: &Path,
    confinement: &Confinement,
) -> Result<Confined, String> {
    let limits = confinement.limits;
    let signal_fd = signal_descriptor(&[
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ])?;
    // The worker's death must end the command too; if it died before this line, end now.
    nix::sys::prctl::set_pdeathsig(Signal::SIGTERM)
        .map_err(|err| format!("cannot set the parent-death signal: {err}"))?;
    // Re-parented means the worker died first. Compared with the worker's own pid, not with 1:
    // in a container the worker is PID 1 itself.
    if getppid() != parent {
        return Err("the worker is gone".to_owned());
    }
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|err| format!("cannot become a child subreaper: {err}"))?;
    drop_privileges()?;
    let landlock_enforced = confine(writable, confinement.landlock, &confinement.image_files)?;
    apply_rlimits(&limits)?;
    Ok(Confined {
        signals: signal_fd,
        supervisor: Supervisor::start(writable, limits),
        landlock_enforced,
    })
}

fn execute(args: &ExecutorArgs) -> Result<i32, String> {
    let confined = confine_executor(args.parent, &args.workspace, &args.confinement)?;
    let path = confined.command_path(&args.confinement.image_files);
    let Confined {
        signals: signal_fd,
        mut supervisor,
        ..
    } = confined;

    let shell = spawn_shell(
        &args.command,
        &args.workspace,
        &path,
        args.confinement.image_files.is_task_container(),
    )
    .map_err(|err| format!("could not start the shell: {err}"))?;
    let shell_pid = Pid::from_raw(i32::try_from(shell.id()).unwrap_or(i32::MAX));
    lower_priority(shell_pid);
    // The child handle is not waited through std: every child is reaped below with waitpid.
    drop(shell);

    let mut status = None;
    let mut grace_ends: Option<Instant> = None;
    let mut exceeded = loop {
        let wake = [grace_ends, supervisor.next_check()]
            .into_iter()
            .flatten()
            .min();
        let timeout = match wake {
            None => PollTimeout::NONE,
            Some(at) => poll_timeout_until(at),
        };
        let mut fds = [PollFd::new(
            std::os::fd::AsFd::as_fd(&signal_fd),
            PollFlags::POLLIN,
        )];
        match poll(&mut fds, timeout) {
            Ok(0) => {} // a check is due, or the grace after the shell's exit is over
            Ok(_) => {
                if let Ok(Some(info)) = signal_fd.read_signal() {
                    if i32::try_from(info.ssi_signo).ok() != Some(Signal::SIGCHLD as i32) {
                        // Asked to stop: a timeout, a cancelled call, or the worker's death.
                        break None;
                    }
                    if let Some(code) = reap_exited(shell_pid) {
                        status = Some(code);
                    }
                }
            }
            Err(Errno::EINTR) => continue,
            Err(err) => return Err(format!("poll failed: {err}")),
        }
        if let Some(exceeded) = supervisor.check_if_due() {
            break Some(exceeded);
        }
        if status.is_some() {
            if !has_children() {
                break None;
            }
            let end = *grace_ends.get_or_insert_with(|| Instant::now() + args.grace);
            if Instant::now() >= end {
                break None;
            }
        }
    };
    kill_all_descendants(shell_pid);
    if exceeded.is_none() && status.is_some() {
        exceeded = supervisor.check_at_end();
    }
    if let Some(exceeded) = exceeded {
        // Last on the output pipe: every process that could write to it is gone.
        let _ = writeln!(std::io::stderr(), "\n{REFUSED_PREFIX}{exceeded}");
        return Ok(LIMIT_EXIT);
    }
    Ok(status.unwrap_or(128 + Signal::SIGKILL as i32))
}

/// Gives up every capability for good, and the means of regaining one (setuid and file-capability
/// binaries), before anything the model chose runs.
///
/// Why: a worker running as root (a container without `runAsNonRoot`, or this machine's test
/// suite) would otherwise pass root's `CAP_SYS_PTRACE` on to the commands, and that capability
/// overrides the non-dumpable flag: `/proc/<worker>/environ` was readable, key included. Landlock
/// does not close that hole on its own: its ptrace rule stops attaching and signalling, but here
/// reading another process's `environ` or `maps` was still allowed. With no capabilities, root is
/// an ordinary uid to the kernel's ptrace check, and the non-dumpable worker is refused.
pub(crate) fn drop_privileges() -> Result<(), String> {
    use caps::{CapSet, Capability};
    nix::sys::prctl::set_no_new_privs().map_err(|err| format!("cannot set no_new_privs: {err}"))?;
    // Only a process holding CAP_SETPCAP can shrink its bounding set; without it (any non-root
    // uid) the set bounds nothing the commands could get under no_new_privs anyway.
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false) {
        caps::clear(None, CapSet::Bounding)
            .map_err(|err| format!("cannot drop the bounding capabilities: {err}"))?;
    }
    for set in [
        CapSet::Ambient,
        CapSet::Inheritable,
        CapSet::Effective,
        CapSet::Permitted,
    ] {
        caps::clear(None, set).map_err(|err| format!("cannot drop capabilities: {err}"))?;
    }
    Ok(())
}

/// Applies the Landlock rules to this process (and so to everything it starts); whether the
/// kernel enforces them.
pub(crate) fn confine(
    workspace: &Path,
    mode: LandlockMode,
    image_files: &ImageFiles,
) -> Result<bool, String> {
    if mode == LandlockMode::Off {
        return Ok(false);
    }
    let status =
        landlock_rules(workspace, image_files).map_err(|err| format!("Landlock: {err}"))?;
    match (status, mode) {
        (RulesetStatus::FullyEnforced | RulesetStatus::PartiallyEnforced, _) => Ok(true),
        (RulesetStatus::NotEnforced, LandlockMode::Auto) => Ok(false),
        (RulesetStatus::NotEnforced, _) => Err(
            "Landlock is required (--landlock required) but this kernel does not enforce it; \
             the command was not run"
                .to_owned(),
        ),
    }
}

/// Read-only system paths, writable devices, and `workspace` writable; the image's top-level
/// directories as [`ImageFiles`] opens them. In a task container those are writable, and the
/// workspace (a directory in them, or `/` itself for an image without a working directory) adds
/// nothing: a rule on `/` would open the private directories too.
fn landlock_rules(
    workspace: &Path,
    image_files: &ImageFiles,
) -> Result<RulesetStatus, landlock::RulesetError> {
    let abi = LANDLOCK_ABI;
    let read = AccessFs::from_read(abi);
    let all = AccessFs::from_all(abi);
    let (image_access, workspace_rule) = if image_files.is_task_container() {
        (all, None)
    } else {
        (read, Some(workspace))
    };
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)?
        .scope(Scope::from_all(abi))?
        .create()?
        .add_rules(path_beneath_rules(SYSTEM_READ_ONLY, read))?
        .add_rules(path_beneath_rules(image_dirs(image_files), image_access))?
        .add_rules(path_beneath_rules(
            WRITABLE_DEVICES,
            AccessFs::from_file(abi),
        ))?
        .add_rules(path_beneath_rules(workspace_rule, all))?
        .restrict_self()?;
    Ok(status.ruleset)
}

/// Starts the shell in the workspace, with the executor's standard streams and an environment of
/// its own: `HOME` and `TMPDIR` are the workspace, `TERM=dumb`, and what [`pass_environment`]
/// passes (in a task container, the container's environment and `TERM=dumb`). `bash`, or `sh` where bash is missing. The shell leads a process group of its own,
/// which its pipelines and background jobs join: one `killpg` ends them all at once, forks in
/// flight included (a fork bomb outpaces killing its members one by one).
///
/// The shell is named by its path on `PATH`, and the executor moves into the workspace itself
/// rather than asking `Command` to: with a bare name and a `PATH` of its own, or a directory to
/// change to that glibc's `posix_spawn` cannot be told about (a static build), std forks the
/// executor and tries each `PATH` entry with `execve`; like this it spawns with `posix_spawn`
/// (`vfork`: no page tables copied) and one `execve` (issue 13, the terminal's CPU per command).
fn spawn_shell(
    command: &OsStr,
    workspace: &Path,
    path: &OsStr,
    task_container: bool,
) -> std::io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    std::env::set_current_dir(workspace)?;
    let spawn = |shell: &str| {
        let mut cmd = Command::new(on_path(shell, path));
        cmd.arg0(shell).process_group(0);
        cmd.arg("-c").arg(command);
        // In a task container the image's environment stays (`command` kept it).
        if !task_container {
            cmd.env_clear()
                .env("HOME", workspace)
                .env("TMPDIR", workspace);
            pass_environment(&mut cmd);
        }
        cmd.env("PATH", path).env("TERM", "dumb").spawn()
    };
    match spawn("bash") {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => spawn("sh"),
        spawned => spawned,
    }
}

/// The nice value of the commands: the lowest priority. A command that keeps every CPU busy (a
/// fork bomb is thousands of runnable processes) still leaves CPU time to the executor that must
/// stop it, to the worker and to the other conversations' executors. Commands compete among
/// themselves as before.
const COMMAND_NICE: i32 = 19;

/// Gives the shell, and so everything it starts, the lowest CPU priority. Set from here, just
/// after the spawn (setting it between fork and exec would need `unsafe`): the shell has not yet
/// read its command by then. A failure leaves the command at the executor's priority.
pub(crate) fn lower_priority(shell: Pid) {
    if let Some(pid) = rustix::process::Pid::from_raw(shell.as_raw()) {
        let _ = rustix::process::setpriority_process(Some(pid), COMMAND_NICE);
    }
}

/// Where `program` is on `path` (the one the shell gets): the first entry holding an executable
/// file of that name, as `execvp` would pick. `program` itself when none does (the spawn then
/// fails with `NotFound`).
pub(crate) fn on_path(program: &str, path: &OsStr) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path)
        .map(|dir| {
            // An empty entry is the current directory, to execvp.
            let dir = if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            };
            dir.join(program)
        })
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
        .unwrap_or_else(|| PathBuf::from(program))
}

/// Reaps every child that has exited; returns the shell's exit code if it was among them (a
/// signal N gives 128+N, the shell's own convention).
pub(crate) fn reap_exited(shell: Pid) -> Option<i32> {
    let mut shell_code = None;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) if pid == shell => shell_code = Some(code),
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == shell => {
                shell_code = Some(128 + signal as i32);
            }
            Ok(WaitStatus::StillAlive) | Err(_) => return shell_code,
            Ok(_) => {}
        }
    }
}

/// This process's children. The executor has one thread, so its children are that thread's
/// (`/proc/thread-self/children`: one file read, no listing of `/proc/self/task`).
fn children() -> Vec<Pid> {
    std::fs::read_to_string("/proc/thread-self/children")
        .map(|list| {
            list.split_whitespace()
                .filter_map(|pid| pid.parse().ok())
                .map(Pid::from_raw)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether any child, running or exited, is left: one `waitid` that reaps nothing (`WNOWAIT`),
/// instead of reading `/proc` (the usual case, a command that left nothing behind, reads none).
fn has_children() -> bool {
    waitid(
        Id::All,
        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
    ) != Err(Errno::ECHILD)
}

/// How many times [`kill_all_but`] lists and kills what is left: each round catches what forked
/// while the last one listed; a process group that keeps forking faster is the process limit's.
const INTERRUPT_ROUNDS: usize = 16;

/// Kills every descendant of this executor except `program` itself: the program's children with
/// everything under them, and whatever was re-parented here. The program (a conversation's
/// shell) lives on and sees its foreground command killed; the zombies are reaped by their
/// parents, or by this executor's `SIGCHLD` handling (which also takes the program's own exit,
/// should it end meanwhile).
pub(crate) fn kill_all_but(program: Pid) {
    for _ in 0..INTERRUPT_ROUNDS {
        let mut victims: Vec<Pid> = children()
            .into_iter()
            .filter(|child| *child != program)
            .collect();
        let mut parents = vec![program];
        while let Some(parent) = parents.pop() {
            let below = children_of(parent);
            parents.extend(&below);
            victims.extend(below);
        }
        victims.retain(|pid| !is_zombie(*pid));
        if victims.is_empty() {
            return;
        }
        for victim in victims {
            let _ = kill(victim, Signal::SIGKILL);
        }
    }
}

/// How long `poll` may wait to wake at `at`: rounded up to the millisecond, since a wait rounded
/// down to zero with less than a millisecond left would spin on `poll` until the time comes.
pub(crate) fn poll_timeout_until(at: Instant) -> PollTimeout {
    let left = at.saturating_duration_since(Instant::now());
    let millis = left.as_micros().div_ceil(1000);
    i32::try_from(millis)
        .ok()
        .and_then(|millis| PollTimeout::try_from(millis).ok())
        .unwrap_or(PollTimeout::MAX)
}

/// The children of every thread of `pid`.
pub(crate) fn children_of(pid: Pid) -> Vec<Pid> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|child| child.parse().ok())
                .map(Pid::from_raw)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Whether `pid` has exited and waits to be reaped (or is gone already).
fn is_zombie(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        // The state follows the command name, which is in parentheses and may hold any byte.
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].trim_start().chars().next())
            .is_none_or(|state| state == 'Z' || state == 'X')
    })
}

/// Kills every descendant and reaps it: first the shell's process group (`shell` is its id,
/// which stays reserved while the group has a member, even once the shell is reaped), then, as a
/// killed process's children are re-parented to this subreaper, whatever left the group, until
/// no child is left.
pub(crate) fn kill_all_descendants(shell: Pid) {
    let _ = killpg(shell, Signal::SIGKILL);
    while has_children() {
        for child in children() {
            let _ = kill(child, Signal::SIGKILL);
        }
        match waitpid(None, None) {
            Err(Errno::EINTR) | Ok(_) => {}
            // ECHILD: no child is left. Nothing can be done about another failure of waitpid
            // either, and the loop must not spin on it.
            Err(_) => return,
        }
        // Every zombie at once before listing the children again: a fork bomb leaves thousands,
        // and one listing per zombie would be quadratic.
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break,
                Err(Errno::EINTR) | Ok(_) => {}
                Err(_) => return,
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A command line's arguments, as the executor reads them.
    pub(crate) fn args(list: &[&str]) -> impl Iterator<Item = OsString> + use<> {
        list.iter()
            .map(OsString::from)
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn executor_arguments_round_trip_through_the_command_line() {
        let cmd = command(
            Path::new("/bin/trajectory-executor"),
            Path::new("/w"),
            LandlockMode::Required,
            Limits {
                processes: 7,
                memory_bytes: 8,
                workspace_bytes: 9,
            },
            &ImageFiles::ReadableExcept(vec!["/workspace".into(), "/tmp/sessions".into()]),
            Duration::from_millis(500),
            "echo hi",
        );
        let mut given = cmd.get_args().map(OsStr::to_owned);
        assert_eq!(given.next().unwrap(), SUBCOMMAND);
        let parsed = parse_args(given).unwrap();
        assert_eq!(parsed.workspace, Path::new("/w"));
        assert_eq!(parsed.confinement.landlock, LandlockMode::Required);
        assert_eq!(parsed.grace, Duration::from_millis(500));
        assert_eq!(parsed.confinement.limits.processes, 7);
        assert_eq!(parsed.confinement.limits.memory_bytes, 8);
        assert_eq!(parsed.confinement.limits.workspace_bytes, 9);
        assert_eq!(
            parsed.confinement.image_files,
            ImageFiles::ReadableExcept(vec!["/workspace".into(), "/tmp/sessions".into()])
        );
        let worker = i32::try_from(std::process::id()).unwrap();
        assert_eq!(parsed.parent, Pid::from_raw(worker));
        assert_eq!(parsed.command, "echo hi");
    }

    #[test]
    fn a_readable_image_keeps_its_private_top_level_directories_and_run_and_var() {
        let private =
            ImageFiles::ReadableExcept(vec!["/workspace/c1".into(), "/tmp/sessions".into()]);
        let readable = image_dirs(&private);
        let at_root: Vec<PathBuf> = std::fs::read_dir("/")
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| {
                !["/tmp", "/workspace", "/run", "/var"].contains(&path.to_str().unwrap())
            })
            .collect();
        assert_eq!(readable.len(), at_root.len(), "{readable:?}");
        assert!(at_root.iter().all(|path| readable.contains(path)));
        assert!(image_dirs(&ImageFiles::Hidden).is_empty());
        let with = |private: &str| {
            parse_args(args(&[
                "--workspace",
                "/w",
                "--parent",
                "1",
                "--image-readable-except",
                private,
                "--",
                "true",
            ]))
        };
        assert!(with("/workspace:/tmp").is_ok());
        for bad in ["", "relative", "/", "/workspace:"] {
            assert!(with(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn executor_refuses_unknown_or_incomplete_arguments() {
        assert!(parse_args(args(&["--workspace"])).is_err());
        assert!(parse_args(args(&["--workspace", "/w", "--"])).is_err());
        assert!(parse_args(args(&["--nope", "x", "--", "true"])).is_err());
        assert!(parse_args(args(&["--landlock", "maybe", "--", "true"])).is_err());
        assert!(parse_args(args(&["--", "true"])).is_err());
        assert!(
            parse_args(args(&["--workspace", "/w", "--", "true"])).is_err(),
            "no --parent"
        );
        assert!(parse_args(args(&["--workspace", "/w", "--parent", "x", "--", "true"])).is_err());
        assert!(
            parse_args(args(&[
                "--workspace",
                "/w",
                "--parent",
                "1",
                "--max-memory",
                "2G",
                "--",
                "true"
            ]))
            .is_err()
        );
    }
}

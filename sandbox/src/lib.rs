//! The tool executor: every command the model chooses runs under it, confined to its
//! conversation's workspace, and when the command ends, everything it started ends too.
//!
//! ```text
//! local run (trajectory-worker local)        pod of a generation Job
//!
//! worker (API key; non-dumpable)             worker container (API key, data volume)
//!   └─ trajectory-executor run …               │ Unix socket on a shared emptyDir
//!        └─ bash -c <command> …              sandbox container (task image; workspace only)
//!                                              └─ trajectory-executor serve   (PID 1, reaps)
//!                                                   └─ trajectory-executor run …
//!                                                        └─ bash -c <command> …
//! ```
//!
//! One binary, six subcommands:
//! - [`run`]: runs one command confined (cleared environment, no capabilities, Landlock, child
//!   subreaper that kills and reaps every descendant). The worker starts it as a child in local
//!   runs; in a pod, the server does.
//! - [`serve`]: the sandbox container's entry point. It accepts one connection per command from
//!   the worker over a Unix socket ([`protocol`]), runs the command under [`run`] and streams its
//!   output back. The worker container alone holds the API key and the data volume; the sandbox
//!   container mounts only the workspaces, the socket and this binary.
//! - [`session`]: one long-lived program (an MCP stdio server, Chromium) confined like a
//!   command, with a private writable directory instead of a workspace; its standard streams
//!   (and `DevTools` pipe) travel as frames over the connection it is given as standard input.
//!   The worker starts it on a socket pair in local runs; in a pod, the server does, on the
//!   worker's connection.
//! - [`file`]: one call of a file tool ([`files`]), confined as a command is, for a
//!   conversation in a task container, whose files only that container sees; the server starts
//!   it.
//! - [`verifier`]: the steps of a row's verifier around its command (fresh directories, the
//!   tests unpacked; the reward read), confined as a command is, in the environment the
//!   conversation left.
//! - `install DIR`: copies this binary into `DIR` (the init container that puts it on the pod's
//!   shared volume, for a task image that has no such binary).
//!
//! The binary is small and built static for pods, so that it runs on any image's libc and costs
//! every command one cheap exec.

pub mod args;
pub mod file;
pub mod files;
mod limits;
pub mod protocol;
pub mod reach;
pub mod run;
pub mod serve;
pub mod session;
pub mod text;
pub mod verifier;

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The executor binary's file name.
pub const EXECUTOR_BINARY: &str = "trajectory-executor";

/// Exit code of an executor that refused to run the command (the sandbox could not be set up as
/// required). Outside the shell's own 126/127/128+N conventions.
pub const REFUSED_EXIT: i32 = 121;

/// What a refused command's output starts with; the rest of that output says why.
pub const REFUSED_PREFIX: &str = "sandbox: ";

/// Exit code of an executor that stopped its command because the command went past one of its
/// [`Limits`]. The output's last line is [`REFUSED_PREFIX`] and which limit, after whatever the
/// command wrote before.
pub const LIMIT_EXIT: i32 = 122;

/// Used when the executor itself has no `PATH` (as in some minimal containers).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Environment variables passed through to commands besides `PATH`. Everything else is dropped:
/// the worker's environment carries the model server's API key, and a model running `env` must
/// not copy it into a trajectory.
pub const PASSED_ENV: [&str; 3] = ["LANG", "LC_ALL", "TZ"];

/// What to do about Landlock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LandlockMode {
    /// Confine where the kernel supports it; run unconfined where it does not (the worker says so).
    #[default]
    Auto,
    /// Refuse to run a command that Landlock does not confine.
    Required,
    /// Do not use Landlock (what a kernel without it looks like; for tests and comparisons).
    Off,
}

impl LandlockMode {
    pub const ALL: [Self; 3] = [Self::Auto, Self::Required, Self::Off];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Required => "required",
            Self::Off => "off",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|mode| mode.as_str() == text)
    }
}

impl std::fmt::Display for LandlockMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a command may read of the filesystem besides its own directory and the system's
/// (`/usr`, `/etc`, ...; `run` lists them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ImageFiles {
    /// Nothing more: on a machine that is not a container of the task's image, the rest is
    /// someone else's (a user's home, other checkouts).
    #[default]
    Hidden,
    /// These directories too, to read and run programs from, nothing else: toolchains a user
    /// installed under the home directory (a pyenv version, a conda environment), named on
    /// purpose by the run (`spec.sandbox.toolDirs`, `local --tool-dir`). Only for a machine that is
    /// not a container of the task's image, as [`ImageFiles::Hidden`].
    Named(Vec<PathBuf>),
    /// Every top-level directory of the container's image too (a task's repository at
    /// `/testbed`, its tools), read-only, but these (the conversations' workspaces, the
    /// sessions' directories, the executor's own) and `/run` and `/var`, where Kubernetes mounts
    /// tokens and Secrets. Only for `serve` in a container of the task image, whose files are the
    /// task's.
    ReadableExcept(Vec<PathBuf>),
    /// Every top-level directory of the container's image, readable and writable, but these (the
    /// executor's own, its socket's) and `/run` and `/var`. Only for `serve --task`, in a task
    /// container: a container of the row's image that serves one conversation and ends with it,
    /// so its filesystem is that conversation's to change (a repository at `/testbed` to fix),
    /// and the container, not the directory, is the confinement. Commands keep the container's
    /// environment (the image's `PATH`, `HOME`, a conda environment): a task container holds no
    /// secret.
    WritableExcept(Vec<PathBuf>),
}

impl ImageFiles {
    /// The private paths of [`ImageFiles::ReadableExcept`] or [`ImageFiles::WritableExcept`].
    pub fn private(&self) -> &[PathBuf] {
        match self {
            Self::Hidden | Self::Named(_) => &[],
            Self::ReadableExcept(private) | Self::WritableExcept(private) => private,
        }
    }

    /// Whether this is a task container's ([`ImageFiles::WritableExcept`]).
    pub fn is_task_container(&self) -> bool {
        matches!(self, Self::WritableExcept(_))
    }
}

/// What one command, with everything it starts, may use ([`run`] says how each is enforced). Zero
/// means no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Limits {
    /// Processes and threads alive at once.
    pub processes: u64,
    /// Bytes of resident memory (anonymous and shared), summed over the processes.
    pub memory_bytes: u64,
    /// Bytes the conversation's workspace may hold on disk.
    pub workspace_bytes: u64,
}

impl Limits {
    /// No limit at all.
    pub const NONE: Self = Self {
        processes: 0,
        memory_bytes: 0,
        workspace_bytes: 0,
    };

    /// The defaults of a run's `spec.sandbox.limits`: room for a build or a test suite, far below
    /// what would starve the other conversations of a pod or a laptop.
    pub const DEFAULT: Self = Self {
        processes: 256,
        memory_bytes: 2 << 30,
        workspace_bytes: 1 << 30,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `bytes` for people, to a tenth of the unit: `1.5 GiB`, `64 MiB`, `512 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1024 << (10 * (unit + 1)) {
        unit += 1;
    }
    let tenths = u128::from(bytes) * 10 / (1024_u128 << (10 * unit));
    match (tenths / 10, tenths % 10) {
        (whole, 0) => format!("{whole} {}", UNITS[unit]),
        (whole, tenth) => format!("{whole}.{tenth} {}", UNITS[unit]),
    }
}

/// The whole `trajectory-executor` process: `args` are its arguments after the program name.
/// Returns the exit code.
pub fn main(mut args: impl Iterator<Item = OsString>) -> i32 {
    let subcommand = args.next();
    match subcommand.as_ref().and_then(|name| name.to_str()) {
        Some(run::SUBCOMMAND) => run::main(args),
        Some(serve::SUBCOMMAND) => serve::main(args),
        Some(session::SUBCOMMAND) => session::main(args),
        Some(file::SUBCOMMAND) => file::main(args),
        Some(verifier::SUBCOMMAND) => verifier::main(args),
        // A prefetch pod's container runs this in the image it pulls: the image is on the node.
        Some("pulled") => 0,
        Some("install") => match args.next() {
            Some(dir) => report(install(Path::new(&dir)), "install"),
            None => report(Err("install needs a directory".to_owned()), "install"),
        },
        _ => {
            let _ = writeln!(
                std::io::stderr(),
                "usage: {EXECUTOR_BINARY} run|session|file|verifier|serve|install|pulled … (see the trajectory_sandbox docs)"
            );
            2
        }
    }
}

fn report(result: Result<(), String>, what: &str) -> i32 {
    match result {
        Ok(()) => 0,
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "{EXECUTOR_BINARY} {what}: {message}");
            1
        }
    }
}

/// Copies this binary into `dir` as [`EXECUTOR_BINARY`], atomically (a reader never sees half).
fn install(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let this = std::env::current_exe().map_err(|err| format!("no /proc/self/exe: {err}"))?;
    let target = dir.join(EXECUTOR_BINARY);
    let partial = dir.join(format!(".{EXECUTOR_BINARY}.partial"));
    std::fs::copy(&this, &partial)
        .map_err(|err| format!("cannot copy to {}: {err}", partial.display()))?;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o555))
        .map_err(|err| format!("cannot make {} executable: {err}", partial.display()))?;
    std::fs::rename(&partial, &target)
        .map_err(|err| format!("cannot rename to {}: {err}", target.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_shown_in_their_largest_whole_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(2 << 40), "2 TiB");
    }
}

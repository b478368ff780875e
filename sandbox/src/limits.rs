//! The executor's [`Limits`] on one command: what the kernel enforces on each process (rlimits,
//! set before the shell starts), and what the executor checks over the whole command while it
//! runs ([`Supervisor`]). [`crate::run`]'s docs say what each guarantees.

use std::collections::HashSet;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, getrlimit, setrlimit};

use crate::{Limits, human_bytes};

/// The first check comes this soon after the start: a fork bomb doubles every few milliseconds,
/// and most commands are over before it, so they pay for no check at all.
const FIRST_CHECK: Duration = Duration::from_millis(10);

/// The interval doubles from [`FIRST_CHECK`] up to this: a long command's checks cost a few
/// file reads per process ten times a second.
const CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// A walk of the workspace costs at most this share of the time between walks (it runs only
/// while the filesystem grows, see [`Disk`]).
const WALK_TIME_SHARE: u32 = 10;

/// A walk this fast (a few hundred files) is done at the end of every command, `statvfs` or not.
const CHEAP_WALK: Duration = Duration::from_millis(1);

/// Entries one walk of the workspace looks at; beyond them the size is a lower bound (the
/// pod's ephemeral-storage limit still holds).
const WALK_MAX_ENTRIES: usize = 100_000;

/// Processes and threads one check looks at when their number is not limited.
const MAX_TASKS_SEEN: u64 = 100_000;

/// Sets the per-process limits of this process, and so of everything it starts (the rlimits are
/// inherited, and without `CAP_SYS_RESOURCE`, which the executor has dropped, never raised):
/// - no core files (`RLIMIT_CORE` 0), which would fill the workspace;
/// - no writable private mapping beyond twice the memory limit (`RLIMIT_DATA`): one process
///   cannot take a multiple of the limit between two checks. Twice, so that a process growing
///   past the limit is caught by the [`Supervisor`] and the model is told which limit it hit,
///   rather than seeing a bare allocation failure;
/// - no file beyond the workspace limit plus one byte (`RLIMIT_FSIZE`: the write gets `SIGXFSZ`),
///   so one file cannot overshoot the limit between checks, and the end-of-command check sees the
///   workspace past its limit.
pub(crate) fn apply_rlimits(limits: &Limits) -> Result<(), String> {
    lower(Resource::RLIMIT_CORE, 0)?;
    if limits.memory_bytes > 0 {
        lower(Resource::RLIMIT_DATA, limits.memory_bytes.saturating_mul(2))?;
    }
    if limits.workspace_bytes > 0 {
        lower(
            Resource::RLIMIT_FSIZE,
            limits.workspace_bytes.saturating_add(1),
        )?;
    }
    Ok(())
}

/// Lowers both the soft and the hard limit of `resource` to `value` (never raises either).
fn lower(resource: Resource, value: u64) -> Result<(), String> {
    let (soft, hard) =
        getrlimit(resource).map_err(|err| format!("cannot read {resource:?}: {err}"))?;
    setrlimit(resource, soft.min(value), hard.min(value))
        .map_err(|err| format!("cannot set {resource:?}: {err}"))
}

/// A limit the command went past, with what was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exceeded {
    Processes { limit: u64, seen: u64 },
    Memory { limit: u64, seen: u64 },
    Workspace { limit: u64, seen: u64 },
}

impl fmt::Display for Exceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Processes { limit, seen } => write!(
                f,
                "the command exceeded the sandbox's process limit ({limit} processes and \
                 threads; it had more than {}) and all its processes were stopped",
                seen.saturating_sub(1)
            ),
            Self::Memory { limit, seen } => write!(
                f,
                "the command exceeded the sandbox's memory limit ({}; its processes held {}) \
                 and all its processes were stopped",
                human_bytes(limit),
                beyond(limit, seen)
            ),
            Self::Workspace { limit, seen } => write!(
                f,
                "the command exceeded the sandbox's workspace limit ({}; the workspace holds {}) \
                 and all its processes were stopped; delete files to make room",
                human_bytes(limit),
                beyond(limit, seen)
            ),
        }
    }
}

/// `seen`, which is past `limit`, as people read it: "more than" the limit when the two would
/// read the same.
fn beyond(limit: u64, seen: u64) -> String {
    let (limit, seen) = (human_bytes(limit), human_bytes(seen));
    if limit == seen {
        format!("more than {limit}")
    } else {
        seen
    }
}

/// Checks a running command against its limits, at a short interval.
#[derive(Debug)]
pub(crate) struct Supervisor {
    limits: Limits,
    workspace: PathBuf,
    interval: Duration,
    /// `None` when nothing is limited.
    next_check: Option<Instant>,
    /// `None` when the workspace is not limited.
    disk: Option<Disk>,
}

/// What is known of the workspace's size. Walking the workspace costs a `stat` per file, so it
/// is walked only when the filesystem's used space (one `statvfs`) has grown enough since the
/// last walk that the workspace could be past its limit: the workspace cannot grow by more than
/// the filesystem does (unless something else frees space at the same time, which at worst
/// delays the check), and a command that writes nothing costs one `statvfs` per check.
#[derive(Debug)]
struct Disk {
    /// At the command's start: a workspace already past its limit (the files of an earlier
    /// command, or of a background job under an executor of its own) is not this command's
    /// fault, as long as it does not grow. 0 when it was under its limit without a walk.
    at_start: u64,
    /// At the last walk, with the filesystem's used bytes then.
    walked: u64,
    filesystem_then: u64,
    next_walk: Instant,
    walk_cost: Duration,
}

impl Disk {
    /// The most the workspace can hold now, given the filesystem's used bytes now: what the last
    /// walk saw plus what the filesystem grew by since.
    fn at_most(&self, filesystem_now: u64) -> u64 {
        self.walked
            .saturating_add(filesystem_now.saturating_sub(self.filesystem_then))
    }

    fn walk(&mut self, workspace: &Path, filesystem_now: u64) {
        let started = Instant::now();
        self.walked = workspace_bytes(workspace);
        self.filesystem_then = filesystem_now;
        self.walk_cost = started.elapsed();
        self.next_walk = Instant::now() + self.walk_cost * WALK_TIME_SHARE;
    }
}

/// The workspace past its limit at a command's end, by what was there before the command (a
/// background job's files, an earlier command's): not the command's fault, but the model is
/// told, so that it makes room before a command that writes is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PastLimit {
    limit: u64,
    holds: u64,
}

impl fmt::Display for PastLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (limit, holds) = (human_bytes(self.limit), human_bytes(self.holds));
        if limit == holds {
            write!(f, "The workspace is past its limit of {limit}")?;
        } else {
            write!(f, "The workspace holds {holds}, past its limit of {limit}")?;
        }
        f.write_str(": delete files to make room; a command that writes more is stopped")
    }
}

impl Supervisor {
    /// Measures what the command starts from (the workspace's size, if limited).
    pub(crate) fn start(workspace: &Path, limits: Limits) -> Self {
        let now = Instant::now();
        let disk = (limits.workspace_bytes > 0).then(|| {
            let filesystem_then = filesystem_used(workspace);
            let started = Instant::now();
            let walked = workspace_bytes(workspace);
            Disk {
                at_start: walked,
                walked,
                filesystem_then,
                next_walk: now,
                walk_cost: started.elapsed(),
            }
        });
        let limited = limits != Limits::NONE;
        Self {
            limits,
            workspace: workspace.to_owned(),
            interval: FIRST_CHECK,
            next_check: limited.then(|| now + FIRST_CHECK),
            disk,
        }
    }

    /// A new command of a long-lived shell starts: the first check [`FIRST_CHECK`] from now, and
    /// the workspace's baseline taken again, so that the command is blamed only for making it
    /// grow past its limit, not for what filled it since the last command (a background job
    /// under an executor of its own). A walk only when `statvfs` says the workspace could be
    /// past its limit (under it, any size past the limit at a check is the command's), or when
    /// it is cheap: space freed elsewhere on the filesystem meanwhile can hide a job's writes
    /// from `statvfs`, and the command would be blamed for them.
    pub(crate) fn command_started(&mut self) {
        if self.next_check.is_some() {
            self.interval = FIRST_CHECK;
            self.next_check = Some(Instant::now() + FIRST_CHECK);
        }
        let limit = self.limits.workspace_bytes;
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        let filesystem_now = filesystem_used(&self.workspace);
        disk.at_start = if disk.at_most(filesystem_now) > limit || disk.walk_cost < CHEAP_WALK {
            disk.walk(&self.workspace, filesystem_now);
            disk.walked
        } else {
            0
        };
    }

    /// When the next check is due.
    pub(crate) fn next_check(&self) -> Option<Instant> {
        self.next_check
    }

    /// Checks every limit if a check is due.
    pub(crate) fn check_if_due(&mut self) -> Option<Exceeded> {
        let now = Instant::now();
        if self.next_check.is_none_or(|at| now < at) {
            return None;
        }
        self.interval = (self.interval * 2).min(CHECK_INTERVAL);
        self.next_check = Some(now + self.interval);
        let limits = self.limits;
        if limits.processes > 0 || limits.memory_bytes > 0 {
            let usage = descendants_usage(match limits.processes {
                0 => MAX_TASKS_SEEN,
                limit => limit,
            });
            if limits.processes > 0 && usage.tasks > limits.processes {
                return Some(Exceeded::Processes {
                    limit: limits.processes,
                    seen: usage.tasks,
                });
            }
            if limits.memory_bytes > 0 && usage.resident_bytes > limits.memory_bytes {
                return Some(Exceeded::Memory {
                    limit: limits.memory_bytes,
                    seen: usage.resident_bytes,
                });
            }
        }
        self.check_workspace(Some(now))
    }

    /// The last check, once the command has ended by itself: a file cut short by `RLIMIT_FSIZE`
    /// (or written between two checks) still leaves the workspace past its limit. A walk whenever
    /// `statvfs` says the workspace could be past its limit, however recent the last: growth
    /// left unseen now would be the next command's baseline, and never blamed. A walk whatever
    /// `statvfs` says if the workspace is small enough to walk cheaply: space freed elsewhere on
    /// the filesystem meanwhile (another conversation deleting files) can hide the command's
    /// writes from `statvfs`, and no later check would catch them.
    pub(crate) fn check_at_end(&mut self) -> Option<Exceeded> {
        self.check_workspace(None)
    }

    /// After a [`Self::check_at_end`] that blamed nothing: the workspace still past its limit,
    /// which that check has just measured (it walks whenever the workspace could be past it).
    pub(crate) fn past_limit(&self) -> Option<PastLimit> {
        let limit = self.limits.workspace_bytes;
        self.disk
            .as_ref()
            .filter(|disk| disk.walked > limit)
            .map(|disk| PastLimit {
                limit,
                holds: disk.walked,
            })
    }

    /// Checks the workspace; `now` for a check during the command, which walks only when the
    /// filesystem's growth says it could be past its limit, and not more often than the walk's
    /// cost allows; `None` for the check at its end ([`Self::check_at_end`]).
    fn check_workspace(&mut self, now: Option<Instant>) -> Option<Exceeded> {
        let limit = self.limits.workspace_bytes;
        let disk = self.disk.as_mut()?;
        let filesystem_now = filesystem_used(&self.workspace);
        let under = disk.at_most(filesystem_now) <= limit;
        let skip = match now {
            Some(now) => under || now < disk.next_walk,
            None => under && disk.walk_cost >= CHEAP_WALK,
        };
        if skip {
            return None;
        }
        disk.walk(&self.workspace, filesystem_now);
        (disk.walked > limit && disk.walked > disk.at_start).then_some(Exceeded::Workspace {
            limit,
            seen: disk.walked,
        })
    }
}

/// Bytes in use on the filesystem that holds `path` (0 if it cannot be asked, which makes every
/// check walk the workspace: slower, never wrong).
fn filesystem_used(path: &Path) -> u64 {
    nix::sys::statvfs::statvfs(path).map_or(0, |stats| {
        stats
            .blocks()
            .saturating_sub(stats.blocks_free())
            .saturating_mul(stats.fragment_size())
    })
}

/// Bytes the files under `root` take on disk (allocated blocks, so sparse files count what they
/// hold; a file with several links once), looking at no more than [`WALK_MAX_ENTRIES`] entries.
/// Symbolic links are not followed.
fn workspace_bytes(root: &Path) -> u64 {
    let mut total = 0_u64;
    let mut linked = HashSet::new();
    let mut entries = 0_usize;
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let Ok(listing) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in listing.flatten() {
            entries += 1;
            if entries > WALK_MAX_ENTRIES {
                return total;
            }
            let Ok(meta) = entry.metadata() else { continue };
            if meta.nlink() > 1 && !meta.is_dir() && !linked.insert((meta.dev(), meta.ino())) {
                continue;
            }
            total = total.saturating_add(meta.blocks().saturating_mul(512));
            if meta.is_dir() {
                dirs.push(entry.path());
            }
        }
    }
    total
}

/// What the executor's descendants use at this moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    /// Processes and threads (zombies included: they still hold a pid).
    tasks: u64,
    /// Anonymous and shared resident memory; file-backed pages (program text, libraries, the page
    /// cache) are left out, being shared by every process that maps them.
    resident_bytes: u64,
}

/// Walks the tree of this process's descendants through `/proc/<pid>/task/<tid>/children` (every
/// descendant is in it: the executor is their subreaper).
fn descendants_usage(max_tasks: u64) -> Usage {
    let mut usage = Usage::default();
    let mut seen = HashSet::new();
    let mut pending = task_children("/proc/self", None);
    while let Some(pid) = pending.pop() {
        if !seen.insert(pid) {
            continue;
        }
        let dir = format!("/proc/{pid}");
        // Gone since it was listed: nothing to count.
        let Ok(status) = std::fs::read_to_string(format!("{dir}/status")) else {
            continue;
        };
        let process = parse_status(&status);
        usage.tasks += process.threads.max(1);
        usage.resident_bytes = usage.resident_bytes.saturating_add(process.resident_bytes);
        if usage.tasks > max_tasks {
            // Past the process limit: the rest of a fork bomb need not be read (and reading it
            // would compete for the CPU with it).
            break;
        }
        let only_thread = (process.threads <= 1).then_some(pid);
        pending.extend(task_children(&dir, only_thread));
    }
    usage
}

/// The children of every thread of the process at `dir`: of the one thread `only_thread` if the
/// process has just that one (one read instead of a directory listing).
fn task_children(dir: &str, only_thread: Option<u32>) -> Vec<u32> {
    let read = |path: PathBuf| std::fs::read_to_string(path).unwrap_or_default();
    let lists = match only_thread {
        Some(tid) => vec![read(PathBuf::from(format!("{dir}/task/{tid}/children")))],
        None => std::fs::read_dir(format!("{dir}/task"))
            .map(|tasks| {
                tasks
                    .flatten()
                    .map(|task| read(task.path().join("children")))
                    .collect()
            })
            .unwrap_or_default(),
    };
    lists
        .iter()
        .flat_map(|list| list.split_whitespace().filter_map(|pid| pid.parse().ok()))
        .collect()
}

/// What one process's `/proc/<pid>/status` says of its size.
#[derive(Debug, Default, PartialEq, Eq)]
struct ProcessStatus {
    threads: u64,
    resident_bytes: u64,
}

fn parse_status(status: &str) -> ProcessStatus {
    let mut parsed = ProcessStatus::default();
    for line in status.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let number = || {
            value
                .split_whitespace()
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
        };
        match key {
            "Threads" => parsed.threads = number(),
            "RssAnon" | "RssShmem" => {
                parsed.resident_bytes = parsed
                    .resident_bytes
                    .saturating_add(number().saturating_mul(1024));
            }
            _ => {}
        }
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_gives_threads_and_anonymous_and_shared_memory() {
        let status = "Name:\tpython3\nVmRSS:\t  9000 kB\nRssAnon:\t  6000 kB\n\
                      RssFile:\t  2000 kB\nRssShmem:\t  1000 kB\nThreads:\t3\n";
        assert_eq!(
            parse_status(status),
            ProcessStatus {
                threads: 3,
                resident_bytes: 7000 * 1024
            }
        );
        // A zombie has no memory lines.
        assert_eq!(
            parse_status("Name:\tsh\nState:\tZ (zombie)\nThreads:\t1\n").threads,
            1
        );
    }

    #[test]
    fn workspace_size_counts_blocks_and_hard_links_once() {
        let dir = tempfile::tempdir().unwrap();
        let empty = workspace_bytes(dir.path());
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a"), vec![1_u8; 1 << 20]).unwrap();
        std::fs::hard_link(dir.path().join("sub/a"), dir.path().join("b")).unwrap();
        std::os::unix::fs::symlink("/usr", dir.path().join("usr")).unwrap();
        let size = workspace_bytes(dir.path()) - empty;
        assert!((1 << 20..(1 << 20) + (64 << 10)).contains(&size), "{size}");
    }

    #[test]
    fn a_workspace_that_was_full_before_the_command_is_not_its_fault() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("old"), vec![1_u8; 256 << 10]).unwrap();
        let limits = Limits {
            workspace_bytes: 64 << 10,
            ..Limits::NONE
        };
        let mut supervisor = Supervisor::start(dir.path(), limits);
        assert_eq!(supervisor.check_at_end(), None);
        std::fs::write(dir.path().join("new"), vec![1_u8; 64 << 10]).unwrap();
        assert!(matches!(
            supervisor.check_at_end(),
            Some(Exceeded::Workspace { limit, seen }) if limit == 64 << 10 && seen > 256 << 10
        ));
    }

    #[test]
    fn a_workspace_filled_between_commands_is_not_the_next_ones_fault() {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            workspace_bytes: 64 << 10,
            ..Limits::NONE
        };
        let mut supervisor = Supervisor::start(dir.path(), limits);
        assert_eq!(supervisor.check_at_end(), None);
        assert_eq!(supervisor.past_limit(), None);
        // A background job, under an executor of its own, fills the workspace between commands.
        let fill = dir.path().join("fill");
        std::fs::write(&fill, vec![1_u8; 256 << 10]).unwrap();
        supervisor.command_started();
        assert_eq!(supervisor.check_at_end(), None);
        let past = supervisor
            .past_limit()
            .expect("the workspace is past its limit");
        assert!(past.holds >= 256 << 10, "{past:?}");
        assert!(
            past.to_string()
                .contains("past its limit of 64 KiB: delete files to make room"),
            "{past}"
        );
        // A command that makes it grow further is blamed.
        supervisor.command_started();
        std::fs::write(dir.path().join("more"), vec![1_u8; 64 << 10]).unwrap();
        assert!(matches!(
            supervisor.check_at_end(),
            Some(Exceeded::Workspace { seen, .. }) if seen > 256 << 10
        ));
        // Once it is under its limit again, a command that takes it past is blamed too.
        std::fs::remove_file(&fill).unwrap();
        std::fs::remove_file(dir.path().join("more")).unwrap();
        supervisor.command_started();
        assert_eq!(supervisor.check_at_end(), None);
        assert_eq!(supervisor.past_limit(), None);
        supervisor.command_started();
        std::fs::write(&fill, vec![1_u8; 128 << 10]).unwrap();
        assert!(matches!(
            supervisor.check_at_end(),
            Some(Exceeded::Workspace { limit, .. }) if limit == 64 << 10
        ));
    }

    #[test]
    fn nothing_limited_means_no_checks() {
        let dir = tempfile::tempdir().unwrap();
        let mut supervisor = Supervisor::start(dir.path(), Limits::NONE);
        assert_eq!(supervisor.next_check(), None);
        assert_eq!(supervisor.check_if_due(), None);
        assert_eq!(supervisor.check_at_end(), None);
    }

    #[test]
    fn reasons_name_the_limit() {
        let memory = Exceeded::Memory {
            limit: 256 << 20,
            seen: 300 << 20,
        };
        assert!(
            memory.to_string().contains("memory limit (256 MiB"),
            "{memory}"
        );
        let processes = Exceeded::Processes {
            limit: 64,
            seen: 70,
        };
        assert!(
            processes.to_string().contains("process limit (64"),
            "{processes}"
        );
    }
}

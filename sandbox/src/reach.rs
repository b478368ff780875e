//! What a confined command can reach of the filesystem, as [`crate::run`]'s Landlock rules open
//! it: the directories it may read and run programs from besides its workspace.
//!
//! The same lists make the rules and answer two questions about them: which entries of the
//! commands' `PATH` name directories they can run programs from ([`command_path`]: an entry
//! under the user's home directory, a pyenv shim, shadows the system's `python3` with a program
//! the sandbox refuses), and whether a path a command was refused lies outside what it may use
//! ([`may_read`]: the worker then tells the model why).

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use crate::{DEFAULT_PATH, ImageFiles};

/// Read-only (and executable) system paths. `/run` and `/var` are left out on purpose: a pod's
/// `ServiceAccount` token and Secrets are mounted there (`/var/run` is usually a link to `/run`).
pub const SYSTEM_READ_ONLY: [&str; 12] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc",
    "/sys", "/dev",
];

/// Top-level directories never readable through [`ImageFiles::ReadableExcept`]: Kubernetes
/// mounts a pod's `ServiceAccount` token and Secrets under them.
pub(crate) const NEVER_READABLE: [&str; 2] = ["/run", "/var"];

/// The kernel's interfaces: read as system paths, never opened for writing as an image's files
/// are in a task container.
pub(crate) const KERNEL_INTERFACES: [&str; 3] = ["/proc", "/sys", "/dev"];

/// The directories `image_files` opens besides the system's (to read, or in a task container to
/// write too): none, the named ones, or every top-level entry of `/` but the private ones,
/// [`NEVER_READABLE`] and (in a task container) the kernel's interfaces.
pub(crate) fn image_dirs(image_files: &ImageFiles) -> Vec<PathBuf> {
    let private = match image_files {
        ImageFiles::Hidden => return Vec::new(),
        ImageFiles::Named(dirs) => return dirs.clone(),
        ImageFiles::ReadableExcept(private) | ImageFiles::WritableExcept(private) => private,
    };
    let Ok(entries) = std::fs::read_dir("/") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| {
            let kernel = image_files.is_task_container()
                && KERNEL_INTERFACES
                    .iter()
                    .any(|kernel| Path::new(kernel) == path);
            let never = NEVER_READABLE.iter().any(|never| Path::new(never) == path);
            !(kernel || never || private.iter().any(|private| top_level(private) == *path))
        })
        .collect()
}

/// `/a` of `/a/b/c`.
fn top_level(path: &Path) -> PathBuf {
    path.components().take(2).collect()
}

/// Every directory a command may read and run programs from besides its workspace, with
/// symbolic links resolved as Landlock resolves them when the rules are made (`/bin` is
/// `/usr/bin` on a merged-`/usr` system). Directories that do not exist are left out.
pub fn readable_roots(image_files: &ImageFiles) -> Vec<PathBuf> {
    SYSTEM_READ_ONLY
        .iter()
        .map(PathBuf::from)
        .chain(image_dirs(image_files))
        .filter_map(|root| root.canonicalize().ok())
        .collect()
}

/// Whether a command may read `path` (run it, if it is a program): it lies in `workspace` or
/// beneath one of `roots` ([`readable_roots`]) once its symbolic links are resolved. A path that
/// does not exist is judged by its longest existing ancestor.
pub fn may_read(path: &Path, workspace: Option<&Path>, roots: &[PathBuf]) -> bool {
    let resolved = resolve(path);
    let workspace = workspace.and_then(|workspace| workspace.canonicalize().ok());
    roots
        .iter()
        .chain(workspace.as_ref())
        .any(|root| resolved.starts_with(root))
}

/// `path` with its symbolic links resolved, as far as it exists.
fn resolve(path: &Path) -> PathBuf {
    let mut existing = path;
    let mut rest = Vec::new();
    loop {
        if let Ok(resolved) = existing.canonicalize() {
            return rest.iter().rev().fold(resolved, |dir, name| dir.join(name));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => return path.to_owned(),
        }
    }
}

/// The commands' `PATH`, and what was left out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandPath {
    pub path: OsString,
    /// The entries dropped, in their order: directories the commands cannot run programs from.
    pub dropped: Vec<PathBuf>,
}

/// `path` as the commands get it: first the `bin` directories of [`ImageFiles::Named`]'s
/// directories that have one and are not on `path` already, in their order (a toolchain named on
/// purpose is the one the commands mean); then, where Landlock `confines` the commands, the
/// entries they can run programs from, in the user's order (relative entries, which name the
/// command's own directory, kept), and [`DEFAULT_PATH`]'s system directories if none is left;
/// where it does not, every entry.
pub fn command_path(path: &OsStr, image_files: &ImageFiles, confines: bool) -> CommandPath {
    let entries: Vec<PathBuf> = std::env::split_paths(path).collect();
    let named_bins: Vec<PathBuf> = match image_files {
        ImageFiles::Named(dirs) => dirs
            .iter()
            .map(|dir| dir.join("bin"))
            .filter(|bin| bin.is_dir() && !entries.contains(bin))
            .collect(),
        _ => Vec::new(),
    };
    let (kept, dropped): (Vec<PathBuf>, Vec<PathBuf>) = if confines {
        let roots = readable_roots(image_files);
        entries
            .into_iter()
            .partition(|entry| entry.is_relative() || may_read(entry, None, &roots))
    } else {
        (entries, Vec::new())
    };
    let path = if kept.is_empty() && named_bins.is_empty() {
        DEFAULT_PATH.into()
    } else {
        // Entries came out of a list split on ':' or were checked for one: they join again.
        std::env::join_paths(named_bins.iter().chain(&kept)).unwrap_or_else(|_| DEFAULT_PATH.into())
    };
    CommandPath { path, dropped }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_outside_the_readable_directories_are_dropped_in_order() {
        let home = tempfile::tempdir().unwrap();
        let shims = home.path().join(".pyenv/shims");
        std::fs::create_dir_all(&shims).unwrap();
        let tools = home.path().join("tools/bin");
        std::fs::create_dir_all(&tools).unwrap();
        let path = std::env::join_paths([
            shims.as_path(),
            Path::new("/usr/local/bin"),
            Path::new("bin"),
            tools.as_path(),
            Path::new("/usr/bin"),
            Path::new("/run/secrets"),
        ])
        .unwrap();

        let hidden = command_path(&path, &ImageFiles::Hidden, true);
        assert_eq!(
            hidden.path,
            OsString::from("/usr/local/bin:bin:/usr/bin"),
            "{hidden:?}"
        );
        assert_eq!(
            hidden.dropped,
            vec![shims.clone(), tools.clone(), PathBuf::from("/run/secrets")]
        );

        let named = command_path(
            &path,
            &ImageFiles::Named(vec![home.path().join("tools")]),
            true,
        );
        let expected = format!("/usr/local/bin:bin:{}:/usr/bin", tools.display());
        assert_eq!(named.path, OsString::from(expected));
        assert_eq!(
            named.dropped,
            vec![shims.clone(), PathBuf::from("/run/secrets")]
        );

        // A named toolchain whose `bin` the user's PATH lacks comes first; unconfined commands
        // keep every entry.
        let version = home.path().join(".pyenv/versions/3.12.7");
        std::fs::create_dir_all(version.join("bin")).unwrap();
        let unconfined = command_path(&path, &ImageFiles::Named(vec![version.clone()]), false);
        let mut expected = vec![version.join("bin")];
        expected.extend(std::env::split_paths(&path));
        assert_eq!(unconfined.path, std::env::join_paths(expected).unwrap());
        assert!(unconfined.dropped.is_empty());
    }

    #[test]
    fn a_path_with_nothing_runnable_falls_back_to_the_system_directories() {
        let only_home = command_path(OsStr::new("/root/.cargo/bin"), &ImageFiles::Hidden, true);
        assert_eq!(only_home.path, OsString::from(DEFAULT_PATH));
        assert_eq!(only_home.dropped, vec![PathBuf::from("/root/.cargo/bin")]);
    }

    #[test]
    fn links_are_judged_where_they_lead() {
        let dir = tempfile::tempdir().unwrap();
        let roots = readable_roots(&ImageFiles::Hidden);
        let into_usr = dir.path().join("usr-link");
        std::os::unix::fs::symlink("/usr/bin", &into_usr).unwrap();
        assert!(may_read(&into_usr.join("python3"), None, &roots));
        let not_yet = Path::new("/usr/share").join(format!("traj-probe-{}", std::process::id()));
        assert!(may_read(&not_yet.join("missing/file"), None, &roots));
        assert!(!may_read(&dir.path().join("file"), None, &roots));
        assert!(may_read(&dir.path().join("file"), Some(dir.path()), &roots));
        assert!(!may_read(Path::new("/var/run/secrets/token"), None, &roots));
    }
}

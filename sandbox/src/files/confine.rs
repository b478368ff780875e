//! Confining the file tools to the workspace.
//!
//! Confinement has layers. [`Workspace::resolve`] refuses absolute paths and `..` that climbs
//! out, and canonicalises the existing part of a path, so a symlink along the way that points
//! outside is refused. What it cannot see is a *dangling* symlink (it does not "exist", so it is
//! not canonicalised, and following it could create its target wherever that is): such paths are
//! refused by [`resolve`], and every open also uses `O_NOFOLLOW` in case one appears in the
//! meantime. Last, where `/proc` is available, the opened descriptor's real path is checked, which
//! also catches a directory swapped for a symlink between resolving and opening (the terminal tool
//! runs concurrently in the same directory).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::libc;

use super::{Workspace, WorkspaceError};

/// Resolves a model-given path inside the workspace, with an error message the model can act on.
pub fn resolve(workspace: &Workspace, requested: &str) -> Result<PathBuf, String> {
    let path = workspace.resolve(requested).map_err(|err| match err {
        WorkspaceError::Absolute(_) => {
            format!("{err}; give a path relative to the workspace directory")
        }
        other => other.to_string(),
    })?;
    // `resolve` canonicalised the part of the path that exists, so a symlink still on it is
    // dangling: following it could create its target, wherever that is.
    for ancestor in path
        .ancestors()
        .take_while(|ancestor| *ancestor != workspace.root())
    {
        if fs::symlink_metadata(ancestor).is_ok_and(|metadata| metadata.is_symlink()) {
            return Err(format!(
                "{} is a symbolic link that points outside the workspace or to nothing; \
                 refusing to follow it",
                workspace.display(ancestor)
            ));
        }
    }
    Ok(path)
}

/// Resolves a model-given path of a file to create or replace, and creates its parent
/// directories inside the workspace (refusing directories replaced by symlinks meanwhile).
pub fn prepare_file(workspace: &Workspace, requested: &str) -> Result<PathBuf, String> {
    let path = resolve(workspace, requested)?;
    let parent = match path.parent() {
        Some(parent) if path != workspace.root() => parent,
        _ => return Err(format!("{requested} is a directory, not a file")),
    };
    fs::create_dir_all(parent)
        .map_err(|err| format!("cannot create the directories for {requested}: {err}"))?;
    // The directories may have been replaced by symlinks since `resolve` looked at them.
    let real_parent = parent
        .canonicalize()
        .map_err(|err| format!("cannot create the directories for {requested}: {err}"))?;
    if !real_parent.starts_with(workspace.root()) {
        return Err(WorkspaceError::Escapes(requested.to_owned()).to_string());
    }
    Ok(path)
}

/// Opens `path` without following a symlink in its last component and without blocking on a FIFO,
/// then makes sure it is a regular file inside the workspace.
pub fn open_confined(
    workspace: &Workspace,
    path: &Path,
    requested: &str,
    options: &mut OpenOptions,
) -> Result<File, String> {
    let file = open_nofollow(path, options).map_err(|err| io_message(&err, requested))?;
    if !opened_inside(&file, workspace) {
        return Err(WorkspaceError::Escapes(requested.to_owned()).to_string());
    }
    let metadata = file.metadata().map_err(|err| io_message(&err, requested))?;
    if metadata.is_dir() {
        return Err(format!("{requested} is a directory, not a file"));
    }
    if !metadata.is_file() {
        return Err(format!("{requested} is not a regular file"));
    }
    Ok(file)
}

pub fn open_nofollow(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

/// Whether an open descriptor really lies inside the workspace, judged by the kernel's view of
/// its path. Without `/proc` (not Linux) the earlier checks have to do.
pub fn opened_inside(file: &File, workspace: &Workspace) -> bool {
    match fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
        Ok(real) => real.starts_with(workspace.root()),
        Err(_) => true,
    }
}

/// An I/O error as a message naming the path the model gave.
pub fn io_message(err: &io::Error, requested: &str) -> String {
    match err.kind() {
        io::ErrorKind::NotFound => format!("file not found: {requested}"),
        io::ErrorKind::IsADirectory => format!("{requested} is a directory, not a file"),
        io::ErrorKind::PermissionDenied => format!("permission denied: {requested}"),
        _ if err.raw_os_error() == Some(libc::ELOOP) => format!(
            "{requested} is a symbolic link that points outside the workspace or to nothing; \
             refusing to follow it"
        ),
        _ => format!("cannot access {requested}: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::fixture::Fixture;

    #[test]
    fn read_file_refuses_a_dangling_symlink_even_when_its_target_appears() {
        let fx = Fixture::new();
        // `resolve` saw no file at `dangling`; the target is created afterwards, as a concurrent
        // terminal command could.
        fs::write(fx.outside.join("new.txt"), "late secret\n").unwrap();
        let path = fx.root().join("dangling");
        let message = open_confined(
            &fx.workspace,
            &path,
            "dangling",
            OpenOptions::new().read(true),
        )
        .unwrap_err();
        assert!(message.contains("refusing to follow"), "{message}");
    }

    #[test]
    fn creating_a_file_through_a_dangling_symlink_creates_nothing_outside() {
        let fx = Fixture::new();
        let path = fx.root().join("dangling");
        let mut options = OpenOptions::new();
        options.write(true).create(true);
        let message = open_confined(&fx.workspace, &path, "dangling", &mut options).unwrap_err();
        assert!(message.contains("refusing to follow"), "{message}");
        fx.assert_outside_untouched();
    }

    #[test]
    fn descriptor_of_a_file_outside_the_workspace_is_recognised() {
        let fx = Fixture::new();
        fx.write("inside.txt", "");
        let inside = File::open(fx.root().join("inside.txt")).unwrap();
        let outside = File::open(fx.outside.join("secret.txt")).unwrap();
        assert!(opened_inside(&inside, &fx.workspace));
        assert!(!opened_inside(&outside, &fx.workspace));
    }
}

//! Where the file tools' paths lead: a conversation's workspace directory, or, in a task
//! container, the container's whole filesystem.

use std::path::{Component, Path, PathBuf};

/// Why a path given by the model was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkspaceError {
    #[error("absolute paths are not allowed: {0}")]
    Absolute(String),
    #[error("path escapes the workspace: {0}")]
    Escapes(String),
    #[error("cannot resolve {path}: {reason}")]
    Io { path: String, reason: String },
}

/// The directory one conversation works in. Tools resolve every path through
/// [`Workspace::resolve`], which refuses absolute paths, `..` that climbs out, and symlinks whose
/// target lies outside.
///
/// In a task container ([`Workspace::container`]) the container is the confinement: the root is
/// `/`, absolute paths are the normal case (`/testbed/src/app.py`), and the executor that serves
/// the file tools there runs under the same Landlock rules as the conversation's commands.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    /// Where relative paths start, relative to `root` (the terminal's working directory).
    base: PathBuf,
    /// The root is a task container's `/`: absolute paths are taken, and shown as they are.
    container: bool,
}

impl Workspace {
    /// Uses `root` (which must exist) as the workspace.
    pub fn new(root: impl Into<PathBuf>) -> std::io::Result<Self> {
        let root = root.into().canonicalize()?;
        Ok(Self {
            root,
            base: PathBuf::new(),
            container: false,
        })
    }

    /// A task container's filesystem, relative paths starting in `start` (an existing directory).
    pub fn container(start: &Path) -> std::io::Result<Self> {
        let start = start.canonicalize()?;
        Ok(Self {
            root: PathBuf::from("/"),
            base: start.strip_prefix("/").unwrap_or(&start).to_owned(),
            container: true,
        })
    }

    /// The same workspace with relative paths starting in `base`, relative to the root.
    #[must_use]
    pub fn starting_in(self, base: PathBuf) -> Self {
        Self { base, ..self }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether this is a task container's filesystem.
    pub fn is_container(&self) -> bool {
        self.container
    }

    /// Maps a path the model gave (relative to the directory relative paths start in) to a real
    /// path inside the workspace.
    ///
    /// The path need not exist (so `write_file` can create it), but every existing ancestor is
    /// canonicalised, so a symlink anywhere along the way that points outside is refused.
    pub fn resolve(&self, requested: &str) -> Result<PathBuf, WorkspaceError> {
        let given = Path::new(requested);
        let mut lexical = if given.is_absolute() {
            if !self.container {
                return Err(WorkspaceError::Absolute(requested.to_owned()));
            }
            PathBuf::new()
        } else {
            self.base.clone()
        };
        for component in given.components() {
            match component {
                Component::Normal(part) => lexical.push(part),
                Component::CurDir | Component::RootDir => {}
                // `/..` is `/`, as the kernel has it, in a container.
                Component::ParentDir => {
                    if !lexical.pop() && !self.container {
                        return Err(WorkspaceError::Escapes(requested.to_owned()));
                    }
                }
                Component::Prefix(_) => {
                    return Err(WorkspaceError::Absolute(requested.to_owned()));
                }
            }
        }
        let candidate = self.root.join(&lexical);
        // Canonicalise the longest existing prefix: that resolves symlinks on the way.
        let mut existing = candidate.as_path();
        let mut rest = Vec::new();
        while !existing.exists() {
            match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    rest.push(name.to_owned());
                    existing = parent;
                }
                _ => break,
            }
        }
        let mut real = existing.canonicalize().map_err(|err| WorkspaceError::Io {
            path: requested.to_owned(),
            reason: err.to_string(),
        })?;
        if !real.starts_with(&self.root) {
            return Err(WorkspaceError::Escapes(requested.to_owned()));
        }
        for name in rest.into_iter().rev() {
            real.push(name);
        }
        Ok(real)
    }

    /// Shows a resolved path to the model: relative to the workspace root, or, in a container,
    /// as the absolute path it is there.
    pub fn display(&self, path: &Path) -> String {
        if self.container {
            return path.display().to_string();
        }
        path.strip_prefix(&self.root)
            .unwrap_or(path)
            .display()
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_refuses_absolute_and_climbing_paths() {
        let dir = tempfile::tempdir().unwrap();
        let workspace = Workspace::new(dir.path()).unwrap();
        assert!(matches!(
            workspace.resolve("/etc/passwd"),
            Err(WorkspaceError::Absolute(_))
        ));
        assert!(matches!(
            workspace.resolve("../x"),
            Err(WorkspaceError::Escapes(_))
        ));
        assert!(matches!(
            workspace.resolve("a/../../x"),
            Err(WorkspaceError::Escapes(_))
        ));
        assert_eq!(
            workspace.resolve("a/../b").unwrap(),
            workspace.root().join("b")
        );
    }

    #[test]
    fn workspace_refuses_symlink_that_points_outside() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).unwrap();
        let workspace = Workspace::new(dir.path()).unwrap();
        assert!(matches!(
            workspace.resolve("link/secret"),
            Err(WorkspaceError::Escapes(_))
        ));
        assert!(matches!(
            workspace.resolve("link"),
            Err(WorkspaceError::Escapes(_))
        ));
    }

    #[test]
    fn a_container_takes_absolute_paths_and_starts_relative_ones_in_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let start = dir.path().canonicalize().unwrap();
        let workspace = Workspace::container(&start).unwrap();
        assert_eq!(workspace.resolve("a.py").unwrap(), start.join("a.py"));
        assert_eq!(
            workspace.resolve("/etc/hostname").unwrap(),
            PathBuf::from("/etc/hostname")
        );
        assert_eq!(workspace.resolve("/../..").unwrap(), PathBuf::from("/"));
        assert_eq!(
            workspace.display(&start.join("a.py")),
            start.join("a.py").display().to_string()
        );
    }
}

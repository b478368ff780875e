//! A workspace with ways out of it, for the file tools' tests.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tempfile::TempDir;

use super::{FileLimits, Workspace};

const SECRET: &str = "TOP SECRET outside the workspace\n";

/// A workspace next to an `outside` directory holding a secret, with symlinks from the
/// workspace to outside: `dirlink` (a directory), `filelink` (the secret), `dangling` (a file
/// that does not exist yet) and `danglingdir` (a directory that does not exist yet).
pub(super) struct Fixture {
    _parent: TempDir,
    pub(super) workspace: Workspace,
    limits: FileLimits,
    pub(super) outside: PathBuf,
}

impl Fixture {
    pub(super) fn new() -> Self {
        Self::with_limits(FileLimits::default())
    }

    pub(super) fn with_limits(limits: FileLimits) -> Self {
        let parent = tempfile::tempdir().unwrap();
        let root = parent.path().join("ws");
        let outside = parent.path().join("outside");
        fs::create_dir(&root).unwrap();
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("secret.txt"), SECRET).unwrap();
        symlink(&outside, root.join("dirlink")).unwrap();
        symlink(outside.join("secret.txt"), root.join("filelink")).unwrap();
        symlink(outside.join("new.txt"), root.join("dangling")).unwrap();
        symlink(outside.join("newdir"), root.join("danglingdir")).unwrap();
        Self {
            workspace: Workspace::new(&root).unwrap(),
            limits,
            outside: outside.canonicalize().unwrap(),
            _parent: parent,
        }
    }

    pub(super) fn root(&self) -> &Path {
        self.workspace.root()
    }

    pub(super) fn write(&self, path: &str, content: &str) {
        let path = self.root().join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    pub(super) fn read(&self, path: &str) -> String {
        fs::read_to_string(self.root().join(path)).unwrap()
    }

    /// Paths that lead outside the workspace, each in a different way, with the start of the
    /// error that refuses them.
    fn escaping_paths(&self) -> Vec<(String, String)> {
        let absolute = self.outside.join("secret.txt").display().to_string();
        [
            ("../outside/secret.txt", "path escapes the workspace"),
            ("sub/../../outside/secret.txt", "path escapes the workspace"),
            (absolute.as_str(), "absolute paths are not allowed"),
            ("dirlink/secret.txt", "path escapes the workspace"),
            ("filelink", "path escapes the workspace"),
            (
                "dangling",
                "dangling is a symbolic link that points outside",
            ),
            (
                "danglingdir/new.txt",
                "danglingdir is a symbolic link that points outside",
            ),
        ]
        .into_iter()
        .map(|(path, refusal)| (path.to_owned(), refusal.to_owned()))
        .collect()
    }

    /// Calls `tool` with each of [`Self::escaping_paths`] (`args` makes its arguments from the
    /// path) and asserts every call is refused, says nothing of the secret, and leaves the outside
    /// untouched.
    pub(super) fn assert_every_escape_refused(&self, tool: &str, args: impl Fn(&str) -> Value) {
        for (path, refusal) in self.escaping_paths() {
            let message = self.err(tool, args(&path));
            assert!(message.starts_with(&refusal), "{path}: {message}");
            assert!(!message.contains("TOP SECRET"), "{path}: {message}");
        }
        self.assert_outside_untouched();
    }

    /// Asserts the outside directory still holds exactly the secret, unchanged.
    pub(super) fn assert_outside_untouched(&self) {
        let names: Vec<_> = fs::read_dir(&self.outside)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret.txt"]);
        assert_eq!(
            fs::read_to_string(self.outside.join("secret.txt")).unwrap(),
            SECRET
        );
    }

    pub(super) fn call(&self, tool: &str, args: Value) -> Result<Value, String> {
        let Value::Object(args) = args else {
            panic!("arguments must be an object")
        };
        super::call(tool, &args, &self.workspace, &self.limits)
    }

    pub(super) fn ok(&self, tool: &str, args: Value) -> Value {
        self.call(tool, args)
            .unwrap_or_else(|message| panic!("expected success, got error: {message}"))
    }

    pub(super) fn err(&self, tool: &str, args: Value) -> String {
        match self.call(tool, args) {
            Err(message) => message,
            Ok(value) => panic!("expected an error, got {value}"),
        }
    }
}

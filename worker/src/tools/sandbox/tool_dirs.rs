//! The directories a local run opens to its commands besides the system's
//! (`spec.sandbox.toolDirs`, `--tool-dir`): a toolchain under the user's home directory.
//!
//! They are resolved and checked before the run starts, with the place that named them: a name
//! that would open the home directory, the run's storage, the model's key file or the
//! workspaces is refused (the model, which a dataset's prompt may steer, could read them
//! through it), and so is a Python that cannot run in the sandbox (a virtual environment whose
//! base interpreter was not named too), before any conversation needs it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::Sandbox;

/// A directory as the run names it, with where it was named (`spec.sandbox.toolDirs[0]`,
/// `--tool-dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedDir {
    pub place: String,
    pub dir: String,
}

/// A path that no tool directory may hold, and what it is, for the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guarded {
    pub what: &'static str,
    pub path: PathBuf,
    /// No tool directory may lie in it either: a directory of the run's own (its storage, its
    /// workspaces), where every directory holds its data.
    pub whole: bool,
}

impl Guarded {
    /// A path no tool directory may hold.
    pub fn new(what: &'static str, path: impl Into<PathBuf>) -> Self {
        Self {
            what,
            path: path.into(),
            whole: false,
        }
    }

    /// A directory of the run's that no tool directory may hold or lie in.
    pub fn whole(what: &'static str, path: impl Into<PathBuf>) -> Self {
        Self {
            whole: true,
            ..Self::new(what, path)
        }
    }
}

/// How to find the directory an interpreter needs, said with every refusal.
const PREFIX_HINT: &str = "an interpreter needs its whole prefix: for Python, name the directory \
     `python3 -c 'import sys; print(sys.base_prefix)'` prints";

/// `named` as absolute, resolved directories, in their order; an error naming the place of the
/// first that does not exist, is not a directory, holds one of `guarded`, or lies in a
/// [`Guarded::whole`] one. `home` expands `~/`.
pub fn resolve(
    named: &[NamedDir],
    guarded: &[Guarded],
    home: Option<&Path>,
) -> Result<Vec<PathBuf>, String> {
    let guarded: Vec<Guarded> = guarded
        .iter()
        .map(|guard| Guarded {
            path: guard
                .path
                .canonicalize()
                .unwrap_or_else(|_| guard.path.clone()),
            ..guard.clone()
        })
        .collect();
    named
        .iter()
        .map(|NamedDir { place, dir }| {
            let path = match (dir.strip_prefix("~/"), home) {
                (Some(below), Some(home)) => home.join(below),
                (Some(_), None) => {
                    return Err(format!(
                        "{place} {dir:?}: there is no home directory (HOME) to expand ~ in"
                    ));
                }
                (None, _) => PathBuf::from(dir),
            };
            if !path.is_absolute() {
                return Err(format!(
                    "{place} {dir:?}: must be an absolute path or start with ~/"
                ));
            }
            let resolved = path
                .canonicalize()
                .map_err(|err| format!("{place} {dir:?}: {}: {err}", path.display()))?;
            if !resolved.is_dir() {
                return Err(format!(
                    "{place} {dir:?}: {} is not a directory",
                    resolved.display()
                ));
            }
            if let Some(guard) = guarded
                .iter()
                .find(|guard| guard.path.starts_with(&resolved))
            {
                return Err(format!(
                    "{place} {dir:?}: {} holds {} ({}), which the model's commands must not \
                     reach; name the toolchain's own directory inside it ({PREFIX_HINT})",
                    resolved.display(),
                    guard.what,
                    guard.path.display()
                ));
            }
            if let Some(guard) = guarded
                .iter()
                .find(|guard| guard.whole && resolved.starts_with(&guard.path))
            {
                return Err(format!(
                    "{place} {dir:?}: {} lies in {} ({}), which the model's commands must not \
                     reach",
                    resolved.display(),
                    guard.what,
                    guard.path.display()
                ));
            }
            Ok(resolved)
        })
        .collect()
}

/// How long one interpreter's check may take: a cold Python starts in well under a second.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs each tool directory's Python (`bin/python3`, or `python3` in a directory that is itself
/// a `bin`) in the sandbox once, in `scratch` (an empty workspace), as a command would: an error
/// naming the directory and what the interpreter said when it cannot start there.
pub async fn check_interpreters(sandbox: &Sandbox, scratch: &Path) -> Result<(), String> {
    for dir in sandbox.tool_dirs() {
        let Some(python) = [dir.join("bin/python3"), dir.join("python3")]
            .into_iter()
            .find(|candidate| candidate.is_file())
        else {
            continue;
        };
        let command = format!(
            "{} -c 'import sys; print(sys.base_prefix)'",
            super::shell_quoted(&python.display().to_string())
        );
        let run = sandbox
            .run_once(scratch, &command, CHECK_TIMEOUT, 2048)
            .await
            .map_err(|err| {
                format!(
                    "cannot start the executor to check {}: {err}",
                    dir.display()
                )
            })?;
        if run.exit_code != Some(0) {
            let said = String::from_utf8_lossy(&run.output_tail);
            return Err(format!(
                "tool directory {}: its {} does not run in the sandbox (exit {}): {}; {PREFIX_HINT}, \
                 and name it too",
                dir.display(),
                python.display(),
                run.exit_code
                    .map_or_else(|| "none: timed out".to_owned(), |code| code.to_string()),
                said.trim()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(dir: &str) -> NamedDir {
        NamedDir {
            place: "spec.sandbox.toolDirs[0]".to_owned(),
            dir: dir.to_owned(),
        }
    }

    #[test]
    fn a_toolchain_under_home_resolves_and_what_holds_guarded_paths_is_refused() {
        let home = tempfile::tempdir().unwrap();
        let version = home.path().join(".pyenv/versions/3.12.7");
        std::fs::create_dir_all(version.join("bin")).unwrap();
        let storage = home.path().join("runs");
        std::fs::create_dir_all(storage.join("run-1")).unwrap();
        let guarded = [
            Guarded::new("the home directory", home.path()),
            Guarded::whole("the run's storage", &storage),
        ];
        let parent = home.path().parent().unwrap().display().to_string();
        let home = Some(home.path());

        let resolved = resolve(&[named("~/.pyenv/versions/3.12.7")], &guarded, home).unwrap();
        assert_eq!(resolved, vec![version.canonicalize().unwrap()]);

        for (dir, says) in [
            ("~/", "holds the home directory"),
            ("~/runs", "holds the run's storage"),
            ("~/runs/run-1", "lies in the run's storage"),
            ("~/missing", "No such file"),
            (
                "~/.pyenv/versions/3.12.7/../../..",
                "holds the home directory",
            ),
        ] {
            let refused = resolve(&[named(dir)], &guarded, home).unwrap_err();
            assert!(refused.starts_with("spec.sandbox.toolDirs[0]"), "{refused}");
            assert!(refused.contains(says), "{dir}: {refused}");
        }
        let refused = resolve(&[named(&parent)], &guarded, home).unwrap_err();
        assert!(refused.contains("holds the home directory"), "{refused}");
    }
}

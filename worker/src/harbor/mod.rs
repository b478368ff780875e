//! Harbor task directories as a dataset (`spec.dataset.format: HarborTasks`).
//!
//! Terminal-Bench 2, SWE-bench through Harbor's adapters, and the tasks TRL, `SkyRL`, Tinker and
//! `NeMo` read are directories: `instruction.md`, `task.toml`, `environment/` (a Dockerfile or a
//! compose file), `tests/test.sh` (writing `/logs/verifier/reward.txt` or `reward.json`) and
//! `solution/solve.sh`. The plan reads such a directory (a task, or a folder whose immediate
//! subdirectories are tasks, as Harbor takes `-p`) and writes each task as a row of the run's
//! dataset: the instruction is the prompt; the task's image (its prebuilt `docker_image`, or
//! the base of a Dockerfile that only names one and a working directory) and working directory
//! are the row's `image` and `cwd`; its tests are the row's verifier (`tests_tar`, run by their
//! `test.sh`, within the task's verifier timeout); its solution is kept for the oracle; and what
//! Harbor says of it (`harbor`, `metadata`) goes into the record's `source`. From there a task
//! runs, resumes and merges as any row does.
//!
//! A task a run cannot honour is refused by name, never run otherwise than Harbor would run it:
//! compose-based environments, Dockerfiles that need a build (a `RUN`, `COPY`, `ENV`, … line),
//! and `task.toml` fields with no equivalent here ([`config::TaskConfig::unsupported`]). Keys
//! Harbor ignores are ignored and named.

pub mod config;
pub mod task;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use task::{HarborTask, TaskImage, is_task_dir};

/// What reading Harbor tasks met.
#[derive(Debug, thiserror::Error)]
pub enum HarborError {
    #[error("cannot read {path}: {err}")]
    Read {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("{path}: {why}")]
    Config { path: PathBuf, why: String },
    /// A task a run cannot honour, and why.
    #[error("task {task} is refused: {why}")]
    Refused { task: PathBuf, why: String },
    #[error(
        "{path} holds no Harbor task (a task.toml and an instruction.md), nor directories that do"
    )]
    NoTasks { path: PathBuf },
}

/// The tasks under `root` (itself a task, or a folder of tasks, in name order): each read, or
/// why it is refused.
pub fn read_tasks(root: &Path) -> Result<Vec<Result<HarborTask, HarborError>>, HarborError> {
    if is_task_dir(root) {
        return Ok(vec![HarborTask::read(root)]);
    }
    let entries = std::fs::read_dir(root).map_err(|err| HarborError::Read {
        path: root.to_path_buf(),
        err,
    })?;
    // A link to a directory is not followed: a task carries its own files only.
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
        .map(|entry| entry.path())
        .filter(|path| is_task_dir(path))
        .collect();
    if dirs.is_empty() {
        return Err(HarborError::NoTasks {
            path: root.to_path_buf(),
        });
    }
    dirs.sort();
    Ok(dirs.iter().map(|dir| HarborTask::read(dir)).collect())
}

/// The tasks under `root` as dataset rows, one JSON line each, and the tasks refused: those
/// that cannot run, and those `excluded` names (by directory name, with why).
pub fn rows_jsonl(
    root: &Path,
    excluded: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<HarborError>), HarborError> {
    let mut jsonl = Vec::new();
    let mut refused = Vec::new();
    for task in read_tasks(root)? {
        match task {
            Ok(task) if let Some(why) = excluded.get(&task.dir_name) => {
                refused.push(HarborError::Refused {
                    task: PathBuf::from(&task.dir_name),
                    why: why.clone(),
                });
            }
            Ok(task) => {
                if !task.ignored.is_empty() {
                    tracing::warn!(task = %task.dir_name, keys = ?task.ignored, "task.toml keys Harbor ignores are ignored");
                }
                serde_json::to_writer(&mut jsonl, &task.row()).expect("a row serialises");
                jsonl.push(b'\n');
            }
            Err(error) => refused.push(error),
        }
    }
    Ok((jsonl, refused))
}

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
//! compose-based environments, Dockerfiles that need a build (a `RUN`, `COPY`, `ENV`, … line)
//! when the run builds no images (`spec.sandbox.builds`), and `task.toml` fields with no
//! equivalent here ([`config::TaskConfig::unsupported`]). Keys Harbor ignores are ignored and
//! named. With builds, each distinct `environment/` directory is built once, as the image its
//! tasks' rows name.

pub mod config;
pub mod task;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use task::{HarborTask, TaskImage, is_task_dir};

use crate::contract::{BuildEntry, TaskResources};
use crate::spec::ImageBuilds;

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

/// The tasks under `root` as dataset rows, with what reading them met.
#[derive(Debug, Default)]
pub struct HarborRows {
    /// One JSON line a task that runs.
    pub jsonl: Vec<u8>,
    /// The tasks refused: those that cannot run, and those excluded (with why).
    pub refused: Vec<HarborError>,
    /// The images the run builds: one a distinct build context, in the order the tasks first
    /// need them, each with its packed context.
    pub builds: Vec<(BuildEntry, Vec<u8>)>,
    /// What the tasks of each image (as the rows name it) ask of their containers, for the images
    /// whose tasks ask anything.
    pub resources: BTreeMap<String, TaskResources>,
}

/// The tasks under `root` as dataset rows, one JSON line each, and the tasks refused: those
/// that cannot run, and those `excluded` names (by directory name, with why). A task whose
/// Dockerfile needs a build runs in the image `builds` builds of its context; without
/// `builds` it is refused.
pub fn rows_jsonl(
    root: &Path,
    excluded: &BTreeMap<String, String>,
    builds: Option<&ImageBuilds>,
) -> Result<HarborRows, HarborError> {
    let mut rows = HarborRows::default();
    let mut by_hash: BTreeMap<String, usize> = BTreeMap::new();
    for task in read_tasks(root)? {
        let task = match task {
            Ok(task) if let Some(why) = excluded.get(&task.dir_name) => {
                rows.refused.push(HarborError::Refused {
                    task: PathBuf::from(&task.dir_name),
                    why: why.clone(),
                });
                continue;
            }
            Ok(task) => task,
            Err(error) => {
                rows.refused.push(error);
                continue;
            }
        };
        let built = match (&task.image, builds) {
            (TaskImage::Build { needs, .. }, None) => {
                rows.refused.push(HarborError::Refused {
                    task: PathBuf::from(&task.dir_name),
                    why: format!(
                        "environment/Dockerfile {needs}: set spec.sandbox.builds to build it"
                    ),
                });
                continue;
            }
            (TaskImage::Build { hash, context, .. }, Some(builds)) => {
                let timeout = task.config.environment.build_timeout_sec;
                let at = *by_hash.entry(hash.clone()).or_insert_with(|| {
                    let entry = BuildEntry {
                        hash: hash.clone(),
                        image: builds.image_of(hash),
                        context: format!("{BUILDS_DIR}/{hash}.tar.gz"),
                        tasks: Vec::new(),
                        timeout_sec: timeout,
                    };
                    rows.builds.push((entry, context.clone()));
                    rows.builds.len() - 1
                });
                let entry = &mut rows.builds[at].0;
                entry.tasks.push(task.dir_name.clone());
                entry.timeout_sec = entry.timeout_sec.max(timeout);
                Some(entry.image.clone())
            }
            _ => None,
        };
        if !task.ignored.is_empty() {
            tracing::warn!(task = %task.dir_name, keys = ?task.ignored, "task.toml keys Harbor ignores are ignored");
        }
        let row = task.row(built.as_deref());
        if let (Some(asked), Some(image)) = (task.resources().asked(), row["image"].as_str()) {
            let entry = rows.resources.entry(image.to_owned()).or_default();
            *entry = entry.max(asked);
        }
        serde_json::to_writer(&mut rows.jsonl, &row).expect("a row serialises");
        rows.jsonl.push(b'\n');
    }
    Ok(rows)
}

/// Hex sha256 of `bytes`: a build context's digest, its image's tag.
pub fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("{:x}", sha2::Sha256::digest(bytes))
}

/// The directory of the run's packed build contexts, in the run's directory.
pub const BUILDS_DIR: &str = "builds";

//! One Harbor task directory read into a dataset row.

use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::config::TaskConfig;
use super::{HarborError, hex_sha256};
use crate::verify::{TESTS_TAR_FIELD, VERIFIER_TIMEOUT_FIELD};

/// The row field of a task's `solution/` directory (base64 of a gzipped tar), which the oracle
/// runs instead of a model.
pub const SOLUTION_TAR_FIELD: &str = "solution_tar";
/// The row field of Harbor's own description of the task (its directory, name, timeouts,
/// resources), kept in the record's `source`.
pub const HARBOR_FIELD: &str = "harbor";

/// Where a task's commands run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskImage {
    /// `[environment] docker_image`.
    Prebuilt(String),
    /// An `environment/Dockerfile` that only names its base image and a working directory (and
    /// labels, a command, ports): its base image is the same filesystem a build would give.
    Base {
        image: String,
        workdir: Option<String>,
    },
    /// An `environment/Dockerfile` that needs a build: the run builds it when it has
    /// `spec.sandbox.builds` ([`crate::spec::ImageBuilds`]), and refuses the task otherwise.
    Build {
        /// Hex sha256 of the context (`environment/`) as an uncompressed tar packed like
        /// [`pack`]'s: the same directory, the same digest.
        hash: String,
        /// The context, packed ([`pack`]).
        context: Vec<u8>,
        /// The Dockerfile's last static `WORKDIR`, where the conversation starts.
        workdir: Option<String>,
        /// What needs the build (the line and its instruction), for the refusal without builds.
        needs: String,
    },
}

/// A task directory, read.
#[derive(Debug, Clone, PartialEq)]
pub struct HarborTask {
    /// Its directory's name, which Harbor's `-i` filters on.
    pub dir_name: String,
    pub config: TaskConfig,
    /// Keys of `task.toml` Harbor ignores, ignored here too.
    pub ignored: Vec<String>,
    pub instruction: String,
    pub image: TaskImage,
    /// `tests/`, packed (a gzipped tar, entries in name order, no times or owners).
    pub tests_tar: Vec<u8>,
    /// `solution/`, packed the same way, when there is one.
    pub solution_tar: Option<Vec<u8>>,
}

/// Whether `dir` looks like a task (Harbor's `Task.is_valid_dir`: a `task.toml` and an
/// `instruction.md`), rather than a folder of tasks.
pub fn is_task_dir(dir: &Path) -> bool {
    dir.join("task.toml").is_file() && dir.join("instruction.md").is_file()
}

impl HarborTask {
    /// Reads the task in `dir`; an error names what makes it one a run cannot honour.
    pub fn read(dir: &Path) -> Result<Self, HarborError> {
        let refused = |why: String| HarborError::Refused {
            task: dir.to_path_buf(),
            why,
        };
        not_a_link(dir)?;
        let config_path = dir.join("task.toml");
        let text = read_text(&config_path)?;
        let (config, ignored) = TaskConfig::parse(&text).map_err(|why| HarborError::Config {
            path: config_path.clone(),
            why,
        })?;
        if let Some(why) = config.unsupported().into_iter().next() {
            return Err(refused(format!("task.toml {why}")));
        }
        let instruction = read_text(&dir.join("instruction.md"))?;
        if instruction.trim().is_empty() {
            return Err(refused("instruction.md is empty".into()));
        }
        let image = task_image(dir, &config)?;
        let tests = dir.join("tests");
        if !tests.join("test.sh").is_file() {
            return Err(refused("tests/test.sh is missing".into()));
        }
        let solution = dir.join("solution");
        let solution_tar = if solution.join("solve.sh").is_file() {
            Some(pack(&solution)?)
        } else {
            None
        };
        Ok(Self {
            dir_name: dir
                .file_name()
                .map_or_else(String::new, |name| name.to_string_lossy().into_owned()),
            config,
            ignored,
            instruction,
            image,
            tests_tar: pack(&tests)?,
            solution_tar,
        })
    }

    /// What the task asks of its container (`[environment]` `cpus`, `memory_mb`, `storage_mb`).
    pub fn resources(&self) -> crate::contract::TaskResources {
        let environment = &self.config.environment;
        crate::contract::TaskResources {
            // A positive, finite count (checked when `task.toml` was read), in thousandths.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            millicpus: environment
                .cpus
                .map(|cpus| (cpus * 1000.0).round().clamp(1.0, 1.0e9) as u64),
            memory_mb: environment.memory_mb,
            storage_mb: environment.storage_mb,
        }
    }

    /// The task as a dataset row: its instruction as the prompt, its image and working
    /// directory, its tests as the verifier (`tests_tar`, run by their `test.sh`) within its
    /// verifier timeout, its solution for the oracle, and Harbor's description of it
    /// (`harbor`: directory, name, timeouts, resources) with its `metadata`, which the record's
    /// `source` keeps.
    ///
    /// A task whose image the run builds runs in `built`, the image its build is pushed as.
    pub fn row(&self, built: Option<&str>) -> Map<String, Value> {
        let base64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
        let mut row = Map::new();
        row.insert("prompt".into(), self.instruction.clone().into());
        let (image, workdir) = match &self.image {
            TaskImage::Prebuilt(image) => (image.as_str(), None),
            TaskImage::Base { image, workdir } => (image.as_str(), workdir.as_ref()),
            TaskImage::Build { workdir, .. } => (built.unwrap_or_default(), workdir.as_ref()),
        };
        row.insert("image".into(), image.into());
        if let Some(cwd) = self.config.environment.workdir.as_ref().or(workdir) {
            row.insert("cwd".into(), cwd.clone().into());
        }
        row.insert(TESTS_TAR_FIELD.into(), base64(&self.tests_tar).into());
        row.insert(
            VERIFIER_TIMEOUT_FIELD.into(),
            self.config.verifier.timeout_sec.into(),
        );
        if let Some(solution) = &self.solution_tar {
            row.insert(SOLUTION_TAR_FIELD.into(), base64(solution).into());
        }
        let environment = &self.config.environment;
        row.insert(
            HARBOR_FIELD.into(),
            json!({
                "task": self.dir_name,
                "name": self.config.name(),
                "schema_version": self.config.schema_version.as_ref().or(self.config.version.as_ref()),
                "agent_timeout_sec": self.config.agent.timeout_sec,
                "verifier_timeout_sec": self.config.verifier.timeout_sec,
                "build_timeout_sec": environment.build_timeout_sec,
                "cpus": environment.cpus,
                "memory_mb": environment.memory_mb,
                "storage_mb": environment.storage_mb,
                "source": self.config.source,
            }),
        );
        if !self.config.metadata.is_empty() {
            row.insert(
                "metadata".into(),
                Value::Object(self.config.metadata.clone().into_iter().collect()),
            );
        }
        row
    }
}

/// The image a task runs in: its prebuilt `docker_image`, else the base of its Dockerfile;
/// a compose file, or a Dockerfile that needs a build, refuses the task.
fn task_image(dir: &Path, config: &TaskConfig) -> Result<TaskImage, HarborError> {
    let refused = |why: String| HarborError::Refused {
        task: dir.to_path_buf(),
        why,
    };
    if let Some(image) = &config.environment.docker_image {
        return Ok(TaskImage::Prebuilt(image.clone()));
    }
    let environment = dir.join("environment");
    for compose in ["docker-compose.yaml", "docker-compose.yml"] {
        if environment.join(compose).exists() {
            return Err(refused(format!(
                "environment/{compose}: compose-based tasks are not supported"
            )));
        }
    }
    let dockerfile = environment.join("Dockerfile");
    if !dockerfile.is_file() {
        return Err(refused(
            "neither [environment] docker_image nor environment/Dockerfile".into(),
        ));
    }
    match base_image(&read_text(&dockerfile)?) {
        Ok(image) => Ok(image),
        Err(Dockerfile::NeedsBuild { needs, workdir }) => {
            let tar = pack_tar(&environment)?;
            let hash = hex_sha256(&tar);
            Ok(TaskImage::Build {
                hash,
                context: gzip(&tar).map_err(|err| HarborError::Read {
                    path: environment.clone(),
                    err,
                })?,
                workdir,
                needs,
            })
        }
        Err(Dockerfile::Invalid(why)) => Err(refused(format!("environment/Dockerfile {why}"))),
    }
}

/// Why a Dockerfile's base image is not the task's image.
#[derive(Debug, PartialEq, Eq)]
enum Dockerfile {
    /// It needs a build (`needs`: the line and its instruction); its last stage's last static
    /// `WORKDIR`.
    NeedsBuild {
        needs: String,
        workdir: Option<String>,
    },
    /// It names no image.
    Invalid(String),
}

/// Refuses `path` when it is a link: a task carries its own files only, never what a link
/// points at elsewhere on the run's storage (which would go to the model, or into a container).
fn not_a_link(path: &Path) -> Result<(), HarborError> {
    if std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_symlink()) {
        return Err(HarborError::Refused {
            task: path.to_path_buf(),
            why: "is a link: a task carries its own files only".into(),
        });
    }
    Ok(())
}

fn read_text(path: &Path) -> Result<String, HarborError> {
    not_a_link(path)?;
    std::fs::read_to_string(path).map_err(|err| HarborError::Read {
        path: path.to_path_buf(),
        err,
    })
}

/// The base image and working directory of a Dockerfile that does nothing else, or why it
/// needs a build (the first instruction that does, and its line).
fn base_image(dockerfile: &str) -> Result<TaskImage, Dockerfile> {
    let (mut image, mut workdir): (Option<String>, Option<String>) = (None, None);
    let mut needs: Option<String> = None;
    let mut saw_from = false;
    let mut logical = String::new();
    let mut first_line = 0;
    for (number, line) in dockerfile.lines().enumerate() {
        let trimmed = line.trim();
        if logical.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if logical.is_empty() {
            first_line = number + 1;
        }
        if let Some(continued) = trimmed.strip_suffix('\\') {
            logical.push_str(continued);
            logical.push(' ');
            continue;
        }
        logical.push_str(trimmed);
        let instruction = std::mem::take(&mut logical);
        let (keyword, arguments) = instruction
            .split_once(char::is_whitespace)
            .unwrap_or((&instruction, ""));
        let arguments = arguments.trim();
        let keyword = keyword.to_ascii_uppercase();
        let mut build = || {
            needs.get_or_insert_with(|| {
                format!("line {first_line}: {keyword} needs an image build")
            });
        };
        match keyword.as_str() {
            "FROM" => {
                saw_from = true;
                let words: Vec<&str> = arguments
                    .split_whitespace()
                    .filter(|word| !word.starts_with("--"))
                    .collect();
                match words.as_slice() {
                    [base] | [base, _, _] if image.is_none() && !base.contains('$') => {
                        image = Some((*base).to_owned());
                    }
                    _ => build(),
                }
                // A new stage starts where its base image does.
                workdir = None;
            }
            "WORKDIR" if arguments.contains('$') => {
                build();
                workdir = None;
            }
            "WORKDIR" => {
                let next = Path::new(workdir.as_deref().unwrap_or("/")).join(arguments);
                workdir = Some(next.display().to_string());
            }
            "LABEL" | "MAINTAINER" | "CMD" | "ENTRYPOINT" | "EXPOSE" | "STOPSIGNAL" => {}
            _ => build(),
        }
    }
    match (image, needs) {
        (None, _) if !saw_from => Err(Dockerfile::Invalid("has no FROM".into())),
        (Some(image), None) => Ok(TaskImage::Base { image, workdir }),
        (_, needs) => Err(Dockerfile::NeedsBuild {
            needs: needs.unwrap_or_else(|| "its FROM needs an image build".into()),
            workdir,
        }),
    }
}

/// The directory `dir` as a gzipped tar: regular files and directories in name order, modes
/// kept, no times or owners, so the same directory packs to the same bytes. A link, or a file
/// of another kind, is refused: a task must not carry in what lies outside it.
fn pack(dir: &Path) -> Result<Vec<u8>, HarborError> {
    gzip(&pack_tar(dir)?).map_err(|err| HarborError::Read {
        path: dir.to_path_buf(),
        err,
    })
}

fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut encoder = flate2::GzBuilder::new().write(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes)?;
    encoder.finish()
}

/// [`pack`]'s tar, uncompressed.
fn pack_tar(dir: &Path) -> Result<Vec<u8>, HarborError> {
    not_a_link(dir)?;
    let mut files: Vec<PathBuf> = Vec::new();
    for entry in walkdir::WalkDir::new(dir).sort_by_file_name().min_depth(1) {
        let entry = entry.map_err(|err| HarborError::Read {
            path: dir.to_path_buf(),
            err: err.into(),
        })?;
        let kind = entry.file_type();
        if !(kind.is_file() || kind.is_dir()) {
            return Err(HarborError::Refused {
                task: dir.to_path_buf(),
                why: format!(
                    "{} is a link or special file: a task carries regular files only",
                    entry.path().display()
                ),
            });
        }
        files.push(entry.into_path());
    }
    let mut builder = tar::Builder::new(Vec::new());
    for path in files {
        let name = path.strip_prefix(dir).expect("walked under dir");
        let read = |err| HarborError::Read {
            path: path.clone(),
            err,
        };
        let meta = std::fs::metadata(&path).map_err(read)?;
        let mut header = tar::Header::new_gnu();
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        if meta.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o755);
            header.set_size(0);
            builder
                .append_data(&mut header, name, std::io::empty())
                .map_err(read)?;
        } else {
            use std::os::unix::fs::PermissionsExt as _;
            header.set_mode(if meta.permissions().mode() & 0o111 != 0 {
                0o755
            } else {
                0o644
            });
            header.set_size(meta.len());
            let file = std::fs::File::open(&path).map_err(read)?;
            builder.append_data(&mut header, name, file).map_err(read)?;
        }
    }
    builder.into_inner().map_err(|err| HarborError::Read {
        path: dir.to_path_buf(),
        err,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dockerfile_of_a_base_and_a_workdir_runs_in_its_base() {
        assert_eq!(
            base_image(
                "# syntax=docker/dockerfile:1\nFROM --platform=linux/amd64 python:3.12 AS base\nWORKDIR /app\nWORKDIR src\nCMD [\"sleep\", \"infinity\"]\n"
            ),
            Ok(TaskImage::Base {
                image: "python:3.12".into(),
                workdir: Some("/app/src".into())
            })
        );
        for (dockerfile, says) in [
            (
                "FROM debian:12\nRUN apt-get update && \\\n  apt-get install -y git\n",
                "line 2: RUN",
            ),
            ("FROM debian:12\nCOPY . /app\n", "line 2: COPY"),
            ("FROM debian:12\nENV A=1\n", "line 2: ENV"),
            ("ARG BASE\nFROM $BASE\n", "line 1: ARG"),
            ("FROM a\nFROM b\n", "line 2: FROM"),
        ] {
            match base_image(dockerfile) {
                Err(Dockerfile::NeedsBuild { needs, .. }) => {
                    assert!(needs.starts_with(says), "{dockerfile:?}: {needs}");
                }
                other => panic!("{dockerfile:?}: {other:?}"),
            }
        }
        assert_eq!(
            base_image("# nothing\n"),
            Err(Dockerfile::Invalid("has no FROM".into()))
        );
        // Built: the conversation starts in the last stage's working directory.
        assert_eq!(
            base_image("FROM a AS b\nWORKDIR /x\nFROM b\nRUN true\nWORKDIR /app\nWORKDIR src\n"),
            Err(Dockerfile::NeedsBuild {
                needs: "line 3: FROM needs an image build".into(),
                workdir: Some("/app/src".into())
            })
        );
    }

    #[test]
    fn a_directory_packs_to_the_same_bytes_and_links_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("test.sh"), "#!/bin/bash\n").unwrap();
        std::fs::write(dir.path().join("sub/data.txt"), "x").unwrap();
        let once = pack(dir.path()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(dir.path().join("sub/data.txt"), "x").unwrap();
        assert_eq!(pack(dir.path()).unwrap(), once, "times are not packed");
        let mut names = Vec::new();
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(once.as_slice()));
        for entry in archive.entries().unwrap() {
            names.push(entry.unwrap().path().unwrap().display().to_string());
        }
        assert_eq!(names, ["sub", "sub/data.txt", "test.sh"]);
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("leak")).unwrap();
        let refused = pack(dir.path()).unwrap_err().to_string();
        assert!(refused.contains("leak"), "{refused}");
    }

    #[test]
    fn a_task_whose_files_are_links_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let task = dir.path().join("t");
        std::fs::create_dir_all(task.join("tests")).unwrap();
        std::fs::write(
            task.join("task.toml"),
            "[environment]\ndocker_image = \"a\"\n",
        )
        .unwrap();
        std::fs::write(task.join("tests/test.sh"), "true\n").unwrap();
        std::fs::write(dir.path().join("secret"), "the key").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), task.join("instruction.md")).unwrap();
        let refused = HarborTask::read(&task).unwrap_err().to_string();
        assert!(
            refused.contains("instruction.md") && refused.contains("is a link"),
            "{refused}"
        );
        std::fs::remove_file(task.join("instruction.md")).unwrap();
        std::fs::write(task.join("instruction.md"), "do it\n").unwrap();
        assert!(HarborTask::read(&task).is_ok());
        std::os::unix::fs::symlink(&task, dir.path().join("linked")).unwrap();
        let refused = HarborTask::read(&dir.path().join("linked"))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("is a link"), "{refused}");
    }
}

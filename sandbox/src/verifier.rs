//! `trajectory-executor verifier`: the steps of a row's verifier around its command, in the
//! environment the conversation left.
//!
//! A verifier's command is an ordinary command ([`crate::run`]); what it needs besides is done
//! here, confined as a command is (same Landlock rules and capabilities, so nothing here can
//! reach further than the model's own commands could):
//! - **Prepare**, after the conversation ended and before the command: each directory the
//!   verifier reads from or writes to (the tests', the reward's) is replaced by a new empty one,
//!   whatever the model left there (files, a link to elsewhere: removed, never followed), and the
//!   tests are unpacked into it. No process of the conversation is alive by then (the worker
//!   ends them first), so what the verifier finds there is what arrived after the conversation.
//! - **Read the reward** the command wrote, bounded.
//!
//! Answers are a file call's: one JSON object, `{"ok": value}` or `{"error": message}`.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use serde_json::Value;

use crate::file::{answer_one_request, one_request_command};
use crate::protocol::{FileAnswer, MAX_REWARD_BYTES, VerifierRequest, VerifierStep};
use crate::{ImageFiles, LandlockMode};

/// The subcommand.
pub const SUBCOMMAND: &str = "verifier";

/// The name the row's `test_sh` is written under in the tests' directory, as terminal-bench's.
pub const TEST_SCRIPT: &str = "test.sh";

/// The most the tests may take once unpacked: a tests archive is scripts and small fixtures, and
/// a gzip bomb must not fill the environment the verifier runs in.
pub const MAX_UNPACKED_BYTES: u64 = 256 << 20;

/// The command line of an executor that runs one verifier step in `workspace`; the caller writes
/// the [`VerifierRequest`] to its standard input and reads the answer from its standard output.
pub fn command(
    executor: &Path,
    workspace: &Path,
    landlock: LandlockMode,
    image_files: &ImageFiles,
) -> Command {
    one_request_command(executor, SUBCOMMAND, workspace, landlock, image_files)
}

/// The executor process: `args` are those after the subcommand.
pub fn main(args: impl Iterator<Item = OsString>) -> i32 {
    answer_one_request(args, |args, line| {
        let request: VerifierRequest =
            serde_json::from_slice(line).map_err(|err| format!("bad verifier step: {err}"))?;
        Ok(FileAnswer::from(step(&args.workspace, &request.step)))
    })
}

/// Does `step` with relative paths starting in `workspace`.
pub fn step(workspace: &Path, step: &VerifierStep) -> Result<Value, String> {
    match step {
        VerifierStep::Prepare {
            fresh,
            tests_dir,
            tests_tar,
            test_sh,
        } => {
            for dir in fresh {
                replace_with_empty_dir(&workspace.join(dir))?;
            }
            let tests_dir = workspace.join(tests_dir);
            if let Some(tar) = tests_tar.as_deref() {
                unpack_tests(tar, &tests_dir)?;
            }
            if let Some(script) = test_sh.as_deref() {
                write_script(&tests_dir.join(TEST_SCRIPT), script)?;
            }
            Ok(Value::Null)
        }
        VerifierStep::ReadReward { path } => read_reward(&workspace.join(path)),
    }
}

/// Makes `path` an empty directory: a directory is emptied (not removed: a top-level one of a
/// task container cannot be made again under Landlock), anything else there (a file, a link,
/// which is removed, not followed) replaced; an ancestor that is not a directory is replaced
/// too.
fn replace_with_empty_dir(path: &Path) -> Result<(), String> {
    if path.parent().is_none() {
        return Err(format!("{} cannot be made afresh", path.display()));
    }
    let ancestors: Vec<&Path> = path.ancestors().skip(1).collect();
    for ancestor in ancestors.into_iter().rev() {
        if let Ok(meta) = std::fs::metadata(ancestor)
            && !meta.is_dir()
        {
            std::fs::remove_file(ancestor)
                .map_err(|err| format!("cannot remove {}: {err}", ancestor.display()))?;
        }
    }
    let removed = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => empty(path),
        Ok(_) => std::fs::remove_file(path),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(err),
    };
    removed
        .and_then(|()| std::fs::create_dir_all(path))
        .map_err(|err| format!("cannot make {} afresh: {err}", path.display()))
}

/// Removes everything in the directory `dir` (links removed, not followed).
fn empty(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// Unpacks `encoded` (base64 of a tar archive, gzipped or not) into `dir`.
fn unpack_tests(encoded: &str, dir: &Path) -> Result<(), String> {
    let compact: Vec<u8> = encoded
        .bytes()
        .filter(|byte| !byte.is_ascii_whitespace())
        .collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|err| format!("tests_tar is not base64: {err}"))?;
    let reader: Box<dyn Read> = if bytes.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::GzDecoder::new(bytes.as_slice()))
    } else {
        Box::new(bytes.as_slice())
    };
    let mut archive = tar::Archive::new(reader);
    archive.set_overwrite(true);
    let broken = |err: std::io::Error| format!("tests_tar is not a readable tar archive: {err}");
    let mut unpacked = 0_u64;
    for entry in archive.entries().map_err(broken)? {
        let mut entry = entry.map_err(broken)?;
        unpacked += entry.header().size().map_err(broken)?;
        if unpacked > MAX_UNPACKED_BYTES {
            return Err(format!(
                "tests_tar unpacks to more than {} MiB",
                MAX_UNPACKED_BYTES >> 20
            ));
        }
        let name = entry.path().map_or_else(
            |_| PathBuf::from("(unreadable name)"),
            std::borrow::Cow::into_owned,
        );
        let inside = entry
            .unpack_in(dir)
            .map_err(|err| format!("cannot unpack {} of tests_tar: {err}", name.display()))?;
        if !inside {
            return Err(format!(
                "tests_tar holds {}, which would land outside {}",
                name.display(),
                dir.display()
            ));
        }
    }
    Ok(())
}

fn write_script(path: &Path, script: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, script)
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)))
        .map_err(|err| format!("cannot write {}: {err}", path.display()))
}

/// The reward file's text (at most [`MAX_REWARD_BYTES`]), or `null` when there is none.
fn read_reward(path: &Path) -> Result<Value, String> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Value::Null),
        Err(err) => return Err(format!("cannot open {}: {err}", path.display())),
    };
    let mut text = Vec::new();
    file.take(MAX_REWARD_BYTES)
        .read_to_end(&mut text)
        .map_err(|err| format!("cannot read {}: {err}", path.display()))?;
    Ok(Value::String(String::from_utf8_lossy(&text).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(files: &[(&str, &str)], gzip: bool) -> String {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, text) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(text.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder
                .append_data(&mut header, name, text.as_bytes())
                .unwrap();
        }
        let tar = builder.into_inner().unwrap();
        let bytes = if gzip {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            std::io::Write::write_all(&mut encoder, &tar).unwrap();
            encoder.finish().unwrap()
        } else {
            tar
        };
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn prepare(tests_tar: Option<String>, test_sh: Option<&str>) -> VerifierStep {
        VerifierStep::Prepare {
            fresh: vec!["tests".to_owned(), "logs/verifier".to_owned()],
            tests_dir: "tests".to_owned(),
            tests_tar,
            test_sh: test_sh.map(str::to_owned),
        }
    }

    #[test]
    fn prepare_replaces_what_the_model_left_and_unpacks_the_tests_gzipped_or_not() {
        for gzip in [false, true] {
            let root = tempfile::tempdir().unwrap();
            let outside = tempfile::tempdir().unwrap();
            let ws = root.path();
            // The model's preparations: a reward already written, a test edited, and a link
            // that would send the verifier's writes elsewhere.
            std::fs::create_dir_all(ws.join("logs/verifier")).unwrap();
            std::fs::write(ws.join("logs/verifier/reward.txt"), "1").unwrap();
            std::fs::create_dir_all(ws.join("tests")).unwrap();
            std::fs::write(ws.join("tests/test_outputs.py"), "assert True").unwrap();
            std::os::unix::fs::symlink(outside.path(), ws.join("tests/link")).unwrap();
            let tests = tar_of(
                &[("test_outputs.py", "assert False"), ("data/input.txt", "x")],
                gzip,
            );
            assert_eq!(
                step(ws, &prepare(Some(tests), Some("exit 3"))),
                Ok(Value::Null)
            );
            assert!(!ws.join("logs/verifier/reward.txt").exists());
            assert!(ws.join("logs/verifier").is_dir());
            assert_eq!(
                std::fs::read_to_string(ws.join("tests/test_outputs.py")).unwrap(),
                "assert False"
            );
            assert_eq!(
                std::fs::read_to_string(ws.join("tests/data/input.txt")).unwrap(),
                "x"
            );
            assert!(!ws.join("tests/link").exists(), "the old directory is gone");
            assert_eq!(
                std::fs::read_to_string(ws.join("tests").join(TEST_SCRIPT)).unwrap(),
                "exit 3"
            );
            assert!(outside.path().exists(), "a link is removed, not followed");
        }
    }

    #[test]
    fn a_link_or_a_file_where_a_directory_goes_is_replaced_not_followed() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), "kept").unwrap();
        let ws = root.path();
        std::os::unix::fs::symlink(outside.path(), ws.join("tests")).unwrap();
        std::fs::write(ws.join("logs"), "a file where a directory goes").unwrap();
        assert_eq!(step(ws, &prepare(None, None)), Ok(Value::Null));
        assert!(ws.join("tests").is_dir() && !ws.join("tests").is_symlink());
        assert!(ws.join("logs/verifier").is_dir());
        assert_eq!(
            std::fs::read_to_string(outside.path().join("keep")).unwrap(),
            "kept"
        );
    }

    #[test]
    fn tests_that_are_not_a_tar_or_would_land_outside_are_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        let ws = root.path();
        let error = step(ws, &prepare(Some("not base64!".to_owned()), None)).unwrap_err();
        assert!(error.starts_with("tests_tar is not base64"), "{error}");
        let plain = base64::engine::general_purpose::STANDARD.encode(b"just some text");
        let error = step(ws, &prepare(Some(plain), None)).unwrap_err();
        assert!(error.contains("tests_tar"), "{error}");
        // A name with `..` in it, written raw (the builder refuses such names).
        let mut header = tar::Header::new_gnu();
        header.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"../escaped.py");
        header.set_size(1);
        header.set_mode(0o644);
        header.set_cksum();
        let mut raw = header.as_bytes().to_vec();
        raw.extend_from_slice(&[b'x'; 512]);
        raw.extend_from_slice(&[0; 1024]);
        let encoded = base64::engine::general_purpose::STANDARD.encode(raw);
        let error = step(ws, &prepare(Some(encoded), None)).unwrap_err();
        assert!(error.contains("../escaped.py"), "{error}");
        assert!(!ws.parent().unwrap().join("escaped.py").exists());
    }

    #[test]
    fn the_reward_is_read_bounded_and_a_missing_one_is_null() {
        let root = tempfile::tempdir().unwrap();
        let ws = root.path();
        let read = |path: &str| {
            step(
                ws,
                &VerifierStep::ReadReward {
                    path: path.to_owned(),
                },
            )
        };
        assert_eq!(read("reward.txt"), Ok(Value::Null));
        std::fs::write(ws.join("reward.txt"), "0.75\n").unwrap();
        assert_eq!(read("reward.txt"), Ok(Value::String("0.75\n".to_owned())));
        std::fs::write(ws.join("big.txt"), "1".repeat(10_000)).unwrap();
        let big = read("big.txt").unwrap();
        assert_eq!(big.as_str().map(str::len), Some(4096));
    }
}

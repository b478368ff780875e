//! `write_file`: creates a file or replaces its whole content.

use std::fs::OpenOptions;
use std::io::Write;

use serde_json::{Map, Value, json};

use super::confine::{open_confined, prepare_file};
use super::{FileCall, file_path_parameter};
use super::{FileLimits, Workspace};
use crate::args::{non_empty_string_arg, string_arg};

#[derive(Debug)]
pub(super) struct WriteFileCall {
    path: String,
    content: String,
}

impl FileCall for WriteFileCall {
    const NAME: &'static str = "write_file";
    const DESCRIPTION: &'static str = "Create a file in the workspace, or replace the whole \
        content of an existing one. Missing parent directories are created. To change part of an \
        existing file use `patch` instead.";
    const READ_ONLY: bool = false;

    fn parameters() -> Value {
        json!({
            "type": "object",
            "properties": {
                "path": file_path_parameter(),
                "content": {
                    "type": "string",
                    "description": "The complete new content of the file."
                }
            },
            "required": ["path", "content"]
        })
    }

    fn parse(args: &Map<String, Value>) -> Result<Self, String> {
        Ok(Self {
            path: non_empty_string_arg(args, "path")?.to_owned(),
            content: string_arg(args, "content")?.to_owned(),
        })
    }

    fn run(self, workspace: &Workspace, limits: &FileLimits) -> Result<Value, String> {
        let Self {
            path: requested,
            content,
        } = self;
        let requested = requested.as_str();
        if content.len() > limits.max_write_bytes {
            return Err(format!(
                "content is {} bytes; write_file accepts at most {} bytes per call (write a \
                 smaller file, or generate large files with a command)",
                content.len(),
                limits.max_write_bytes
            ));
        }
        let path = prepare_file(workspace, requested)?;
        // Not truncated on open: truncation waits until the descriptor is known to be inside.
        let mut file = open_confined(
            workspace,
            &path,
            requested,
            OpenOptions::new().write(true).create(true),
        )?;
        file.set_len(0)
            .and_then(|()| file.write_all(content.as_bytes()))
            .map_err(|err| format!("cannot write {requested}: {err}"))?;
        Ok(json!({ "path": workspace.display(&path), "bytes_written": content.len() }))
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::files::fixture::Fixture;

    #[test]
    fn write_file_creates_parent_directories() {
        let fx = Fixture::new();
        let result = fx.ok(
            "write_file",
            json!({"path": "a/b/c.txt", "content": "hello\n"}),
        );
        assert_eq!(result, json!({"path": "a/b/c.txt", "bytes_written": 6}));
        assert_eq!(fx.read("a/b/c.txt"), "hello\n");
    }

    #[test]
    fn write_file_replaces_longer_content_entirely() {
        let fx = Fixture::new();
        fx.write("f.txt", "a much longer original content\n");
        fx.ok("write_file", json!({"path": "f.txt", "content": "short"}));
        assert_eq!(fx.read("f.txt"), "short");
    }

    #[test]
    fn write_file_refuses_content_over_the_limit() {
        let fx = Fixture::with_limits(FileLimits {
            max_write_bytes: 10,
            ..FileLimits::default()
        });
        let message = fx.err(
            "write_file",
            json!({"path": "big.txt", "content": "x".repeat(11)}),
        );
        assert!(message.starts_with("content is 11 bytes; write_file accepts at most 10 bytes"));
        assert!(!fx.root().join("big.txt").exists());
    }

    #[test]
    fn write_file_refuses_to_overwrite_a_directory() {
        let fx = Fixture::new();
        fs::create_dir(fx.root().join("dir")).unwrap();
        assert_eq!(
            fx.err("write_file", json!({"path": "dir", "content": "x"})),
            "dir is a directory, not a file"
        );
        assert_eq!(
            fx.err("write_file", json!({"path": ".", "content": "x"})),
            ". is a directory, not a file"
        );
    }

    #[test]
    fn write_file_refuses_every_path_that_escapes_the_workspace() {
        Fixture::new().assert_every_escape_refused(
            "write_file",
            |path| json!({"path": path, "content": "overwritten"}),
        );
    }
}

//! `patch`: replaces exact text in an existing file.

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};

use serde_json::{Map, Value, json};

use super::confine::{io_message, open_confined, resolve};
use super::{FileCall, file_path_parameter};
use super::{FileLimits, Workspace};
use crate::args::{non_empty_string_arg, optional_bool_arg, string_arg};

/// Files `patch` loads into memory at most.
const MAX_PATCH_FILE_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Debug)]
pub(super) struct PatchCall {
    path: String,
    old: String,
    new: String,
    replace_all: bool,
}

impl FileCall for PatchCall {
    const NAME: &'static str = "patch";
    const DESCRIPTION: &'static str = "Replace exact text in an existing file of the workspace. \
        `old_string` must match the file's current text exactly, including whitespace and \
        indentation (copy it from read_file output without the line-number prefix), and must \
        occur exactly once unless `replace_all` is true; include surrounding lines to make it \
        unique.";
    const READ_ONLY: bool = false;

    fn parameters() -> Value {
        json!({
            "type": "object",
            "properties": {
                "path": file_path_parameter(),
                "old_string": {
                    "type": "string",
                    "description": "The exact text to replace. Must not be empty."
                },
                "new_string": {
                    "type": "string",
                    "description": "The text to put in its place (empty to delete it)."
                },
                "replace_all": {
                    "type": "boolean",
                    "description": "Replace every occurrence instead of requiring exactly \
                        one. Default false."
                }
            },
            "required": ["path", "old_string", "new_string"]
        })
    }

    fn parse(args: &Map<String, Value>) -> Result<Self, String> {
        let old = string_arg(args, "old_string")?.to_owned();
        if old.is_empty() {
            return Err(
                "old_string is empty; give the exact text to replace (to create \
                        or overwrite a whole file use write_file)"
                    .to_owned(),
            );
        }
        Ok(Self {
            path: non_empty_string_arg(args, "path")?.to_owned(),
            old,
            new: string_arg(args, "new_string")?.to_owned(),
            replace_all: optional_bool_arg(args, "replace_all")?.unwrap_or(false),
        })
    }

    fn run(self, workspace: &Workspace, limits: &FileLimits) -> Result<Value, String> {
        let requested = self.path.as_str();
        let path = resolve(workspace, requested)?;
        // One descriptor for reading and writing, so the file written is the file that was read.
        let mut file = open_confined(
            workspace,
            &path,
            requested,
            OpenOptions::new().read(true).write(true),
        )?;
        let text = read_text(&mut file, requested)?;
        let occurrences = text.matches(self.old.as_str()).count();
        if occurrences == 0 {
            return Err(format!(
                "old_string not found in {requested}; it must match the current text exactly, \
                 including whitespace and indentation (read_file shows it)"
            ));
        }
        if occurrences > 1 && !self.replace_all {
            return Err(format!(
                "old_string occurs {occurrences} times in {requested}; add context or set \
                 replace_all"
            ));
        }
        let patched = if self.replace_all {
            text.replace(&self.old, &self.new)
        } else {
            text.replacen(&self.old, &self.new, 1)
        };
        if patched.len() > text.len().max(limits.max_write_bytes) {
            return Err(format!(
                "the patched file would be {} bytes; files may grow to at most {} bytes",
                patched.len(),
                limits.max_write_bytes
            ));
        }
        file.seek(SeekFrom::Start(0))
            .and_then(|_| file.set_len(0))
            .and_then(|()| file.write_all(patched.as_bytes()))
            .map_err(|err| format!("cannot write {requested}: {err}"))?;
        Ok(json!({ "path": workspace.display(&path), "replacements": occurrences }))
    }
}

/// The whole file as UTF-8 text, refusing what `patch` cannot edit safely.
fn read_text(file: &mut std::fs::File, requested: &str) -> Result<String, String> {
    let size = file
        .metadata()
        .map_err(|err| io_message(&err, requested))?
        .len();
    if size > MAX_PATCH_FILE_BYTES {
        return Err(format!(
            "{requested} is {size} bytes; patch edits files up to {MAX_PATCH_FILE_BYTES} bytes"
        ));
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|err| io_message(&err, requested))?;
    if bytes.contains(&0) {
        return Err(format!(
            "{requested} is a binary file; patch edits text files only"
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| format!("{requested} is not valid UTF-8; patch edits UTF-8 text files only"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::fixture::Fixture;

    #[test]
    fn patch_replaces_a_unique_string() {
        let fx = Fixture::new();
        fx.write("code.py", "def f():\n    return 1\n");
        let result = fx.ok(
            "patch",
            json!({"path": "code.py", "old_string": "return 1", "new_string": "return 2"}),
        );
        assert_eq!(result, json!({"path": "code.py", "replacements": 1}));
        assert_eq!(fx.read("code.py"), "def f():\n    return 2\n");
    }

    #[test]
    fn patch_can_shrink_a_file() {
        let fx = Fixture::new();
        fx.write("code.py", "keep\nremove this long line\nkeep\n");
        fx.ok(
            "patch",
            json!({"path": "code.py", "old_string": "remove this long line\n", "new_string": ""}),
        );
        assert_eq!(fx.read("code.py"), "keep\nkeep\n");
    }

    #[test]
    fn patch_names_the_file_when_old_string_is_missing() {
        let fx = Fixture::new();
        fx.write("code.py", "x = 1\n");
        let message = fx.err(
            "patch",
            json!({"path": "code.py", "old_string": "y = 1", "new_string": "y"}),
        );
        assert!(
            message.starts_with("old_string not found in code.py"),
            "{message}"
        );
        assert_eq!(fx.read("code.py"), "x = 1\n");
    }

    #[test]
    fn patch_refuses_old_string_that_occurs_twice() {
        let fx = Fixture::new();
        fx.write("code.py", "x = 1\nx = 1\n");
        let message = fx.err(
            "patch",
            json!({"path": "code.py", "old_string": "x = 1", "new_string": "x = 2"}),
        );
        assert_eq!(
            message,
            "old_string occurs 2 times in code.py; add context or set replace_all"
        );
        assert_eq!(fx.read("code.py"), "x = 1\nx = 1\n");
    }

    #[test]
    fn patch_with_replace_all_replaces_every_occurrence() {
        let fx = Fixture::new();
        fx.write("code.py", "x = 1\ny = 0\nx = 1\n");
        let result = fx.ok(
            "patch",
            json!({"path": "code.py", "old_string": "x = 1", "new_string": "x = 2",
                       "replace_all": "true"}),
        );
        assert_eq!(result["replacements"], 2);
        assert_eq!(fx.read("code.py"), "x = 2\ny = 0\nx = 2\n");
    }

    #[test]
    fn patch_refuses_an_empty_old_string_and_a_missing_file() {
        let fx = Fixture::new();
        fx.write("code.py", "x\n");
        let message = fx.err(
            "patch",
            json!({"path": "code.py", "old_string": "", "new_string": "y"}),
        );
        assert!(message.starts_with("old_string is empty"), "{message}");
        assert_eq!(
            fx.err(
                "patch",
                json!({"path": "gone.py", "old_string": "a", "new_string": "b"})
            ),
            "file not found: gone.py"
        );
    }

    #[test]
    fn patch_refuses_every_path_that_escapes_the_workspace() {
        Fixture::new().assert_every_escape_refused(
            "patch",
            |path| json!({"path": path, "old_string": "TOP SECRET", "new_string": "leaked"}),
        );
    }
}

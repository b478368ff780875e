//! `search_files`: lines matching a regex in the workspace's text files, or files matching a glob.

use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::ops::ControlFlow;
use std::path::Path;

use globset::{Glob, GlobMatcher};
use regex::{Regex, RegexBuilder};
use serde_json::{Map, Value, json};
use walkdir::{DirEntry, WalkDir};

use super::confine::{io_message, open_nofollow, opened_inside, resolve};
use super::{FileCall, MAX_LINE_BYTES};
use super::{FileLimits, Workspace};
use crate::args::{non_empty_string_arg, optional_string_arg};

/// Files larger than this are skipped by content search (they are rarely source and slow to scan).
const MAX_SEARCH_FILE_BYTES: u64 = 1024 * 1024;
/// Directory entries one search visits at most, so a huge tree cannot stall a call.
const MAX_SEARCH_ENTRIES: usize = 100_000;
/// Compiled size a search regex may reach; the `regex` crate runs in linear time, but a pattern
/// like `\w{1000}{1000}` could still take a lot of memory to compile.
const MAX_REGEX_BYTES: usize = 1024 * 1024;

#[derive(Debug)]
pub(super) struct SearchFilesCall {
    pattern: String,
    path: String,
    target: Target,
    file_glob: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Content,
    Files,
}

impl FileCall for SearchFilesCall {
    const NAME: &'static str = "search_files";
    const DESCRIPTION: &'static str = "Search the workspace. With target \"content\" (the \
        default), find lines matching the regular expression `pattern` (Rust regex syntax, \
        matched per line) in text files under `path`, optionally only in files whose path matches \
        `file_glob`; each match gives the file path, line number and line text. With target \
        \"files\", list the files under `path` whose path matches the glob `pattern` (e.g. \
        `*.py`, `src/**/*.rs`). Symbolic links are not followed; `.git` directories, binary files \
        and (for content search) files over 1 MiB are skipped.";
    const READ_ONLY: bool = true;

    fn parameters() -> Value {
        json!({
            "type": "object",
            "properties": {
                "pattern": {
                    "type": "string",
                    "description": "A regular expression (target \"content\") or a glob \
                        (target \"files\")."
                },
                "path": {
                    "type": "string",
                    "description": "Directory to search, relative to the workspace \
                        directory. Default \".\" (the whole workspace)."
                },
                "target": {
                    "type": "string",
                    "enum": ["content", "files"],
                    "description": "\"content\" searches inside files, \"files\" matches \
                        file paths. Default \"content\"."
                },
                "file_glob": {
                    "type": "string",
                    "description": "Only consider files whose path (relative to `path`) \
                        or name matches this glob, e.g. `*.rs`."
                }
            },
            "required": ["pattern"]
        })
    }

    fn parse(args: &Map<String, Value>) -> Result<Self, String> {
        let pattern = non_empty_string_arg(args, "pattern")?;
        let target = match optional_string_arg(args, "target")? {
            None | Some("content") => Target::Content,
            Some("files") => Target::Files,
            Some(other) => {
                return Err(format!(
                    "argument `target` must be \"content\" or \"files\", got {other:?}"
                ));
            }
        };
        Ok(Self {
            pattern: pattern.to_owned(),
            path: optional_string_arg(args, "path")?
                .filter(|path| !path.is_empty())
                .unwrap_or(".")
                .to_owned(),
            target,
            file_glob: optional_string_arg(args, "file_glob")?
                .filter(|glob| !glob.is_empty())
                .map(str::to_owned),
        })
    }

    fn run(self, workspace: &Workspace, limits: &FileLimits) -> Result<Value, String> {
        let file_glob = self
            .file_glob
            .as_deref()
            .map(|glob| compile_glob(glob, "file_glob"))
            .transpose()?;
        let matcher = Matcher::compile(&self.pattern, self.target)?;
        let root = resolve(workspace, &self.path)?;
        match fs::symlink_metadata(&root) {
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(format!("directory not found: {}", self.path));
            }
            Err(err) => return Err(io_message(&err, &self.path)),
        }
        let mut found = Found {
            items: Vec::new(),
            max: limits.max_search_results.max(1),
        };
        let truncated = walk(workspace, &root, &matcher, file_glob.as_ref(), &mut found).is_break();
        Ok(match matcher {
            Matcher::Content(_) => json!({ "matches": found.items, "truncated": truncated }),
            Matcher::Files(_) => json!({ "files": found.items, "truncated": truncated }),
        })
    }
}

/// Visits the regular files under `root` in name order, without following symlinks or entering
/// `.git`, and collects what `matcher` finds in those `file_glob` admits. Breaks when a limit
/// stopped the search early.
fn walk(
    workspace: &Workspace,
    root: &Path,
    matcher: &Matcher,
    file_glob: Option<&GlobMatcher>,
    found: &mut Found,
) -> ControlFlow<()> {
    let entries = WalkDir::new(root)
        .follow_links(false)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|entry| !(entry.depth() > 0 && entry.file_name() == ".git"));
    for (visited, entry) in entries.enumerate() {
        if visited >= MAX_SEARCH_ENTRIES {
            return ControlFlow::Break(());
        }
        // Unreadable directories and entries are skipped, as `grep -r` does.
        let Ok(entry) = entry else { continue };
        // Symlinks are never followed: their file type is "symlink", not "file".
        if !entry.file_type().is_file() {
            continue;
        }
        let relative = match entry.path().strip_prefix(root) {
            Ok(relative) if !relative.as_os_str().is_empty() => relative,
            // The search root is the file itself.
            _ => Path::new(entry.file_name()),
        };
        let name = Path::new(entry.file_name());
        if file_glob.is_some_and(|glob| !glob.is_match(relative) && !glob.is_match(name)) {
            continue;
        }
        matcher.collect(workspace, &entry, relative, name, found)?;
    }
    ControlFlow::Continue(())
}

#[derive(Debug)]
enum Matcher {
    Content(Regex),
    Files(GlobMatcher),
}

impl Matcher {
    fn compile(pattern: &str, target: Target) -> Result<Self, String> {
        Ok(match target {
            Target::Content => Self::Content(
                RegexBuilder::new(pattern)
                    .size_limit(MAX_REGEX_BYTES)
                    .build()
                    .map_err(|err| format!("invalid regex {pattern:?}: {err}"))?,
            ),
            Target::Files => Self::Files(compile_glob(pattern, "pattern")?),
        })
    }

    /// Adds what matches in one file (`relative` to the search root, file `name`) to `found`.
    fn collect(
        &self,
        workspace: &Workspace,
        entry: &DirEntry,
        relative: &Path,
        name: &Path,
        found: &mut Found,
    ) -> ControlFlow<()> {
        let shown = workspace.display(entry.path());
        match self {
            Self::Files(glob) => {
                if glob.is_match(relative) || glob.is_match(name) {
                    found.push(Value::String(shown))?;
                }
            }
            Self::Content(regex) => {
                let Some(text) = searchable_text(workspace, entry.path()) else {
                    return ControlFlow::Continue(());
                };
                for (index, line) in text.lines().enumerate() {
                    if regex.is_match(line) {
                        found.push(json!({
                            "path": shown,
                            "line": index + 1,
                            "text": clip(line),
                        }))?;
                    }
                }
            }
        }
        ControlFlow::Continue(())
    }
}

/// Results so far, up to `max`.
#[derive(Debug)]
struct Found {
    items: Vec<Value>,
    max: usize,
}

impl Found {
    /// Adds a result, or breaks when there is no room for it (so there were more than `max`).
    fn push(&mut self, item: Value) -> ControlFlow<()> {
        if self.items.len() == self.max {
            return ControlFlow::Break(());
        }
        self.items.push(item);
        ControlFlow::Continue(())
    }
}

/// A file's text for content search, or `None` for files that are skipped: too large, binary,
/// unreadable, or no longer a regular file inside the workspace.
fn searchable_text(workspace: &Workspace, path: &Path) -> Option<String> {
    let file = open_nofollow(path, OpenOptions::new().read(true)).ok()?;
    let metadata = file.metadata().ok()?;
    if !metadata.is_file()
        || metadata.len() > MAX_SEARCH_FILE_BYTES
        || !opened_inside(&file, workspace)
    {
        return None;
    }
    let mut bytes = Vec::new();
    // The size was checked above, but the file may be growing.
    Read::take(&file, MAX_SEARCH_FILE_BYTES)
        .read_to_end(&mut bytes)
        .ok()?;
    if bytes.contains(&0) {
        return None;
    }
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

fn compile_glob(glob: &str, argument: &str) -> Result<GlobMatcher, String> {
    Glob::new(glob)
        .map(|glob| glob.compile_matcher())
        .map_err(|err| format!("invalid glob {glob:?} in `{argument}`: {err}"))
}

/// A matched line for display, cut at [`MAX_LINE_BYTES`] on a character boundary.
fn clip(line: &str) -> String {
    if line.len() <= MAX_LINE_BYTES {
        return line.to_owned();
    }
    let mut end = MAX_LINE_BYTES;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... [line cut: {} bytes]", &line[..end], line.len())
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::files::fixture::Fixture;

    fn search_fixture() -> Fixture {
        let fx = Fixture::new();
        fx.write("src/main.rs", "fn main() {\n    println!(\"hello\");\n}\n");
        fx.write("src/lib/util.rs", "pub fn helper() {}\n// hello again\n");
        fx.write("README.md", "say hello\n");
        fx.write(".git/config", "hello from git\n");
        fs::write(fx.root().join("src/blob.bin"), b"hello\0binary").unwrap();
        fx.write("big.txt", &format!("hello\n{}", "x".repeat(1024 * 1024)));
        fx
    }

    #[test]
    fn search_files_finds_regex_matches_with_line_numbers() {
        let fx = search_fixture();
        let result = fx.ok("search_files", json!({"pattern": "hel+o"}));
        assert_eq!(
            result,
            json!({
                "matches": [
                    {"path": "README.md", "line": 1, "text": "say hello"},
                    {"path": "src/lib/util.rs", "line": 2, "text": "// hello again"},
                    {"path": "src/main.rs", "line": 2, "text": "    println!(\"hello\");"},
                ],
                "truncated": false,
            })
        );
    }

    #[test]
    fn search_files_limits_content_search_by_directory_and_glob() {
        let fx = search_fixture();
        let result = fx.ok(
            "search_files",
            json!({"pattern": "fn \\w+", "path": "src", "file_glob": "util.rs"}),
        );
        assert_eq!(
            result["matches"],
            json!([{"path": "src/lib/util.rs", "line": 1, "text": "pub fn helper() {}"}])
        );
    }

    #[test]
    fn search_files_lists_files_matching_a_glob() {
        let fx = search_fixture();
        let result = fx.ok(
            "search_files",
            json!({"pattern": "*.rs", "target": "files"}),
        );
        assert_eq!(
            result,
            json!({"files": ["src/lib/util.rs", "src/main.rs"], "truncated": false})
        );
        let nested = fx.ok(
            "search_files",
            json!({"pattern": "lib/**", "path": "src", "target": "files"}),
        );
        assert_eq!(nested["files"], json!(["src/lib/util.rs"]));
    }

    #[test]
    fn search_files_caps_results_and_says_so() {
        let fx = Fixture::with_limits(FileLimits {
            max_search_results: 2,
            ..FileLimits::default()
        });
        fx.write("many.txt", "hit\nhit\nhit\n");
        let result = fx.ok("search_files", json!({"pattern": "hit"}));
        assert_eq!(result["matches"].as_array().unwrap().len(), 2);
        assert_eq!(result["truncated"], true);
    }

    #[test]
    fn search_files_names_a_bad_regex_or_glob_or_target() {
        let fx = search_fixture();
        let message = fx.err("search_files", json!({"pattern": "fn ("}));
        assert!(message.starts_with("invalid regex \"fn (\""), "{message}");
        let message = fx.err("search_files", json!({"pattern": "a[", "target": "files"}));
        assert!(
            message.starts_with("invalid glob \"a[\" in `pattern`"),
            "{message}"
        );
        let message = fx.err("search_files", json!({"pattern": "x", "file_glob": "{a"}));
        assert!(
            message.starts_with("invalid glob \"{a\" in `file_glob`"),
            "{message}"
        );
        let message = fx.err("search_files", json!({"pattern": "x", "target": "dirs"}));
        assert_eq!(
            message,
            "argument `target` must be \"content\" or \"files\", got \"dirs\""
        );
    }

    #[test]
    fn search_files_names_a_missing_directory() {
        let fx = search_fixture();
        let message = fx.err("search_files", json!({"pattern": "x", "path": "nowhere"}));
        assert_eq!(message, "directory not found: nowhere");
    }

    #[test]
    fn search_files_refuses_directories_outside_the_workspace() {
        let fx = Fixture::new();
        let absolute = fx.outside.display().to_string();
        for (path, refusal) in [
            ("..", "path escapes the workspace"),
            ("../outside", "path escapes the workspace"),
            ("sub/../..", "path escapes the workspace"),
            (absolute.as_str(), "absolute paths are not allowed"),
            ("dirlink", "path escapes the workspace"),
            ("filelink", "path escapes the workspace"),
            (
                "danglingdir",
                "danglingdir is a symbolic link that points outside",
            ),
        ] {
            let message = fx.err("search_files", json!({"pattern": "SECRET", "path": path}));
            assert!(message.starts_with(refusal), "{path}: {message}");
        }
    }

    #[test]
    fn search_files_does_not_follow_symlinks_out_of_the_workspace() {
        let fx = Fixture::new();
        let content = fx.ok("search_files", json!({"pattern": "SECRET"}));
        assert_eq!(content, json!({"matches": [], "truncated": false}));
        let files = fx.ok("search_files", json!({"pattern": "*", "target": "files"}));
        assert_eq!(files, json!({"files": [], "truncated": false}));
    }
}

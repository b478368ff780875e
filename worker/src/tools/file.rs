//! The `file` toolset: `read_file`, `write_file`, `patch` and `search_files`, all confined to the
//! conversation's workspace.
//!
//! Confinement has layers. [`Workspace::resolve`] refuses absolute paths and `..` that climbs
//! out, and canonicalises the existing part of a path, so a symlink along the way that points
//! outside is refused. What it cannot see is a *dangling* symlink (it does not "exist", so it is
//! not canonicalised, and following it could create its target wherever that is): such paths are
//! refused here, and every open also uses `O_NOFOLLOW` in case one appears in the meantime. Last,
//! where `/proc` is available, the opened descriptor's real path is checked, which also catches a
//! directory swapped for a symlink between resolving and opening (the terminal tool runs
//! concurrently in the same directory).
//!
//! File I/O is plain `std::fs` on the blocking pool: simple, and each call is bounded by the limits.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use globset::{Glob, GlobMatcher};
use nix::libc;
use regex::{Regex, RegexBuilder};
use serde_json::{Map, Value, json};
use walkdir::WalkDir;

use super::args::{
    non_empty_string_arg, optional_bool_arg, optional_string_arg, optional_u64_arg, string_arg,
};
use super::text::complete_prefix_len;
use super::{
    Tool, ToolContext, ToolFuture, ToolLimits, ToolOutcome, ToolSpec, Workspace, WorkspaceError,
};
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "file";

/// Longer lines are cut in `read_file` and `search_files` output: a minified bundle would
/// otherwise fill a whole page with one line.
const MAX_LINE_BYTES: usize = 2000;
/// Files larger than this are skipped by content search (they are rarely source and slow to scan).
const MAX_SEARCH_FILE_BYTES: u64 = 1024 * 1024;
/// Directory entries one search visits at most, so a huge tree cannot stall a call.
const MAX_SEARCH_ENTRIES: usize = 100_000;
/// Files `patch` loads into memory at most.
const MAX_PATCH_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// Compiled size a search regex may reach; the `regex` crate runs in linear time, but a pattern
/// like `\w{1000}{1000}` could still take a lot of memory to compile.
const MAX_REGEX_BYTES: usize = 1024 * 1024;

pub fn tools(_config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    [Kind::Read, Kind::Write, Kind::Patch, Kind::Search]
        .into_iter()
        .map(|kind| Arc::new(FileTool::new(kind)) as Arc<dyn Tool>)
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Patch,
    Search,
}

#[derive(Debug)]
struct FileTool {
    kind: Kind,
    spec: ToolSpec,
}

impl FileTool {
    fn new(kind: Kind) -> Self {
        let (name, description, parameters) = match kind {
            Kind::Read => read_file_spec(),
            Kind::Write => write_file_spec(),
            Kind::Patch => patch_spec(),
            Kind::Search => search_files_spec(),
        };
        Self {
            kind,
            spec: ToolSpec {
                name: name.to_owned(),
                description: description.to_owned(),
                parameters,
            },
        }
    }
}

fn read_file_spec() -> (&'static str, &'static str, Value) {
    (
        "read_file",
        "Read a text file from the workspace. Lines are numbered like `cat -n` \
         (`     1|first line`); the number and the `|` are not part of the file. One call \
         returns one page of lines: when `truncated` is true, call again with `offset` \
         set to `end_line + 1`. Lines longer than 2000 bytes are cut. Binary files are \
         refused.",
        json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Path of the file, relative to the workspace directory."
                },
                "offset": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Line number (1-based) to start reading at. Default 1."
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Number of lines to return. Default and maximum: one \
                        page."
                }
            },
            "required": ["path"]
        }),
    )
}

fn write_file_spec() -> (&'static str, &'static str, Value) {
    (
        "write_file",
        "Create a file in the workspace, or replace the whole content of an existing \
         one. Missing parent directories are created. To change part of an existing file \
         use `patch` instead.",
        json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Path of the file, relative to the workspace directory."
                },
                "content": {
                    "type": "string",
                    "description": "The complete new content of the file."
                }
            },
            "required": ["path", "content"]
        }),
    )
}

fn patch_spec() -> (&'static str, &'static str, Value) {
    (
        "patch",
        "Replace exact text in an existing file of the workspace. `old_string` must match \
         the file's current text exactly, including whitespace and indentation (copy it \
         from read_file output without the line-number prefix), and must occur exactly \
         once unless `replace_all` is true; include surrounding lines to make it unique.",
        json!({
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Path of the file, relative to the workspace directory."
                },
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
        }),
    )
}

fn search_files_spec() -> (&'static str, &'static str, Value) {
    (
        "search_files",
        "Search the workspace. With target \"content\" (the default), find lines matching \
         the regular expression `pattern` (Rust regex syntax, matched per line) in text \
         files under `path`, optionally only in files whose path matches `file_glob`; \
         each match gives the file path, line number and line text. With target \
         \"files\", list the files under `path` whose path matches the glob `pattern` \
         (e.g. `*.py`, `src/**/*.rs`). Symbolic links are not followed; `.git` \
         directories, binary files and (for content search) files over 1 MiB are skipped.",
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
        }),
    )
}

impl Tool for FileTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn read_only(&self) -> bool {
        matches!(self.kind, Kind::Read | Kind::Search)
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        let workspace = ctx.workspace.clone();
        let limits = ctx.limits.clone();
        let kind = self.kind;
        Box::pin(async move {
            // Argument errors are found before anything touches the disk.
            let job = match Job::parse(kind, &args) {
                Ok(job) => job,
                Err(message) => return ToolOutcome::Err(message),
            };
            match tokio::task::spawn_blocking(move || job.run(&workspace, &limits)).await {
                Ok(Ok(value)) => ToolOutcome::Ok(value),
                Ok(Err(message)) => ToolOutcome::Err(message),
                Err(err) => ToolOutcome::Err(format!("the tool failed internally: {err}")),
            }
        })
    }
}

/// One call's validated arguments, owned so they can move to the blocking pool.
#[derive(Debug)]
enum Job {
    Read {
        path: String,
        offset: Option<u64>,
        limit: Option<u64>,
    },
    Write {
        path: String,
        content: String,
    },
    Patch {
        path: String,
        old: String,
        new: String,
        replace_all: bool,
    },
    Search {
        pattern: String,
        path: String,
        target: Target,
        file_glob: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Content,
    Files,
}

impl Job {
    fn parse(kind: Kind, args: &Map<String, Value>) -> Result<Self, String> {
        Ok(match kind {
            Kind::Read => Self::Read {
                path: non_empty_string_arg(args, "path")?.to_owned(),
                offset: optional_u64_arg(args, "offset")?,
                limit: optional_u64_arg(args, "limit")?,
            },
            Kind::Write => Self::Write {
                path: non_empty_string_arg(args, "path")?.to_owned(),
                content: string_arg(args, "content")?.to_owned(),
            },
            Kind::Patch => {
                let old = string_arg(args, "old_string")?.to_owned();
                if old.is_empty() {
                    return Err(
                        "old_string is empty; give the exact text to replace (to create \
                                or overwrite a whole file use write_file)"
                            .to_owned(),
                    );
                }
                Self::Patch {
                    path: non_empty_string_arg(args, "path")?.to_owned(),
                    old,
                    new: string_arg(args, "new_string")?.to_owned(),
                    replace_all: optional_bool_arg(args, "replace_all")?.unwrap_or(false),
                }
            }
            Kind::Search => {
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
                Self::Search {
                    pattern: pattern.to_owned(),
                    path: optional_string_arg(args, "path")?
                        .filter(|path| !path.is_empty())
                        .unwrap_or(".")
                        .to_owned(),
                    target,
                    file_glob: optional_string_arg(args, "file_glob")?
                        .filter(|glob| !glob.is_empty())
                        .map(str::to_owned),
                }
            }
        })
    }

    fn run(self, workspace: &Workspace, limits: &ToolLimits) -> Result<Value, String> {
        match self {
            Self::Read {
                path,
                offset,
                limit,
            } => read_file(workspace, limits, &path, offset, limit),
            Self::Write { path, content } => write_file(workspace, limits, &path, &content),
            Self::Patch {
                path,
                old,
                new,
                replace_all,
            } => patch(workspace, limits, &path, &old, &new, replace_all),
            Self::Search {
                pattern,
                path,
                target,
                file_glob,
            } => search_files(
                workspace,
                limits,
                &pattern,
                &path,
                target,
                file_glob.as_deref(),
            ),
        }
    }
}

fn read_file(
    workspace: &Workspace,
    limits: &ToolLimits,
    requested: &str,
    offset: Option<u64>,
    limit: Option<u64>,
) -> Result<Value, String> {
    let path = resolve(workspace, requested)?;
    let file = open_confined(workspace, &path, requested, OpenOptions::new().read(true))?;
    let page_size = u64::try_from(limits.max_read_lines.max(1)).unwrap_or(u64::MAX);
    let first = offset.unwrap_or(1).max(1);
    let count = limit.map_or(page_size, |limit| limit.clamp(1, page_size));
    let page = read_lines(BufReader::with_capacity(64 * 1024, file), first, count)
        .map_err(|err| io_message(&err, requested))?;
    if page.binary {
        return Err(format!(
            "{requested} is a binary file; read_file shows text files only"
        ));
    }
    let shown = workspace.display(&path);
    if page.total_lines == 0 {
        return Ok(json!({
            "content": "", "path": shown, "total_lines": 0,
            "start_line": 0, "end_line": 0, "truncated": false,
        }));
    }
    if first > page.total_lines {
        return Err(format!(
            "offset {first} is past the end of {requested}, which has {} lines",
            page.total_lines
        ));
    }
    let end = first + (page.lines.len() as u64).saturating_sub(1);
    let content = page
        .lines
        .iter()
        .zip(first..)
        .map(|(line, number)| format!("{number:>6}|{line}"))
        .collect::<Vec<_>>()
        .join("\n");
    Ok(json!({
        "content": content,
        "path": shown,
        "total_lines": page.total_lines,
        "start_line": first,
        "end_line": end,
        "truncated": end < page.total_lines,
    }))
}

/// Lines `first..first+count` of a file (1-based), plus its line count, read in one streaming
/// pass so memory stays bounded however large the file or its lines are.
#[derive(Debug, Default)]
struct Page {
    lines: Vec<String>,
    total_lines: u64,
    binary: bool,
}

fn read_lines(mut reader: impl BufRead, first: u64, count: u64) -> io::Result<Page> {
    let wanted = first..first.saturating_add(count);
    let mut page = Page::default();
    let mut number = 1_u64;
    let mut current = Vec::new();
    let mut current_len = 0_usize;
    let mut line_started = false;
    loop {
        let chunk = reader.fill_buf()?;
        if chunk.is_empty() {
            break;
        }
        if chunk.contains(&0) {
            page.binary = true;
            return Ok(page);
        }
        let consumed = chunk.len();
        for piece in chunk.split_inclusive(|byte| *byte == b'\n') {
            line_started = true;
            let ends_line = piece.ends_with(b"\n");
            let text = if ends_line {
                &piece[..piece.len() - 1]
            } else {
                piece
            };
            if wanted.contains(&number) {
                let room = (MAX_LINE_BYTES + 1).saturating_sub(current.len());
                current.extend_from_slice(&text[..text.len().min(room)]);
                current_len += text.len();
            }
            if ends_line {
                if wanted.contains(&number) {
                    page.lines.push(render_line(&current, current_len));
                }
                current.clear();
                current_len = 0;
                number += 1;
                line_started = false;
            }
        }
        reader.consume(consumed);
    }
    if line_started && wanted.contains(&number) {
        page.lines.push(render_line(&current, current_len));
    }
    page.total_lines = if line_started { number } else { number - 1 };
    Ok(page)
}

/// A line for display: lossy UTF-8, cut at [`MAX_LINE_BYTES`] with a note of its real length.
fn render_line(kept: &[u8], full_len: usize) -> String {
    if full_len <= MAX_LINE_BYTES {
        return String::from_utf8_lossy(kept).into_owned();
    }
    let kept = &kept[..MAX_LINE_BYTES.min(kept.len())];
    let kept = &kept[..complete_prefix_len(kept)];
    format!(
        "{}... [line cut: {full_len} bytes]",
        String::from_utf8_lossy(kept)
    )
}

fn write_file(
    workspace: &Workspace,
    limits: &ToolLimits,
    requested: &str,
    content: &str,
) -> Result<Value, String> {
    if content.len() > limits.max_write_bytes {
        return Err(format!(
            "content is {} bytes; write_file accepts at most {} bytes per call (write a smaller \
             file, or generate large files with a command)",
            content.len(),
            limits.max_write_bytes
        ));
    }
    let path = resolve(workspace, requested)?;
    let parent = match path.parent() {
        Some(parent) if path != workspace.root() => parent,
        _ => return Err(format!("{requested} is a directory, not a file")),
    };
    fs::create_dir_all(parent)
        .map_err(|err| format!("cannot create the directories for {requested}: {err}"))?;
    // The directories may have been replaced by symlinks since `resolve` looked at them.
    let real_parent = parent
        .canonicalize()
        .map_err(|err| format!("cannot create the directories for {requested}: {err}"))?;
    if !real_parent.starts_with(workspace.root()) {
        return Err(WorkspaceError::Escapes(requested.to_owned()).to_string());
    }
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

fn patch(
    workspace: &Workspace,
    limits: &ToolLimits,
    requested: &str,
    old: &str,
    new: &str,
    replace_all: bool,
) -> Result<Value, String> {
    let path = resolve(workspace, requested)?;
    // One descriptor for reading and writing, so the file written is the file that was read.
    let mut file = open_confined(
        workspace,
        &path,
        requested,
        OpenOptions::new().read(true).write(true),
    )?;
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
    let Ok(text) = String::from_utf8(bytes) else {
        return Err(format!(
            "{requested} is not valid UTF-8; patch edits UTF-8 text files only"
        ));
    };
    let occurrences = text.matches(old).count();
    if occurrences == 0 {
        return Err(format!(
            "old_string not found in {requested}; it must match the current text exactly, \
             including whitespace and indentation (read_file shows it)"
        ));
    }
    if occurrences > 1 && !replace_all {
        return Err(format!(
            "old_string occurs {occurrences} times in {requested}; add context or set replace_all"
        ));
    }
    let patched = if replace_all {
        text.replace(old, new)
    } else {
        text.replacen(old, new, 1)
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

fn search_files(
    workspace: &Workspace,
    limits: &ToolLimits,
    pattern: &str,
    requested: &str,
    target: Target,
    file_glob: Option<&str>,
) -> Result<Value, String> {
    let file_glob = file_glob
        .map(|glob| compile_glob(glob, "file_glob"))
        .transpose()?;
    let matcher = match target {
        Target::Content => Matcher::Content(
            RegexBuilder::new(pattern)
                .size_limit(MAX_REGEX_BYTES)
                .build()
                .map_err(|err| format!("invalid regex {pattern:?}: {err}"))?,
        ),
        Target::Files => Matcher::Files(compile_glob(pattern, "pattern")?),
    };
    let root = resolve(workspace, requested)?;
    match fs::symlink_metadata(&root) {
        Ok(_) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Err(format!("directory not found: {requested}"));
        }
        Err(err) => return Err(io_message(&err, requested)),
    }

    let max_results = limits.max_search_results.max(1);
    let mut found = Vec::new();
    let mut truncated = false;
    let walk = WalkDir::new(&root)
        .follow_links(false)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|entry| !(entry.depth() > 0 && entry.file_name() == ".git"));
    'walk: for (visited, entry) in walk.enumerate() {
        if visited >= MAX_SEARCH_ENTRIES {
            truncated = true;
            break;
        }
        // Unreadable directories and entries are skipped, as `grep -r` does.
        let Ok(entry) = entry else { continue };
        // Symlinks are never followed: their file type is "symlink", not "file".
        if !entry.file_type().is_file() {
            continue;
        }
        let relative = match entry.path().strip_prefix(&root) {
            Ok(relative) if !relative.as_os_str().is_empty() => relative,
            // The search root is the file itself.
            _ => Path::new(entry.file_name()),
        };
        let name = Path::new(entry.file_name());
        if file_glob
            .as_ref()
            .is_some_and(|glob| !glob.is_match(relative) && !glob.is_match(name))
        {
            continue;
        }
        let shown = workspace.display(entry.path());
        match &matcher {
            Matcher::Files(glob) => {
                if glob.is_match(relative) || glob.is_match(name) {
                    if found.len() == max_results {
                        truncated = true;
                        break;
                    }
                    found.push(Value::String(shown));
                }
            }
            Matcher::Content(regex) => {
                let Some(text) = searchable_text(workspace, entry.path()) else {
                    continue;
                };
                for (index, line) in text.lines().enumerate() {
                    if regex.is_match(line) {
                        if found.len() == max_results {
                            truncated = true;
                            break 'walk;
                        }
                        found.push(json!({
                            "path": shown,
                            "line": index + 1,
                            "text": clip(line),
                        }));
                    }
                }
            }
        }
    }
    Ok(match matcher {
        Matcher::Content(_) => json!({ "matches": found, "truncated": truncated }),
        Matcher::Files(_) => json!({ "files": found, "truncated": truncated }),
    })
}

#[derive(Debug)]
enum Matcher {
    Content(Regex),
    Files(GlobMatcher),
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

/// Resolves a model-given path inside the workspace, with an error message the model can act on.
fn resolve(workspace: &Workspace, requested: &str) -> Result<PathBuf, String> {
    let path = workspace.resolve(requested).map_err(|err| match err {
        WorkspaceError::Absolute(_) => {
            format!("{err}; give a path relative to the workspace directory")
        }
        other => other.to_string(),
    })?;
    // `resolve` canonicalised the part of the path that exists, so a symlink still on it is
    // dangling: following it could create its target, wherever that is.
    for ancestor in path
        .ancestors()
        .take_while(|ancestor| *ancestor != workspace.root())
    {
        if fs::symlink_metadata(ancestor).is_ok_and(|metadata| metadata.is_symlink()) {
            return Err(format!(
                "{} is a symbolic link that points outside the workspace or to nothing; \
                 refusing to follow it",
                workspace.display(ancestor)
            ));
        }
    }
    Ok(path)
}

/// Opens `path` without following a symlink in its last component and without blocking on a FIFO,
/// then makes sure it is a regular file inside the workspace.
fn open_confined(
    workspace: &Workspace,
    path: &Path,
    requested: &str,
    options: &mut OpenOptions,
) -> Result<File, String> {
    let file = open_nofollow(path, options).map_err(|err| io_message(&err, requested))?;
    if !opened_inside(&file, workspace) {
        return Err(WorkspaceError::Escapes(requested.to_owned()).to_string());
    }
    let metadata = file.metadata().map_err(|err| io_message(&err, requested))?;
    if metadata.is_dir() {
        return Err(format!("{requested} is a directory, not a file"));
    }
    if !metadata.is_file() {
        return Err(format!("{requested} is not a regular file"));
    }
    Ok(file)
}

fn open_nofollow(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

/// Whether an open descriptor really lies inside the workspace, judged by the kernel's view of
/// its path. Without `/proc` (not Linux) the earlier checks have to do.
fn opened_inside(file: &File, workspace: &Workspace) -> bool {
    match fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
        Ok(real) => real.starts_with(workspace.root()),
        Err(_) => true,
    }
}

/// An I/O error as a message naming the path the model gave.
fn io_message(err: &io::Error, requested: &str) -> String {
    match err.kind() {
        io::ErrorKind::NotFound => format!("file not found: {requested}"),
        io::ErrorKind::IsADirectory => format!("{requested} is a directory, not a file"),
        io::ErrorKind::PermissionDenied => format!("permission denied: {requested}"),
        _ if err.raw_os_error() == Some(libc::ELOOP) => format!(
            "{requested} is a symbolic link that points outside the workspace or to nothing; \
             refusing to follow it"
        ),
        _ => format!("cannot access {requested}: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use tempfile::TempDir;

    use super::*;

    const SECRET: &str = "TOP SECRET outside the workspace\n";

    /// A workspace next to an `outside` directory holding a secret, with symlinks from the
    /// workspace to outside: `dirlink` (a directory), `filelink` (the secret), `dangling` (a file
    /// that does not exist yet) and `danglingdir` (a directory that does not exist yet).
    struct Fixture {
        _parent: TempDir,
        ctx: ToolContext,
        outside: PathBuf,
    }

    impl Fixture {
        fn new() -> Self {
            Self::with_limits(ToolLimits::default())
        }

        fn with_limits(limits: ToolLimits) -> Self {
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
                ctx: ToolContext {
                    workspace: Workspace::new(&root).unwrap(),
                    limits,
                },
                outside: outside.canonicalize().unwrap(),
                _parent: parent,
            }
        }

        fn root(&self) -> &Path {
            self.ctx.workspace.root()
        }

        fn write(&self, path: &str, content: &str) {
            let path = self.root().join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        }

        fn read(&self, path: &str) -> String {
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

        /// Asserts the outside directory still holds exactly the secret, unchanged.
        fn assert_outside_untouched(&self) {
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

        async fn call(&self, tool: &str, args: Value) -> ToolOutcome {
            let tools = tools(&ToolsSpec::default());
            let tool = tools
                .iter()
                .find(|candidate| candidate.spec().name == tool)
                .unwrap();
            let Value::Object(args) = args else {
                panic!("arguments must be an object")
            };
            tool.call(args, &self.ctx).await
        }

        async fn ok(&self, tool: &str, args: Value) -> Value {
            match self.call(tool, args).await {
                ToolOutcome::Ok(value) => value,
                ToolOutcome::Err(message) => panic!("expected success, got error: {message}"),
            }
        }

        async fn err(&self, tool: &str, args: Value) -> String {
            match self.call(tool, args).await {
                ToolOutcome::Err(message) => message,
                ToolOutcome::Ok(value) => panic!("expected an error, got {value}"),
            }
        }
    }

    fn lines(numbers: std::ops::RangeInclusive<u32>) -> String {
        numbers
            .map(|n| format!("line {n}\n"))
            .collect::<Vec<_>>()
            .concat()
    }

    fn numbered(lines: std::ops::RangeInclusive<u32>) -> String {
        lines
            .map(|n| format!("{n:>6}|line {n}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[tokio::test]
    async fn file_toolset_offers_four_tools_with_object_schemas() {
        let tools = tools(&ToolsSpec::default());
        let names: Vec<_> = tools.iter().map(|tool| tool.spec().name.as_str()).collect();
        assert_eq!(names, ["read_file", "write_file", "patch", "search_files"]);
        for tool in &tools {
            let parameters = &tool.spec().parameters;
            assert_eq!(parameters["type"], "object");
            for required in parameters["required"].as_array().unwrap() {
                assert!(
                    parameters["properties"]
                        .get(required.as_str().unwrap())
                        .is_some()
                );
            }
        }
    }

    // read_file

    #[tokio::test]
    async fn read_file_returns_numbered_lines() {
        let fx = Fixture::new();
        fx.write("notes/a.txt", "alpha\nbeta\n");
        let result = fx.ok("read_file", json!({"path": "notes/a.txt"})).await;
        assert_eq!(
            result,
            json!({
                "content": "     1|alpha\n     2|beta", "path": "notes/a.txt", "total_lines": 2,
                "start_line": 1, "end_line": 2, "truncated": false,
            })
        );
    }

    #[tokio::test]
    async fn read_file_counts_a_last_line_without_newline() {
        let fx = Fixture::new();
        fx.write("a.txt", "one\ntwo");
        let result = fx.ok("read_file", json!({"path": "./a.txt"})).await;
        assert_eq!(result["content"], "     1|one\n     2|two");
        assert_eq!(result["total_lines"], 2);
    }

    #[tokio::test]
    async fn read_file_pages_with_offset_and_limit() {
        let fx = Fixture::new();
        fx.write("ten.txt", &lines(1..=10));
        let result = fx
            .ok(
                "read_file",
                json!({"path": "ten.txt", "offset": 3, "limit": "4"}),
            )
            .await;
        assert_eq!(result["content"], numbered(3..=6));
        assert_eq!(result["start_line"], 3);
        assert_eq!(result["end_line"], 6);
        assert_eq!(result["total_lines"], 10);
        assert_eq!(result["truncated"], true);

        let last = fx
            .ok("read_file", json!({"path": "ten.txt", "offset": 7}))
            .await;
        assert_eq!(last["content"], numbered(7..=10));
        assert_eq!(last["truncated"], false);
    }

    #[tokio::test]
    async fn read_file_returns_at_most_one_page_of_lines() {
        let fx = Fixture::with_limits(ToolLimits {
            max_read_lines: 5,
            ..ToolLimits::default()
        });
        fx.write("twelve.txt", &lines(1..=12));
        let result = fx
            .ok("read_file", json!({"path": "twelve.txt", "limit": 100}))
            .await;
        assert_eq!(result["content"], numbered(1..=5));
        assert_eq!(result["end_line"], 5);
        assert_eq!(result["truncated"], true);
    }

    #[tokio::test]
    async fn read_file_refuses_offset_past_the_end() {
        let fx = Fixture::new();
        fx.write("short.txt", "a\nb\n");
        let message = fx
            .err("read_file", json!({"path": "short.txt", "offset": 5}))
            .await;
        assert_eq!(
            message,
            "offset 5 is past the end of short.txt, which has 2 lines"
        );
    }

    #[tokio::test]
    async fn read_file_of_an_empty_file_returns_no_lines() {
        let fx = Fixture::new();
        fx.write("empty.txt", "");
        let result = fx.ok("read_file", json!({"path": "empty.txt"})).await;
        assert_eq!(result["content"], "");
        assert_eq!(result["total_lines"], 0);
        assert_eq!(result["truncated"], false);
    }

    #[tokio::test]
    async fn read_file_cuts_very_long_lines() {
        let fx = Fixture::new();
        fx.write("long.txt", &format!("{}\nshort\n", "é".repeat(3000)));
        let result = fx.ok("read_file", json!({"path": "long.txt"})).await;
        let content = result["content"].as_str().unwrap();
        let (first, second) = content.split_once('\n').unwrap();
        assert!(first.ends_with("... [line cut: 6000 bytes]"), "{first}");
        assert!(first.len() < MAX_LINE_BYTES + 100);
        assert!(!first.contains('\u{FFFD}'));
        assert_eq!(second, "     2|short");
    }

    #[tokio::test]
    async fn read_file_names_a_missing_file() {
        let fx = Fixture::new();
        let message = fx
            .err("read_file", json!({"path": "nope/missing.txt"}))
            .await;
        assert_eq!(message, "file not found: nope/missing.txt");
    }

    #[tokio::test]
    async fn read_file_refuses_binary_files_and_directories() {
        let fx = Fixture::new();
        fs::write(fx.root().join("blob.bin"), b"ab\0cd").unwrap();
        fs::create_dir(fx.root().join("dir")).unwrap();
        assert_eq!(
            fx.err("read_file", json!({"path": "blob.bin"})).await,
            "blob.bin is a binary file; read_file shows text files only"
        );
        assert_eq!(
            fx.err("read_file", json!({"path": "dir"})).await,
            "dir is a directory, not a file"
        );
    }

    #[tokio::test]
    async fn read_file_does_not_block_on_a_fifo() {
        let fx = Fixture::new();
        let status = std::process::Command::new("mkfifo")
            .arg(fx.root().join("fifo"))
            .status()
            .unwrap();
        assert!(status.success());
        let message = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            fx.err("read_file", json!({"path": "fifo"})),
        )
        .await
        .unwrap();
        assert_eq!(message, "fifo is not a regular file");
    }

    #[tokio::test]
    async fn read_file_follows_a_symlink_that_stays_inside() {
        let fx = Fixture::new();
        fx.write("real.txt", "inside\n");
        symlink(fx.root().join("real.txt"), fx.root().join("alias")).unwrap();
        let result = fx.ok("read_file", json!({"path": "alias"})).await;
        assert_eq!(result["content"], "     1|inside");
        assert_eq!(result["path"], "real.txt");
    }

    #[tokio::test]
    async fn read_file_refuses_every_path_that_escapes_the_workspace() {
        let fx = Fixture::new();
        for (path, refusal) in fx.escaping_paths() {
            let message = fx.err("read_file", json!({"path": path})).await;
            assert!(message.starts_with(&refusal), "{path}: {message}");
            assert!(!message.contains("TOP SECRET"), "{path}: {message}");
        }
        fx.assert_outside_untouched();
    }

    #[tokio::test]
    async fn read_file_refuses_a_dangling_symlink_even_when_its_target_appears() {
        let fx = Fixture::new();
        // `resolve` saw no file at `dangling`; the target is created afterwards, as a concurrent
        // terminal command could.
        fs::write(fx.outside.join("new.txt"), "late secret\n").unwrap();
        let path = fx.root().join("dangling");
        let message = open_confined(
            &fx.ctx.workspace,
            &path,
            "dangling",
            OpenOptions::new().read(true),
        )
        .unwrap_err();
        assert!(message.contains("refusing to follow"), "{message}");
    }

    #[tokio::test]
    async fn creating_a_file_through_a_dangling_symlink_creates_nothing_outside() {
        let fx = Fixture::new();
        let path = fx.root().join("dangling");
        let mut options = OpenOptions::new();
        options.write(true).create(true);
        let message =
            open_confined(&fx.ctx.workspace, &path, "dangling", &mut options).unwrap_err();
        assert!(message.contains("refusing to follow"), "{message}");
        fx.assert_outside_untouched();
    }

    #[test]
    fn descriptor_of_a_file_outside_the_workspace_is_recognised() {
        let fx = Fixture::new();
        fx.write("inside.txt", "");
        let inside = File::open(fx.root().join("inside.txt")).unwrap();
        let outside = File::open(fx.outside.join("secret.txt")).unwrap();
        assert!(opened_inside(&inside, &fx.ctx.workspace));
        assert!(!opened_inside(&outside, &fx.ctx.workspace));
    }

    // write_file

    #[tokio::test]
    async fn write_file_creates_parent_directories() {
        let fx = Fixture::new();
        let result = fx
            .ok(
                "write_file",
                json!({"path": "a/b/c.txt", "content": "hello\n"}),
            )
            .await;
        assert_eq!(result, json!({"path": "a/b/c.txt", "bytes_written": 6}));
        assert_eq!(fx.read("a/b/c.txt"), "hello\n");
    }

    #[tokio::test]
    async fn write_file_replaces_longer_content_entirely() {
        let fx = Fixture::new();
        fx.write("f.txt", "a much longer original content\n");
        fx.ok("write_file", json!({"path": "f.txt", "content": "short"}))
            .await;
        assert_eq!(fx.read("f.txt"), "short");
    }

    #[tokio::test]
    async fn write_file_refuses_content_over_the_limit() {
        let fx = Fixture::with_limits(ToolLimits {
            max_write_bytes: 10,
            ..ToolLimits::default()
        });
        let message = fx
            .err(
                "write_file",
                json!({"path": "big.txt", "content": "x".repeat(11)}),
            )
            .await;
        assert!(message.starts_with("content is 11 bytes; write_file accepts at most 10 bytes"));
        assert!(!fx.root().join("big.txt").exists());
    }

    #[tokio::test]
    async fn write_file_refuses_to_overwrite_a_directory() {
        let fx = Fixture::new();
        fs::create_dir(fx.root().join("dir")).unwrap();
        assert_eq!(
            fx.err("write_file", json!({"path": "dir", "content": "x"}))
                .await,
            "dir is a directory, not a file"
        );
        assert_eq!(
            fx.err("write_file", json!({"path": ".", "content": "x"}))
                .await,
            ". is a directory, not a file"
        );
    }

    #[tokio::test]
    async fn write_file_refuses_every_path_that_escapes_the_workspace() {
        let fx = Fixture::new();
        for (path, refusal) in fx.escaping_paths() {
            let message = fx
                .err(
                    "write_file",
                    json!({"path": path, "content": "overwritten"}),
                )
                .await;
            assert!(message.starts_with(&refusal), "{path}: {message}");
        }
        fx.assert_outside_untouched();
    }

    // patch

    #[tokio::test]
    async fn patch_replaces_a_unique_string() {
        let fx = Fixture::new();
        fx.write("code.py", "def f():\n    return 1\n");
        let result = fx
            .ok(
                "patch",
                json!({"path": "code.py", "old_string": "return 1", "new_string": "return 2"}),
            )
            .await;
        assert_eq!(result, json!({"path": "code.py", "replacements": 1}));
        assert_eq!(fx.read("code.py"), "def f():\n    return 2\n");
    }

    #[tokio::test]
    async fn patch_can_shrink_a_file() {
        let fx = Fixture::new();
        fx.write("code.py", "keep\nremove this long line\nkeep\n");
        fx.ok(
            "patch",
            json!({"path": "code.py", "old_string": "remove this long line\n", "new_string": ""}),
        )
        .await;
        assert_eq!(fx.read("code.py"), "keep\nkeep\n");
    }

    #[tokio::test]
    async fn patch_names_the_file_when_old_string_is_missing() {
        let fx = Fixture::new();
        fx.write("code.py", "x = 1\n");
        let message = fx
            .err(
                "patch",
                json!({"path": "code.py", "old_string": "y = 1", "new_string": "y"}),
            )
            .await;
        assert!(
            message.starts_with("old_string not found in code.py"),
            "{message}"
        );
        assert_eq!(fx.read("code.py"), "x = 1\n");
    }

    #[tokio::test]
    async fn patch_refuses_old_string_that_occurs_twice() {
        let fx = Fixture::new();
        fx.write("code.py", "x = 1\nx = 1\n");
        let message = fx
            .err(
                "patch",
                json!({"path": "code.py", "old_string": "x = 1", "new_string": "x = 2"}),
            )
            .await;
        assert_eq!(
            message,
            "old_string occurs 2 times in code.py; add context or set replace_all"
        );
        assert_eq!(fx.read("code.py"), "x = 1\nx = 1\n");
    }

    #[tokio::test]
    async fn patch_with_replace_all_replaces_every_occurrence() {
        let fx = Fixture::new();
        fx.write("code.py", "x = 1\ny = 0\nx = 1\n");
        let result = fx
            .ok(
                "patch",
                json!({"path": "code.py", "old_string": "x = 1", "new_string": "x = 2",
                       "replace_all": "true"}),
            )
            .await;
        assert_eq!(result["replacements"], 2);
        assert_eq!(fx.read("code.py"), "x = 2\ny = 0\nx = 2\n");
    }

    #[tokio::test]
    async fn patch_refuses_an_empty_old_string_and_a_missing_file() {
        let fx = Fixture::new();
        fx.write("code.py", "x\n");
        let message = fx
            .err(
                "patch",
                json!({"path": "code.py", "old_string": "", "new_string": "y"}),
            )
            .await;
        assert!(message.starts_with("old_string is empty"), "{message}");
        assert_eq!(
            fx.err(
                "patch",
                json!({"path": "gone.py", "old_string": "a", "new_string": "b"})
            )
            .await,
            "file not found: gone.py"
        );
    }

    #[tokio::test]
    async fn patch_refuses_every_path_that_escapes_the_workspace() {
        let fx = Fixture::new();
        for (path, refusal) in fx.escaping_paths() {
            let message = fx
                .err(
                    "patch",
                    json!({"path": path, "old_string": "TOP SECRET", "new_string": "leaked"}),
                )
                .await;
            assert!(message.starts_with(&refusal), "{path}: {message}");
        }
        fx.assert_outside_untouched();
    }

    // search_files

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

    #[tokio::test]
    async fn search_files_finds_regex_matches_with_line_numbers() {
        let fx = search_fixture();
        let result = fx.ok("search_files", json!({"pattern": "hel+o"})).await;
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

    #[tokio::test]
    async fn search_files_limits_content_search_by_directory_and_glob() {
        let fx = search_fixture();
        let result = fx
            .ok(
                "search_files",
                json!({"pattern": "fn \\w+", "path": "src", "file_glob": "util.rs"}),
            )
            .await;
        assert_eq!(
            result["matches"],
            json!([{"path": "src/lib/util.rs", "line": 1, "text": "pub fn helper() {}"}])
        );
    }

    #[tokio::test]
    async fn search_files_lists_files_matching_a_glob() {
        let fx = search_fixture();
        let result = fx
            .ok(
                "search_files",
                json!({"pattern": "*.rs", "target": "files"}),
            )
            .await;
        assert_eq!(
            result,
            json!({"files": ["src/lib/util.rs", "src/main.rs"], "truncated": false})
        );
        let nested = fx
            .ok(
                "search_files",
                json!({"pattern": "lib/**", "path": "src", "target": "files"}),
            )
            .await;
        assert_eq!(nested["files"], json!(["src/lib/util.rs"]));
    }

    #[tokio::test]
    async fn search_files_caps_results_and_says_so() {
        let fx = Fixture::with_limits(ToolLimits {
            max_search_results: 2,
            ..ToolLimits::default()
        });
        fx.write("many.txt", "hit\nhit\nhit\n");
        let result = fx.ok("search_files", json!({"pattern": "hit"})).await;
        assert_eq!(result["matches"].as_array().unwrap().len(), 2);
        assert_eq!(result["truncated"], true);
    }

    #[tokio::test]
    async fn search_files_names_a_bad_regex_or_glob_or_target() {
        let fx = search_fixture();
        let message = fx.err("search_files", json!({"pattern": "fn ("})).await;
        assert!(message.starts_with("invalid regex \"fn (\""), "{message}");
        let message = fx
            .err("search_files", json!({"pattern": "a[", "target": "files"}))
            .await;
        assert!(
            message.starts_with("invalid glob \"a[\" in `pattern`"),
            "{message}"
        );
        let message = fx
            .err("search_files", json!({"pattern": "x", "file_glob": "{a"}))
            .await;
        assert!(
            message.starts_with("invalid glob \"{a\" in `file_glob`"),
            "{message}"
        );
        let message = fx
            .err("search_files", json!({"pattern": "x", "target": "dirs"}))
            .await;
        assert_eq!(
            message,
            "argument `target` must be \"content\" or \"files\", got \"dirs\""
        );
    }

    #[tokio::test]
    async fn search_files_names_a_missing_directory() {
        let fx = search_fixture();
        let message = fx
            .err("search_files", json!({"pattern": "x", "path": "nowhere"}))
            .await;
        assert_eq!(message, "directory not found: nowhere");
    }

    #[tokio::test]
    async fn search_files_refuses_directories_outside_the_workspace() {
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
            let message = fx
                .err("search_files", json!({"pattern": "SECRET", "path": path}))
                .await;
            assert!(message.starts_with(refusal), "{path}: {message}");
        }
    }

    #[tokio::test]
    async fn search_files_does_not_follow_symlinks_out_of_the_workspace() {
        let fx = Fixture::new();
        let content = fx.ok("search_files", json!({"pattern": "SECRET"})).await;
        assert_eq!(content, json!({"matches": [], "truncated": false}));
        let files = fx
            .ok("search_files", json!({"pattern": "*", "target": "files"}))
            .await;
        assert_eq!(files, json!({"files": [], "truncated": false}));
    }

    #[test]
    fn read_lines_handles_lines_split_across_buffer_reads() {
        let text = "first line\nsecond\n\nfourth";
        let reader = BufReader::with_capacity(3, text.as_bytes());
        let page = read_lines(reader, 2, 2).unwrap();
        assert_eq!(page.lines, ["second", ""]);
        assert_eq!(page.total_lines, 4);
        assert!(!page.binary);
    }
}

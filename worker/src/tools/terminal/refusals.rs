//! Why a command was refused a file. In a local run Landlock lets the commands read and run
//! programs only in their workspace, the system's directories and the run's tool directories;
//! anything else fails with `EACCES`, which the model sees as a bare `Permission denied` (a pyenv
//! shim on its `PATH`, a note in the researcher's home) and cannot tell from a file's mode. The
//! terminal's results name such paths in one note ([`ConversationReach::note_outcome`]), and the
//! record counts what the notes named per path prefix ([`refusal_counts`]).
//!
//! Scanning costs one substring search when the output holds no "Permission denied"; only the
//! lines that do are parsed, and only a bounded number of their paths are judged.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use trajectory_sandbox::reach::{may_read, readable_roots};

use crate::model::Message;
use crate::tools::sandbox::LandlockMode;
use crate::tools::{ToolContext, ToolOutcome};

/// What every refused access prints, in `Permission denied` (`strerror(EACCES)`) and
/// `permission denied` (Node's `EACCES: permission denied`) alike.
const DENIED: &str = "ermission denied";

/// How the note opens: the record finds the notes of a conversation by it.
pub(crate) const NOTE_MARKER: &str = "[The sandbox refused ";

/// What follows the refused paths in the note: where the named paths end.
const NOTE_REASON: &str = ": this conversation's commands may read and run programs only in ";

/// Said instead of the paths beyond [`NAMED_PATHS`].
const MORE_PATHS: &str = " and other paths";

/// Paths a note names at most: enough to show the pattern, short enough to read.
const NAMED_PATHS: usize = 3;

/// Distinct paths judged per result at most: each costs a few `canonicalize` calls, and a
/// `find /` prints thousands.
const JUDGED_PATHS: usize = 32;

/// Names of the directories whose files are programs: a refused one of these may have a system
/// program of its name to use instead.
const PROGRAM_DIRS: [&str; 3] = ["bin", "sbin", "shims"];

/// Where the system keeps the programs the model may run instead of a refused one.
const SYSTEM_PROGRAMS: [&str; 3] = ["/usr/local/bin", "/usr/bin", "/bin"];

/// What a conversation's commands may read, worked out at its first refusal: the roots of
/// [`readable_roots`] and the workspace, all with their links resolved.
#[derive(Debug, Default)]
pub struct ConversationReach {
    /// Holds `None` where the worker cannot judge: a pod's sandbox container has an image of
    /// its own, and without Landlock a refusal is a file's mode, not the sandbox's.
    roots: OnceLock<Option<Vec<PathBuf>>>,
}

impl ConversationReach {
    /// `outcome` with a note on the paths of its output that the sandbox refused, if any.
    pub(super) fn note_outcome(&self, ctx: &ToolContext, mut outcome: ToolOutcome) -> ToolOutcome {
        if let ToolOutcome::Ok(result) = &mut outcome {
            self.note_result(ctx, result);
        }
        outcome
    }

    /// Adds the note to a result's `output` (a background job's `output_preview` when it has
    /// no `output`, as a `poll` has).
    fn note_result(&self, ctx: &ToolContext, result: &mut Value) {
        let Some(map) = result.as_object_mut() else {
            return;
        };
        let field = if map.contains_key("output") {
            "output"
        } else {
            "output_preview"
        };
        let Some(Value::String(output)) = map.get_mut(field) else {
            return;
        };
        if memchr::memmem::find(output.as_bytes(), DENIED.as_bytes()).is_none() {
            return;
        }
        let Some(roots) = self.roots(ctx) else {
            return;
        };
        let Some(note) = refusal_note(output, roots, ctx.sandbox.tool_dirs()) else {
            return;
        };
        if !output.is_empty() {
            output.push('\n');
        }
        output.push_str(&note);
    }

    /// Worked out once per conversation: they cost a few `canonicalize` calls.
    fn roots(&self, ctx: &ToolContext) -> Option<&[PathBuf]> {
        self.roots
            .get_or_init(|| {
                if ctx.sandbox.landlock == LandlockMode::Off {
                    return None;
                }
                let mut roots = readable_roots(&ctx.sandbox.command_files()?);
                roots.extend(ctx.workspace.root().canonicalize().ok());
                Some(roots)
            })
            .as_deref()
    }
}

/// The note on the absolute paths of `output`'s refusals that lie outside `roots`; `None` when
/// every one is inside (a file's mode refused it, not the sandbox).
fn refusal_note(output: &str, roots: &[PathBuf], tool_dirs: &[PathBuf]) -> Option<String> {
    let refused: Vec<&str> = denied_paths(output, JUDGED_PATHS)
        .into_iter()
        .filter(|path| !may_read(Path::new(path), None, roots))
        .take(NAMED_PATHS + 1)
        .collect();
    if refused.is_empty() {
        return None;
    }
    let named = &refused[..refused.len().min(NAMED_PATHS)];
    let more = if refused.len() > NAMED_PATHS {
        MORE_PATHS
    } else {
        ""
    };
    let system = "the system's directories (/usr, /bin, /etc, /opt, ...)";
    let places = if tool_dirs.is_empty() {
        format!("its workspace and {system}")
    } else {
        let dirs: Vec<String> = tool_dirs.iter().map(|d| d.display().to_string()).collect();
        format!(
            "its workspace, {system} and the run's tool directories ({})",
            dirs.join(", ")
        )
    };
    let instead = named
        .iter()
        .find_map(|path| system_program(path))
        .map_or_else(
            || "Use programs and files from those instead".to_owned(),
            |program| format!("Use a program from those instead: {}", program.display()),
        );
    Some(format!(
        "{NOTE_MARKER}{}{more}{NOTE_REASON}{places}. {instead}]",
        named.join(", ")
    ))
}

/// The system's program of the same name as the refused `path` (`/usr/bin/python3` for a
/// pyenv shim), if `path` is a program's (in a `bin` or `shims` directory: a file such as
/// `~/test` would otherwise send the model to `/usr/bin/test`) and there is one.
fn system_program(path: &str) -> Option<PathBuf> {
    let path = Path::new(path);
    let dir = path.parent()?.file_name()?;
    if !PROGRAM_DIRS.iter().any(|program_dir| dir == *program_dir) {
        return None;
    }
    let name = path.file_name()?;
    SYSTEM_PROGRAMS
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|program| program.is_file())
}

/// The first `limit` distinct absolute paths named on the lines of `output` that say
/// "Permission denied", in their order.
fn denied_paths(output: &str, limit: usize) -> Vec<&str> {
    let mut paths: Vec<&str> = Vec::new();
    for line in output.lines().filter(|line| line.contains(DENIED)) {
        for path in line_paths(line) {
            if paths.len() == limit {
                return paths;
            }
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
    }
    paths
}

/// The absolute paths one line names: quoted ones (coreutils' `'/root'`, Python's
/// `[Errno 13] Permission denied: '/home/alice/x'`); else the one right before
/// `: Permission denied` (bash's `bash: line 11: /root/.pyenv/shims/python3: Permission denied`,
/// which may hold spaces); else every word that starts with `/`.
fn line_paths(line: &str) -> Vec<&str> {
    let quoted = quoted_paths(line);
    if !quoted.is_empty() {
        return quoted;
    }
    if let Some((before, _)) = line.split_once(": Permission denied") {
        let last = before.rsplit_once(": ").map_or(before, |(_, last)| last);
        if last.starts_with('/') {
            return vec![last];
        }
    }
    line.split_whitespace()
        .map(|word| word.trim_start_matches(['(', '[', '=']))
        .map(|word| word.trim_end_matches([':', ',', ';', ')', ']']))
        .filter(|word| word.starts_with('/'))
        .collect()
}

/// The absolute paths between quotes on `line`. A quote opens only at the start of a word,
/// so that the apostrophe of Python's `can't open file '/root/x.py'` does not.
fn quoted_paths(line: &str) -> Vec<&str> {
    let mut paths = Vec::new();
    let mut rest = line;
    let mut at_word_start = true;
    while let Some(c) = rest.chars().next() {
        let close = match c {
            '\'' | '"' => Some(c),
            '‘' => Some('’'),
            _ => None,
        };
        if let (true, Some(close)) = (at_word_start, close) {
            let inside = &rest[c.len_utf8()..];
            if let Some(end) = inside.find(close) {
                if inside.starts_with('/') {
                    paths.push(&inside[..end]);
                }
                rest = &inside[end + close.len_utf8()..];
                at_word_start = false;
                continue;
            }
        }
        at_word_start = !c.is_alphanumeric();
        rest = &rest[c.len_utf8()..];
    }
    paths
}

/// The paths the sandbox's notes in a conversation's tool results named, each once, by path
/// prefix ([`refusal_prefix`] under the worker's `$HOME`, read only when there is a note). Counted
/// from the transcript rather than from state the terminal keeps, so that a conversation
/// resumed from a stored log counts the refusals of its earlier turns the same.
pub fn refusal_counts(messages: &[Message]) -> BTreeMap<String, u64> {
    if !messages.iter().any(|message| noted(message).is_some()) {
        return BTreeMap::new();
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    counts_under(messages, home.as_deref())
}

/// The content of a tool result that holds a note.
fn noted(message: &Message) -> Option<&str> {
    match message {
        Message::Tool(result) if result.content.contains(NOTE_MARKER) => Some(&result.content),
        _ => None,
    }
}

/// [`refusal_counts`] with the home directory `home`: each distinct path the notes named counts
/// once per conversation, so that reading a job's output again (`poll`, `log`), which repeats its
/// note, counts nothing more.
fn counts_under(messages: &[Message], home: Option<&Path>) -> BTreeMap<String, u64> {
    let mut paths = std::collections::BTreeSet::new();
    for content in messages.iter().filter_map(noted) {
        // The note is inside a JSON result's `output`, where a path's quotes and backslashes
        // are escaped: read its strings, not the JSON text.
        match serde_json::from_str::<Value>(content) {
            Ok(Value::Object(map)) => {
                for text in map.values().filter_map(Value::as_str) {
                    noted_paths(text, &mut paths);
                }
            }
            _ => noted_paths(content, &mut paths),
        }
    }
    let mut counts = BTreeMap::new();
    for path in paths {
        *counts
            .entry(refusal_prefix(Path::new(&path), home))
            .or_default() += 1;
    }
    counts
}

/// Adds the paths each note in `text` names to `paths`.
fn noted_paths(text: &str, paths: &mut std::collections::BTreeSet<String>) {
    for (at, _) in text.match_indices(NOTE_MARKER) {
        let named = &text[at + NOTE_MARKER.len()..];
        let Some((named, _)) = named.split_once(NOTE_REASON) else {
            continue;
        };
        let named = named.strip_suffix(MORE_PATHS).unwrap_or(named);
        paths.extend(named_paths(named).into_iter().map(str::to_owned));
    }
}

/// The paths of a note's list: split at `, `, except where a path holds one (the piece after
/// it is not absolute).
fn named_paths(list: &str) -> Vec<&str> {
    let mut paths: Vec<&str> = Vec::new();
    let mut start = 0;
    for (at, _) in list.match_indices(", ") {
        if list[at + 2..].starts_with('/') {
            paths.push(&list[start..at]);
            start = at + 2;
        }
    }
    paths.push(&list[start..]);
    paths.retain(|path| path.starts_with('/'));
    paths
}

/// Where a refused path is, as `statistics.json` counts it: under `home` (the worker's `$HOME`),
/// `~/` and its first directory there (`~/.pyenv`); under `/home/<user>`, that directory;
/// else its top-level directory (`/tmp`, `/var`, `/run`).
pub(crate) fn refusal_prefix(path: &Path, home: Option<&Path>) -> String {
    if let Some(rest) = home
        .filter(|home| home.parent().is_some())
        .and_then(|home| path.strip_prefix(home).ok())
    {
        return match rest.components().next() {
            Some(first) => format!("~/{}", first.as_os_str().to_string_lossy()),
            None => "~".to_owned(),
        };
    }
    let names: Vec<&std::ffi::OsStr> = path
        .components()
        .filter_map(|component| match component {
            Component::Normal(name) => Some(name),
            _ => None,
        })
        .take(2)
        .collect();
    match names.as_slice() {
        [home, user] if *home == "home" => format!("/home/{}", user.to_string_lossy()),
        [top, ..] => format!("/{}", top.to_string_lossy()),
        [] => "/".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn system_roots() -> Vec<PathBuf> {
        readable_roots(&trajectory_sandbox::ImageFiles::Hidden)
    }

    #[test]
    fn bash_coreutils_and_python_refusals_give_their_paths() {
        let output = "bash: line 11: /root/.pyenv/shims/python3: Permission denied\n\
            cat: /root/notes.txt: Permission denied\n\
            ls: cannot open directory '/root': Permission denied\n\
            PermissionError: [Errno 13] Permission denied: '/home/alice/x'\n\
            python3: can't open file '/srv/a b.py': [Errno 13] Permission denied\n\
            bash: /root/my dir/run: Permission denied\n\
            error: could not lock config file /root/.gitconfig: Permission denied\n\
            Error: EACCES: permission denied, open \"/run/user/0/x\"\n\
            cat: /root/notes.txt: Permission denied\n";
        assert_eq!(
            denied_paths(output, JUDGED_PATHS),
            [
                "/root/.pyenv/shims/python3",
                "/root/notes.txt",
                "/root",
                "/home/alice/x",
                "/srv/a b.py",
                "/root/my dir/run",
                "/root/.gitconfig",
                "/run/user/0/x",
            ]
        );
    }

    #[test]
    fn a_line_without_permission_denied_is_not_scanned() {
        let output = "reading /root/notes.txt\n'/home/alice/x': No such file or directory\n";
        assert_eq!(denied_paths(output, JUDGED_PATHS), Vec::<&str>::new());
        assert_eq!(refusal_note(output, &system_roots(), &[]), None);
    }

    #[test]
    fn paths_in_the_workspace_or_the_system_get_no_note() {
        let workspace = tempfile::tempdir().unwrap();
        let mut roots = system_roots();
        roots.push(workspace.path().canonicalize().unwrap());
        let inside = workspace.path().join("locked.txt");
        let output = format!(
            "cat: {}: Permission denied\ncat: /etc/shadow: Permission denied\n\
             ls: cannot open directory '/usr/share/private': Permission denied",
            inside.display()
        );
        assert_eq!(refusal_note(&output, &roots, &[]), None);
    }

    #[test]
    fn one_note_names_the_refused_paths_and_a_system_program_to_use() {
        let roots = system_roots();
        // `env` is in `/usr/bin` with `/usr` merged or not.
        let shim = "bash: line 1: /root/.pyenv/shims/env: Permission denied\n\
                    cat: /usr/share/doc: Permission denied\n";
        assert_eq!(
            refusal_note(shim, &roots, &[]).unwrap(),
            "[The sandbox refused /root/.pyenv/shims/env: this conversation's commands may read \
             and run programs only in its workspace and the system's directories (/usr, /bin, \
             /etc, /opt, ...). Use a program from those instead: /usr/bin/env]"
        );
        let many = "cat: /root/a: Permission denied\ncat: /root/b: Permission denied\n\
                    cat: /var/c: Permission denied\ncat: /tmp/traj-none/d: Permission denied\n";
        let tools = [PathBuf::from("/srv/tools")];
        assert_eq!(
            refusal_note(many, &roots, &tools).unwrap(),
            "[The sandbox refused /root/a, /root/b, /var/c and other paths: this conversation's \
             commands may read and run programs only in its workspace, the system's directories \
             (/usr, /bin, /etc, /opt, ...) and the run's tool directories (/srv/tools). Use \
             programs and files from those instead]"
        );
        // A file named as a program is not one.
        let data = refusal_note("cat: /root/test: Permission denied", &roots, &[]).unwrap();
        assert!(
            data.ends_with("Use programs and files from those instead]"),
            "{data}"
        );
    }

    #[test]
    fn prefixes_name_the_home_directory_a_users_home_or_the_top_level_directory() {
        let home = Some(Path::new("/root"));
        for (path, prefix) in [
            ("/root/.pyenv/shims/python3", "~/.pyenv"),
            ("/root/notes.txt", "~/notes.txt"),
            ("/root", "~"),
            ("/home/alice/x/y", "/home/alice"),
            ("/home/alice", "/home/alice"),
            ("/home", "/home"),
            ("/tmp/a/b", "/tmp"),
            ("/var/run/secrets", "/var"),
            ("/", "/"),
        ] {
            assert_eq!(refusal_prefix(Path::new(path), home), prefix, "{path}");
        }
        assert_eq!(
            refusal_prefix(
                Path::new("/home/alice/.cargo/bin/x"),
                Some(Path::new("/home/alice"))
            ),
            "~/.cargo"
        );
        assert_eq!(refusal_prefix(Path::new("/root/x"), None), "/root");
        assert_eq!(
            refusal_prefix(Path::new("/root/x"), Some(Path::new("/"))),
            "/root"
        );
    }

    #[test]
    fn the_transcripts_notes_are_counted_by_prefix() {
        let roots = system_roots();
        let note = refusal_note(
            "cat: /root/a, b: Permission denied\nls: cannot access '/tmp/x': Permission denied\n\
             cat: /root/.pyenv/c: Permission denied\ncat: /var/d: Permission denied\n",
            &roots,
            &[],
        )
        .unwrap();
        let result = serde_json::json!({"output": format!("out\n{note}"), "exit_code": 1});
        let tool = |content: String| {
            Message::Tool(crate::model::ToolMessage {
                tool_call_id: "1".to_owned(),
                name: "terminal".to_owned(),
                content,
            })
        };
        let other = refusal_note("cat: /tmp/y: Permission denied\n", &roots, &[]).unwrap();
        // The same note twice (a job's output read again) counts its paths once.
        let messages = [
            tool(result.to_string()),
            tool(format!("plain text {note}")),
            tool(format!("again {other}")),
            Message::User("[The sandbox refused /root/z: this conversation's".to_owned()),
        ];
        let counts = counts_under(&messages, Some(Path::new("/root")));
        assert_eq!(
            counts,
            BTreeMap::from([
                ("~/a, b".to_owned(), 1),
                ("/tmp".to_owned(), 2),
                ("~/.pyenv".to_owned(), 1)
            ])
        );
    }
}

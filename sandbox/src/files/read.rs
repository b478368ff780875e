//! `read_file`: one page of a text file's lines, numbered like `cat -n`.

use std::fs::OpenOptions;
use std::io::{self, BufRead, BufReader};

use serde_json::{Map, Value, json};

use super::confine::{io_message, open_confined, resolve};
use super::{FileCall, MAX_LINE_BYTES, file_path_parameter};
use super::{FileLimits, Workspace};
use crate::args::{non_empty_string_arg, optional_u64_arg};
use crate::text::complete_prefix_len;

#[derive(Debug)]
pub(super) struct ReadFileCall {
    path: String,
    offset: Option<u64>,
    limit: Option<u64>,
}

impl FileCall for ReadFileCall {
    const NAME: &'static str = "read_file";
    const DESCRIPTION: &'static str = "Read a text file from the workspace. Lines are numbered \
        like `cat -n` (`     1|first line`); the number and the `|` are not part of the file. One \
        call returns one page of lines: when `truncated` is true, call again with `offset` set to \
        `end_line + 1`. Lines longer than 2000 bytes are cut. Binary files are refused.";
    const READ_ONLY: bool = true;

    fn parameters() -> Value {
        json!({
            "type": "object",
            "properties": {
                "path": file_path_parameter(),
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
        })
    }

    fn parse(args: &Map<String, Value>) -> Result<Self, String> {
        Ok(Self {
            path: non_empty_string_arg(args, "path")?.to_owned(),
            offset: optional_u64_arg(args, "offset")?,
            limit: optional_u64_arg(args, "limit")?,
        })
    }

    fn run(self, workspace: &Workspace, limits: &FileLimits) -> Result<Value, String> {
        let requested = self.path.as_str();
        let path = resolve(workspace, requested)?;
        let file = open_confined(workspace, &path, requested, OpenOptions::new().read(true))?;
        let page_size = u64::try_from(limits.max_read_lines.max(1)).unwrap_or(u64::MAX);
        let first = self.offset.unwrap_or(1).max(1);
        let count = self
            .limit
            .map_or(page_size, |limit| limit.clamp(1, page_size));
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

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::files::fixture::Fixture;

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

    #[test]
    fn read_file_returns_numbered_lines() {
        let fx = Fixture::new();
        fx.write("notes/a.txt", "alpha\nbeta\n");
        let result = fx.ok("read_file", json!({"path": "notes/a.txt"}));
        assert_eq!(
            result,
            json!({
                "content": "     1|alpha\n     2|beta", "path": "notes/a.txt", "total_lines": 2,
                "start_line": 1, "end_line": 2, "truncated": false,
            })
        );
    }

    #[test]
    fn read_file_counts_a_last_line_without_newline() {
        let fx = Fixture::new();
        fx.write("a.txt", "one\ntwo");
        let result = fx.ok("read_file", json!({"path": "./a.txt"}));
        assert_eq!(result["content"], "     1|one\n     2|two");
        assert_eq!(result["total_lines"], 2);
    }

    #[test]
    fn read_file_pages_with_offset_and_limit() {
        let fx = Fixture::new();
        fx.write("ten.txt", &lines(1..=10));
        let result = fx.ok(
            "read_file",
            json!({"path": "ten.txt", "offset": 3, "limit": "4"}),
        );
        assert_eq!(result["content"], numbered(3..=6));
        assert_eq!(result["start_line"], 3);
        assert_eq!(result["end_line"], 6);
        assert_eq!(result["total_lines"], 10);
        assert_eq!(result["truncated"], true);

        let last = fx.ok("read_file", json!({"path": "ten.txt", "offset": 7}));
        assert_eq!(last["content"], numbered(7..=10));
        assert_eq!(last["truncated"], false);
    }

    #[test]
    fn read_file_returns_at_most_one_page_of_lines() {
        let fx = Fixture::with_limits(FileLimits {
            max_read_lines: 5,
            ..FileLimits::default()
        });
        fx.write("twelve.txt", &lines(1..=12));
        let result = fx.ok("read_file", json!({"path": "twelve.txt", "limit": 100}));
        assert_eq!(result["content"], numbered(1..=5));
        assert_eq!(result["end_line"], 5);
        assert_eq!(result["truncated"], true);
    }

    #[test]
    fn read_file_refuses_offset_past_the_end() {
        let fx = Fixture::new();
        fx.write("short.txt", "a\nb\n");
        let message = fx.err("read_file", json!({"path": "short.txt", "offset": 5}));
        assert_eq!(
            message,
            "offset 5 is past the end of short.txt, which has 2 lines"
        );
    }

    #[test]
    fn read_file_of_an_empty_file_returns_no_lines() {
        let fx = Fixture::new();
        fx.write("empty.txt", "");
        let result = fx.ok("read_file", json!({"path": "empty.txt"}));
        assert_eq!(result["content"], "");
        assert_eq!(result["total_lines"], 0);
        assert_eq!(result["truncated"], false);
    }

    #[test]
    fn read_file_cuts_very_long_lines() {
        let fx = Fixture::new();
        fx.write("long.txt", &format!("{}\nshort\n", "é".repeat(3000)));
        let result = fx.ok("read_file", json!({"path": "long.txt"}));
        let content = result["content"].as_str().unwrap();
        let (first, second) = content.split_once('\n').unwrap();
        assert!(first.ends_with("... [line cut: 6000 bytes]"), "{first}");
        assert!(first.len() < MAX_LINE_BYTES + 100);
        assert!(!first.contains('\u{FFFD}'));
        assert_eq!(second, "     2|short");
    }

    #[test]
    fn read_file_names_a_missing_file() {
        let fx = Fixture::new();
        let message = fx.err("read_file", json!({"path": "nope/missing.txt"}));
        assert_eq!(message, "file not found: nope/missing.txt");
    }

    #[test]
    fn read_file_refuses_binary_files_and_directories() {
        let fx = Fixture::new();
        fs::write(fx.root().join("blob.bin"), b"ab\0cd").unwrap();
        fs::create_dir(fx.root().join("dir")).unwrap();
        assert_eq!(
            fx.err("read_file", json!({"path": "blob.bin"})),
            "blob.bin is a binary file; read_file shows text files only"
        );
        assert_eq!(
            fx.err("read_file", json!({"path": "dir"})),
            "dir is a directory, not a file"
        );
    }

    #[test]
    fn read_file_does_not_block_on_a_fifo() {
        let fx = Fixture::new();
        let status = std::process::Command::new("mkfifo")
            .arg(fx.root().join("fifo"))
            .status()
            .unwrap();
        assert!(status.success());
        // On a thread, so that a blocking open fails the test instead of hanging it.
        let root = fx.root().to_owned();
        let (sender, received) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let workspace = Workspace::new(root).unwrap();
            let args = json!({"path": "fifo"});
            let outcome = crate::files::call(
                "read_file",
                args.as_object().unwrap(),
                &workspace,
                &FileLimits::default(),
            );
            let _ = sender.send(outcome);
        });
        let message = received
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("read_file returned")
            .unwrap_err();
        assert_eq!(message, "fifo is not a regular file");
    }

    #[test]
    fn read_file_follows_a_symlink_that_stays_inside() {
        let fx = Fixture::new();
        fx.write("real.txt", "inside\n");
        symlink(fx.root().join("real.txt"), fx.root().join("alias")).unwrap();
        let result = fx.ok("read_file", json!({"path": "alias"}));
        assert_eq!(result["content"], "     1|inside");
        assert_eq!(result["path"], "real.txt");
    }

    #[test]
    fn read_file_refuses_every_path_that_escapes_the_workspace() {
        Fixture::new().assert_every_escape_refused("read_file", |path| json!({"path": path}));
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

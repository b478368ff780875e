//! What the model is shown of a command's output, as hermes-agent 0.19.0 shows it
//! (`tools/environments/base.py`, `tools/ansi_strip.py`): the head and the tail within a fixed
//! budget, with a notice in the middle saying how much was left out; then terminal escape
//! sequences removed; then surrounding whitespace trimmed.
//!
//! The budget is in bytes here (the run's `maxOutputBytes`) where the reference counts Python
//! characters; the notice counts characters, as the reference's does. For ASCII output the two
//! are the same text.

use std::collections::VecDeque;
use std::sync::LazyLock;

use regex::Regex;

use crate::tools::text::{complete_prefix_len, complete_suffix_start};

/// The reference's share of the budget kept from the head (error messages often come first);
/// the tail gets the rest.
const HEAD_SHARE: f64 = 0.4;

/// Escape sequences of the whole of ECMA-48, the reference's `_ANSI_ESCAPE_RE`: CSI (with
/// private-mode and intermediate bytes), OSC ended by BEL or ST, DCS/SOS/PM/APC strings, nF
/// escapes, single-byte Fp/Fe/Fs escapes, and their 8-bit C1 forms.
static ANSI_ESCAPE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(concat!(
        r"(?s)\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]",
        r"|\].*?(?:\x07|\x1b\\)",
        r"|[PX^_].*?\x1b\\",
        r"|[\x20-\x2f]+[\x30-\x7e]",
        r"|[\x30-\x7e])",
        r"|\x{9b}[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]",
        r"|\x{9d}.*?(?:\x07|\x{9c})",
        r"|[\x{80}-\x{9f}]",
    ))
    .expect("the escape pattern compiles")
});

/// Bash's line about a foreground command killed by a signal.
static KILL_NOTICE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?m)^(?:[\w./-]+: )?line \d+: +\d+ Killed[^\n]*\n?")
        .expect("the notice pattern compiles")
});

/// Keeps the first and last bytes of a stream within a budget, counting what is dropped.
#[derive(Debug)]
pub(crate) struct OutputBuffer {
    budget: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total_bytes: usize,
    total_chars: usize,
}

impl OutputBuffer {
    /// Room for `budget` bytes of output, the notice included when some is left out.
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            budget,
            head: Vec::new(),
            tail: VecDeque::new(),
            total_bytes: 0,
            total_chars: 0,
        }
    }

    pub(crate) fn push(&mut self, mut bytes: &[u8]) {
        self.total_bytes += bytes.len();
        self.total_chars += bytes.iter().filter(|byte| !is_continuation(**byte)).count();
        // The head keeps at most the whole budget: how much of it is shown depends on the
        // notice's length, known only at the end.
        let into_head = bytes.len().min(self.budget - self.head.len());
        self.head.extend_from_slice(&bytes[..into_head]);
        bytes = &bytes[into_head..];
        if bytes.len() >= self.budget {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - self.budget..]);
        } else {
            let overflow = (self.tail.len() + bytes.len()).saturating_sub(self.budget);
            self.tail.drain(..overflow);
            self.tail.extend(bytes);
        }
    }

    /// The kept bytes as they came (lossy UTF-8), for the worker's own use.
    pub(crate) fn render_raw(self) -> String {
        let mut all = self.head;
        all.extend(self.tail);
        String::from_utf8_lossy(&all).into_owned()
    }

    /// The output as the model sees it, `suffix` (a timeout's note) kept whole at its end.
    /// With a note, the shell's report of the command it killed (`bash: line 3: 1234 Killed
    /// sleep 30`) is left out: the note says it, as the reference's does.
    pub(crate) fn render(self, suffix: &str) -> String {
        let available = self.budget.saturating_sub(suffix.len());
        let kept = if self.total_bytes <= available {
            let mut all = self.head;
            all.extend(self.tail);
            String::from_utf8_lossy(&all).into_owned()
        } else {
            self.render_cut(available)
        };
        let shown = if suffix.is_empty() {
            kept
        } else {
            let kept = KILL_NOTICE.replace_all(&kept, "");
            format!("{}{suffix}", kept.trim_end())
        };
        strip_ansi(&shown).trim().to_owned()
    }

    /// Head, notice and tail within `available` bytes. The notice's length depends on the
    /// numbers in it, which depend on the room it leaves: the reference iterates to a fixed point.
    fn render_cut(self, available: usize) -> String {
        let tail: Vec<u8> = self.tail.into();
        let mut notice = String::new();
        let mut parts = (String::new(), String::new());
        for _ in 0..4 {
            let content = available.saturating_sub(notice.len());
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss,
                reason = "a share of a byte budget, floored as the reference's int() does"
            )]
            let head_bytes = (content as f64 * HEAD_SHARE) as usize;
            let tail_bytes = content - head_bytes;
            let head = &self.head[..head_bytes.min(self.head.len())];
            let head = &head[..complete_prefix_len(head)];
            let tail = &tail[tail.len().saturating_sub(tail_bytes)..];
            let tail = &tail[complete_suffix_start(tail)..];
            let head = String::from_utf8_lossy(head).into_owned();
            let tail = String::from_utf8_lossy(tail).into_owned();
            let omitted = self
                .total_chars
                .saturating_sub(head.chars().count() + tail.chars().count());
            let updated = format!(
                "\n\n... [OUTPUT TRUNCATED - {} chars omitted out of {} total] ...\n\n",
                thousands(omitted),
                thousands(self.total_chars)
            );
            parts = (head, tail);
            if updated == notice {
                break;
            }
            notice = updated;
        }
        format!("{}{notice}{}", parts.0, parts.1)
    }
}

/// Removes terminal escape sequences, so that the model never copies them into files.
pub(crate) fn strip_ansi(text: &str) -> String {
    if !text.contains(|c: char| c == '\x1b' || ('\u{80}'..='\u{9f}').contains(&c)) {
        return text.to_owned();
    }
    ANSI_ESCAPE.replace_all(text, "").into_owned()
}

/// `1234567` as `1,234,567`, as Python's `{:,}`.
fn thousands(number: usize) -> String {
    let digits = number.to_string();
    let mut grouped = String::with_capacity(digits.len() + digits.len() / 3);
    for (at, digit) in digits.chars().enumerate() {
        if at > 0 && (digits.len() - at).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    grouped
}

fn is_continuation(byte: u8) -> bool {
    byte & 0b1100_0000 == 0b1000_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_shown_whole_and_trimmed() {
        let mut buffer = OutputBuffer::new(100);
        buffer.push(b"hello\n");
        buffer.push(b"world\n\n");
        assert_eq!(buffer.render(""), "hello\nworld");
    }

    #[test]
    fn colour_codes_and_other_escapes_are_removed() {
        assert_eq!(strip_ansi("\x1b[31mred\x1b[0m"), "red");
        assert_eq!(strip_ansi("\x1b]0;title\x07text"), "text");
        assert_eq!(strip_ansi("a\x1b[?25lb"), "ab");
        assert_eq!(strip_ansi("plain é Û"), "plain é Û");
        assert_eq!(strip_ansi("c1\u{9b}31mx"), "c1x");
    }

    #[test]
    fn a_timed_out_command_shows_its_output_then_the_note() {
        let mut buffer = OutputBuffer::new(1000);
        buffer.push(b"start\nbash: line 13: 11309 Killed                  sleep 30\n\n");
        assert_eq!(
            buffer.render("\n\n[Command timed out after 2s]"),
            "start\n\n[Command timed out after 2s]"
        );
        let buffer = OutputBuffer::new(1000);
        assert_eq!(
            buffer.render("\n\n[Command timed out after 2s]"),
            "[Command timed out after 2s]"
        );
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_939_053), "1,939,053");
    }

    #[test]
    fn a_timeout_note_is_kept_after_a_cut() {
        let mut buffer = OutputBuffer::new(200);
        for line in 0..1000 {
            buffer.push(format!("{line}\n").as_bytes());
        }
        let shown = buffer.render("\n\n[Command timed out after 2s]");
        assert!(shown.starts_with("0\n1\n"), "{shown}");
        assert!(
            shown.contains("chars omitted out of 3,890 total"),
            "{shown}"
        );
        assert!(
            shown.ends_with("999\n\n[Command timed out after 2s]"),
            "{shown}"
        );
        assert!(shown.len() <= 200, "{}", shown.len());
    }

    #[test]
    fn characters_cut_at_the_edges_are_dropped() {
        let mut buffer = OutputBuffer::new(120);
        buffer.push("é".repeat(200).as_bytes());
        let shown = buffer.render("");
        assert!(!shown.contains('\u{FFFD}'), "{shown}");
        assert!(shown.contains("out of 200 total"), "{shown}");
    }
}

//! JSON text exactly as Python's `json.dumps(value, ensure_ascii=False)` writes it.
//!
//! Hermes-format datasets were written by Python with its default separators (`", "` and
//! `": "`), and the system turn, `<tool_call>` and `<tool_response>` blocks embed JSON text in
//! strings, so byte compatibility needs the same spacing. Non-ASCII stays UTF-8, as there.

use std::io;

use serde::Serialize;
use serde_json::ser::{Formatter, Serializer};

/// The formatter: compact JSON with Python's separators.
#[derive(Debug, Default, Clone, Copy)]
pub struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Python puts `", "` between array items and between object members alike.
fn separator<W: ?Sized + io::Write>(writer: &mut W, first: bool) -> io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

/// Writes `value` as Python would into `out`.
pub fn write<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    let mut serializer = Serializer::with_formatter(out, PythonFormatter);
    // Serialising a serde_json::Value or our own derive types into a Vec cannot fail: there are
    // no non-string map keys and no I/O errors from a Vec.
    value
        .serialize(&mut serializer)
        .expect("serialising JSON into memory cannot fail");
}

/// `value` as Python's `json.dumps(value, ensure_ascii=False)` text.
pub fn to_string<T: Serialize + ?Sized>(value: &T) -> String {
    let mut out = Vec::new();
    write(&mut out, value);
    // serde_json writes valid UTF-8 only.
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_default_separators_and_keeps_unicode() {
        let value = json!({"name": "terminal", "arguments": {"command": "echo héllo", "n": [1, 2]}, "x": null});
        // Output of: json.dumps({...}, ensure_ascii=False) in CPython 3.11.
        assert_eq!(
            to_string(&value),
            r#"{"name": "terminal", "arguments": {"command": "echo héllo", "n": [1, 2]}, "x": null}"#
        );
        assert_eq!(to_string(&json!("a\"b\n\u{1}")), r#""a\"b\n\u0001""#);
        assert_eq!(to_string(&json!([])), "[]");
        assert_eq!(to_string(&json!({})), "{}");
    }
}

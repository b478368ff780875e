//! A conservative JSON syntax scanner for the two paths that read every byte of a run's data only
//! to know that each line is valid: the plan's check of the dataset and merge's check of the
//! batch files.
//!
//! [`object_line`] walks one line's syntax without building, unescaping or converting anything and
//! answers either "valid" (then `serde_json` certainly accepts the line, also when parsing it into
//! a [`serde_json::Value`]) or "not sure". It is not sure of everything whose acceptance depends on
//! more than syntax: a `\u` escape naming a surrogate (which must be paired), a number with an
//! exponent or of [`MAX_NUMBER_LEN`] characters (which may be beyond `f64`), nesting deeper than
//! [`MAX_DEPTH`] (`serde_json` refuses past 128), and any control character in the line (invalid
//! raw inside a string, whitespace outside one). Callers send every line the scanner does not
//! vouch for through `serde_json`, which decides and words the error, so the scanner changes how
//! fast a line is accepted, never whether.
//!
//! It is fast because strings, most of a line's bytes, are crossed from one quote or backslash to
//! the next eight bytes at a time (and with `memchr2`'s SIMD search over long stretches) instead of
//! byte by byte, after one pass over the line for control characters.

use std::ops::Range;

/// Nesting the scanner follows before it is not sure (`serde_json` refuses past 128 levels).
pub const MAX_DEPTH: usize = 100;

/// Numbers this long or longer may be out of `f64`'s range (about 1.8e308); shorter ones without
/// an exponent are far inside it.
pub const MAX_NUMBER_LEN: usize = 300;

/// One top-level field of an object line, as [`object_line`] hands it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field<'a> {
    /// The key's bytes between its quotes, as written.
    pub raw_key: &'a [u8],
    /// The key holds a backslash escape, so `raw_key` is not its text.
    pub key_escaped: bool,
    /// The value's byte range in the line (for a string, its quotes included).
    pub value: Range<usize>,
    /// The value is a string holding a `\u` escape.
    pub unicode_escape: bool,
}

impl Field<'_> {
    /// Whether the key is `name` (certainly, i.e. written without escapes).
    pub fn is(&self, name: &str) -> bool {
        !self.key_escaped && self.raw_key == name.as_bytes()
    }
}

/// Whether `line` is certainly one valid JSON object (spaces around it allowed), calling `on_field`
/// with each top-level field in order. `false` means "not sure": the line may still be valid. A
/// field for which `on_field` returns `false` makes the answer "not sure" too, and ends the scan.
pub fn object_line<'a>(line: &'a [u8], mut on_field: impl FnMut(&Field<'a>) -> bool) -> bool {
    if has_control_byte(line) {
        return false;
    }
    let mut scanner = Scanner { bytes: line, at: 0 };
    scanner.skip_spaces();
    if scanner.peek() != Some(b'{') {
        return false;
    }
    scanner.object(1, &mut on_field).is_some() && {
        scanner.skip_spaces();
        scanner.at == line.len()
    }
}

/// Whether any byte is below 0x20. Whole chunks are folded without an early exit, which the
/// compiler turns into SIMD compares.
fn has_control_byte(bytes: &[u8]) -> bool {
    let mut chunks = bytes.chunks_exact(64);
    for chunk in &mut chunks {
        if chunk
            .iter()
            .fold(0u8, |found, &byte| found | u8::from(byte < 0x20))
            != 0
        {
            return true;
        }
    }
    chunks.remainder().iter().any(|&byte| byte < 0x20)
}

/// The position of the first quote or backslash at or after `at`.
///
/// The next one is usually close (dataset text and records are full of `\n` and `\"`), so the
/// first 32 bytes are searched inline, 8 at a time with bit tricks on a `u64`, without the cost
/// of a call; a longer stretch is left to `memchr2`'s SIMD search.
fn next_quote_or_backslash(bytes: &[u8], mut at: usize) -> Option<usize> {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES << 7;
    // High bit of each byte that is zero in `word ^ ONES * target`, exact for the lowest such
    // byte (borrows only reach bytes above a zero byte), which is the one we take.
    let matches = |word: u64| {
        let quotes = word ^ (ONES * u64::from(b'"'));
        let backslashes = word ^ (ONES * u64::from(b'\\'));
        (quotes.wrapping_sub(ONES) & !quotes | backslashes.wrapping_sub(ONES) & !backslashes) & HIGH
    };
    let inline_until = at + 32;
    while at < inline_until {
        let Some(word) = bytes.get(at..).and_then(<[u8]>::first_chunk::<8>) else {
            return bytes[at.min(bytes.len())..]
                .iter()
                .position(|&byte| byte == b'"' || byte == b'\\')
                .map(|offset| at + offset);
        };
        let found = matches(u64::from_le_bytes(*word));
        if found != 0 {
            return Some(at + found.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    memchr::memchr2(b'"', b'\\', &bytes[at..]).map(|offset| at + offset)
}

/// What a scanned string held.
#[derive(Debug, Clone, Copy, Default)]
struct Escapes {
    any: bool,
    unicode: bool,
}

/// A position in a line known to hold no control byte, so a space is its only whitespace.
/// Every method returns `None` for "not sure" and leaves the position anywhere.
struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn skip_spaces(&mut self) {
        while self.peek() == Some(b' ') {
            self.at += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.peek() == Some(byte)).then(|| self.at += 1)
    }

    /// A string, from its opening quote to past its closing one.
    fn string(&mut self) -> Option<Escapes> {
        self.expect(b'"')?;
        let mut escapes = Escapes::default();
        loop {
            self.at = next_quote_or_backslash(self.bytes, self.at)?;
            if self.bytes[self.at] == b'"' {
                self.at += 1;
                return Some(escapes);
            }
            escapes.any = true;
            match *self.bytes.get(self.at + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.at += 2,
                b'u' => {
                    let hex = self.bytes.get(self.at + 2..self.at + 6)?;
                    let code = std::str::from_utf8(hex)
                        .ok()
                        .filter(|hex| hex.bytes().all(|byte| byte.is_ascii_hexdigit()))
                        .and_then(|hex| u16::from_str_radix(hex, 16).ok())?;
                    if (0xD800..=0xDFFF).contains(&code) {
                        return None;
                    }
                    escapes.unicode = true;
                    self.at += 6;
                }
                _ => return None,
            }
        }
    }

    /// Any value; for a string, what it held.
    fn value(&mut self, depth: usize) -> Option<Escapes> {
        match self.peek()? {
            b'"' => return self.string(),
            b'{' => self.object(depth + 1, &mut |_: &Field<'a>| true)?,
            b'[' => self.array(depth + 1)?,
            b't' => self.word(b"true")?,
            b'f' => self.word(b"false")?,
            b'n' => self.word(b"null")?,
            b'-' | b'0'..=b'9' => self.number()?,
            _ => return None,
        }
        Some(Escapes::default())
    }

    fn word(&mut self, word: &[u8]) -> Option<()> {
        self.bytes[self.at..].starts_with(word).then(|| {
            self.at += word.len();
        })
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?`, shorter than [`MAX_NUMBER_LEN`]; an exponent is not sure.
    fn number(&mut self) -> Option<()> {
        let start = self.at;
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return None;
            }
            self.digits();
        }
        // A digit here follows a leading zero ("01"), which is invalid; an exponent is not sure.
        if matches!(self.peek(), Some(b'0'..=b'9' | b'e' | b'E')) {
            return None;
        }
        (self.at - start < MAX_NUMBER_LEN).then_some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if self.opens(b'[', b']', depth)? {
            return Some(());
        }
        loop {
            self.value(depth)?;
            if self.closes(b']')? {
                return Some(());
            }
        }
    }

    fn object(
        &mut self,
        depth: usize,
        on_field: &mut impl FnMut(&Field<'a>) -> bool,
    ) -> Option<()> {
        if self.opens(b'{', b'}', depth)? {
            return Some(());
        }
        loop {
            let key_start = self.at + 1;
            let key = self.string()?;
            let raw_key = &self.bytes[key_start..self.at - 1];
            self.skip_spaces();
            self.expect(b':')?;
            self.skip_spaces();
            let value_start = self.at;
            let value = self.value(depth)?;
            let field = Field {
                raw_key,
                key_escaped: key.any,
                value: value_start..self.at,
                unicode_escape: value.unicode,
            };
            if !on_field(&field) {
                return None;
            }
            if self.closes(b'}')? {
                return Some(());
            }
        }
    }

    /// Past the opening bracket of an array or object and the spaces after it; `true` when it is
    /// empty (then past its closing bracket too).
    fn opens(&mut self, open: u8, close: u8, depth: usize) -> Option<bool> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.expect(open)?;
        self.skip_spaces();
        Some(self.expect(close).is_some())
    }

    /// After a member of an array or object: `true` past its closing bracket, `false` past a
    /// comma and the spaces after it.
    fn closes(&mut self, close: u8) -> Option<bool> {
        self.skip_spaces();
        let byte = self.peek()?;
        self.at += 1;
        if byte == close {
            return Some(true);
        }
        (byte == b',').then(|| {
            self.skip_spaces();
            false
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn sure(line: &str) -> bool {
        object_line(line.as_bytes(), |_| true)
    }

    fn fields(line: &str) -> Vec<(String, String, bool)> {
        let mut seen = Vec::new();
        assert!(object_line(line.as_bytes(), |field| {
            seen.push((
                String::from_utf8(field.raw_key.to_vec()).unwrap(),
                line[field.value.clone()].to_owned(),
                field.unicode_escape,
            ));
            true
        }));
        seen
    }

    #[test]
    fn valid_objects_are_vouched_for_with_their_fields() {
        assert_eq!(
            fields(
                r#" {"a": 1, "b":[true, false, null, -0.5, {"c": {}}],"p\n":"x\"\\\/\b\f\n\r\t\u00e9y", "e": []} "#
            ),
            vec![
                ("a".into(), "1".into(), false),
                (
                    "b".into(),
                    r#"[true, false, null, -0.5, {"c": {}}]"#.into(),
                    false
                ),
                (r"p\n".into(), r#""x\"\\\/\b\f\n\r\t\u00e9y""#.into(), true),
                ("e".into(), "[]".into(), false),
            ]
        );
        assert!(sure("{}"));
        assert!(sure(r#"{"naïve": "café — ü", "n": 18446744073709551616}"#));
    }

    #[test]
    fn invalid_syntax_is_never_vouched_for() {
        for line in [
            "",
            "[]",
            "\"x\"",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":1}x",
            "{\"a\":1}{}",
            "{a:1}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":.5}",
            "{\"a\":+1}",
            "{\"a\":tru}",
            "{\"a\":nul}",
            "{\"a\":\"x}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":'x'}",
            "{\"a\" 1}",
            "{\"a\":1 \"b\":2}",
        ] {
            assert!(!sure(line), "{line}");
            assert!(serde_json::from_str::<Value>(line).is_err() || !line.starts_with('{'));
        }
    }

    #[test]
    fn what_more_than_syntax_decides_is_not_sure() {
        for line in [
            r#"{"a":"\ud800"}"#,
            r#"{"a":"\udc00"}"#,
            r#"{"a":"\ud83d\ude00"}"#,
            r#"{"a":1e5}"#,
            r#"{"a":1E400}"#,
            "{\"a\":\"tab\there\"}",
            "{\"a\":\t1}",
            "{\"a\":1}\r",
        ] {
            assert!(!sure(line), "{line}");
        }
        let long = format!("{{\"a\":1{}}}", "0".repeat(MAX_NUMBER_LEN));
        assert!(!sure(&long));
        let deep =
            |levels: usize| format!("{{\"a\":{}{}}}", "[".repeat(levels), "]".repeat(levels));
        assert!(sure(&deep(MAX_DEPTH - 1)));
        assert!(!sure(&deep(MAX_DEPTH)));
        assert!(!sure(&deep(200)));
    }

    #[test]
    fn a_field_the_caller_refuses_makes_the_line_not_sure() {
        assert!(!object_line(br#"{"a":1,"b":2}"#, |field| !field.is("b")));
        assert!(object_line(br#"{"a":1,"b\u0062":2}"#, |field| !field.is("bb")));
    }

    #[test]
    fn control_bytes_are_found_in_whole_chunks_and_the_remainder() {
        for length in [0usize, 1, 63, 64, 65, 200] {
            for position in 0..length {
                let mut bytes = vec![b'a'; length];
                bytes[position] = b'\n';
                assert!(has_control_byte(&bytes), "{length} {position}");
            }
            assert!(!has_control_byte(&vec![b' '; length]));
        }
    }

    proptest::proptest! {
        #[test]
        fn quotes_and_backslashes_are_found_where_they_are(
            bytes in proptest::collection::vec(proptest::sample::select(b"ab\"\\\xff\x00 ".to_vec()), 0..120),
            gap in 0usize..100,
            at in 0usize..130,
        ) {
            // A long stretch without one, then the random bytes.
            let mut haystack = vec![b'x'; gap];
            haystack.extend_from_slice(&bytes);
            let at = at.min(haystack.len());
            let expected = haystack[at..]
                .iter()
                .position(|&byte| byte == b'"' || byte == b'\\')
                .map(|offset| at + offset);
            proptest::prop_assert_eq!(next_quote_or_backslash(&haystack, at), expected);
        }
    }

    /// JSON-like text: valid values of every kind, values only a full parse refuses, and
    /// near-misses that do not parse.
    fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("fals".to_owned()),
            Just("0".to_owned()),
            Just("-0".to_owned()),
            Just("-".to_owned()),
            Just("01".to_owned()),
            Just("1.".to_owned()),
            Just("1.5".to_owned()),
            Just("-0.5e-3".to_owned()),
            Just("1e400".to_owned()),
            Just("18446744073709551616".to_owned()),
            Just(format!("1{}", "0".repeat(298))),
            Just(format!("1{}", "0".repeat(400))),
            Just(format!("0.{}1", "0".repeat(297))),
            Just(r#""\ud800""#.to_owned()),
            Just(r#""\ud83d\ude00""#.to_owned()),
            Just(r#""a\"b\\n\u00e9\u0000""#.to_owned()),
            Just(r#""\u00G0""#.to_owned()),
            Just(r#""\x""#.to_owned()),
            Just("\"\u{1}\"".to_owned()),
            Just("\"tab\there\"".to_owned()),
            Just("\"é — ü\"".to_owned()),
            Just(r#""unterminated"#.to_owned()),
            Just(r#""\""#.to_owned()),
            "[a-z \\\\\"]{0,6}".prop_map(|text| format!("\"{text}\"")),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                (proptest::collection::vec(inner.clone(), 0..4), "[ ,]{0,2}")
                    .prop_map(|(items, separator)| format!("[{}]", items.join(&separator))),
                (
                    proptest::collection::vec(("[a-z\\\\\"]{0,3}", inner), 0..4),
                    "[ ,:]{0,2}"
                )
                    .prop_map(|(entries, separator)| {
                        let entries: Vec<String> = entries
                            .iter()
                            .map(|(key, value)| format!("\"{key}\" : {value}"))
                            .collect();
                        format!("{{{}}}", entries.join(&separator))
                    }),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(4000))]
        #[test]
        fn a_line_vouched_for_is_one_serde_json_parses_into_a_value(
            first in json_text(),
            second in json_text(),
            levels in 0usize..140,
            deep in proptest::bool::weighted(0.1),
        ) {
            let second = if deep {
                format!("{}{second}{}", "[".repeat(levels), "]".repeat(levels))
            } else {
                second
            };
            let line = format!("{{\"a\": {first}, \"b\" :{second}}}");
            let mut ranges = Vec::new();
            if object_line(line.as_bytes(), |field| {
                ranges.push(field.value.clone());
                true
            }) {
                let parsed = serde_json::from_str::<Value>(&line);
                proptest::prop_assert!(parsed.is_ok(), "vouched for, but: {parsed:?}: {line}");
                // Each field's range holds exactly its value.
                let parsed = parsed.unwrap();
                let values: Vec<Value> = ranges
                    .iter()
                    .map(|range| serde_json::from_str(&line[range.clone()]).unwrap())
                    .collect();
                proptest::prop_assert_eq!(values, parsed.as_object().unwrap().values().cloned().collect::<Vec<_>>());
            }
        }
    }
}

//! Reading the JSONL dataset: line framing with a length cap, and the validation rules.
//!
//! The plan step streams the whole file through [`LineReader`] and [`probe_line`] (no value is
//! built, so memory does not depend on the file); a batch re-reads only its own byte range and
//! parses its rows fully with [`parse_row`]. Both apply the same rules, so a line is valid in one
//! exactly when it is valid in the other.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, BufRead};

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Value};

/// Lines longer than this are rejected (and never held in memory whole).
pub const MAX_LINE_BYTES: usize = 1024 * 1024;

/// One framed line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineInfo {
    /// 1-based line number.
    pub number: u64,
    /// Byte offset of the line's first byte.
    pub offset: u64,
    /// Bytes including the newline.
    pub length: u64,
    /// The line exceeded [`MAX_LINE_BYTES`]; its content was not kept.
    pub too_long: bool,
}

/// Splits a reader into lines, keeping at most `max` bytes of each.
#[derive(Debug)]
pub struct LineReader<R> {
    reader: R,
    number: u64,
    offset: u64,
    max: usize,
}

impl<R: BufRead> LineReader<R> {
    pub fn new(reader: R, max: usize) -> Self {
        Self {
            reader,
            number: 0,
            offset: 0,
            max,
        }
    }

    /// Reads the next line into `buffer` (without its newline). `None` at the end.
    /// `observe` sees every byte read, for digests.
    pub fn next_line(
        &mut self,
        buffer: &mut Vec<u8>,
        observe: &mut impl FnMut(&[u8]),
    ) -> io::Result<Option<LineInfo>> {
        buffer.clear();
        let start = self.offset;
        let mut too_long = false;
        let mut length = 0u64;
        loop {
            let available = self.reader.fill_buf()?;
            if available.is_empty() {
                break;
            }
            let (chunk, done) = match memchr(available) {
                Some(position) => (&available[..=position], true),
                None => (available, false),
            };
            observe(chunk);
            let content = if done {
                &chunk[..chunk.len() - 1]
            } else {
                chunk
            };
            if !too_long {
                if buffer.len() + content.len() > self.max {
                    too_long = true;
                    buffer.clear();
                } else {
                    buffer.extend_from_slice(content);
                }
            }
            let consumed = chunk.len();
            length += consumed as u64;
            self.reader.consume(consumed);
            if done {
                break;
            }
        }
        if length == 0 {
            return Ok(None);
        }
        self.number += 1;
        self.offset += length;
        Ok(Some(LineInfo {
            number: self.number,
            offset: start,
            length,
            too_long,
        }))
    }
}

fn memchr(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&byte| byte == b'\n')
}

/// Why a dataset line was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub message: String,
}

/// Stable labels of rejections, written to `invalid.jsonl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    EmptyLine,
    TooLong,
    InvalidUtf8,
    InvalidJson,
    NotAnObject,
    MissingPrompt,
    PromptNotString,
    EmptyPrompt,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EmptyLine => "empty_line",
            Self::TooLong => "too_long",
            Self::InvalidUtf8 => "invalid_utf8",
            Self::InvalidJson => "invalid_json",
            Self::NotAnObject => "not_an_object",
            Self::MissingPrompt => "missing_prompt",
            Self::PromptNotString => "prompt_not_string",
            Self::EmptyPrompt => "empty_prompt",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn reject(reason: Reason, message: impl Into<String>) -> Rejection {
    Rejection {
        reason,
        message: message.into(),
    }
}

/// The checks every line passes before its JSON is looked at.
fn frame_checks<'a>(line: &'a [u8], info: Option<&LineInfo>) -> Result<&'a str, Rejection> {
    if info.is_some_and(|info| info.too_long) {
        return Err(reject(
            Reason::TooLong,
            format!("line is longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let text = std::str::from_utf8(line).map_err(|err| {
        reject(
            Reason::InvalidUtf8,
            format!("invalid UTF-8 at byte {}", err.valid_up_to()),
        )
    })?;
    if text.trim().is_empty() {
        return Err(reject(Reason::EmptyLine, "empty line"));
    }
    Ok(text)
}

/// Validates a line without building its value (the plan's fast path).
pub fn probe_line(line: &[u8], info: &LineInfo, prompt_field: &str) -> Result<(), Rejection> {
    let text = frame_checks(line, Some(info))?;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let found = ProbeSeed {
        field: prompt_field,
    }
    .deserialize(&mut deserializer)
    .and_then(|found| deserializer.end().map(|()| found))
    .map_err(|err| {
        if err.is_data() {
            reject(Reason::NotAnObject, "line is JSON but not an object")
        } else {
            reject(Reason::InvalidJson, format!("invalid JSON: {err}"))
        }
    })?;
    found.into_result(prompt_field).map(|_| ())
}

/// A valid dataset row: its prompt and its other fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub prompt: String,
    pub source: Map<String, Value>,
}

/// Parses a line fully (the batch's path).
pub fn parse_row(line: &[u8], prompt_field: &str) -> Result<Row, Rejection> {
    let text = frame_checks(line, None)?;
    if text.len() > MAX_LINE_BYTES {
        return Err(reject(
            Reason::TooLong,
            format!("line is longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    let value: Value = serde_json::from_str(text)
        .map_err(|err| reject(Reason::InvalidJson, format!("invalid JSON: {err}")))?;
    let Value::Object(mut source) = value else {
        return Err(reject(
            Reason::NotAnObject,
            "line is JSON but not an object",
        ));
    };
    let found = match source.get(prompt_field) {
        Some(value) => Found::Prompt(classify_prompt(value)),
        None => Found::Chat(
            CHAT_FIELDS
                .iter()
                .find_map(|field| source.get(*field).map(chat_prompt))
                .flatten(),
        ),
    };
    let prompt = found.into_result(prompt_field)?;
    if source.get(prompt_field).is_some() {
        source.remove(prompt_field);
    }
    Ok(Row {
        prompt: prompt.into_owned(),
        source,
    })
}

/// Chat-style rows: the first user turn of one of these lists is the prompt.
const CHAT_FIELDS: [&str; 2] = ["conversations", "messages"];

/// What a row offers as its prompt.
enum Found {
    Prompt(PromptValue),
    Chat(Option<String>),
}

enum PromptValue {
    Text(String),
    Other(&'static str),
}

impl Found {
    fn into_result(self, field: &str) -> Result<Cow<'static, str>, Rejection> {
        match self {
            Self::Prompt(PromptValue::Text(text)) if text.trim().is_empty() => Err(reject(
                Reason::EmptyPrompt,
                format!("field {field:?} is an empty string"),
            )),
            Self::Prompt(PromptValue::Text(text)) | Self::Chat(Some(text)) => Ok(Cow::Owned(text)),
            Self::Prompt(PromptValue::Other(kind)) => Err(reject(
                Reason::PromptNotString,
                format!("field {field:?} is {kind}, not a string"),
            )),
            Self::Chat(None) => Err(reject(
                Reason::MissingPrompt,
                format!("no {field:?} field and no user turn in \"conversations\" or \"messages\""),
            )),
        }
    }
}

fn classify_prompt(value: &Value) -> PromptValue {
    match value {
        Value::String(text) => PromptValue::Text(text.clone()),
        Value::Null => PromptValue::Other("null"),
        Value::Bool(_) => PromptValue::Other("a boolean"),
        Value::Number(_) => PromptValue::Other("a number"),
        Value::Array(_) => PromptValue::Other("an array"),
        Value::Object(_) => PromptValue::Other("an object"),
    }
}

/// The first `user`/`human` turn's text of a chat list (`role`/`content` or `from`/`value`).
fn chat_prompt(list: &Value) -> Option<String> {
    list.as_array()?.iter().find_map(|turn| {
        let role = turn.get("role").or_else(|| turn.get("from"))?.as_str()?;
        if role != "user" && role != "human" {
            return None;
        }
        let text = turn
            .get("content")
            .or_else(|| turn.get("value"))?
            .as_str()?;
        (!text.trim().is_empty()).then(|| text.to_owned())
    })
}

/// Walks a JSON object, keeping only the prompt field's value and the chat lists.
struct ProbeSeed<'f> {
    field: &'f str,
}

impl<'de> DeserializeSeed<'de> for ProbeSeed<'_> {
    type Value = Found;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Found, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ProbeSeed<'_> {
    type Value = Found;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut prompt = None;
        let mut chat = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == self.field {
                prompt = Some(classify_prompt(&map.next_value::<Value>()?));
            } else if chat.is_none() && CHAT_FIELDS.contains(&key.as_ref()) {
                chat = chat_prompt(&map.next_value::<Value>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(prompt.map_or(Found::Chat(chat), Found::Prompt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> LineInfo {
        LineInfo {
            number: 1,
            offset: 0,
            length: 1,
            too_long: false,
        }
    }

    fn both(line: &[u8]) -> (Result<(), Reason>, Result<String, Reason>) {
        (
            probe_line(line, &info(), "prompt").map_err(|r| r.reason),
            parse_row(line, "prompt")
                .map(|row| row.prompt)
                .map_err(|r| r.reason),
        )
    }

    #[test]
    fn probe_and_parse_agree_on_every_kind_of_line() {
        let cases: [(&[u8], Result<&str, Reason>); 12] = [
            (br#"{"prompt": "hi", "id": 3}"#, Ok("hi")),
            (br#"{"id": 3, "prompt": "h\u00e9"}"#, Ok("hé")),
            (br#"{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]}"#, Ok("q")),
            (br#"{"messages": [{"role": "user", "content": "m"}]}"#, Ok("m")),
            (b"   ", Err(Reason::EmptyLine)),
            (b"{\"prompt\": \"\xff\"}", Err(Reason::InvalidUtf8)),
            (br#"{"prompt": "x""#, Err(Reason::InvalidJson)),
            (br#"{"prompt": "x"} trailing"#, Err(Reason::InvalidJson)),
            (br#"["prompt"]"#, Err(Reason::NotAnObject)),
            (br#"{"text": "x"}"#, Err(Reason::MissingPrompt)),
            (br#"{"prompt": 42}"#, Err(Reason::PromptNotString)),
            (br#"{"prompt": "  "}"#, Err(Reason::EmptyPrompt)),
        ];
        for (line, expected) in cases {
            let (probe, parse) = both(line);
            assert_eq!(
                parse,
                expected.map(str::to_owned),
                "{}",
                String::from_utf8_lossy(line)
            );
            assert_eq!(
                probe,
                expected.map(|_| ()),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn parse_keeps_the_other_fields_as_source() {
        let row = parse_row(br#"{"prompt": "p", "id": "a1", "answer": 4}"#, "prompt").unwrap();
        assert_eq!(
            serde_json::Value::Object(row.source),
            serde_json::json!({"id": "a1", "answer": 4})
        );
    }

    #[test]
    fn lines_are_framed_with_offsets_and_a_length_cap() {
        let data = b"ab\r\n\nxxxxxxxxxx\nlast";
        let mut reader = LineReader::new(&data[..], 5);
        let mut buffer = Vec::new();
        let mut seen = 0usize;
        let mut lines = Vec::new();
        while let Some(info) = reader
            .next_line(&mut buffer, &mut |bytes| seen += bytes.len())
            .unwrap()
        {
            lines.push((info, buffer.clone()));
        }
        assert_eq!(seen, data.len());
        let summary: Vec<_> = lines
            .iter()
            .map(|(i, b)| (i.number, i.offset, i.too_long, b.clone()))
            .collect();
        assert_eq!(
            summary,
            vec![
                (1, 0, false, b"ab\r".to_vec()),
                (2, 4, false, b"".to_vec()),
                (3, 5, true, b"".to_vec()),
                (4, 16, false, b"last".to_vec()),
            ]
        );
    }
}

//! Reading the JSONL dataset: line framing with a length cap, and the validation rules.
//!
//! The plan step streams the whole file in blocks of whole lines through [`LineBlocks`] and
//! [`probe`] (no value is built, so memory does not depend on the file); a batch re-reads only its
//! own byte range with [`LineReader`] and parses its rows fully with [`parse_row`]. Both frame
//! lines alike and apply the same rules, so a line is valid in one exactly when it is valid in the
//! other.

use std::fmt;
use std::io::{self, BufRead};

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::json_scan;

/// A seed that is its own visitor: it asks the deserializer for what it visits.
macro_rules! seed_by_visiting {
    ($seed:ty, $value:ty, $method:ident) => {
        impl<'de> DeserializeSeed<'de> for $seed {
            type Value = $value;

            fn deserialize<D: Deserializer<'de>>(
                self,
                deserializer: D,
            ) -> Result<$value, D::Error> {
                deserializer.$method(self)
            }
        }
    };
}

/// Lines longer than this are rejected (and never held in memory whole).
pub const MAX_LINE_BYTES: usize = 1024 * 1024;

/// The UTF-8 byte-order mark some editors and exporters put at the start of a file.
pub const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The line as the validation rules see it: without a byte-order mark when it is the file's first
/// line (`offset` is the line's offset in the file), as most JSON Lines readers accept it. The mark
/// stays in the file, its digests and the batch byte ranges; the plan and the batch strip it alike,
/// so a line is valid in one exactly when it is valid in the other.
pub fn without_bom(offset: u64, line: &[u8]) -> &[u8] {
    if offset == 0 {
        line.strip_prefix(UTF8_BOM).unwrap_or(line)
    } else {
        line
    }
}

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
            let (chunk, done) = match memchr::memchr(b'\n', available) {
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

/// A piece of the input handed out by [`LineBlocks`]; it owns its bytes, so it can be handed to
/// another thread.
#[derive(Debug)]
pub enum Block {
    /// Whole lines: each ends with a newline except the input's last line. A line here may still
    /// be longer than the limit; the caller checks lengths.
    Lines(LinesBlock),
    /// One line too long to hold (more than the limit without a newline), of `length` bytes
    /// including its newline. Its content is not kept.
    TooLong { offset: u64, length: u64 },
}

/// Whole lines of the input and the file offset of their first byte.
#[derive(Debug)]
pub struct LinesBlock {
    pub offset: u64,
    buffer: Vec<u8>,
    len: usize,
}

impl LinesBlock {
    pub fn bytes(&self) -> &[u8] {
        &self.buffer[..self.len]
    }
}

/// Reads input in big blocks of whole lines, the plan's fast path: lines are slices of a block
/// (no copy per line), and `observe` sees every byte in block-sized slices (fast for digests).
/// Memory is a few buffers of the block size plus the line limit; hand blocks back with
/// [`LineBlocks::recycle`] to reuse them.
#[derive(Debug)]
pub struct LineBlocks<R> {
    reader: R,
    /// `buffer[..filled]` holds bytes not handed out yet, of which `buffer[..scanned]` are known
    /// to hold no newline (the start of a line whose end has not been read).
    buffer: Vec<u8>,
    filled: usize,
    scanned: usize,
    /// File offset of `buffer[0]`.
    offset: u64,
    max: usize,
    block: usize,
    spare: Vec<Vec<u8>>,
}

impl<R: io::Read> LineBlocks<R> {
    /// Reads of about `block` bytes; lines of more than `max` bytes are reported as too long.
    pub fn new(reader: R, block: usize, max: usize) -> Self {
        Self {
            reader,
            buffer: Vec::new(),
            filled: 0,
            scanned: 0,
            offset: 0,
            max,
            block: block.max(1),
            spare: Vec::new(),
        }
    }

    /// Gives a block's buffer back for reuse.
    pub fn recycle(&mut self, block: Block) {
        if let Block::Lines(lines) = block
            && self.spare.len() < 4
        {
            self.spare.push(lines.buffer);
        }
    }

    fn fresh_buffer(&mut self) -> Vec<u8> {
        let capacity = self.block + self.max + 1;
        let mut buffer = self.spare.pop().unwrap_or_default();
        // Reused buffers keep their length, so they are not zeroed again.
        if buffer.len() < capacity {
            buffer.resize(capacity, 0);
        }
        buffer
    }

    /// Hands out `buffer[..end]`, keeping `buffer[end..filled]` (a partial line) in a fresh buffer.
    fn hand_out(&mut self, end: usize) -> Block {
        let mut fresh = self.fresh_buffer();
        fresh[..self.filled - end].copy_from_slice(&self.buffer[end..self.filled]);
        let buffer = std::mem::replace(&mut self.buffer, fresh);
        let offset = self.offset;
        self.filled -= end;
        self.scanned = self.filled;
        self.offset += end as u64;
        Block::Lines(LinesBlock {
            offset,
            buffer,
            len: end,
        })
    }

    /// The next block, or `None` at the end of the input.
    pub fn next_block(&mut self, observe: &mut impl FnMut(&[u8])) -> io::Result<Option<Block>> {
        if self.buffer.len() < self.block + self.max + 1 {
            self.buffer = self.fresh_buffer();
        }
        loop {
            let start = self.filled;
            let room = self.buffer.len().min(start + self.block);
            let read = read_some(&mut self.reader, &mut self.buffer[start..room])?;
            self.filled += read;
            observe(&self.buffer[start..self.filled]);
            if let Some(last) = memchr::memrchr(b'\n', &self.buffer[self.scanned..self.filled]) {
                return Ok(Some(self.hand_out(self.scanned + last + 1)));
            }
            self.scanned = self.filled;
            if read == 0 {
                // The end: what is left is the last line, without a newline.
                return Ok(match self.filled {
                    0 => None,
                    length if length > self.max => {
                        let offset = self.offset;
                        self.offset += length as u64;
                        (self.filled, self.scanned) = (0, 0);
                        Some(Block::TooLong {
                            offset,
                            length: length as u64,
                        })
                    }
                    length => Some(self.hand_out(length)),
                });
            }
            if self.filled > self.max {
                return self.skip_long_line(observe).map(Some);
            }
        }
    }

    /// Reads past a line that does not fit (the buffer holds its first `filled` bytes).
    fn skip_long_line(&mut self, observe: &mut impl FnMut(&[u8])) -> io::Result<Block> {
        let offset = self.offset;
        let mut length = self.filled as u64;
        (self.filled, self.scanned) = (0, 0);
        loop {
            let read = read_some(&mut self.reader, &mut self.buffer[..self.block])?;
            observe(&self.buffer[..read]);
            if read == 0 {
                break;
            }
            if let Some(position) = memchr::memchr(b'\n', &self.buffer[..read]) {
                length += position as u64 + 1;
                // The rest starts the next line.
                self.buffer.copy_within(position + 1..read, 0);
                self.filled = read - position - 1;
                break;
            }
            length += read as u64;
        }
        self.offset = offset + length;
        Ok(Block::TooLong { offset, length })
    }
}

/// One `read`, retried when interrupted.
fn read_some(reader: &mut impl io::Read, buffer: &mut [u8]) -> io::Result<usize> {
    loop {
        match reader.read(buffer) {
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            result => return result,
        }
    }
}

/// Why a dataset line was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectionReason,
    pub message: String,
}

/// Stable labels of rejections, written to `invalid.jsonl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectionReason {
    EmptyLine,
    TooLong,
    InvalidUtf8,
    InvalidJson,
    NotAnObject,
    MissingPrompt,
    PromptNotString,
    EmptyPrompt,
    InvalidTurns,
}

impl RejectionReason {
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
            Self::InvalidTurns => "invalid_turns",
        }
    }
}

impl fmt::Display for RejectionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn reject(reason: RejectionReason, message: impl Into<String>) -> Rejection {
    Rejection {
        reason,
        message: message.into(),
    }
}

/// The checks every line passes before its JSON is looked at.
fn frame_checks(line: &[u8], too_long: bool) -> Result<&str, Rejection> {
    if too_long {
        return Err(reject(
            RejectionReason::TooLong,
            format!("line is longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // The SIMD check is the fast path; std's finds where the error is.
    let text = simdutf8::basic::from_utf8(line).or_else(|_| {
        std::str::from_utf8(line).map_err(|err| {
            reject(
                RejectionReason::InvalidUtf8,
                format!("invalid UTF-8 at byte {}", err.valid_up_to()),
            )
        })
    })?;
    if text.trim().is_empty() {
        return Err(reject(RejectionReason::EmptyLine, "empty line"));
    }
    Ok(text)
}

/// Validates a line without building its value (the plan's fast path).
pub fn probe_line(line: &[u8], info: &LineInfo, prompt_field: &str) -> Result<(), Rejection> {
    probe(line, info.too_long, prompt_field)
}

/// [`probe_line`] for a line known only by its content and whether it was too long to keep.
pub fn probe(line: &[u8], too_long: bool, prompt_field: &str) -> Result<(), Rejection> {
    probe_image(line, too_long, prompt_field).map(drop)
}

/// The fields in which the reference's datasets name a prompt's own sandbox image; `image` wins
/// when a row has both.
pub const IMAGE_FIELDS: [&str; 2] = ["image", "docker_image"];

/// [`probe`], and the image the row names for itself (a string in one of [`IMAGE_FIELDS`]), if
/// any: the plan lists the rows whose image the run does not honour.
pub fn probe_image(
    line: &[u8],
    too_long: bool,
    prompt_field: &str,
) -> Result<Option<String>, Rejection> {
    let text = frame_checks(line, too_long)?;
    let mut images = [None, None];
    if surely_valid(text, prompt_field, &mut images) {
        return Ok(images.into_iter().flatten().next().map(str::to_owned));
    }
    probe_slowly(text, prompt_field)?;
    // Rare: a valid line the fast path was unsure of. Its image is read by a parse of its own.
    let images: Images = serde_json::from_str(text)
        .map_err(|err| reject(RejectionReason::InvalidJson, format!("invalid JSON: {err}")))?;
    Ok([images.image, images.docker_image]
        .into_iter()
        .flatten()
        .find_map(|image| match image {
            Value::String(image) => Some(image),
            _ => None,
        }))
}

/// Where a row's conversation starts in its image: its `cwd`, when that is a non-empty string.
pub fn row_cwd(source: &Map<String, Value>) -> Option<String> {
    match source.get("cwd") {
        Some(Value::String(cwd)) if !cwd.is_empty() => Some(cwd.clone()),
        _ => None,
    }
}

/// The [`IMAGE_FIELDS`] of a row.
#[derive(serde::Deserialize)]
struct Images {
    image: Option<Value>,
    docker_image: Option<Value>,
}

/// The full check of a line the fast path was unsure of.
fn probe_slowly(text: &str, prompt_field: &str) -> Result<(), Rejection> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let (found, turns) = ProbeSeed {
        field: prompt_field,
    }
    .deserialize(&mut deserializer)
    .and_then(|found| deserializer.end().map(|()| found))
    .map_err(|err| {
        if err.is_data() {
            reject(
                RejectionReason::NotAnObject,
                "line is JSON but not an object",
            )
        } else {
            reject(RejectionReason::InvalidJson, format!("invalid JSON: {err}"))
        }
    })?;
    let turns = match turns {
        Some(value) => {
            episode_turns(&value).map_err(|why| reject(RejectionReason::InvalidTurns, why))?
        }
        None => Vec::new(),
    };
    if matches!(found, Found::Chat(_)) && !turns.is_empty() {
        return Ok(());
    }
    found.into_result(prompt_field)?;
    Ok(())
}

/// The plan's fast path: `true` only for a line that [`parse_row`] accepts, `false` when unsure
/// (then the line goes through the full check, which also words the rejection).
///
/// [`json_scan`] vouches for the line's JSON (it is unsure of whatever a full parse may refuse
/// beyond syntax); what is left is the prompt: present, a string, and not blank. A `\u` escape in
/// the prompt (it could unescape to whitespace), a key written with escapes (it could unescape to
/// the prompt field) and a chat field (rare; the full check reads them) are left to the full check.
///
/// The values of the [`IMAGE_FIELDS`] go into `images`, in that order, when they are strings
/// without escapes (anything else is left to the full check).
fn surely_valid<'t>(text: &'t str, prompt_field: &str, images: &mut [Option<&'t str>; 2]) -> bool {
    let mut prompt = false;
    json_scan::object_line(text.as_bytes(), |field| {
        if field.is(prompt_field) {
            prompt = true;
            let literal = &text[field.value.clone()];
            literal.starts_with('"') && !field.unicode_escape && !blank_string(literal)
        } else if let Some(slot) = IMAGE_FIELDS.iter().position(|name| field.is(name)) {
            let literal = &text[field.value.clone()];
            let plain = literal.starts_with('"') && !literal.contains('\\');
            if plain {
                images[slot] = Some(&literal[1..literal.len() - 1]);
            }
            plain
        } else {
            !field.key_escaped
                && !CHAT_FIELDS.iter().any(|chat| field.is(chat))
                && !field.is(TURNS_FIELD)
        }
    }) && prompt
}

/// Whether a string literal without `\u` escapes is blank once unescaped (as `str::trim` sees
/// it); usually decided by its first character.
fn blank_string(literal: &str) -> bool {
    let mut rest = &literal[1..literal.len() - 1];
    loop {
        let mut chars = rest.chars();
        match chars.next() {
            None => return true,
            Some('\\') => match chars.next() {
                Some('n' | 't' | 'r' | 'f') => rest = chars.as_str(),
                _ => return false,
            },
            Some(other) if other.is_whitespace() => rest = chars.as_str(),
            Some(_) => return false,
        }
    }
}

/// A valid dataset row: its prompt and its other fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub prompt: String,
    /// The row's user turns after the prompt, answered in order in one environment (an episode;
    /// see [`TURNS_FIELD`]); empty for a row of one prompt.
    pub follow_ups: Vec<String>,
    pub source: Map<String, Value>,
}

/// Parses a line fully (the batch's path).
pub fn parse_row(line: &[u8], prompt_field: &str) -> Result<Row, Rejection> {
    let text = frame_checks(line, false)?;
    if text.len() > MAX_LINE_BYTES {
        return Err(reject(
            RejectionReason::TooLong,
            format!("line is longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    let value: Value = serde_json::from_str(text)
        .map_err(|err| reject(RejectionReason::InvalidJson, format!("invalid JSON: {err}")))?;
    let Value::Object(mut source) = value else {
        return Err(reject(
            RejectionReason::NotAnObject,
            "line is JSON but not an object",
        ));
    };
    let mut turns = match source.remove(TURNS_FIELD) {
        Some(value) => {
            episode_turns(&value).map_err(|why| reject(RejectionReason::InvalidTurns, why))?
        }
        None => Vec::new(),
    };
    if !source.contains_key(prompt_field) && !turns.is_empty() {
        // MT-Bench's shape: the first of the turns is the prompt.
        let prompt = turns.remove(0);
        return Ok(Row {
            prompt,
            follow_ups: turns,
            source,
        });
    }
    let found = match source.get(prompt_field) {
        Some(value) => Found::Prompt(classify_prompt(value)),
        None => Found::Chat(
            CHAT_FIELDS
                .iter()
                .find_map(|field| source.get(*field).map(chat_prompt))
                .flatten(),
        ),
    };
    let prompt = match found.into_result(prompt_field)? {
        Prompt::Field(text) | Prompt::Chat(text) => text,
    };
    if source.get(prompt_field).is_some() {
        source.remove(prompt_field);
    }
    Ok(Row {
        prompt,
        follow_ups: turns,
        source,
    })
}

/// The field of a row that makes it an **episode**: its user turns in order, each a string, or a
/// list of `{role, content}` messages whose user contents make the turn (BFCL's multi-turn
/// `question` shape). With the prompt field beside it, they follow the prompt (devops-bench's
/// `prompt` + `turns`); without, the first is the prompt (MT-Bench's `turns`).
pub const TURNS_FIELD: &str = "turns";

/// The texts of a row's [`TURNS_FIELD`], or why it has none that can be sent.
fn episode_turns(value: &Value) -> Result<Vec<String>, String> {
    let Value::Array(turns) = value else {
        return Err(format!(
            "field {TURNS_FIELD:?} is {}, not an array of user turns",
            kind_of(value)
        ));
    };
    turns
        .iter()
        .enumerate()
        .map(|(index, turn)| {
            let text = match turn {
                Value::String(text) => Some(text.clone()),
                Value::Array(messages) => {
                    let users: Vec<&str> = messages
                        .iter()
                        .filter(|message| {
                            let role = message.get("role").or_else(|| message.get("from"));
                            matches!(role.and_then(Value::as_str), Some("user" | "human"))
                        })
                        .filter_map(|message| {
                            message
                                .get("content")
                                .or_else(|| message.get("value"))?
                                .as_str()
                        })
                        .collect();
                    Some(users.join("\n\n"))
                }
                _ => None,
            };
            text.filter(|text| !text.trim().is_empty()).ok_or_else(|| {
                format!(
                    "{TURNS_FIELD}[{index}] is {}: a user turn is a non-empty string or a list \
                     of messages with a user one",
                    kind_of(turn)
                )
            })
        })
        .collect()
}

/// How a rejection names a JSON value's kind.
fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::String(text) if text.trim().is_empty() => "an empty string",
        Value::String(_) => "a string",
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::Array(items) if items.is_empty() => "an empty array",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Chat-style rows: the first user turn of one of these lists is the prompt.
const CHAT_FIELDS: [&str; 2] = ["conversations", "messages"];

/// What a row offers as its prompt: the prompt field's value (its text of type `T`), or the
/// first user turn of a chat list.
enum Found<T> {
    Prompt(PromptValue<T>),
    Chat(Option<String>),
}

enum PromptValue<T> {
    Text(T),
    Other(&'static str),
}

/// The prompt a valid row has.
enum Prompt<T> {
    Field(T),
    Chat(String),
}

/// Prompt text as kept: the whole string when parsing, only whether it is blank when probing.
trait PromptText {
    fn is_blank(&self) -> bool;
}

impl PromptText for String {
    fn is_blank(&self) -> bool {
        self.trim().is_empty()
    }
}

/// What probing keeps of a prompt string.
struct Probed {
    blank: bool,
}

impl PromptText for Probed {
    fn is_blank(&self) -> bool {
        self.blank
    }
}

impl<T: PromptText> Found<T> {
    fn into_result(self, field: &str) -> Result<Prompt<T>, Rejection> {
        match self {
            Self::Prompt(PromptValue::Text(text)) if text.is_blank() => Err(reject(
                RejectionReason::EmptyPrompt,
                format!("field {field:?} is an empty string"),
            )),
            Self::Prompt(PromptValue::Text(text)) => Ok(Prompt::Field(text)),
            Self::Chat(Some(text)) => Ok(Prompt::Chat(text)),
            Self::Prompt(PromptValue::Other(kind)) => Err(reject(
                RejectionReason::PromptNotString,
                format!("field {field:?} is {kind}, not a string"),
            )),
            Self::Chat(None) => Err(reject(
                RejectionReason::MissingPrompt,
                format!("no {field:?} field and no user turn in \"conversations\" or \"messages\""),
            )),
        }
    }
}

fn classify_prompt(value: &Value) -> PromptValue<String> {
    match value {
        Value::String(text) => PromptValue::Text(text.clone()),
        Value::Null => PromptValue::Other("null"),
        Value::Bool(_) => PromptValue::Other("a boolean"),
        Value::Number(_) => PromptValue::Other("a number"),
        Value::Array(_) => PromptValue::Other("an array"),
        Value::Object(_) => PromptValue::Other("an object"),
    }
}

/// Checks a value as parsing it into a [`Value`] would, without building it: every value goes
/// through `deserialize_any` like [`Value`]'s own, so strings are unescaped (lone surrogates
/// refused), numbers converted (out-of-range ones refused) and nesting counted (deeper than
/// `serde_json`'s limit refused) exactly as in the batch's full parse. (Skipping with
/// `IgnoredAny` is faster but lets all three through, and a line the plan counts but the batch
/// drops would fail that batch on every retry.)
struct Validate;

seed_by_visiting!(Validate, (), deserialize_any);

impl<'de> Visitor<'de> for Validate {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Validate)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key_seed(Validate)?.is_some() {
            map.next_value_seed(Validate)?;
        }
        Ok(())
    }
}

/// Classifies the prompt field's value as [`classify_prompt`] does, without building it: a string
/// is looked at where it lies (or in serde's scratch buffer), containers are skipped.
struct ProbePrompt;

seed_by_visiting!(ProbePrompt, PromptValue<Probed>, deserialize_any);

impl<'de> Visitor<'de> for ProbePrompt {
    type Value = PromptValue<Probed>;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_str<E>(self, text: &str) -> Result<Self::Value, E> {
        Ok(PromptValue::Text(Probed {
            blank: text.trim().is_empty(),
        }))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(PromptValue::Other("null"))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(PromptValue::Other("a boolean"))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(PromptValue::Other("a number"))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(PromptValue::Other("a number"))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(PromptValue::Other("a number"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Validate.visit_seq(seq)?;
        Ok(PromptValue::Other("an array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Validate.visit_map(map)?;
        Ok(PromptValue::Other("an object"))
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

/// What a key of a row names.
enum Key {
    Prompt,
    Chat,
    Turns,
    Other,
}

/// Classifies a key where it lies (no string is allocated for it).
struct KeyKind<'f> {
    field: &'f str,
}

seed_by_visiting!(KeyKind<'_>, Key, deserialize_str);

impl Visitor<'_> for KeyKind<'_> {
    type Value = Key;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<Key, E> {
        Ok(if key == self.field {
            Key::Prompt
        } else if CHAT_FIELDS.contains(&key) {
            Key::Chat
        } else if key == TURNS_FIELD {
            Key::Turns
        } else {
            Key::Other
        })
    }
}

/// Walks a JSON object, keeping only the prompt field's value, the chat lists and the turns.
struct ProbeSeed<'f> {
    field: &'f str,
}

seed_by_visiting!(
    ProbeSeed<'_>,
    (Found<Probed>, Option<Value>),
    deserialize_map
);

impl<'de> Visitor<'de> for ProbeSeed<'_> {
    type Value = (Found<Probed>, Option<Value>);

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut prompt, mut chat, mut turns) = (None, None, None);
        while let Some(key) = map.next_key_seed(KeyKind { field: self.field })? {
            match key {
                Key::Prompt => prompt = Some(map.next_value_seed(ProbePrompt)?),
                Key::Chat if chat.is_none() => chat = chat_prompt(&map.next_value::<Value>()?),
                Key::Turns => turns = Some(map.next_value::<Value>()?),
                Key::Chat | Key::Other => map.next_value_seed(Validate)?,
            }
        }
        Ok((prompt.map_or(Found::Chat(chat), Found::Prompt), turns))
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

    fn both(line: &[u8]) -> (Result<(), RejectionReason>, Result<String, RejectionReason>) {
        (
            probe_line(line, &info(), "prompt").map_err(|r| r.reason),
            parse_row(line, "prompt")
                .map(|row| row.prompt)
                .map_err(|r| r.reason),
        )
    }

    #[test]
    fn probe_refuses_what_only_a_full_parse_notices() {
        let deep = format!(
            "{{\"prompt\": \"p\", \"x\": {}{}}}",
            "[".repeat(200),
            "]".repeat(200)
        );
        let lines: [&[u8]; 4] = [
            br#"{"prompt": "p", "x": "\ud800"}"#,
            br#"{"prompt": "p", "x": 1e400}"#,
            br#"{"prompt": "p", "x": -2E+999}"#,
            deep.as_bytes(),
        ];
        for line in lines {
            let info = LineInfo {
                number: 1,
                offset: 0,
                length: 1,
                too_long: false,
            };
            assert!(
                parse_row(line, "prompt").is_err(),
                "{}",
                String::from_utf8_lossy(line)
            );
            assert!(
                probe_line(line, &info, "prompt").is_err(),
                "{}",
                String::from_utf8_lossy(&line[..40])
            );
        }
        let fine = br#"{"prompt": "e 123 and \u00e9", "x": 1e300, "y": "the 2e5 cases"}"#;
        assert!(probe(fine, false, "prompt").is_ok());
        assert!(parse_row(fine, "prompt").is_ok());
    }

    #[test]
    fn probe_and_parse_agree_on_every_kind_of_line() {
        let cases: [(&[u8], Result<&str, RejectionReason>); 27] = [
            (br#"{"prompt": "hi", "id": 3}"#, Ok("hi")),
            (br#"{"prompt": "a\"b\u00e9\n", "x": [1, {"y": null}]}"#, Ok("a\"b\u{e9}\n")),
            (br#"{"prompt": "\n\t "}"#, Err(RejectionReason::EmptyPrompt)),
            (br#"{"prompt": null}"#, Err(RejectionReason::PromptNotString)),
            (br#"{"prompt": true}"#, Err(RejectionReason::PromptNotString)),
            (br#"{"prompt": -1.5e3}"#, Err(RejectionReason::PromptNotString)),
            (br#"{"prompt": [1, {"a": "b"}]}"#, Err(RejectionReason::PromptNotString)),
            (br#"{"prompt": {"text": "x"}}"#, Err(RejectionReason::PromptNotString)),
            (br#"{"prompt": [1, }"#, Err(RejectionReason::InvalidJson)),
            (br#"{"id": 3, "prompt": "h\u00e9"}"#, Ok("hé")),
            (br#"{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]}"#, Ok("q")),
            (br#"{"messages": [{"role": "user", "content": "m"}]}"#, Ok("m")),
            (b"   ", Err(RejectionReason::EmptyLine)),
            (b"{\"prompt\": \"\xff\"}", Err(RejectionReason::InvalidUtf8)),
            (br#"{"prompt": "x""#, Err(RejectionReason::InvalidJson)),
            (br#"{"prompt": "x"} trailing"#, Err(RejectionReason::InvalidJson)),
            (br#"["prompt"]"#, Err(RejectionReason::NotAnObject)),
            (br#"{"text": "x"}"#, Err(RejectionReason::MissingPrompt)),
            (br#"{"prompt": 42}"#, Err(RejectionReason::PromptNotString)),
            (br#"{"prompt": "  "}"#, Err(RejectionReason::EmptyPrompt)),
            (br#"{"prompt": "p", "turns": ["q", "r"]}"#, Ok("p")),
            (br#"{"turns": ["q", [{"role": "user", "content": "r"}]]}"#, Ok("q")),
            (br#"{"turns": []}"#, Err(RejectionReason::MissingPrompt)),
            (br#"{"turns": "q"}"#, Err(RejectionReason::InvalidTurns)),
            (br#"{"prompt": "p", "turns": ["q", " "]}"#, Err(RejectionReason::InvalidTurns)),
            (br#"{"prompt": "p", "turns": [[{"role": "assistant", "content": "a"}]]}"#, Err(RejectionReason::InvalidTurns)),
            (br#"{"prompt": 42, "turns": ["q"]}"#, Err(RejectionReason::PromptNotString)),
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
    fn turns_follow_the_prompt_or_begin_with_it_and_a_bad_one_is_named() {
        let after = parse_row(
            br#"{"prompt": "p", "turns": ["q", "r"], "id": 1}"#,
            "prompt",
        );
        let after = after.unwrap();
        assert_eq!(
            (after.prompt.as_str(), after.follow_ups.as_slice()),
            ("p", &["q".to_owned(), "r".to_owned()][..])
        );
        assert_eq!(
            serde_json::Value::Object(after.source),
            serde_json::json!({"id": 1})
        );
        // BFCL's shape: each turn a list of messages, its user contents the turn.
        let bfcl = br#"{"turns": [[{"role": "user", "content": "a"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]]}"#;
        let bfcl = parse_row(bfcl, "prompt").unwrap();
        assert_eq!(
            (bfcl.prompt.as_str(), bfcl.follow_ups.as_slice()),
            ("a", &["b\n\nc".to_owned()][..])
        );
        let bad = parse_row(br#"{"prompt": "p", "turns": ["q", 7]}"#, "prompt").unwrap_err();
        assert_eq!(bad.reason, RejectionReason::InvalidTurns);
        assert!(
            bad.message.contains("turns[1] is a number"),
            "{}",
            bad.message
        );
    }

    /// A framed line: offset, length, too long, content.
    type Framed = (u64, u64, bool, Vec<u8>);

    /// Lines as [`LineReader`] frames them.
    fn reader_lines(data: &[u8], max: usize) -> Vec<Framed> {
        let mut reader = LineReader::new(data, max);
        let mut buffer = Vec::new();
        let mut lines = Vec::new();
        while let Some(info) = reader.next_line(&mut buffer, &mut |_| {}).unwrap() {
            lines.push((info.offset, info.length, info.too_long, buffer.clone()));
        }
        lines
    }

    /// Lines as the plan frames [`LineBlocks`]' blocks, and every byte `observe` saw.
    fn block_lines(data: &[u8], block: usize, max: usize) -> (Vec<Framed>, Vec<u8>) {
        let mut blocks = LineBlocks::new(data, block, max);
        let mut seen = Vec::new();
        let mut lines = Vec::new();
        while let Some(piece) = blocks
            .next_block(&mut |bytes| seen.extend_from_slice(bytes))
            .unwrap()
        {
            match &piece {
                Block::TooLong { offset, length } => lines.push((*offset, *length, true, vec![])),
                Block::Lines(block) => {
                    let bytes = block.bytes();
                    let mut position = 0;
                    while position < bytes.len() {
                        let (end, next) = match memchr::memchr(b'\n', &bytes[position..]) {
                            Some(newline) => (position + newline, position + newline + 1),
                            None => (bytes.len(), bytes.len()),
                        };
                        let content = &bytes[position..end];
                        let too_long = content.len() > max;
                        lines.push((
                            block.offset + position as u64,
                            (next - position) as u64,
                            too_long,
                            if too_long { vec![] } else { content.to_vec() },
                        ));
                        position = next;
                    }
                }
            }
            blocks.recycle(piece);
        }
        (lines, seen)
    }

    /// JSON-like text: values that parse, values only a full parse refuses (lone surrogates,
    /// numbers beyond `f64`, nesting past 128) and values that do not parse at all.
    fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("0".to_owned()),
            Just("-0.5e-3".to_owned()),
            Just("1e300".to_owned()),
            Just("1e400".to_owned()),
            Just("-2E+999".to_owned()),
            Just("18446744073709551616".to_owned()),
            Just(format!("1{}", "0".repeat(400))),
            Just("01".to_owned()),
            Just("1.".to_owned()),
            Just(r#""\ud800""#.to_owned()),
            Just(r#""\udc00x""#.to_owned()),
            Just(r#""\ud83d\ude00""#.to_owned()),
            Just(r#""a\"b\\n\u00e9""#.to_owned()),
            Just("\"\u{1}\"".to_owned()),
            Just(r#""\x""#.to_owned()),
            Just("\"é\"".to_owned()),
            Just(r#"" \n\t""#.to_owned()),
            Just(r#""\f\r x""#.to_owned()),
            Just(r#""\b""#.to_owned()),
            Just(r#""\/""#.to_owned()),
            Just("\"\u{3000}\u{a0}\"".to_owned()),
            Just("\"\u{3000}x\"".to_owned()),
            "[a-z ]{0,5}".prop_map(|text| format!("\"{text}\"")),
        ];
        let value = leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4)
                    .prop_map(|items| format!("[{}]", items.join(", "))),
                proptest::collection::vec(("[a-z]{1,3}|prompt", inner), 0..4).prop_map(|entries| {
                    let entries: Vec<String> = entries
                        .iter()
                        .map(|(key, value)| format!("\"{key}\": {value}"))
                        .collect();
                    format!("{{{}}}", entries.join(", "))
                }),
            ]
        });
        // Deep wrappers around the limit of 128 levels.
        (value, 0usize..3, 120usize..134).prop_map(|(value, deep, levels)| {
            if deep == 0 {
                format!("{}{value}{}", "[".repeat(levels), "]".repeat(levels))
            } else {
                value
            }
        })
    }

    proptest::proptest! {
        // Many cases: the combinations that matter (a valid prompt beside a value only the full
        // parse refuses) are a small share of the random lines.
        #![proptest_config(proptest::test_runner::Config::with_cases(4000))]
        #[test]
        fn probe_accepts_exactly_what_the_full_parse_accepts(
            prompt in proptest::prop_oneof![
                3 => proptest::strategy::Strategy::prop_map("[a-z\\\\n ]{0,8}", |text| format!("\"{text}\"")),
                1 => json_text(),
            ],
            other in json_text(),
            more in json_text(),
            prompt_first in proptest::bool::ANY,
        ) {
            let line = if prompt_first {
                format!("{{\"prompt\": {prompt}, \"x\": {other}, \"y\": {more}}}")
            } else {
                format!("{{\"x\": {other}, \"prompt\": {prompt}, \"y\": {more}}}")
            };
            let probed = probe(line.as_bytes(), false, "prompt").map_err(|r| r.reason);
            let parsed = parse_row(line.as_bytes(), "prompt").map(|_| ()).map_err(|r| r.reason);
            proptest::prop_assert_eq!(probed, parsed, "{}", line);
        }
    }

    proptest::proptest! {
        #[test]
        fn blocks_frame_lines_as_the_line_reader_does(
            lines in proptest::collection::vec((0usize..60, proptest::bool::ANY), 0..40),
            trailing_newline in proptest::bool::ANY,
            block in 1usize..40,
        ) {
            let mut data = Vec::new();
            for (index, (length, crlf)) in lines.iter().enumerate() {
                data.extend((0..*length).map(|i| b'a' + u8::try_from((index + i) % 26).unwrap()));
                if *crlf {
                    data.push(b'\r');
                }
                if index + 1 < lines.len() || trailing_newline {
                    data.push(b'\n');
                }
            }
            let (framed, seen) = block_lines(&data, block, 16);
            proptest::prop_assert_eq!(framed, reader_lines(&data, 16));
            proptest::prop_assert_eq!(seen, data);
        }
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

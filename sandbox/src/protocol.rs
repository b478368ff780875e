//! What the worker and the sandbox server say to each other over the Unix socket.
//!
//! One connection per command or session. The worker writes one request as a JSON line; the
//! server answers with frames: a kind byte, a big-endian `u32` length, the payload.
//!
//! - **A command** (version 1, the only kind before sessions; its line is a bare [`Request`],
//!   without a `version`): frames of the command's output as it comes ([`OUTPUT`]), then one
//!   [`EXIT`] frame with the exit code (a big-endian `i32`: the shell's, `128 + N` for a signal
//!   N, or [`crate::REFUSED_EXIT`] with the reason in the output).
//! - **A session** (version 2: `{"version": 2, "request": {"session": {…}}}`, a
//!   [`Versioned`] line): one long-lived program ([`SessionRequest`]: an MCP stdio server,
//!   Chromium), confined like a command but with a private writable directory of its own
//!   instead of a workspace. Then the connection carries frames both ways: [`STDIN`] from the
//!   worker to the program's standard input, [`OUTPUT`] from its
//!   standard output and [`STDERR`] from its standard error, and with `cdpPipe` its
//!   `--remote-debugging-pipe` descriptors: [`CDP`] frames from the worker go to its fd 3, its
//!   fd 4 comes back in [`CDP`] frames (bytes as written: NUL-delimited messages that a frame
//!   may cut anywhere). When the program exits, [`EXIT`] ends the connection; a refused session
//!   is a [`STDERR`] frame saying why, then [`EXIT`] with [`crate::REFUSED_EXIT`].
//!
//! - **Version 3** adds to sessions what a conversation's shell and its background jobs need:
//!   [`SessionRequest::workspace`] (run in the conversation's workspace, writable, instead of a
//!   private directory) and [`SessionRequest::cwd`] (where the program starts); a [`PID`] frame
//!   from the server once the program runs; an empty [`STDIN`] frame, which closes the program's
//!   standard input once what was sent before it is written; and an [`INTERRUPT`] frame, which
//!   kills every process the program started but not the program itself (a foreground command
//!   that ran out of time, while the shell that ran it lives on); and a [`CHECK`] frame, which
//!   checks the limits at once (a command of the shell has ended: a file that `RLIMIT_FSIZE` cut
//!   short leaves the workspace past its limit) and is answered by a [`CHECKED`] frame when
//!   they hold, by the end of the program when they do not.
//!
//! - **Version 4** adds a file tool's call ([`FileRequest`]), for a conversation in a task
//!   container, whose files only the container sees: the server runs it under an executor of its
//!   own ([`crate::file`]), confined as a command is, and answers like a command, with
//!   [`OUTPUT`] frames of one JSON object (`{"ok": result}` or `{"error": message}`) and an
//!   [`EXIT`] frame (0, or [`crate::REFUSED_EXIT`] with the reason in the output).
//!
//! - **Version 5** adds a verifier's steps ([`VerifierRequest`]), run in the environment a
//!   finished conversation left (its workspace, or its task container): replacing the tests'
//!   and the reward's directories by fresh ones and unpacking the tests into them, and reading
//!   the reward file after the verifier's command (a version 1 command) ran. The server runs
//!   each under an executor of its own ([`crate::verifier`]), confined as a command is, and
//!   answers as it answers a file call.
//!
//! - **Version 6** adds the [`STOPPED_WAITING`] frame: a caller that checks the limits at each
//!   command's end learns that a stop came while its shell waited, even when its next command
//!   was already on its way, so that the command runs in a new shell instead of being blamed
//!   for a limit its shell's jobs went past. The frame goes to every caller that checks: the
//!   executor a worker talks to is always the one its own release installs (a pod's
//!   `install-executor` init container copies it from the worker's image; a local run starts
//!   the one beside the worker), so both sides speak the same version.
//!
//! - **Version 7** gives the [`CHECKED`] frame a payload: empty when the limits hold with room,
//!   else a UTF-8 note for the model on a limit the shell is past through no fault of the
//!   command that just ended (a workspace a background job filled, which stops only a command
//!   that makes it grow). A caller of version 6 ignored the payload, and one of version 7 reads
//!   an empty payload from an older server as no note.
//!
//! The worker closing the connection early (a timeout, a cancelled conversation, a session no
//! longer needed) asks the server to end the command or program and everything it started. A
//! server older than sessions refuses a versioned line as a bad request (unknown field).

use std::collections::BTreeMap;

use crate::files::FileLimits;
use crate::{LandlockMode, Limits};

/// The newest protocol version this side speaks.
pub const VERSION: u32 = 7;

/// Frames of a session's standard input (worker to server).
pub const STDIN: u8 = b'i';
/// Frames of a session's standard error (server to worker).
pub const STDERR: u8 = b'e';
/// Frames of a session's `DevTools` pipe, both ways (fd 3 in, fd 4 out, for the program).
pub const CDP: u8 = b'c';

/// The program's process id, once it runs (server to worker; a big-endian `i32`). The id is
/// the sandbox's: in a pod, the sandbox container's process namespace, which the program's own
/// commands see.
pub const PID: u8 = b'p';
/// Kill every descendant of the program, not the program (worker to server; empty payload).
pub const INTERRUPT: u8 = b'k';
/// Check the limits now (worker to server; empty payload).
pub const CHECK: u8 = b'l';
/// The limits held at a [`CHECK`] (server to worker): since version 7 a UTF-8 note for the
/// model when the workspace is still past its limit without the command being at fault, empty
/// otherwise (and always before).
pub const CHECKED: u8 = b'L';
/// The limits were exceeded while the program, a shell whose caller [`CHECK`]s at each
/// command's end, waited for its next command (server to worker; empty payload; before the
/// reason and the [`EXIT`]): what its background jobs did, and nothing the caller sent since
/// its last check reached the shell.
pub const STOPPED_WAITING: u8 = b'w';

/// A frame of command output (stdout and stderr, interleaved as written).
pub const OUTPUT: u8 = b'o';
/// The last frame: the exit code.
pub const EXIT: u8 = b'x';

/// Bytes of one frame's header: the kind and the length.
pub const HEADER_BYTES: usize = 5;

/// The longest request line a server reads: a command is at most what a model's tool call
/// argument can hold, and a file call's content what `write_file` takes (1 MiB by default),
/// escaped as JSON.
pub const MAX_REQUEST_BYTES: u64 = 8 << 20;

/// The longest frame payload either side writes or accepts.
pub const MAX_FRAME_BYTES: usize = 64 * 1024;

/// One command to run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    /// The conversation's workspace: a directory under the server's workspace root (the worker
    /// and sandbox containers mount the workspace volume at the same path). The root itself for
    /// the worker's start-up probe.
    pub workspace: String,
    /// Run as `bash -c command` (or `sh` where the image has no bash).
    pub command: String,
    pub landlock: LandlockMode,
    /// How long a background process may still write after the shell exits, in milliseconds.
    pub grace_ms: u64,
    /// What the command may use; the defaults when left out.
    #[serde(default)]
    pub limits: Limits,
}

/// A request line of version 2 or later (a line without `version` is a version 1 [`Request`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Versioned {
    pub version: u32,
    pub request: Kind,
}

/// What a versioned line asks for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Kind {
    Command(Request),
    Session(SessionRequest),
    File(FileRequest),
    Verifier(VerifierRequest),
}

/// One step of a verifier's, in the environment a finished conversation left (version 5).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VerifierRequest {
    /// Where relative paths start, as a [`FileRequest`]'s `workspace`.
    pub workspace: String,
    pub step: VerifierStep,
    pub landlock: LandlockMode,
}

/// What a [`VerifierRequest`] does.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum VerifierStep {
    /// Replaces each of `fresh` (whatever is there: a directory, a file, a link, which is
    /// removed, not followed) by a new empty directory, then unpacks `tests_tar` (base64 of a
    /// tar, gzipped or not) into `tests_dir` and writes `test_sh` there as `test.sh`. Answered
    /// with `null`.
    #[serde(rename_all = "camelCase")]
    Prepare {
        fresh: Vec<String>,
        tests_dir: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tests_tar: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        test_sh: Option<String>,
    },
    /// Reads the reward file at `path`, at most [`MAX_REWARD_BYTES`]: answered with its text,
    /// or `null` when there is no such file.
    #[serde(rename_all = "camelCase")]
    ReadReward { path: String },
}

/// The most of a reward file that is read: a number, a line at most.
pub const MAX_REWARD_BYTES: u64 = 4096;

/// One call of a file tool, run in the workspace it names (version 4).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileRequest {
    /// Where relative paths start: a workspace as a command's `workspace` names one (in a task
    /// container, any directory of its image, the empty name its working directory).
    pub workspace: String,
    /// The tool's name (`read_file`, …) and the model's arguments, checked by the executor.
    pub tool: String,
    pub args: serde_json::Map<String, serde_json::Value>,
    pub landlock: LandlockMode,
    #[serde(default)]
    pub limits: FileLimits,
}

/// A long-lived program to start, whose standard streams the connection then carries.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionRequest {
    /// The program (looked up on `PATH`) and its arguments.
    pub argv: Vec<String>,
    /// Its environment besides `PATH`, `LANG`, `LC_ALL` and `TZ` (from the server) and `HOME`
    /// and `TMPDIR` (its private directory); these win over those.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub landlock: LandlockMode,
    /// What the program, with everything it starts, may use; its private directory counts as
    /// the workspace. The defaults when left out.
    #[serde(default)]
    pub limits: Limits,
    /// Give the program a `DevTools` pipe on fds 3 and 4 (Chromium's `--remote-debugging-pipe`).
    #[serde(default)]
    pub cdp_pipe: bool,
    /// Run in this workspace (in a pod, a directory under the server's workspace root) instead
    /// of a private directory: it is then the writable directory, `HOME` and `TMPDIR`, and it is
    /// left in place when the session ends. Version 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// Where the program starts; its writable directory when left out. Version 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A request line, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    Command(Request),
    Session(SessionRequest),
    File(FileRequest),
    Verifier(VerifierRequest),
}

impl Line {
    /// Reads a request line of any version this side speaks.
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_slice(line).map_err(|err| format!("bad request: {err}"))?;
        let Some(version) = value.get("version") else {
            return serde_json::from_value(value)
                .map(Self::Command)
                .map_err(|err| format!("bad request: {err}"));
        };
        match version.as_u64() {
            Some(spoken) if (2..=u64::from(VERSION)).contains(&spoken) => {}
            _ => {
                return Err(format!(
                    "protocol version {version} is not spoken here (versions 1 to {VERSION})"
                ));
            }
        }
        let versioned: Versioned =
            serde_json::from_value(value).map_err(|err| format!("bad request: {err}"))?;
        Ok(match versioned.request {
            Kind::Command(request) => Self::Command(request),
            Kind::Session(session) => Self::Session(session),
            Kind::File(file) => Self::File(file),
            Kind::Verifier(verifier) => Self::Verifier(verifier),
        })
    }
}

/// The request line (newline included) that starts `session`.
pub fn session_line(session: &SessionRequest) -> Vec<u8> {
    versioned_line(Kind::Session(session.clone()))
}

/// What a file call's executor writes: the tool's result, or the message the model is shown.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum FileAnswer {
    Ok(serde_json::Value),
    Error(String),
}

impl From<Result<serde_json::Value, String>> for FileAnswer {
    fn from(outcome: Result<serde_json::Value, String>) -> Self {
        match outcome {
            Ok(value) => Self::Ok(value),
            Err(message) => Self::Error(message),
        }
    }
}

/// The request line (newline included) of a file call.
pub fn file_line(request: &FileRequest) -> Vec<u8> {
    versioned_line(Kind::File(request.clone()))
}

/// The request line (newline included) of a verifier's step.
pub fn verifier_line(request: &VerifierRequest) -> Vec<u8> {
    versioned_line(Kind::Verifier(request.clone()))
}

/// The request line (newline included) of `request`, at this side's version.
fn versioned_line(request: Kind) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Versioned {
        version: VERSION,
        request,
    })
    .expect("a request serialises");
    line.push(b'\n');
    line
}

/// A frame's header.
pub fn header(kind: u8, len: usize) -> [u8; HEADER_BYTES] {
    let len = u32::try_from(len).expect("frames are at most MAX_FRAME_BYTES long");
    let [a, b, c, d] = len.to_be_bytes();
    [kind, a, b, c, d]
}

/// Reads a header back: the kind and the payload length.
pub fn parse_header(header: [u8; HEADER_BYTES]) -> (u8, usize) {
    let [kind, a, b, c, d] = header;
    (kind, u32::from_be_bytes([a, b, c, d]) as usize)
}

/// The payload of an [`EXIT`] frame.
pub fn exit_payload(code: i32) -> [u8; 4] {
    code.to_be_bytes()
}

/// Reads an [`EXIT`] or a [`PID`] payload back (both a big-endian `i32`).
pub fn parse_exit(payload: &[u8]) -> Option<i32> {
    Some(i32::from_be_bytes(payload.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_exit_codes_round_trip() {
        assert_eq!(parse_header(header(OUTPUT, 70_000)), (OUTPUT, 70_000));
        assert_eq!(parse_exit(&exit_payload(-3)), Some(-3));
        assert_eq!(parse_exit(b"abc"), None);
    }

    #[test]
    fn a_request_with_an_unknown_field_is_refused() {
        let line = r#"{"workspace":"c1","command":"ls","landlock":"auto","graceMs":5,"env":{}}"#;
        assert!(serde_json::from_str::<Request>(line).is_err());
        let line = r#"{"workspace":"c1","command":"ls","landlock":"required","graceMs":5}"#;
        let request: Request = serde_json::from_str(line).unwrap();
        assert_eq!(request.landlock, LandlockMode::Required);
        assert_eq!(request.limits, Limits::DEFAULT);
        let line = r#"{"workspace":"c1","command":"ls","landlock":"off","graceMs":5,
            "limits":{"processes":3,"memoryBytes":4,"workspaceBytes":5}}"#;
        let request: Request = serde_json::from_str(line).unwrap();
        assert_eq!(request.limits.workspace_bytes, 5);
    }

    #[test]
    fn version_1_and_2_lines_are_told_apart() {
        let command = r#"{"workspace":"c1","command":"ls","landlock":"auto","graceMs":5}"#;
        assert!(matches!(
            Line::parse(command.as_bytes()),
            Ok(Line::Command(_))
        ));
        let versioned = format!(r#"{{"version":2,"request":{{"command":{command}}}}}"#);
        assert!(matches!(
            Line::parse(versioned.as_bytes()),
            Ok(Line::Command(_))
        ));
        let session = SessionRequest {
            argv: vec!["cat".to_owned()],
            env: BTreeMap::from([("A".to_owned(), "b".to_owned())]),
            landlock: LandlockMode::Required,
            limits: Limits::NONE,
            cdp_pipe: true,
            workspace: Some("/w/c1".to_owned()),
            cwd: None,
        };
        let line = session_line(&session);
        let text = String::from_utf8(line.clone()).unwrap();
        assert!(!text.contains("cwd"), "absent options are left out: {text}");
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(Line::parse(&line), Ok(Line::Session(session)));
        let file = FileRequest {
            workspace: String::new(),
            tool: "read_file".to_owned(),
            args: serde_json::Map::from_iter([("path".to_owned(), "/a".into())]),
            landlock: LandlockMode::Auto,
            limits: FileLimits::default(),
        };
        assert_eq!(Line::parse(&file_line(&file)), Ok(Line::File(file)));
        let verifier = VerifierRequest {
            workspace: "/testbed".to_owned(),
            step: VerifierStep::Prepare {
                fresh: vec!["/tests".to_owned(), "/logs/verifier".to_owned()],
                tests_dir: "/tests".to_owned(),
                tests_tar: None,
                test_sh: Some("exit 0".to_owned()),
            },
            landlock: LandlockMode::Required,
        };
        let line = verifier_line(&verifier);
        let text = String::from_utf8(line.clone()).unwrap();
        assert!(text.contains(r#""step":{"prepare":{"fresh""#), "{text}");
        assert_eq!(Line::parse(&line), Ok(Line::Verifier(verifier)));
        let next = VERSION + 1;
        let future = format!(r#"{{"version":{next},"request":{{"teleport":{{}}}}}}"#);
        let refused = Line::parse(future.as_bytes()).unwrap_err();
        assert!(refused.contains(&format!("version {next}")), "{refused}");
        let unknown = r#"{"version":2,"request":{"session":{"argv":[],"landlock":"off","x":1}}}"#;
        assert!(Line::parse(unknown.as_bytes()).is_err());
    }
}

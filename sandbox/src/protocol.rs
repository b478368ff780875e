//! What the worker and the sandbox server say to each other over the Unix socket.
//!
//! One connection per command. The worker writes one [`Request`] as a JSON line; the server
//! answers with frames — a kind byte, a big-endian `u32` length, the payload — of the command's
//! output as it comes ([`OUTPUT`]), then one [`EXIT`] frame with the exit code (a big-endian
//! `i32`: the shell's, `128 + N` for a signal N, or [`crate::REFUSED_EXIT`] with the reason in
//! the output). The worker closing the connection early (a timeout, a cancelled conversation)
//! asks the server to end the command and everything it started.

use crate::{LandlockMode, Limits};

/// A frame of command output (stdout and stderr, interleaved as written).
pub const OUTPUT: u8 = b'o';
/// The last frame: the exit code.
pub const EXIT: u8 = b'x';

/// Bytes of one frame's header: the kind and the length.
pub const HEADER_BYTES: usize = 5;

/// The longest request line a server reads: a command is at most what a model's tool call
/// argument can hold, far below this.
pub const MAX_REQUEST_BYTES: u64 = 1 << 20;

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

/// Reads an [`EXIT`] payload back.
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
}

//! The worker's end of a Chromium in the sandbox container: its `--remote-debugging-pipe`
//! (NUL-delimited `DevTools` messages on a session's pipe) as the WebSocket endpoint that
//! chromiumoxide connects to, since chromiumoxide 0.9 takes a WebSocket URL only (its
//! `Connection` wraps a TCP WebSocket stream; there is no custom transport).
//!
//! The endpoint listens on `127.0.0.1:<ephemeral>`. The pod's network namespace is shared with
//! the sandbox container, so the model's commands can reach that port, and `DevTools` is full
//! control of the browser (every conversation's pages and cookies). What keeps them out: the URL's
//! path holds a 256-bit random token, compared in constant time, which only the worker knows
//! (never on a command line or in a file); a connection without it is refused with 404; each
//! handshake has a time limit; and the first connection that presents the token is the only one
//! ever served: the listener closes then.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Duration;

use async_tungstenite::WebSocketStream;
use async_tungstenite::tokio::{TokioAdapter, accept_hdr_async_with_config};
use async_tungstenite::tungstenite::handshake::server::{
    Callback, ErrorResponse, Request, Response,
};
use async_tungstenite::tungstenite::http::StatusCode;
use async_tungstenite::tungstenite::protocol::WebSocketConfig;
use async_tungstenite::tungstenite::{Message, Utf8Bytes};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// How long a connection may take to complete its WebSocket handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

type Socket = WebSocketStream<TokioAdapter<TcpStream>>;

/// A running bridge; dropping it closes the endpoint and the pipe (which ends the session, and
/// with it Chromium).
#[derive(Debug)]
pub(super) struct Bridge {
    url: String,
    task: JoinHandle<()>,
}

impl Bridge {
    /// Listens for the one connection that `url` names, and relays it to `pipe`.
    pub(super) async fn open(pipe: DuplexStream) -> std::io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let port = listener.local_addr()?.port();
        let token =
            rand::random::<[u8; 32]>()
                .iter()
                .fold(String::with_capacity(64), |mut hex, byte| {
                    let _ = write!(hex, "{byte:02x}");
                    hex
                });
        let path = format!("/devtools/browser/{token}");
        let url = format!("ws://127.0.0.1:{port}{path}");
        let task = tokio::spawn(async move {
            if let Some(socket) = accept_one(listener, path).await {
                relay(socket, pipe).await;
            }
        });
        Ok(Self { url, task })
    }

    /// The endpoint's URL, token included (never logged).
    pub(super) fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The first connection that completes a handshake on `path`; the listener is closed after it.
/// Handshakes run side by side, so that a connection that never speaks holds nothing up.
async fn accept_one(listener: TcpListener, path: String) -> Option<Socket> {
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted.ok()?;
                let check = CheckPath(path.clone());
                handshakes.spawn(async move {
                    let config = WebSocketConfig::default()
                        .max_message_size(None)
                        .max_frame_size(None);
                    tokio::time::timeout(
                        HANDSHAKE_TIMEOUT,
                        accept_hdr_async_with_config(stream, check, Some(config)),
                    )
                    .await
                    .ok()?
                    .ok()
                });
            }
            Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                if let Ok(Some(socket)) = done {
                    return Some(socket);
                }
            }
        }
    }
}

/// Accepts the handshake of a request for the path it holds, refuses any other with 404.
struct CheckPath(String);

impl Callback for CheckPath {
    fn on_request(self, request: &Request, response: Response) -> Result<Response, ErrorResponse> {
        if same(request.uri().path().as_bytes(), self.0.as_bytes()) {
            Ok(response)
        } else {
            let mut refused = ErrorResponse::new(None);
            *refused.status_mut() = StatusCode::NOT_FOUND;
            Err(refused)
        }
    }
}

/// Whether `a` and `b` are equal, in a time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Each WebSocket message goes into the pipe followed by a NUL; each NUL-terminated message out
/// of the pipe becomes a text message. Either side ending ends both.
async fn relay(socket: Socket, pipe: DuplexStream) {
    let (mut to_worker, mut from_worker) = socket.split();
    let (mut from_browser, mut to_browser) = tokio::io::split(pipe);
    let inbound = async {
        while let Some(Ok(message)) = from_worker.next().await {
            let bytes = match message {
                Message::Text(text) => text.as_bytes().to_vec(),
                Message::Binary(bytes) => bytes.to_vec(),
                Message::Close(_) => break,
                _ => continue,
            };
            if to_browser.write_all(&bytes).await.is_err()
                || to_browser.write_all(&[0]).await.is_err()
            {
                break;
            }
        }
    };
    let outbound = async {
        let mut pending = Vec::new();
        let mut chunk = vec![0_u8; 64 * 1024];
        loop {
            let n = match from_browser.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            pending.extend_from_slice(&chunk[..n]);
            while let Some(end) = memchr::memchr(0, &pending) {
                let mut message: Vec<u8> = pending.drain(..=end).collect();
                message.pop();
                let Ok(text) = String::from_utf8(message) else {
                    return;
                };
                if to_worker
                    .send(Message::Text(Utf8Bytes::from(text)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        let _ = to_worker.close(None).await;
    };
    tokio::select! {
        () = inbound => {}
        () = outbound => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_comparison_needs_every_byte() {
        assert!(same(b"/devtools/browser/ab", b"/devtools/browser/ab"));
        assert!(!same(b"/devtools/browser/ab", b"/devtools/browser/ac"));
        assert!(!same(b"/devtools/browser/a", b"/devtools/browser/ab"));
    }

    /// Over a pipe whose other end echoes: a connection without the token is refused, the one
    /// with it gets its messages back, and no second connection is served.
    #[tokio::test]
    async fn only_the_first_connection_with_the_token_is_served() {
        let (pipe, mut browser) = tokio::io::duplex(1 << 16);
        let bridge = Bridge::open(pipe).await.unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0_u8; 1024];
            while let Ok(n @ 1..) = browser.read(&mut buf).await {
                if browser.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        });
        let (base, _) = bridge.url().rsplit_once('/').unwrap();
        let guessed = format!("{base}/0000");
        assert!(
            async_tungstenite::tokio::connect_async(guessed.as_str())
                .await
                .is_err()
        );
        let (mut socket, _) = async_tungstenite::tokio::connect_async(bridge.url())
            .await
            .unwrap();
        for text in ["{\"id\":1}", "{\"id\":2}"] {
            socket.send(Message::text(text)).await.unwrap();
            let back = socket.next().await.unwrap().unwrap();
            assert_eq!(back.into_text().unwrap().as_str(), text);
        }
        assert!(
            async_tungstenite::tokio::connect_async(bridge.url())
                .await
                .is_err(),
            "the listener closed after the first connection"
        );
    }
}

//! A program under the executor whose output the worker collects as it comes, and which the
//! worker can signal (protocol version 3): a conversation's shell and its background jobs.
//!
//! Unlike a [`super::Session`] (whose streams an MCP client or a `DevTools` client reads at its
//! own pace), a program's output is always read at once by a task of its own into an
//! [`OutputLog`] of bounded size: the executor writes to the connection without waiting, so the
//! worker must never stop reading, whether or not anybody asks for the output. The same task
//! notes the program's pid and its end.
//!
//! The program ends when the [`Program`] is stopped or dropped: the connection closes, and the
//! executor kills the program with everything it started, then sends its exit frame.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;
use trajectory_sandbox::protocol::{self, SessionRequest};

use super::session::{Ended, read_frame};
use super::{REFUSED_PREFIX, Sandbox};

/// Bytes of the executor's own messages (a limit's reason, a refusal) kept.
const STDERR_TAIL: usize = 4096;

/// Bytes read from the executor at once.
const FRAME_BUFFER: usize = 8 * 1024;

/// The last bytes a program wrote, within a fixed size, and how many it wrote in all.
#[derive(Debug)]
pub struct OutputLog {
    kept: VecDeque<u8>,
    capacity: usize,
    total: u64,
}

impl OutputLog {
    fn new(capacity: usize) -> Self {
        Self {
            kept: VecDeque::new(),
            capacity,
            total: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let bytes = &bytes[bytes.len().saturating_sub(self.capacity)..];
        let overflow = (self.kept.len() + bytes.len()).saturating_sub(self.capacity);
        self.kept.drain(..overflow);
        self.kept.extend(bytes);
    }

    /// Takes what is kept, leaving the log empty (the count goes on).
    pub fn drain(&mut self) -> Vec<u8> {
        self.kept.drain(..).collect()
    }

    /// A copy of what is kept.
    pub fn snapshot(&self) -> Vec<u8> {
        self.kept.iter().copied().collect()
    }

    /// Bytes written since the program started, kept or not.
    pub fn total(&self) -> u64 {
        self.total
    }
}

/// Where a program's output goes instead of its log while someone reads it as it comes (the
/// shell, while a command runs): nothing is dropped however fast it arrives.
pub type OutputSink = Box<dyn FnMut(&[u8]) + Send>;

/// The sink, if any.
struct Sink(Option<OutputSink>);

impl std::fmt::Debug for Sink {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(if self.0.is_some() {
            "Sink(set)"
        } else {
            "Sink(none)"
        })
    }
}

/// What the reader task has learnt of the program.
#[derive(Debug)]
pub struct ProgramState {
    /// The output, when no sink takes it.
    pub output: OutputLog,
    sink: Sink,
    /// Bytes of output in all, to a sink or to the log.
    output_total: u64,
    /// The program's pid in the sandbox, once it runs.
    pub pid: Option<i32>,
    /// Its end, once it came.
    pub ended: Option<Ended>,
    /// The connection has closed after the end: the executor, and so everything it ran, is gone.
    pub gone: bool,
    /// Checks of the limits that passed ([`Program::check_limits`]).
    checks_passed: u64,
    /// The executor's note with the last check that passed (protocol version 7): a limit the
    /// program is past without its last command being at fault (a workspace a job filled).
    past_limit: Option<String>,
    /// The output limit stopped it.
    pub over_output_limit: bool,
    /// The executor stopped it at a limit while it waited for a command (a shell whose jobs
    /// went past it): nothing sent since the last check of the limits ran.
    pub stopped_waiting: bool,
    /// The last bytes of the executor's own messages (a refusal, a limit's reason).
    stderr: Vec<u8>,
}

impl ProgramState {
    /// What the executor said with the last check of the limits that passed, when the program
    /// is still past one without being at fault (a workspace a job filled): a note for the model.
    pub fn past_limit(&self) -> Option<&str> {
        self.past_limit.as_deref()
    }

    /// Why the executor refused or stopped the program: its last message, without the
    /// [`REFUSED_PREFIX`] it starts with.
    pub fn sandbox_reason(&self) -> Option<String> {
        String::from_utf8_lossy(&self.stderr)
            .lines()
            .rev()
            .find_map(|line| line.strip_prefix(REFUSED_PREFIX))
            .map(str::to_owned)
    }
}

/// A running (or ended) program.
#[derive(Debug)]
pub struct Program {
    /// `None` once stopped: dropping it closes the connection.
    writer: Arc<tokio::sync::Mutex<Option<OwnedWriteHalf>>>,
    state: Arc<Mutex<ProgramState>>,
    changed: watch::Receiver<u64>,
}

impl Program {
    /// Starts `request`'s program in `sandbox`, keeping the last `log_capacity` bytes of its
    /// output; past `output_limit` bytes in all (0: none) it is stopped.
    pub async fn start(
        sandbox: &Sandbox,
        request: &SessionRequest,
        log_capacity: usize,
        output_limit: u64,
    ) -> std::io::Result<Self> {
        let stream = sandbox.connect_session(request).await?;
        let (read, write) = stream.into_split();
        let writer = Arc::new(tokio::sync::Mutex::new(Some(write)));
        let state = Arc::new(Mutex::new(ProgramState {
            output: OutputLog::new(log_capacity),
            sink: Sink(None),
            output_total: 0,
            pid: None,
            ended: None,
            gone: false,
            checks_passed: 0,
            past_limit: None,
            over_output_limit: false,
            stopped_waiting: false,
            stderr: Vec::new(),
        }));
        let (notify, changed) = watch::channel(0);
        tokio::spawn(read_frames(
            read,
            Arc::clone(&state),
            notify,
            Arc::downgrade(&writer),
            output_limit,
        ));
        Ok(Self {
            writer,
            state,
            changed,
        })
    }

    /// What is known of the program now.
    pub fn state(&self) -> MutexGuard<'_, ProgramState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends the output to `sink` from now on (what the log holds first), or, with `None`, to
    /// the log again.
    pub fn divert(&self, sink: Option<OutputSink>) {
        let mut state = self.state();
        if let Some(mut sink) = sink {
            let waiting = state.output.drain();
            if !waiting.is_empty() {
                sink(&waiting);
            }
            state.sink = Sink(Some(sink));
        } else {
            state.sink = Sink(None);
        }
    }

    /// A receiver that sees a change each time output, the pid or the end arrives.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.changed.clone()
    }

    /// Sends `bytes` to the program's standard input.
    pub async fn write(&self, bytes: &[u8]) -> std::io::Result<()> {
        for chunk in bytes.chunks(protocol::MAX_FRAME_BYTES) {
            self.send(protocol::STDIN, chunk).await?;
        }
        Ok(())
    }

    /// Closes the program's standard input, once what was written before is delivered.
    pub async fn close_input(&self) -> std::io::Result<()> {
        self.send(protocol::STDIN, &[]).await
    }

    /// Kills every process the program started, not the program.
    pub async fn interrupt(&self) -> std::io::Result<()> {
        self.send(protocol::INTERRUPT, &[]).await
    }

    /// Has the executor check the limits now; true when they hold (false: the program was
    /// stopped, its end says why, or the connection is gone). A note that comes with the answer
    /// is in [`ProgramState::past_limit`].
    pub async fn check_limits(&self) -> bool {
        let before = self.state().checks_passed;
        if self.send(protocol::CHECK, &[]).await.is_err() {
            return false;
        }
        self.until(|state| {
            if state.checks_passed > before {
                Some(true)
            } else {
                state.ended.map(|_| false)
            }
        })
        .await
        .unwrap_or(false)
    }

    /// Waits until `seen` finds what it looks for in the state (checked now and at every change);
    /// `None` when the reader task ended without it.
    pub async fn until<T>(&self, mut seen: impl FnMut(&ProgramState) -> Option<T>) -> Option<T> {
        let mut changed = self.watch();
        loop {
            if let Some(found) = seen(&self.state()) {
                return Some(found);
            }
            if changed.changed().await.is_err() {
                return seen(&self.state());
            }
        }
    }

    async fn send(&self, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let mut writer = self.writer.lock().await;
        let Some(writer) = writer.as_mut() else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the program was stopped",
            ));
        };
        let mut frame = Vec::with_capacity(protocol::HEADER_BYTES + payload.len());
        frame.extend_from_slice(&protocol::header(kind, payload.len()));
        frame.extend_from_slice(payload);
        writer.write_all(&frame).await
    }

    /// Waits until the program has ended, at most `wait`; returns its end if it came.
    pub async fn wait(&self, wait: Duration) -> Option<Ended> {
        // The reader task notes an end before it goes, so `until` finds one.
        tokio::time::timeout(wait, self.until(|state| state.ended))
            .await
            .ok()
            .map(|ended| ended.unwrap_or(Ended::Lost))
    }

    /// Ends the program with everything it started, and waits (at most `wait`) until the
    /// executor is gone, and so all of it.
    pub async fn stop(&self, wait: Duration) {
        self.writer.lock().await.take();
        let gone = self.until(|state| state.gone.then_some(()));
        let _ = tokio::time::timeout(wait, gone).await;
    }
}

/// The reader task: every frame of the executor into `state`, until the connection's end (the
/// exit frame comes first, then the executor closes its side as it exits).
async fn read_frames(
    socket: OwnedReadHalf,
    state: Arc<Mutex<ProgramState>>,
    notify: watch::Sender<u64>,
    // Weak: dropping the [`Program`] must close the connection, whatever this task does.
    writer: Weak<tokio::sync::Mutex<Option<OwnedWriteHalf>>>,
    output_limit: u64,
) {
    // Buffered: the executor's frames come in bursts (output, then the marker; a check's answer),
    // each a header and a payload, read here in one system call rather than two per frame.
    let mut socket = BufReader::with_capacity(FRAME_BUFFER, socket);
    let mut payload = Vec::new();
    loop {
        let Ok(Some((kind, len))) = read_frame(&mut socket, &mut payload).await else {
            break;
        };
        let bytes = &payload[..len];
        let mut stop = false;
        {
            let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
            match kind {
                protocol::OUTPUT => {
                    state.output_total += bytes.len() as u64;
                    match state.sink.0.as_mut() {
                        Some(sink) => sink(bytes),
                        None => state.output.push(bytes),
                    }
                    if output_limit > 0
                        && state.output_total > output_limit
                        && !state.over_output_limit
                    {
                        state.over_output_limit = true;
                        stop = true;
                    }
                }
                protocol::STDERR => {
                    state.stderr.extend_from_slice(bytes);
                    let excess = state.stderr.len().saturating_sub(STDERR_TAIL);
                    state.stderr.drain(..excess);
                }
                protocol::PID => state.pid = protocol::parse_exit(bytes),
                protocol::CHECKED => {
                    state.checks_passed += 1;
                    state.past_limit =
                        (!bytes.is_empty()).then(|| String::from_utf8_lossy(bytes).into_owned());
                }
                protocol::STOPPED_WAITING => state.stopped_waiting = true,
                protocol::EXIT => {
                    state.ended =
                        Some(protocol::parse_exit(bytes).map_or(Ended::Lost, Ended::Exited));
                }
                _ => break,
            }
        }
        if stop && let Some(writer) = writer.upgrade() {
            // Closing the connection ends the program; its exit frame still comes.
            writer.lock().await.take();
        }
        notify.send_modify(|generation| *generation += 1);
    }
    {
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        state.ended.get_or_insert(Ended::Lost);
        state.gone = true;
    }
    notify.send_modify(|generation| *generation += 1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_last_bytes_and_counts_them_all() {
        let mut log = OutputLog::new(4);
        log.push(b"ab");
        log.push(b"cdef");
        assert_eq!(log.snapshot(), b"cdef");
        log.push(b"0123456789");
        assert_eq!(log.snapshot(), b"6789");
        assert_eq!(log.total(), 16);
        assert_eq!(log.drain(), b"6789");
        assert!(log.snapshot().is_empty());
        assert_eq!(log.total(), 16);
    }
}

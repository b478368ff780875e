//! The conversation's shell: one `bash` (or `sh` where the image has none) that lives as long
//! as the conversation, under the executor in the conversation's workspace, and runs every
//! foreground command of it, so that `cd`, exported variables, functions and aliases persist
//! between calls as they do in hermes-agent's terminal.
//!
//! Why one long-lived shell rather than the reference's snapshot-and-marker way (a new
//! `bash -c` per command that re-sources a snapshot of the environment and `cd`s to a recorded
//! directory): the shell and its executor are started once per conversation instead of once per
//! command, the executor's confinement is set up once, and nothing has to be dumped and
//! re-sourced around each command. What it costs is that a command can end the shell (`exit`,
//! a limit, a command that will not stop at its timeout); the next call then starts a new one in
//! the last known directory and says that the shell's state was reset.
//!
//! Each command goes to the shell's standard input as a small script: the command itself in a
//! quoted here-document (so that no quoting, no syntax error and no unbalanced `"` in it can
//! reach the script around it), `eval`ed with its standard input on `/dev/null` and its standard
//! error on the output, then a marker line with the exit code and the working directory. The
//! marker carries a random nonce of the command's, so that neither a command printing something
//! like it nor the marker of an earlier command whose call was abandoned (a cancelled
//! conversation) ends the read early.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;
use trajectory_sandbox::protocol::SessionRequest;

use super::output::OutputBuffer;
use crate::tools::sandbox::{Ended, LIMIT_EXIT, Program, REFUSED_EXIT, Sandbox};

/// How long a timed-out command's processes have to die (and the shell to print its marker)
/// once the executor killed them; past it, the shell itself is stuck (a loop of builtins) and is
/// ended.
const INTERRUPT_GRACE: Duration = Duration::from_secs(2);

/// How long stopping the shell may take: the executor kills and reaps in milliseconds.
pub(super) const STOP_WAIT: Duration = Duration::from_secs(5);

/// Output kept while nobody reads it: between commands, what a job left running with `&` writes.
const IDLE_LOG: usize = 256 * 1024;

/// How long a started shell may take to answer its start-up script: its start is milliseconds,
/// on a machine busy enough seconds.
const START_WAIT: Duration = Duration::from_secs(30);

/// The shell function, defined at the shell's start, that ends each command: it prints the
/// marker line with the command's exit code (its first argument) and the directory.
const END_FUNCTION: &str = "__traj_end";

/// A new random marker nonce.
fn new_nonce() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

/// The marker that starts the line ending the command of `nonce`.
fn marker(nonce: &str) -> String {
    format!("\n__TRAJ_{nonce}_END ")
}

/// Shell starts in progress at once, in this process: as many as it has cores, in turn.
fn starts() -> &'static tokio::sync::Semaphore {
    static STARTS: OnceLock<tokio::sync::Semaphore> = OnceLock::new();
    STARTS.get_or_init(|| {
        tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(1, usize::from))
    })
}

/// Which shell runs, and so how a command is read into a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// `read -d ''` reads the here-document without a process.
    Bash,
    /// POSIX `sh`: a command substitution with `cat`.
    Posix,
}

/// How a command ended.
#[derive(Debug)]
pub(super) enum CommandEnd {
    /// It ran to its end; the shell reported its exit code and directory. `past_limit`: the
    /// sandbox's note on a limit the shell is still past without the command being at fault (a
    /// workspace a job filled), for the model.
    Finished {
        exit_code: i32,
        cwd: PathBuf,
        past_limit: Option<String>,
    },
    /// It ran out of time and was killed; `shell_lost` when the shell went with it.
    /// `past_limit` as for [`CommandEnd::Finished`].
    TimedOut {
        shell_lost: bool,
        past_limit: Option<String>,
    },
    /// The shell ended while it ran (`exit`, a limit, a crash): the exit code, and the
    /// executor's reason when it stopped the shell.
    ShellEnded {
        exit_code: i32,
        reason: Option<String>,
    },
    /// The shell could not be started: the executor's reason.
    NotStarted(String),
    /// The sandbox stopped the shell at a limit while it waited for this command (what a job
    /// left running with `&` did), before the command reached it: the sandbox's reason. The
    /// command did not run.
    StoppedBeforeIt(String),
}

impl CommandEnd {
    /// The sandbox's note on a limit the shell is still past after the command, through no
    /// fault of the command's.
    pub(super) fn past_limit(&self) -> Option<&str> {
        match self {
            Self::Finished { past_limit, .. } | Self::TimedOut { past_limit, .. } => {
                past_limit.as_deref()
            }
            _ => None,
        }
    }
}

/// A running shell.
#[derive(Debug)]
pub(super) struct Shell {
    program: Program,
    flavour: Flavour,
}

impl Shell {
    /// Starts a shell of `flavour` in `workspace`, in the directory `cwd` (`None`: the
    /// workspace), and waits until it is ready for commands (or has ended: the first command
    /// then says why).
    pub(super) async fn start(
        sandbox: &Sandbox,
        workspace: &str,
        cwd: Option<&Path>,
        flavour: Flavour,
    ) -> std::io::Result<Self> {
        let argv = match flavour {
            Flavour::Bash => vec![
                "bash".to_owned(),
                "--noprofile".to_owned(),
                "--norc".to_owned(),
            ],
            Flavour::Posix => vec!["sh".to_owned()],
        };
        let request = SessionRequest {
            argv,
            env: [("TERM".to_owned(), "dumb".to_owned())].into(),
            landlock: sandbox.landlock,
            limits: sandbox.limits,
            cdp_pipe: false,
            workspace: Some(workspace.to_owned()),
            cwd: cwd.map(|cwd| cwd.display().to_string()),
        };
        // Starting is CPU work (the executor's start and confinement, the shell's own start) that
        // nothing else waits on; started all at once, as a batch's conversations do, they would
        // share the cores and all be ready late together.
        let _start = starts().acquire().await;
        let program = Program::start(sandbox, &request, IDLE_LOG, 0).await?;
        let shell = Self { program, flavour };
        let nonce = new_nonce();
        let mut scan = MarkerScan::new(marker(&nonce).into_bytes());
        // What the shell writes before it is ready (nothing, unless its start fails) is dropped
        // with the marker: no command asked for it.
        let mut discarded = OutputBuffer::new(0);
        let ready = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&ready);
        shell.program.divert(Some(Box::new(move |bytes| {
            if scan.feed(bytes, &mut discarded).is_some() {
                seen.store(true, Ordering::Release);
            }
        })));
        shell
            .program
            .write(start_script(flavour, &nonce).as_bytes())
            .await?;
        let until_ready = shell
            .program
            .until(|state| (ready.load(Ordering::Acquire) || state.ended.is_some()).then_some(()));
        let answered = tokio::time::timeout(START_WAIT, until_ready).await.is_ok();
        shell.program.divert(None);
        if !answered {
            shell.stop().await;
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the shell was not ready within {} s", START_WAIT.as_secs()),
            ));
        }
        // The start-up script was not a command: a check now tells the executor that the shell
        // waits for one, so that it does not watch the idle shell until the first command ends.
        // (A check that fails has stopped the shell; the first command says why.)
        shell.program.check_limits().await;
        Ok(shell)
    }

    /// The sandbox's reason, when it stopped the shell while it waited for a command (what a
    /// job left running with `&` did); `None` while the shell runs (or ended otherwise: the
    /// next command finds out how).
    pub(super) fn stopped_while_waiting(&self) -> Option<String> {
        let state = self.program.state();
        match state.ended {
            Some(Ended::Exited(LIMIT_EXIT)) => state.sandbox_reason(),
            _ => None,
        }
    }

    pub(super) fn flavour(&self) -> Flavour {
        self.flavour
    }

    /// Runs `command` (in `workdir` first, when given) for at most `timeout`; returns how it
    /// ended and its output, kept within `budget` bytes. Output that came between commands (from
    /// jobs left running with `&`) comes first.
    pub(super) async fn run(
        &self,
        command: &str,
        workdir: Option<&str>,
        timeout: Duration,
        budget: usize,
    ) -> (CommandEnd, OutputBuffer) {
        let nonce = new_nonce();
        let read = Arc::new(Mutex::new(CommandRead {
            scan: MarkerScan::new(marker(&nonce).into_bytes()),
            kept: OutputBuffer::new(budget),
            end: None,
        }));
        let sink = Arc::clone(&read);
        self.program.divert(Some(Box::new(move |bytes| {
            let mut read = sink.lock().unwrap_or_else(PoisonError::into_inner);
            let CommandRead { scan, kept, end } = &mut *read;
            if end.is_none() {
                *end = scan.feed(bytes, kept);
            }
        })));
        let end = self
            .read_until_end(&read, &nonce, command, workdir, timeout)
            .await;
        self.program.divert(None);
        let mut read = read.lock().unwrap_or_else(PoisonError::into_inner);
        let CommandRead { scan, kept, .. } = &mut *read;
        if !matches!(end, CommandEnd::Finished { .. }) {
            scan.flush(kept);
        }
        (end, std::mem::replace(kept, OutputBuffer::new(0)))
    }

    async fn read_until_end(
        &self,
        read: &Mutex<CommandRead>,
        nonce: &str,
        command: &str,
        workdir: Option<&str>,
        timeout: Duration,
    ) -> CommandEnd {
        let mut watch = self.program.watch();
        let script = command_script(self.flavour, nonce, command, workdir);
        if self.program.write(script.as_bytes()).await.is_err() {
            return self.ended_early().await;
        }
        let deadline = Instant::now() + timeout;
        let mut interrupted_at: Option<Instant> = None;
        loop {
            let marked = read
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .end
                .take();
            if let Some((exit_code, cwd)) = marked {
                // A file cut short at the workspace limit ends its command quietly: the limits
                // are checked at each command's end, as they were when each had its executor.
                if !self.program.check_limits().await {
                    return self.ended_early().await;
                }
                let past_limit = self.program.state().past_limit().map(str::to_owned);
                if interrupted_at.is_some() {
                    return CommandEnd::TimedOut {
                        shell_lost: false,
                        past_limit,
                    };
                }
                return CommandEnd::Finished {
                    exit_code,
                    cwd: PathBuf::from(cwd),
                    past_limit,
                };
            }
            if self.program.state().ended.is_some() {
                return match interrupted_at {
                    Some(_) => CommandEnd::TimedOut {
                        shell_lost: true,
                        past_limit: None,
                    },
                    None => self.ended_early().await,
                };
            }
            let wake_at = match interrupted_at {
                Some(at) => at + INTERRUPT_GRACE,
                None => deadline,
            };
            match tokio::time::timeout_at(wake_at, watch.changed()).await {
                Ok(Ok(())) => {}
                // The reader task is gone: the end is in the state, seen on the next round.
                Ok(Err(_)) => tokio::task::yield_now().await,
                Err(_) if interrupted_at.is_none() => {
                    interrupted_at = Some(Instant::now());
                    if self.program.interrupt().await.is_err() {
                        return CommandEnd::TimedOut {
                            shell_lost: true,
                            past_limit: None,
                        };
                    }
                }
                Err(_) => {
                    // The shell did not come back: it is stuck itself.
                    self.stop().await;
                    return CommandEnd::TimedOut {
                        shell_lost: true,
                        past_limit: None,
                    };
                }
            }
        }
    }

    /// The shell ended before the marker: what it wrote, and how it ended.
    async fn ended_early(&self) -> CommandEnd {
        let ended = self.program.wait(STOP_WAIT).await;
        let (reason, stopped_waiting) = {
            let state = self.program.state();
            (state.sandbox_reason(), state.stopped_waiting)
        };
        // The stop can come after the look before the command and before the command arrived:
        // the executor says so, and the command is not blamed for it.
        if stopped_waiting && let Some(reason) = &reason {
            return CommandEnd::StoppedBeforeIt(reason.clone());
        }
        match ended {
            Some(Ended::Exited(REFUSED_EXIT)) => CommandEnd::NotStarted(
                reason.unwrap_or_else(|| "the sandbox refused the shell".to_owned()),
            ),
            Some(Ended::Exited(code)) => CommandEnd::ShellEnded {
                exit_code: code,
                reason: (code == LIMIT_EXIT).then_some(reason).flatten(),
            },
            Some(Ended::Lost) | None => CommandEnd::ShellEnded {
                exit_code: -1,
                reason: Some("the sandbox closed the connection".to_owned()),
            },
        }
    }

    /// The shell's exported variables, as a script that sets them again (`export -p`), for a
    /// background job to start from; `None` when the shell does not answer in time.
    pub(super) async fn exported(&self) -> Option<String> {
        match self
            .run("export -p", None, Duration::from_secs(10), 1 << 20)
            .await
        {
            (CommandEnd::Finished { exit_code: 0, .. }, kept) => Some(kept.render_raw()),
            _ => None,
        }
    }

    /// Ends the shell with everything it started, waiting until it is gone.
    pub(super) async fn stop(&self) {
        self.program.stop(STOP_WAIT).await;
    }
}

/// The script a shell of `flavour` starts with: its own messages (a syntax error in a script)
/// go where the commands' do; the markers go to a copy of the output of their own, so that a
/// command that sends the shell's output elsewhere (`exec >log`) does not lose them; the
/// function that ends each command (defined once: the shell reads its input a byte at a time);
/// and the ready marker of `nonce`. Public for the terminal benchmark, which measures its cost.
pub fn start_script(flavour: Flavour, nonce: &str) -> String {
    let (redirect, markers) = match flavour {
        // `cd` resolves symbolic links, so that the directory reported (and followed by the
        // file tools) is the real one, as the reference's `pwd -P` is.
        Flavour::Bash => ("exec 2>&1 19>&1\nset -o physical\n", 19),
        Flavour::Posix => ("exec 2>&1 9>&1\n", 9),
    };
    format!(
        "{redirect}{END_FUNCTION}() {{ unset __traj_command; \
         printf '\\n__TRAJ_%s_END %d %s\\n' \"$2\" \"$1\" \"$PWD\" >&{markers}; }}\n\
         {END_FUNCTION} 0 {nonce}\n"
    )
}

/// The script that runs `command` (in `workdir` first, when given) in a shell of `flavour` and
/// ends with the marker of `nonce`. Public for the terminal benchmark.
pub fn command_script(
    flavour: Flavour,
    nonce: &str,
    command: &str,
    workdir: Option<&str>,
) -> String {
    let delimiter = format!("__TRAJ_{nonce}_EOF");
    let read = match flavour {
        Flavour::Bash => {
            format!("IFS= read -r -d '' __traj_command <<'{delimiter}'\n{command}\n{delimiter}\n")
        }
        Flavour::Posix => {
            format!("__traj_command=$(cat <<'{delimiter}'\n{command}\n{delimiter}\n)\n")
        }
    };
    let markers = match flavour {
        Flavour::Bash => 19,
        Flavour::Posix => 9,
    };
    // Each command starts with the session's output as its own, whatever an earlier one did
    // to the shell's (`exec >log`), as each of the reference's commands is a new process.
    let run = format!(
        "eval \"$__traj_command\" </dev/null >&{markers} 2>&{markers}\n\
         {END_FUNCTION} $? {nonce}\n"
    );
    // A workdir the reference's check let through has no quote in it. One that cannot be
    // entered is exit code 126 and the command is not run, as the reference's
    // `builtin cd -- DIR || exit 126`.
    match workdir {
        Some(dir) => {
            format!("{read}if cd -- '{dir}'; then\n{run}else\n{END_FUNCTION} 126 {nonce}\nfi\n")
        }
        None => format!("{read}{run}"),
    }
}

/// A command's output as it is read: the marker's search, what is kept, and the marker's
/// exit code and directory once found.
#[derive(Debug)]
struct CommandRead {
    scan: MarkerScan,
    kept: OutputBuffer,
    end: Option<(i32, String)>,
}

/// Finds the marker line in the output as it arrives, passing everything before it on.
#[derive(Debug)]
struct MarkerScan {
    marker: Vec<u8>,
    /// Bytes that may be the start of the marker, held back until more output says.
    pending: Vec<u8>,
}

impl MarkerScan {
    fn new(marker: Vec<u8>) -> Self {
        Self {
            marker,
            pending: Vec::new(),
        }
    }

    /// Takes `arrived`; returns the exit code and directory once the whole marker line is in.
    /// What follows the marker line in the same piece is dropped: the shell prints nothing after
    /// it, only a job left running with `&` could have.
    fn feed(&mut self, arrived: &[u8], kept: &mut OutputBuffer) -> Option<(i32, String)> {
        self.pending.extend_from_slice(arrived);
        if let Some(at) = find(&self.pending, &self.marker) {
            let after = &self.pending[at + self.marker.len()..];
            let end = after.iter().position(|byte| *byte == b'\n')?;
            let line = String::from_utf8_lossy(&after[..end]).into_owned();
            kept.push(&self.pending[..at]);
            self.pending.clear();
            let (code, cwd) = line.split_once(' ')?;
            return Some((code.parse().unwrap_or(-1), cwd.to_owned()));
        }
        // All but what could still grow into the marker is output.
        let keep_back = self.marker.len() - 1;
        if self.pending.len() > keep_back {
            let upto = self.pending.len() - keep_back;
            kept.push(&self.pending[..upto]);
            self.pending.drain(..upto);
        }
        None
    }

    /// Passes on what was held back: no marker is coming.
    fn flush(&mut self, kept: &mut OutputBuffer) {
        kept.push(&self.pending);
        self.pending.clear();
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_is_found_across_pieces_and_the_output_before_it_kept() {
        let mut scan = MarkerScan::new(b"\n__M ".to_vec());
        let mut kept = OutputBuffer::new(100);
        assert_eq!(scan.feed(b"hello\nwor", &mut kept), None);
        assert_eq!(scan.feed(b"ld\n__", &mut kept), None);
        assert_eq!(scan.feed(b"M 3 /w/s", &mut kept), None);
        assert_eq!(
            scan.feed(b"ub\n", &mut kept),
            Some((3, "/w/sub".to_owned()))
        );
        assert_eq!(kept.render(""), "hello\nworld");
    }

    #[test]
    fn without_a_marker_everything_is_output() {
        let mut scan = MarkerScan::new(b"\n__M ".to_vec());
        let mut kept = OutputBuffer::new(100);
        assert_eq!(scan.feed(b"partial\n__", &mut kept), None);
        scan.flush(&mut kept);
        assert_eq!(kept.render(""), "partial\n__");
    }
}

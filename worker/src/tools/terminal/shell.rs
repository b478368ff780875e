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
use std::sync::{Arc, Mutex, PoisonError};
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

/// Which shell runs, and so how a command is read into a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flavour {
    /// `read -d ''` reads the here-document without a process.
    Bash,
    /// POSIX `sh`: a command substitution with `cat`.
    Posix,
}

/// How a command ended.
#[derive(Debug)]
pub(super) enum CommandEnd {
    /// It ran to its end; the shell reported its exit code and directory.
    Finished { exit_code: i32, cwd: PathBuf },
    /// It ran out of time and was killed; `shell_lost` when the shell went with it.
    TimedOut { shell_lost: bool },
    /// The shell ended while it ran (`exit`, a limit, a crash): the exit code, and the
    /// executor's reason when it stopped the shell.
    ShellEnded {
        exit_code: i32,
        reason: Option<String>,
    },
    /// The shell could not be started: the executor's reason.
    NotStarted(String),
}

/// A running shell.
#[derive(Debug)]
pub(super) struct Shell {
    program: Program,
    flavour: Flavour,
}

impl Shell {
    /// Starts a shell of `flavour` in `workspace`, in the directory `cwd`.
    pub(super) async fn start(
        sandbox: &Sandbox,
        workspace: &Path,
        cwd: &Path,
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
            workspace: Some(workspace.display().to_string()),
            cwd: Some(cwd.display().to_string()),
        };
        let program = Program::start(sandbox, &request, IDLE_LOG, 0).await?;
        // The shell's own messages (a syntax error in the script) go where the commands' do; the
        // markers go to a copy of the output of their own, so that a command that sends the
        // shell's output elsewhere (`exec >log`) does not lose them.
        let init = match flavour {
            // `cd` resolves symbolic links, so that the directory reported (and followed by the
            // file tools) is the real one, as the reference's `pwd -P` is.
            Flavour::Bash => "exec 2>&1 19>&1\nset -o physical\n",
            Flavour::Posix => "exec 2>&1 9>&1\n",
        };
        program.write(init.as_bytes()).await?;
        Ok(Self { program, flavour })
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
        let nonce = format!("{:032x}", rand::rng().random::<u128>());
        let marker = format!("\n__TRAJ_{nonce}_END ");
        let read = Arc::new(Mutex::new(CommandRead {
            scan: MarkerScan::new(marker.into_bytes()),
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
        let script = self.script(nonce, command, workdir);
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
                if interrupted_at.is_some() {
                    return CommandEnd::TimedOut { shell_lost: false };
                }
                return CommandEnd::Finished {
                    exit_code,
                    cwd: PathBuf::from(cwd),
                };
            }
            if self.program.state().ended.is_some() {
                return match interrupted_at {
                    Some(_) => CommandEnd::TimedOut { shell_lost: true },
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
                        return CommandEnd::TimedOut { shell_lost: true };
                    }
                }
                Err(_) => {
                    // The shell did not come back: it is stuck itself.
                    self.stop().await;
                    return CommandEnd::TimedOut { shell_lost: true };
                }
            }
        }
    }

    /// The shell ended before the marker: what it wrote, and how it ended.
    async fn ended_early(&self) -> CommandEnd {
        let ended = self.program.wait(STOP_WAIT).await;
        let reason = self.program.state().sandbox_reason();
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

    /// The script that runs one command and reports how it ended.
    fn script(&self, nonce: &str, command: &str, workdir: Option<&str>) -> String {
        let delimiter = format!("__TRAJ_{nonce}_EOF");
        let read = match self.flavour {
            Flavour::Bash => format!(
                "IFS= read -r -d '' __traj_command <<'{delimiter}'\n{command}\n{delimiter}\n"
            ),
            Flavour::Posix => {
                format!("__traj_command=$(cat <<'{delimiter}'\n{command}\n{delimiter}\n)\n")
            }
        };
        let markers = match self.flavour {
            Flavour::Bash => 19,
            Flavour::Posix => 9,
        };
        // Each command starts with the session's output as its own, whatever an earlier one did
        // to the shell's (`exec >log`), as each of the reference's commands is a new process.
        let run = format!(
            "eval \"$__traj_command\" </dev/null >&{markers} 2>&{markers}\n__traj_status=$?\n"
        );
        // A workdir the reference's check let through has no quote in it. One that cannot be
        // entered is exit code 126 and the command is not run, as the reference's
        // `builtin cd -- DIR || exit 126`.
        let run = workdir.map_or(run.clone(), |dir| {
            format!("if cd -- '{dir}'; then\n{run}else\n__traj_status=126\nfi\n")
        });
        format!(
            "{read}{run}unset __traj_command\n\
             printf '\\n__TRAJ_%s_END %d %s\\n' '{nonce}' \"$__traj_status\" \"$PWD\" >&{markers}\n\
             unset __traj_status\n"
        )
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

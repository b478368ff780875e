//! `trajectory-executor file`: one call of a file tool, confined as a command is.
//!
//! A conversation in a task container has its files there, out of the worker's reach, so the
//! file tools ([`crate::files`]) run there: the server starts this executor for each call, which
//! drops its capabilities, takes the conversation's Landlock rules and rlimits
//! ([`crate::run::confine_executor`], the same as a command's), reads the call
//! ([`FileRequest`]) on its standard input, does it on the container's filesystem, and writes one
//! JSON object on its standard output: `{"ok": result}` or `{"error": message}`. The executor is
//! its own process so that the server, which must keep its socket and its binary private, never
//! touches a file on the model's behalf.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::unistd::Pid;

use crate::files::{self, Workspace};
use crate::protocol::{FileAnswer, FileRequest, MAX_REQUEST_BYTES};
use crate::run::{Confinement, confine_executor, executor_command};
use crate::{ImageFiles, LandlockMode, Limits, REFUSED_EXIT, REFUSED_PREFIX};

/// The subcommand.
pub const SUBCOMMAND: &str = "file";

/// The command line of an executor that runs one file call in `workspace`; the caller writes the
/// [`FileRequest`] to its standard input and reads the answer from its standard output.
pub fn command(
    executor: &Path,
    workspace: &Path,
    landlock: LandlockMode,
    image_files: &ImageFiles,
) -> Command {
    one_request_command(executor, SUBCOMMAND, workspace, landlock, image_files)
}

/// The command line of an executor `subcommand` that answers one request read on its standard
/// input ([`answer_one_request`]) in `workspace`. A request's bounds are its own (a file call's
/// `FileLimits`, a verifier step's archive bound): no process, memory or disk limit of a
/// command's applies.
pub(crate) fn one_request_command(
    executor: &Path,
    subcommand: &str,
    workspace: &Path,
    landlock: LandlockMode,
    image_files: &ImageFiles,
) -> Command {
    let mut cmd = executor_command(
        executor,
        subcommand,
        workspace,
        landlock,
        Limits::NONE,
        image_files,
    );
    cmd.arg("--").stdin(Stdio::piped());
    cmd
}

/// The arguments of an executor that answers one request read on its standard input (`file`,
/// `verifier`).
#[derive(Debug)]
pub(crate) struct RequestArgs {
    pub(crate) workspace: PathBuf,
    pub(crate) confinement: Confinement,
    parent: Pid,
}

fn parse_args(mut args: impl Iterator<Item = OsString>) -> Result<RequestArgs, String> {
    let mut workspace = None;
    let confinement = Confinement::parse(&mut args, |flag, value| {
        if flag != "--workspace" {
            return Ok(false);
        }
        workspace = Some(PathBuf::from(value()?));
        Ok(true)
    })?;
    if let Some(extra) = args.next() {
        return Err(format!("unexpected argument {}", extra.display()));
    }
    Ok(RequestArgs {
        workspace: workspace.ok_or("missing --workspace")?,
        parent: confinement.parent.ok_or("missing --parent")?,
        confinement,
    })
}

/// The executor process: `args` are those after the subcommand. Exits 0 with the answer on
/// standard output, or [`REFUSED_EXIT`] with why on standard error.
pub fn main(args: impl Iterator<Item = OsString>) -> i32 {
    answer_one_request(args, |args, line| {
        let request: FileRequest =
            serde_json::from_slice(line).map_err(|err| format!("bad file call: {err}"))?;
        let workspace = if args.confinement.image_files.is_task_container() {
            Workspace::container(&args.workspace)
        } else {
            Workspace::new(&args.workspace)
        }
        .map_err(|err| format!("cannot work in {}: {err}", args.workspace.display()))?;
        Ok(FileAnswer::from(files::call(
            &request.tool,
            &request.args,
            &workspace,
            &request.limits,
        )))
    })
}

/// An executor that confines itself as a command is ([`confine_executor`]), reads one request on
/// its standard input, and writes `handle`'s answer as one JSON object on its standard output
/// (exit 0), or why it could not on standard error ([`REFUSED_EXIT`]).
pub(crate) fn answer_one_request(
    args: impl Iterator<Item = OsString>,
    handle: impl FnOnce(&RequestArgs, &[u8]) -> Result<FileAnswer, String>,
) -> i32 {
    let answered = parse_args(args).and_then(|args| {
        // The signals' descriptor and the limits' supervisor are a command's business: a request
        // ends by itself, and the server kills its executor when the worker hangs up.
        let _confined = confine_executor(args.parent, &args.workspace, &args.confinement)?;
        let mut line = Vec::new();
        std::io::stdin()
            .take(MAX_REQUEST_BYTES)
            .read_to_end(&mut line)
            .map_err(|err| format!("cannot read the request: {err}"))?;
        let answer = handle(&args, &line)?;
        serde_json::to_string(&answer).map_err(|err| format!("cannot write the answer: {err}"))
    });
    match answered {
        Ok(answer) => {
            let mut stdout = std::io::stdout().lock();
            match stdout
                .write_all(answer.as_bytes())
                .and_then(|()| stdout.flush())
            {
                Ok(()) => 0,
                Err(_) => REFUSED_EXIT,
            }
        }
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "{REFUSED_PREFIX}{message}");
            REFUSED_EXIT
        }
    }
}

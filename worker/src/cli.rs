//! The command line: `local`, `oracle`, `plan`, `batch`, `merge`, `prompt` and `distributions`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::Serialize;
use tracing::{debug, error, info, warn};

use crate::contract::LandlockStatus;
use crate::contract::{WorkerFailure, env, exit, paths, termination_message};
use crate::run::batch::{Engine, Shutdown, ShutdownTrigger, run_batch, shutdown_channel};
use crate::run::ledger::Ledger;
use crate::run::local::{LocalOptions, ProgressMode, render_report, run_local, shown_paths};
use crate::run::manifest::Manifest;
use crate::run::{RunError, RunFile, RunLocation, load_plan, merge, plan};
use crate::spec::{LandlockSetting, SandboxSpec};
use crate::storage::StorageError;
use crate::tools::sandbox::tool_dirs::{self, Guarded, NamedDir};
use crate::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_sandbox::DEFAULT_PATH;

#[derive(Debug, Parser)]
#[command(
    name = "trajectory-worker",
    version,
    about = "Generate tool-using agent trajectories"
)]
pub struct Cli {
    /// Log output format.
    #[arg(long, env = env::LOG_FORMAT, value_enum, default_value_t = LogFormat::Pretty, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Json,
    Pretty,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a whole run (plan, batches, merge) on this machine from a run file.
    Local {
        #[command(flatten)]
        local: LocalArgs,
        /// Use this model server instead of the run file's `spec.model.baseUrl` (or its
        /// `spec.model.endpoints`).
        #[arg(long, env = "TRAJ_MODEL_BASE_URL")]
        base_url: Option<String>,
    },
    /// Prove a run's rows before any model is paid: run each row's solution (a Harbor task's
    /// `solution/solve.sh`) instead of the model, as `local` with `spec.agent.oracle` set, and
    /// print the rows whose verifier did not give the full reward (exit 3 when there are any).
    /// The report is the run's `oracle.jsonl`. Rows naming an image need a cluster: run the
    /// run file there with `spec.agent.oracle: true`.
    Oracle {
        #[command(flatten)]
        local: LocalArgs,
    },
    /// Validate the dataset and write the run's manifest.
    Plan(RunArgs),
    /// Generate one batch.
    Batch {
        #[command(flatten)]
        run: RunArgs,
        /// Job completion index; mapped to a batch id through the plan.
        #[arg(long, env = env::JOB_COMPLETION_INDEX)]
        index: Option<u32>,
        /// Batch id (overrides --index).
        batch: Option<u32>,
        #[command(flatten)]
        workspaces: WorkspaceArgs,
        /// Seconds the conversations in flight get to finish after SIGTERM; those still running
        /// then stop, their finished turns kept for the next pod (0: stop at once).
        #[arg(long, env = env::SHUTDOWN_GRACE_SECONDS, default_value_t = 20)]
        shutdown_grace_seconds: u64,
    },
    /// Merge the batches into trajectories.jsonl, failures.jsonl and statistics.json.
    Merge(RunArgs),
    /// Report one page of the plan's image index (when the plan's summary could not list every
    /// image group) to the operator, as this pod's termination message.
    ImagePage {
        #[command(flatten)]
        run: RunArgs,
        /// The page (the Job completion index).
        #[arg(long, env = env::JOB_COMPLETION_INDEX)]
        page: u32,
        /// The index, relative to the run's directory (the plan summary's `images.index`).
        #[arg(long, env = env::IMAGE_INDEX)]
        index: String,
    },
    /// Make ready line `--index` of the run's build list (`harbor-builds.jsonl`): its context
    /// unpacked into `--dir`, its Dockerfile's base images rewritten as the run pulls images,
    /// and the line beside it (a build pod's first container, which alone reads the storage).
    BuildContext {
        #[command(flatten)]
        run: RunArgs,
        /// The line (the build Job's completion index).
        #[arg(long, env = env::JOB_COMPLETION_INDEX)]
        index: u32,
        #[arg(long, env = env::BUILD_DIR, default_value = paths::BUILD_DIR)]
        dir: PathBuf,
    },
    /// Build the image `build-context` made ready in `--dir` with buildah and push it, unless the
    /// registry holds it already; report how it went (built, present, failed with why) as this
    /// pod's termination message. A failed build exits 0: it is its tasks' outcome.
    Build {
        #[arg(long, env = env::BUILD_DIR, default_value = paths::BUILD_DIR)]
        dir: PathBuf,
        /// The buildah program.
        #[arg(long, env = "TRAJ_BUILDAH", default_value = "buildah")]
        buildah: PathBuf,
        /// Where the report for the operator is written.
        #[arg(long, env = env::TERMINATION_LOG)]
        termination_log: Option<PathBuf>,
    },
    /// Write `report.html` (the page to read a run in) from a merged run's outputs, and print its
    /// path. Merge writes it too; this makes it again, e.g. for a run merged by an older worker.
    Report {
        /// The run's output directory (where `statistics.json` and `trajectories.jsonl` are).
        run_dir: PathBuf,
    },
    /// Write a merged run's trajectories in a trainer's or a trajectory tool's format, one JSON
    /// line each, to stdout or `--out`: a reinforcement-learning trainer's samples from the
    /// token ids the run kept (`spec.model.tokens`), or ATIF, ADP, `ShareGPT` or `OpenAI`
    /// messages (docs/training-data.md).
    Export {
        /// The run's output directory (where `trajectories.jsonl` and
        /// `trajectories.tokens.jsonl` are).
        run_dir: PathBuf,
        /// The format: a trainer's sample shape (needs the server's ids) or a conversation
        /// format (ATIF, ADP, `ShareGPT`, `OpenAI` messages).
        #[arg(long, value_enum)]
        format: crate::export::ExportFormat,
        /// Sample shapes: instead of refusing trajectories without the server's own ids, write
        /// those whose ids were made again from text (`retokenized`) and leave out the rest.
        #[arg(long)]
        force: bool,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Run one prompt end to end and print its record.
    Prompt {
        /// The `TrajectoryRun` YAML whose model and tools to use.
        run_file: PathBuf,
        /// The prompt.
        prompt: String,
        /// Toolsets to offer (default: drawn from the run's distribution for prompt 0).
        #[arg(long, value_delimiter = ',')]
        toolsets: Option<Vec<String>>,
        #[command(flatten)]
        workspaces: WorkspaceArgs,
    },
    /// List the built-in toolset distributions, the toolsets each draws and what each toolset
    /// needs configured; with a run file, which distributions it can serve and what it lacks
    /// (exits non-zero when its own distribution cannot run).
    Distributions {
        /// A `TrajectoryRun` YAML to check the distributions against.
        run_file: Option<PathBuf>,
    },
}

/// Where the run plan comes from.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The run plan JSON (in a pod, the mounted `ConfigMap`).
    #[arg(long, env = env::PLAN_PATH, conflicts_with = "run_file")]
    pub plan: Option<PathBuf>,
    /// A run file instead of a plan (for running a step by hand).
    #[arg(long)]
    pub run_file: Option<PathBuf>,
    /// Root of the storage volume, or an `s3://bucket/prefix` location (a plan whose
    /// `spec.storage.object` names a bucket is on that bucket).
    #[arg(long, env = env::STORAGE_ROOT, default_value = paths::STORAGE_ROOT)]
    pub storage_root: PathBuf,
    #[command(flatten)]
    pub bucket: BucketArgs,
    /// Where the summary for the operator is written.
    #[arg(long, env = env::TERMINATION_LOG)]
    pub termination_log: Option<PathBuf>,
}

/// What a run on this machine (`local`, `oracle`) is given.
#[derive(Debug, Args)]
pub struct LocalArgs {
    /// The `TrajectoryRun` YAML.
    run_file: PathBuf,
    /// Root the dataset and output paths are relative to: a directory, or an
    /// `s3://bucket/prefix` location (default: the run file's directory).
    #[arg(long, env = env::STORAGE_ROOT)]
    storage: Option<PathBuf>,
    #[command(flatten)]
    bucket: BucketArgs,
    #[command(flatten)]
    workspaces: WorkspaceArgs,
    /// Print periodic progress lines instead of a progress bar.
    #[arg(long)]
    no_progress_bar: bool,
}

/// How to reach the bucket when the storage is an `s3://` location. Credentials are read from
/// the environment as AWS SDKs read them (`AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`, a
/// web-identity token, the container credentials endpoint), never from flags.
#[derive(Debug, Args)]
pub struct BucketArgs {
    /// The S3 server's URL (default: AWS's for the region).
    #[arg(long, env = env::S3_ENDPOINT)]
    pub s3_endpoint: Option<String>,
    /// The region requests are signed for (default: `AWS_REGION`, else us-east-1).
    #[arg(long, env = env::S3_REGION)]
    pub s3_region: Option<String>,
    /// Address the bucket as `<endpoint>/<bucket>` instead of `<bucket>.<endpoint>`.
    #[arg(long, env = env::S3_PATH_STYLE)]
    pub s3_path_style: bool,
}

impl BucketArgs {
    pub fn options(&self) -> crate::storage::BucketOptions {
        crate::storage::BucketOptions {
            endpoint: self.s3_endpoint.clone(),
            region: self.s3_region.clone(),
            path_style: self.s3_path_style,
            keys: None,
        }
    }
}

#[derive(Debug, Args)]
pub struct WorkspaceArgs {
    /// Directory for per-conversation tool workspaces.
    #[arg(long, env = env::WORKSPACE_ROOT)]
    pub workspace_root: Option<PathBuf>,
    /// Landlock confinement of terminal commands: `auto` where the kernel has it, `required` to
    /// refuse commands it cannot confine, `off` to run without it (default: the run's
    /// `spec.sandbox.landlock`).
    #[arg(long, env = env::LANDLOCK, value_parser = parse_landlock)]
    pub landlock: Option<LandlockMode>,
    /// A directory of this machine that terminal commands may read and run programs from besides
    /// the system's (a toolchain under the home directory: a pyenv version, a conda environment),
    /// as `spec.sandbox.toolDirs` names them; added to the run's. Repeat it, or separate several
    /// with ':' in the variable. Local runs (`local`, `prompt`).
    #[arg(long = "tool-dir", env = env::TOOL_DIRS, value_delimiter = ':')]
    pub tool_dirs: Vec<String>,
    /// The `trajectory-executor` binary that runs each terminal command (default: the one next to
    /// this program, else the one on PATH).
    #[arg(long, env = env::EXECUTOR)]
    pub executor: Option<PathBuf>,
    /// Send terminal commands to the sandbox container's executor listening on this Unix socket
    /// instead of starting an executor here (the generation pods).
    #[arg(long, env = env::SANDBOX_SOCKET, conflicts_with = "executor")]
    pub sandbox_socket: Option<PathBuf>,
    /// Run each conversation's terminal in a task container of its row's image: conversation *k*
    /// of the batch through the socket `slot-<k>/executor.sock` under this directory (the
    /// generation pods of a run whose rows name images).
    #[arg(long, env = env::TASK_SOCKETS, requires = "sandbox_socket")]
    pub task_sockets: Option<PathBuf>,
    /// The batch's rows name an image that could not be pulled (this says which, and why):
    /// record each conversation failed with reason `image_unavailable`, without a model request.
    #[arg(long, env = env::IMAGE_UNAVAILABLE, conflicts_with = "task_sockets")]
    pub image_unavailable: Option<String>,
    /// The batch's rows name an image whose build failed (this says which, and why): record each
    /// conversation failed with reason `image_build_failed`, without a model request.
    #[arg(
        long,
        env = env::IMAGE_BUILD_FAILED,
        conflicts_with_all = ["task_sockets", "image_unavailable"]
    )]
    pub image_build_failed: Option<String>,
}

fn parse_landlock(text: &str) -> Result<LandlockMode, String> {
    LandlockMode::parse(text).ok_or_else(|| format!("expected auto, required or off, not {text:?}"))
}

impl WorkspaceArgs {
    /// Where terminal commands run, and with which limits; the Landlock flag overrides the
    /// run's setting.
    fn sandbox(&self, spec: &SandboxSpec) -> Sandbox {
        let landlock = self.landlock.unwrap_or(match spec.landlock {
            LandlockSetting::Auto => LandlockMode::Auto,
            LandlockSetting::Required => LandlockMode::Required,
            LandlockSetting::Off => LandlockMode::Off,
        });
        let sandbox = match (&self.sandbox_socket, &self.executor) {
            (Some(socket), _) => Sandbox::pod(socket, landlock),
            (None, Some(executor)) => Sandbox::new(executor, landlock),
            (None, None) => Sandbox::local(landlock),
        };
        sandbox.with_limits(spec.limits.into())
    }

    /// Says once whether terminal commands will be confined by Landlock, and refuses to start
    /// when they must be and cannot.
    async fn check_sandbox(&self, sandbox: &Sandbox) -> Result<LandlockStatus, RunError> {
        if sandbox.landlock == LandlockMode::Off {
            warn!(
                "Landlock is off (--landlock off): terminal commands can reach every file this uid can"
            );
            return Ok(LandlockStatus::Off);
        }
        let root = self.root();
        std::fs::create_dir_all(&root).map_err(|err| {
            RunError::Internal(format!("cannot create {}: {err}", root.display()))
        })?;
        let enforced = sandbox.landlock_enforced(&root).await.map_err(|err| {
            RunError::Internal(format!("cannot start the terminal's executor: {err}"))
        })?;
        match (enforced, sandbox.landlock) {
            (true, _) => {
                info!("terminal commands are confined by Landlock to their workspace");
                Ok(LandlockStatus::Enforced)
            }
            (false, LandlockMode::Required) => Err(RunError::Spec(format!(
                "Landlock is required (spec.sandbox.landlock, {} or --landlock) but the kernel \
                 where the commands run does not enforce it",
                env::LANDLOCK
            ))),
            (false, _) => {
                warn!(
                    "this kernel does not enforce Landlock: terminal commands can reach every file \
                     this uid can (set spec.sandbox.landlock: required to refuse to run like this)"
                );
                Ok(LandlockStatus::NotEnforced)
            }
        }
    }

    /// Opens the run's tool directories and this command's `--tool-dir`s to the commands of a
    /// local `sandbox`, once checked against `guarded` (what the commands must not reach besides
    /// the home directory and the workspaces) and, where Landlock confines the commands, once
    /// each one's Python runs there; says which entries of `PATH` the commands cannot run
    /// programs from. Returns the sandbox and those entries.
    async fn open_tool_dirs(
        &self,
        sandbox: Sandbox,
        spec: &SandboxSpec,
        landlock: LandlockStatus,
        guarded: Vec<Guarded>,
    ) -> Result<(Sandbox, Vec<PathBuf>), RunError> {
        let named: Vec<NamedDir> = spec
            .tool_dirs
            .iter()
            .enumerate()
            .map(|(index, dir)| NamedDir {
                place: format!("spec.sandbox.toolDirs[{index}]"),
                dir: dir.clone(),
            })
            .chain(self.tool_dirs.iter().map(|dir| NamedDir {
                place: "--tool-dir".to_owned(),
                dir: dir.clone(),
            }))
            .collect();
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let guarded: Vec<Guarded> = home
            .iter()
            .map(|home| Guarded::new("the home directory", home))
            .chain([Guarded::whole("the conversations' workspaces", self.root())])
            .chain(
                std::env::var_os(env::MODEL_API_KEY_FILE)
                    .map(|file| Guarded::new("the model's key file", file)),
            )
            .chain(guarded)
            .collect();
        let dirs = tool_dirs::resolve(&named, &guarded, home.as_deref()).map_err(RunError::Spec)?;
        let mut sandbox = sandbox.with_tool_dirs(dirs);
        if landlock != LandlockStatus::Enforced {
            // What the executor does where the kernel has no Landlock; said so, the terminal
            // does not take a file's own permissions for the sandbox's refusal.
            sandbox.landlock = LandlockMode::Off;
            return Ok((sandbox, Vec::new()));
        }
        let scratch = tempfile::Builder::new()
            .prefix("tool-dirs-check-")
            .tempdir_in(self.root())
            .map_err(|err| RunError::Internal(format!("cannot create a workspace: {err}")))?;
        tool_dirs::check_interpreters(&sandbox, scratch.path())
            .await
            .map_err(RunError::Spec)?;
        let dropped = sandbox.command_files().map_or_else(Vec::new, |files| {
            let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
            trajectory_sandbox::reach::command_path(&path, &files, true).dropped
        });
        if !dropped.is_empty() {
            eprintln!(
                "terminal commands' PATH leaves out {}: the sandbox cannot run programs there \
                 (to give the commands a toolchain from there, name its directory in \
                 spec.sandbox.toolDirs or with --tool-dir)",
                shown_paths(&dropped, home.as_deref())
            );
        }
        Ok((sandbox, dropped))
    }

    fn root(&self) -> PathBuf {
        self.workspace_root
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("trajectory-workspaces"))
    }
}

impl RunArgs {
    fn location(&self) -> Result<RunLocation, RunError> {
        let plan = match (&self.plan, &self.run_file) {
            (Some(path), _) => load_plan(path)?,
            (None, Some(path)) => RunFile::load(path)?.to_plan(),
            (None, None) => {
                return Err(RunError::Spec(format!(
                    "no run plan: pass --plan (or set {}) or --run-file",
                    env::PLAN_PATH
                )));
            }
        };
        RunLocation::of_plan(self.storage_root.clone(), &self.bucket.options(), plan)
    }

    /// Writes the summary (or the error) where the operator reads it.
    fn report<T: Serialize>(&self, result: &Result<T, RunError>) {
        let Some(path) = &self.termination_log else {
            return;
        };
        let message = match result {
            Ok(summary) => termination_message(summary),
            Err(error) => {
                let mut failure =
                    WorkerFailure::new(&error.to_string(), error.reason(), error.exit_code());
                if let RunError::BudgetExhausted {
                    max_cost, spent, ..
                } = error
                {
                    failure.budget = Some(*max_cost);
                    failure.run_spent = Some(crate::contract::usd_text(*spent));
                }
                termination_message(&failure)
            }
        };
        if let Err(err) = std::fs::write(path, message) {
            error!(path = %path.display(), %err, "cannot write the termination message");
        }
    }
}

/// Starts logging to stderr.
/// The whole `trajectory-worker` process; returns its exit code.
pub fn main() -> i32 {
    let dumpable = hide_from_same_uid_processes();
    let huge_pages = disable_transparent_huge_pages();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    if let Err(err) = dumpable {
        error!(%err, "cannot mark the process non-dumpable: tool commands may read its memory");
    }
    if let Err(err) = huge_pages {
        debug!(%err, "transparent huge pages stay enabled");
    }
    match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime.block_on(run(cli)),
        Err(err) => {
            error!(%err, "cannot start the async runtime");
            exit::TRANSIENT
        }
    }
}

/// Marks the process non-dumpable, first thing, before it reads a secret.
///
/// The worker holds the model API key in its environment and memory, and tool commands run as the
/// same uid. A non-dumpable process's `/proc/<pid>/environ`, `mem`, `maps`, `fd/` and the like are
/// owned by root and refused to other processes of the uid (the kernel's ptrace access check), and
/// it cannot be ptrace-attached or core-dumped. `/proc/<pid>/cmdline` stays world-readable, which
/// is why no secret is ever passed on a command line. The process itself keeps full access to its
/// own `/proc/self` (the file tools read `/proc/self/fd`).
fn hide_from_same_uid_processes() -> nix::Result<()> {
    nix::sys::prctl::set_dumpable(false)
}

/// Turns transparent huge pages off for this process before it allocates much.
///
/// Where THP is `always` (as on many nodes), every 2 MiB-aligned region the allocator touches is
/// backed by a whole 2 MiB page: the plan's peak RSS went from 20 to 46 MiB with mimalloc, and a
/// pod's memory limit counts those pages. None of the worker's work gains from huge pages.
fn disable_transparent_huge_pages() -> nix::Result<()> {
    nix::sys::prctl::set_thp_disable(true)
}

pub fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Pretty => builder.compact().init(),
    }
}

/// Triggers shutdown on SIGINT or SIGTERM.
fn watch_signals(trigger: ShutdownTrigger) {
    tokio::spawn(async move {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(err) => {
                    error!(%err, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
        eprintln!("stopping: finishing in-flight conversations (send again to force)…");
        trigger.trigger();
        // A second signal ends the process at once; storage holds only whole lines either way.
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
        std::process::exit(exit::INTERRUPTED);
    });
}

/// Runs the command and returns the process exit code.
pub async fn run(cli: Cli) -> i32 {
    let (trigger, shutdown) = shutdown_channel();
    watch_signals(trigger);
    let result = dispatch(cli.command, &shutdown).await;
    match result {
        Ok(()) => exit::OK,
        Err(error) => {
            error!(reason = error.reason(), "{error}");
            eprintln!("error: {error}");
            error.exit_code()
        }
    }
}

/// `build-context`: the build readied in `dir`; an error is reported to the operator.
async fn build_context_command(run: &RunArgs, index: u32, dir: PathBuf) -> Result<(), RunError> {
    let result = match run.location() {
        Ok(location) => {
            blocking(move || crate::run::builds::prepare(&location, index, &dir).map(|_| ())).await
        }
        Err(error) => Err(error),
    };
    if result.is_err() {
        run.report(&result);
    }
    result
}

/// `build`: the readied build built and pushed, its report written where the operator reads it.
async fn build_command(
    dir: &Path,
    buildah: &Path,
    termination_log: Option<&Path>,
) -> Result<(), RunError> {
    let report = crate::run::builds::build(dir, buildah).await?;
    let message = termination_message(&report);
    if let Some(path) = termination_log
        && let Err(err) = std::fs::write(path, &message)
    {
        error!(path = %path.display(), %err, "cannot write the termination message");
    }
    println!("{message}");
    Ok(())
}

async fn dispatch(command: Command, shutdown: &Shutdown) -> Result<(), RunError> {
    match command {
        Command::Local { local, base_url } => {
            let report = local_command(local, base_url, false, shutdown).await?;
            print!("{}", render_report(&report));
            Ok(())
        }
        Command::Oracle { local } => {
            let report = local_command(local, None, true, shutdown).await?;
            print!("{}", render_report(&report));
            oracle_verdict(&report)
        }
        Command::Plan(args) => {
            let result = match args.location() {
                Ok(location) => blocking(move || plan::plan_for_operator(&location)).await,
                Err(error) => Err(error),
            };
            args.report(&result);
            println!("{}", termination_message(&result?));
            Ok(())
        }
        Command::Batch {
            run,
            index,
            batch,
            workspaces,
            shutdown_grace_seconds,
        } => {
            let grace = Duration::from_secs(shutdown_grace_seconds);
            let result = batch_command(&run, (index, batch), &workspaces, grace, shutdown).await;
            run.report(&result);
            println!("{}", termination_message(&result?));
            Ok(())
        }
        Command::ImagePage { run, page, index } => {
            let result = match run.location() {
                Ok(location) => crate::run::plan::image_page(&location, &index, page),
                Err(error) => Err(error),
            };
            run.report(&result);
            println!("{}", termination_message(&result?));
            Ok(())
        }
        Command::BuildContext { run, index, dir } => build_context_command(&run, index, dir).await,
        Command::Build {
            dir,
            buildah,
            termination_log,
        } => build_command(&dir, &buildah, termination_log.as_deref()).await,
        Command::Merge(args) => {
            let result = match args.location() {
                Ok(location) => blocking(move || merge::merge(&location)).await,
                Err(error) => Err(error),
            };
            args.report(&result);
            println!("{}", termination_message(&result?));
            Ok(())
        }
        Command::Prompt {
            run_file,
            prompt,
            toolsets,
            workspaces,
        } => prompt_command(&run_file, &prompt, toolsets, &workspaces).await,
        Command::Distributions { run_file } => {
            crate::run::distributions::print(run_file.as_deref())
        }
        Command::Export {
            run_dir,
            format,
            force,
            out,
        } => blocking(move || export_to(&run_dir, format, force, out.as_deref())).await,
        Command::Report { run_dir } => {
            let path =
                blocking(move || merge::rewrite_report(&crate::storage::RunDir::new(run_dir)))
                    .await?;
            println!("{}", path.display());
            Ok(())
        }
    }
}

/// `prompt`: one prompt end to end, its record printed.
async fn prompt_command(
    run_file: &Path,
    prompt: &str,
    toolsets: Option<Vec<String>>,
    workspaces: &WorkspaceArgs,
) -> Result<(), RunError> {
    let spec = RunFile::load(run_file)?.spec.sandbox;
    let sandbox = workspaces.sandbox(&spec);
    let landlock = workspaces.check_sandbox(&sandbox).await?;
    let (sandbox, _) = workspaces
        .open_tool_dirs(sandbox, &spec, landlock, Vec::new())
        .await?;
    let record =
        crate::run::prompt::run_prompt(run_file, prompt, toolsets, workspaces.root(), sandbox)
            .await?;
    println!(
        "{}",
        serde_json::to_string_pretty(&record).unwrap_or_default()
    );
    Ok(())
}

/// [`crate::export::export`] to `out` (a file, written whole or not at all) or stdout, saying
/// what it wrote on stderr.
fn export_to(
    run_dir: &Path,
    format: crate::export::ExportFormat,
    force: bool,
    out: Option<&Path>,
) -> Result<(), RunError> {
    let summary = export_into(run_dir, format, force, out)?;
    if format.trains_on_ids() {
        eprintln!(
            "exported {} trajectories as {} samples ({} of them with ids made again from text; {} \
             left out without ids)",
            summary.trajectories, summary.samples, summary.retokenized, summary.skipped
        );
    } else {
        eprintln!("exported {} trajectories", summary.trajectories);
    }
    Ok(())
}

fn export_into(
    run_dir: &Path,
    format: crate::export::ExportFormat,
    force: bool,
    out: Option<&Path>,
) -> Result<crate::export::ExportSummary, RunError> {
    let Some(out) = out else {
        let mut stdout = std::io::BufWriter::new(std::io::stdout().lock());
        let summary = crate::export::export(run_dir, format, force, &mut stdout)?;
        stdout
            .flush()
            .map_err(|err| StorageError::new("writing", Path::new("<stdout>"), err))?;
        return Ok(summary);
    };
    let temp = out.with_extension("partial");
    let file =
        std::fs::File::create(&temp).map_err(|err| StorageError::new("creating", &temp, err))?;
    let mut writer = std::io::BufWriter::new(file);
    let summary = crate::export::export(run_dir, format, force, &mut writer)?;
    writer
        .into_inner()
        .map_err(|err| StorageError::new("writing", &temp, err.into_error()))?
        .sync_all()
        .map_err(|err| StorageError::new("syncing", &temp, err))?;
    std::fs::rename(&temp, out).map_err(|err| StorageError::new("renaming", &temp, err))?;
    Ok(summary)
}

/// Runs blocking file work off the async runtime's threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, RunError> + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| RunError::Internal(err.to_string()))
        .and_then(|result| result)
}

async fn local_command(
    local: LocalArgs,
    base_url: Option<String>,
    oracle: bool,
    shutdown: &Shutdown,
) -> Result<crate::run::local::LocalReport, RunError> {
    let LocalArgs {
        run_file,
        storage,
        bucket,
        workspaces,
        no_progress_bar,
    } = local;
    let workspaces = &workspaces;
    let run = RunFile::load(&run_file)?;
    let sandbox = workspaces.sandbox(&run.spec.sandbox);
    let landlock = workspaces.check_sandbox(&sandbox).await?;
    // The run's storage on this machine: what --storage names, else the run file's directory
    // (unless the run's storage is a bucket).
    let storage_dir = match &storage {
        Some(root) if !root.to_string_lossy().starts_with("s3://") => Some(root.clone()),
        Some(_) => None,
        None if run.spec.storage.object.is_some() => None,
        None => Some(
            run_file
                .parent()
                .filter(|dir| !dir.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
        ),
    };
    let guarded = storage_dir
        .into_iter()
        .map(|dir| Guarded::whole("the run's storage", dir))
        .chain([Guarded::new("the run file", run_file.clone())])
        .collect();
    let (sandbox, path_dropped) = workspaces
        .open_tool_dirs(sandbox, &run.spec.sandbox, landlock, guarded)
        .await?;
    let options = LocalOptions {
        run_file,
        storage,
        bucket: bucket.options(),
        base_url,
        oracle,
        workspace_root: workspaces.root(),
        sandbox,
        path_dropped,
        progress: if no_progress_bar {
            ProgressMode::Lines
        } else {
            ProgressMode::Auto
        },
    };
    run_local(&options, shutdown).await
}

/// What `oracle` says of its run: the rows whose solution did not earn the full reward, named,
/// make it fail.
fn oracle_verdict(report: &crate::run::local::LocalReport) -> Result<(), RunError> {
    let summary = report
        .statistics
        .as_ref()
        .map(|statistics| &statistics["oracle"])
        .filter(|summary| summary.is_object())
        .ok_or_else(|| {
            RunError::Internal("the oracle run's statistics have no oracle summary".into())
        })?;
    let count = |key: &str| summary[key].as_u64().unwrap_or(0);
    let report_path = report.run_dir.join(crate::run::oracle::ORACLE_REPORT);
    println!(
        "oracle: {} of {} passed (the full reward); report {}",
        count("passed"),
        count("records"),
        report_path.display()
    );
    if count("failed") == 0 {
        return Ok(());
    }
    let named: Vec<&str> = summary["failed_rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_str)
        .collect();
    Err(RunError::OracleFailed(format!(
        "{} of {} rows did not pass the oracle: {}{}",
        count("failed"),
        count("records"),
        named.join(", "),
        if (named.len() as u64) < count("failed") {
            format!(", … (all in {})", report_path.display())
        } else {
            String::new()
        }
    )))
}

async fn batch_command(
    run: &RunArgs,
    (index, batch): (Option<u32>, Option<u32>),
    workspaces: &WorkspaceArgs,
    grace: Duration,
    shutdown: &Shutdown,
) -> Result<crate::contract::BatchSummary, RunError> {
    // Before anything else: the worker's start is when its wait for the sidecars ended.
    let pod_start = workspaces
        .sandbox_socket
        .as_deref()
        .zip(workspaces.task_sockets.as_deref())
        .and_then(|(sandbox, tasks)| {
            crate::run::pulls::PodStart::read(sandbox, tasks, std::time::SystemTime::now())
        });
    let location = run.location()?;
    let batch = match (batch, index) {
        (Some(batch), _) => batch,
        // Reads the plan's pending list from storage when it has one: blocking, but once.
        (None, Some(index)) => location.batch_for_index(index)?,
        (None, None) => {
            return Err(RunError::Spec(format!(
                "no batch: pass a batch id or set {}",
                env::JOB_COMPLETION_INDEX
            )));
        }
    };
    let sandbox = workspaces.sandbox(&location.plan.spec.sandbox);
    let landlock = workspaces.check_sandbox(&sandbox).await?;
    if !location.plan.spec.sandbox.tool_dirs.is_empty() {
        info!(
            "spec.sandbox.toolDirs is for local runs (`local`, `prompt`); a batch's commands \
             have the directories of their sandbox's image"
        );
    }
    let manifest = Manifest::require(&location.run_dir())?;
    let mut engine = Engine::new(&location.plan.spec, workspaces.root())?;
    engine.learn_chat_template().await;
    // At most `workers` pods run the run's batches at once: each keeps that share of a limit.
    engine.keep_limits(&location.plan.spec, u64::from(location.plan.spec.workers));
    // Likewise for the budget: each pod grows its allowance by a `workers` share of what the
    // run's other pods leave free.
    let (spec, run_dir) = (location.plan.spec.clone(), location.run_dir());
    let ledger = blocking(move || Ledger::for_run(&spec, &run_dir, spec.workers)).await?;
    if let Some(ledger) = &ledger {
        engine.keep_ledger(ledger.clone());
        // Ends by itself once the ledger is finished.
        let _refresher = ledger.keep_fresh();
    }
    engine.sandbox = sandbox;
    engine.grace = grace;
    engine.task_sockets.clone_from(&workspaces.task_sockets);
    engine.pod_start = pod_start;
    engine
        .image_unavailable
        .clone_from(&workspaces.image_unavailable);
    engine
        .image_build_failed
        .clone_from(&workspaces.image_build_failed);
    let mut result = run_batch(&engine, &location, &manifest, batch, shutdown, &|_| {}).await;
    if let Ok(summary) = &mut result {
        summary.landlock = Some(landlock);
    }
    let Some(ledger) = ledger else {
        return result;
    };
    match &mut result {
        Ok(summary) => {
            let spent = blocking(move || ledger.finish().map_err(RunError::from)).await?;
            summary.run_spent = Some(crate::contract::usd_text(spent));
        }
        // What the claims said when the budget had no room lags: this pod's conversations in
        // flight then, and the other pods', went on spending. The report is what the operator
        // shows as the run's spending, so it is read again once this pod's claim is final and
        // the others had time to write theirs; if that fails, the stop at the budget is still
        // what the pod reports.
        Err(RunError::BudgetExhausted { spent, .. }) => {
            let settled = move || {
                ledger.finish()?;
                ledger.settled_spent()
            };
            match blocking(move || settled().map_err(RunError::from)).await {
                Ok(now) => *spent = now,
                Err(error) => {
                    warn!(%error, "the run's spending could not be read again at the budget");
                }
            }
        }
        // Other stops leave the claim to the ledger's drop, which marks it finished.
        Err(_) => {}
    }
    result
}

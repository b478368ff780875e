//! The contract between the operator and the worker: the run plan a pod receives, the names of
//! the environment variables and mount paths, the exit codes, and the summaries the worker
//! reports through the pod's termination message.
//!
//! It builds with serde alone so that the operator can depend on it (`default-features = false`)
//! without pulling in the HTTP client or the tools. Change it only in ways both sides understand:
//! the operator of one version may schedule worker images of another.

use serde::{Deserialize, Serialize};

use crate::spec::{NamedValue, RunSpec, SecretKeyRef, ToolsSpec};

/// Environment variables, named in one place for the operator (which writes pod specs) and the
/// worker (which reads them).
pub mod env {
    /// Path of the run plan JSON (a mounted `ConfigMap` in a pod).
    pub const PLAN_PATH: &str = "TRAJ_PLAN_PATH";
    /// Root of the shared storage volume, or an `s3://bucket/prefix` location; dataset and
    /// output paths are relative to it.
    pub const STORAGE_ROOT: &str = "TRAJ_STORAGE_ROOT";
    /// The S3 server's URL when the storage is a bucket (default: AWS's for the region).
    pub const S3_ENDPOINT: &str = "TRAJ_S3_ENDPOINT";
    /// The region S3 requests are signed for.
    pub const S3_REGION: &str = "TRAJ_S3_REGION";
    /// `true`: address the bucket as `<endpoint>/<bucket>` (most self-hosted servers).
    pub const S3_PATH_STYLE: &str = "TRAJ_S3_PATH_STYLE";
    /// The batch index Kubernetes gives each pod of an Indexed Job.
    pub const JOB_COMPLETION_INDEX: &str = "JOB_COMPLETION_INDEX";
    /// The model API key, from a Secret reference.
    pub const MODEL_API_KEY: &str = "TRAJ_MODEL_API_KEY";
    /// A file holding the model API key (a mounted Secret), used when the variable above is unset.
    pub const MODEL_API_KEY_FILE: &str = "TRAJ_MODEL_API_KEY_FILE";
    /// The simulated user's model API key, from `spec.userSimulator.model.apiKeySecretRef`.
    pub const USER_SIMULATOR_API_KEY: &str = "TRAJ_USER_SIMULATOR_API_KEY";
    /// The web search backend's API key, from `spec.tools.web.search.apiKeySecretRef`.
    pub const WEB_SEARCH_API_KEY: &str = "TRAJ_WEB_SEARCH_API_KEY";
    /// Where the termination summary is written.
    pub const TERMINATION_LOG: &str = "TRAJ_TERMINATION_LOG";
    /// Directory under which per-conversation tool workspaces are created.
    pub const WORKSPACE_ROOT: &str = "TRAJ_WORKSPACE_ROOT";
    /// Landlock confinement of terminal commands: `auto`, `required` or `off`.
    pub const LANDLOCK: &str = "TRAJ_LANDLOCK";
    /// Directories (':'-separated) a local run's terminal commands may read and run programs
    /// from besides the system's: `local --tool-dir`.
    pub const TOOL_DIRS: &str = "TRAJ_TOOL_DIRS";
    /// `json` or `pretty` log output.
    pub const LOG_FORMAT: &str = "TRAJ_LOG_FORMAT";
    /// The `trajectory-executor` binary a worker starts for each terminal command.
    pub const EXECUTOR: &str = "TRAJ_EXECUTOR";
    /// The Unix socket of the sandbox container's executor (generation pods).
    pub const SANDBOX_SOCKET: &str = "TRAJ_SANDBOX_SOCKET";
    /// The directory of the task containers' sockets (generation pods of a run whose rows name
    /// their own images): conversation *k* of the batch runs its commands through
    /// [`super::paths::task_socket`]`(dir, k)`.
    pub const TASK_SOCKETS: &str = "TRAJ_TASK_SOCKETS";
    /// Set by the operator on the pods of rows whose image could not be pulled: the image and
    /// the node's message. The batch records each conversation failed, `image_unavailable`.
    pub const IMAGE_UNAVAILABLE: &str = "TRAJ_IMAGE_UNAVAILABLE";
    /// Set by the operator on the pods of rows whose image could not be built: the image and
    /// why. The batch records each conversation failed, `image_build_failed`.
    pub const IMAGE_BUILD_FAILED: &str = "TRAJ_IMAGE_BUILD_FAILED";
    /// The directory a build pod's containers share: the context, unpacked with its
    /// `Dockerfile`'s base images rewritten, and the build's line of the build list.
    pub const BUILD_DIR: &str = "TRAJ_BUILD_DIR";
    /// The plan's image index (relative to the run's directory) whose page
    /// `JOB_COMPLETION_INDEX` an `image-page` pod reports.
    pub const IMAGE_INDEX: &str = "TRAJ_IMAGE_INDEX";
    /// Seconds a batch's conversations in flight get to finish after `SIGTERM`; set by the
    /// operator below the pod's `terminationGracePeriodSeconds` ([`super::shutdown_grace`]).
    pub const SHUTDOWN_GRACE_SECONDS: &str = "TRAJ_SHUTDOWN_GRACE_SECONDS";
}

/// What a batch pod's conversations get to finish after `SIGTERM` when its grace period is
/// `pod_grace` seconds (Kubernetes' default: 30): that, less [`SHUTDOWN_MARGIN_SECONDS`]. The
/// kubelet stops a pod's sidecars (the sandbox, the task containers) once the worker has ended
/// or the grace period has passed; the margin ends the conversations first, so none of them runs
/// a tool in a container that is going away, and lets the worker write what finished and exit.
pub fn shutdown_grace(pod_grace: Option<u32>) -> u64 {
    u64::from(pod_grace.unwrap_or(30)).saturating_sub(SHUTDOWN_MARGIN_SECONDS)
}

/// See [`shutdown_grace`]: the kubelet gives a sidecar at least 2 s, and the worker needs about
/// as much to write its last records and exit.
pub const SHUTDOWN_MARGIN_SECONDS: u64 = 5;

/// Every Secret key a tool setting of `tools` refers to, with the environment variable the
/// worker reads it from: the operator puts exactly these into the worker container (never into the
/// sandbox container, where the model's commands run).
pub fn secret_env(tools: &ToolsSpec) -> Vec<(String, &SecretKeyRef)> {
    fn named(values: &[NamedValue]) -> impl Iterator<Item = &SecretKeyRef> {
        values
            .iter()
            .filter_map(|value| value.value_from.as_ref()?.secret_key_ref.as_ref())
    }
    let mut refs: Vec<&SecretKeyRef> = Vec::new();
    for server in &tools.mcp {
        if let Some(http) = &server.streamable_http {
            refs.extend(named(&http.headers));
        }
        if let Some(stdio) = &server.stdio {
            refs.extend(named(&stdio.env));
        }
    }
    for group in &tools.http {
        for tool in &group.tools {
            refs.extend(named(&tool.headers));
        }
    }
    let vision_key = tools.vision.as_ref().and_then(|v| v.api_key.as_ref());
    let image_key = tools.image_gen.as_ref().and_then(|i| i.api_key.as_ref());
    refs.extend(
        vision_key
            .into_iter()
            .chain(image_key)
            .filter_map(|source| source.secret_key_ref.as_ref()),
    );
    let mut vars: Vec<(String, &SecretKeyRef)> = refs
        .into_iter()
        .map(|secret| (secret.env_var(), secret))
        .collect();
    if let Some(secret) = tools
        .web
        .search
        .as_ref()
        .and_then(|search| search.api_key_secret_ref.as_ref())
    {
        vars.push((env::WEB_SEARCH_API_KEY.to_owned(), secret));
    }
    let mut seen = std::collections::BTreeSet::new();
    vars.retain(|(name, _)| seen.insert(name.clone()));
    vars
}

/// Paths inside a worker pod.
pub mod paths {
    /// Mount point of the plan `ConfigMap`.
    pub const PLAN_DIR: &str = "/etc/trajectory";
    /// File name of the run plan inside [`PLAN_DIR`].
    pub const PLAN_FILE: &str = "plan.json";
    /// Mount point of the shared storage volume.
    pub const STORAGE_ROOT: &str = "/data";
    /// Kubernetes' default termination message path.
    pub const TERMINATION_LOG: &str = "/dev/termination-log";
    /// Scratch space for tool workspaces (an emptyDir), mounted at this path in the worker and
    /// the sandbox container alike.
    pub const WORKSPACE_ROOT: &str = "/workspace";
    /// Directory of the executor's socket, shared by the worker and the sandbox container (an
    /// emptyDir). Outside every path a confined command may open.
    pub const SANDBOX_SOCKET_DIR: &str = "/sandbox/socket";
    /// File name of the socket inside [`SANDBOX_SOCKET_DIR`].
    pub const SANDBOX_SOCKET_FILE: &str = "executor.sock";
    /// Where the init container puts the executor binary for the sandbox container (an emptyDir).
    pub const SANDBOX_BIN_DIR: &str = "/sandbox/bin";
    /// The run's report page, in its output directory, written by merge.
    pub const REPORT_FILE: &str = "report.html";
    /// Where the worker finds the task containers' sockets, one directory (an emptyDir shared
    /// with that task container alone) a conversation slot.
    pub const TASK_SOCKETS_DIR: &str = "/sandbox/tasks";
    /// The directory a build pod's containers share (an emptyDir), and the only one of the
    /// build container's that holds anything of the run.
    pub const BUILD_DIR: &str = "/build";

    /// The socket of task container `slot` under `dir` ([`TASK_SOCKETS_DIR`] in a pod): its
    /// directory `slot-<slot>`, which the task container mounts at [`SANDBOX_SOCKET_DIR`].
    pub fn task_socket(dir: &std::path::Path, slot: u64) -> std::path::PathBuf {
        dir.join(format!("slot-{slot}")).join(SANDBOX_SOCKET_FILE)
    }
}

/// Process exit codes. Anything not listed is transient: the Job retries the index.
pub mod exit {
    /// Everything asked was done.
    pub const OK: i32 = 0;
    /// A configuration error no retry can fix (401/403 from the model, exhausted credit, a bad
    /// plan). The operator's pod failure policy fails the whole Job on it.
    pub const PERMANENT_CONFIG: i32 = 78;
    /// The batch's input is bad (e.g. the dataset changed under the plan). Fails only this index.
    pub const BAD_BATCH_INPUT: i32 = 65;
    /// A transient failure; retried.
    pub const TRANSIENT: i32 = 1;
    /// Stopped by a signal (SIGTERM / Ctrl-C) after leaving storage consistent; retried.
    pub const INTERRUPTED: i32 = 130;
    /// The run reached `spec.model.budget` (`EX_TEMPFAIL`): nothing failed, and raising the
    /// budget lets it finish.
    pub const BUDGET_EXHAUSTED: i32 = 75;
    /// `trajectory-worker oracle` ran, and some rows' solutions did not earn the full reward.
    pub const ORACLE_FAILED: i32 = 3;
}

/// Kubernetes truncates termination messages at 4096 bytes.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// Everything a worker pod needs to know about its run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunPlan {
    /// Name of the run (the resource name, or the run file's `metadata.name`).
    pub name: String,
    /// Namespace of the run (`local` for local runs).
    pub namespace: String,
    /// UID of the resource; recorded in the manifest as the run's identity.
    #[serde(default)]
    pub uid: String,
    /// The spec as applied.
    pub spec: RunSpec,
    /// Output directory relative to the storage root.
    pub output_path: String,
    /// The batch id each completion index works (`batches[index]`), when index *i* is not batch
    /// *i*. Written as well as [`RunPlan::batch_ranges`] while the list is short, for worker images
    /// that read only this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<Vec<u32>>,
    /// The same list in the compact ranges form (`3-99999,100004`): the *i*-th id of the ranges
    /// is the batch of index *i*. Preferred over [`RunPlan::batches`] when both are present. It
    /// keeps the plan `ConfigMap` small for any number of batches (a generation Job works up to
    /// [`MAX_JOB_COMPLETIONS`] of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_ranges: Option<String>,
    /// A plan's pending list on storage ([`PlanSummary::pending_list`]: a path relative to the
    /// run's output directory). When set, the ids of [`RunPlan::batch_ranges`] (or
    /// [`RunPlan::batches`]) are *slots*, positions in that list, not batch ids: completion index
    /// *i* works the batch at slot *s* of the list, where *s* is the *i*-th id of the ranges, or
    /// *i* when there are none ([`resolve_batch`]). It lets an attempt work the batches of a plan
    /// whose done set is too scattered for its summary to carry. Unset, indexes map as above.
    ///
    /// Only a worker that writes such a list reads one: the plan pod and the generation pods of a
    /// run run the same image, so an operator sets this only from the summary of a plan that wrote
    /// the list. (A worker image of before this field would take the slots for batch ids.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_list: Option<String>,
}

/// The batches of a run that run in containers of one image: the batches of the rows that name
/// it (`image`, else `docker_image`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageGroup {
    /// The image, as the rows name it (the operator applies the run's registry rewrite).
    pub image: String,
    /// Its batches not done at plan time, in the ids the generation Jobs work (batch ids, or
    /// slots of the plan's pending list when it wrote one), as ranges ([`format_ranges`]).
    pub ids: String,
    /// Set by the plan when the image is one the run builds ([`crate::spec::ImageBuilds`]): the
    /// line of the run's build list (`harbor-builds.jsonl`) that builds it, which is the build
    /// Job's completion index. The operator clears it once the build Job reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<u32>,
    /// Set by the operator when building the image failed: why. Its rows are recorded failed,
    /// `image_build_failed`, without a model request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_failed: Option<String>,
    /// Set by the operator with [`ImageGroup::build`] cleared: how the image's build went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built: Option<BuildOutcome>,
    /// Set by the plan when the image's Harbor tasks ask for resources: the limits of each of its
    /// task containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<TaskResources>,
}

/// What the tasks of an image ask of each of their containers: Harbor's `task.toml`
/// `[environment]` `cpus`, `memory_mb` and `storage_mb`, the most any task of the image asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskResources {
    /// CPU, in thousandths of a core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub millicpus: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_mb: Option<u64>,
}

impl TaskResources {
    /// `None` when nothing is asked.
    pub fn asked(self) -> Option<Self> {
        (self != Self::default()).then_some(self)
    }

    /// Each the larger of the two: what two tasks sharing an image need of its containers.
    #[must_use]
    pub fn max(self, other: Self) -> Self {
        Self {
            millicpus: self.millicpus.max(other.millicpus),
            memory_mb: self.memory_mb.max(other.memory_mb),
            storage_mb: self.storage_mb.max(other.storage_mb),
        }
    }
}

impl ImageGroup {
    /// The group of `image` working `ids`, its image not one the run builds.
    pub fn new(image: String, ids: String) -> Self {
        Self {
            image,
            ids,
            build: None,
            build_failed: None,
            built: None,
            resources: None,
        }
    }
}

/// One line of a run's build list (`harbor-builds.jsonl`, written by the plan): a build context
/// and the image it is built as. Line *i* is built by completion index *i* of the round's build
/// Job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuildEntry {
    /// Hex sha256 of the packed context (the gzipped tar the plan wrote), which the image's tag
    /// is.
    pub hash: String,
    /// Where it is pushed: `<spec.sandbox.builds.repository>:<hash>`.
    pub image: String,
    /// The packed context, relative to the run's directory.
    pub context: String,
    /// The tasks (directory names) built from it.
    pub tasks: Vec<String>,
    /// The longest of the tasks' `build_timeout_sec`.
    pub timeout_sec: f64,
}

/// How a build went ([`BuildReport::outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildOutcome {
    /// Built and pushed.
    Built,
    /// The registry held the tag already: nothing built.
    Present,
    /// The build (or the push) failed: its tasks cannot run.
    Failed,
}

/// What a build pod reports to the operator, as its termination message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuildReport {
    /// Its line of the build list (the completion index).
    pub build: u32,
    pub image: String,
    pub outcome: BuildOutcome,
    pub seconds: f64,
    /// Why it failed: the end of the builder's output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The images of the batches a plan found not done, grouped: one generation Job each. Batches of
/// rows that name no image are in no group.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImagePlan {
    /// How many groups there are (distinct images of pending batches).
    pub groups: u32,
    /// The first groups, in the order the dataset first names their images: all of them, unless
    /// [`ImagePlan::index`] is set.
    pub listed: Vec<ImageGroup>,
    /// Set when not every group fits the termination message: the path, relative to the run's
    /// output directory, of the directory holding them all in [`ImagePlan::pages`] pages
    /// (`plan/images-<16 hex digits>`, new on every plan; [`image_page_path`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    /// How many pages the index has, each an [`ImagePage`] that fits a termination message.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pages: u32,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero(value: &u32) -> bool {
    *value == 0
}

/// One page of a plan's image index, as `trajectory-worker image-page` reports it to the
/// operator: groups in the plan's order. A group too large for one page is cut at range
/// boundaries into parts of the same image on consecutive pages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImagePage {
    pub page: u32,
    pub groups: Vec<ImageGroup>,
}

/// The file of page `page` of the image index `index` (both relative to the run's directory).
pub fn image_page_path(index: &str, page: u32) -> String {
    format!("{index}/page-{page}.json")
}

/// `groups` packed into pages of at most `limit` bytes of JSON each, in order.
pub fn image_pages(groups: &[ImageGroup], limit: usize) -> Vec<ImagePage> {
    let mut pages = Vec::new();
    let mut current = ImagePage {
        page: 0,
        groups: Vec::new(),
    };
    let mut queue: std::collections::VecDeque<ImageGroup> = groups.iter().cloned().collect();
    while let Some(group) = queue.pop_front() {
        current.groups.push(group);
        if serialised_within(&current, limit) {
            continue;
        }
        let group = current.groups.pop().expect("pushed above");
        if !current.groups.is_empty() {
            // The next page: the group goes first there.
            queue.push_front(group);
            pages.push(next_page(&mut current));
            continue;
        }
        // Alone and still too large (all its ranges do not fit): the most of its ranges that
        // fit, at least one, the rest on.
        let ranges: Vec<&str> = group.ids.split(',').collect();
        let part = |n: usize| ImageGroup {
            ids: ranges[..n].join(","),
            ..group.clone()
        };
        let fits = longest_fitting(ranges.len() - 1, |n| {
            current.groups = vec![part(n)];
            serialised_within(&current, limit)
        })
        .max(1);
        current.groups = vec![part(fits)];
        if fits < ranges.len() {
            queue.push_front(ImageGroup {
                ids: ranges[fits..].join(","),
                ..group.clone()
            });
        }
        pages.push(next_page(&mut current));
    }
    if !current.groups.is_empty() {
        pages.push(current);
    }
    pages
}

/// `current`, handed on, replaced by the empty page after it.
fn next_page(current: &mut ImagePage) -> ImagePage {
    let next = ImagePage {
        page: current.page + 1,
        groups: Vec::new(),
    };
    std::mem::replace(current, next)
}

/// Pages read back into the groups they were cut from: parts of one image on consecutive pages
/// joined again.
pub fn groups_of_pages(pages: &[ImagePage]) -> Vec<ImageGroup> {
    let mut groups: Vec<ImageGroup> = Vec::new();
    for group in pages.iter().flat_map(|page| &page.groups) {
        match groups.last_mut() {
            Some(last) if last.image == group.image => {
                last.ids.push(',');
                last.ids.push_str(&group.ids);
            }
            _ => groups.push(group.clone()),
        }
    }
    groups
}

/// The most task containers (conversations) a generation pod of rows naming an image holds: each
/// is a container of the row's image, started with the pod and idle once its conversation ended.
pub const MAX_TASK_CONTAINERS: u32 = 16;

/// Prompts in a batch of rows naming an image: `batchSize`, but no more than leave each of their
/// `samples` conversations a task container of its own ([`MAX_TASK_CONTAINERS`]), and at least 1.
pub fn task_batch_prompts(batch_size: u32, samples: u32) -> u32 {
    (MAX_TASK_CONTAINERS / samples.max(1)).clamp(1, batch_size.max(1))
}

/// Task containers in a generation pod of rows naming an image: one a conversation of its batch.
pub fn task_slots(batch_size: u32, samples: u32) -> u32 {
    task_batch_prompts(batch_size, samples) * samples.max(1)
}

/// Kubernetes refuses an Indexed Job with `backoffLimitPerIndex` and more completions than this;
/// a generation attempt of more batches runs as several Jobs.
pub const MAX_JOB_COMPLETIONS: u32 = 100_000;

/// The longest pending list also written as [`RunPlan::batches`] (about 8 bytes an id).
pub const MAX_LISTED_BATCHES: usize = 10_000;

impl RunPlan {
    /// The batch a Job completion index works; `None` past the end of the list, when the ranges
    /// cannot be read, or when the plan has a [`RunPlan::pending_list`] (the batch is in that file
    /// on storage: see [`resolve_batch`]).
    pub fn batch_for_index(&self, index: u32) -> Option<u32> {
        if self.pending_list.is_some() {
            return None;
        }
        self.slot_for_index(index)
    }

    /// What a Job completion index maps to through [`RunPlan::batch_ranges`] or
    /// [`RunPlan::batches`] (index *i* itself when neither is set): the batch id, or its slot in
    /// the pending list when the plan has a [`RunPlan::pending_list`]. `None` past the end of the
    /// ranges or when they cannot be read.
    pub fn slot_for_index(&self, index: u32) -> Option<u32> {
        if let Some(ranges) = &self.batch_ranges {
            return nth_in_ranges(ranges, index).ok().flatten();
        }
        match &self.batches {
            None => Some(index),
            Some(batches) => usize::try_from(index)
                .ok()
                .and_then(|i| batches.get(i).copied()),
        }
    }

    /// Every id the indexes map to, in index order (as [`RunPlan::slot_for_index`]: batch ids, or
    /// slots of the [`RunPlan::pending_list`] when the plan has one); `None` for the identity
    /// (index *i* is *i*).
    pub fn pending_list(&self) -> Result<Option<Vec<u32>>, String> {
        match (&self.batch_ranges, &self.batches) {
            (Some(ranges), _) => parse_ranges(ranges).map(Some),
            (None, list) => Ok(list.clone()),
        }
    }

    /// The plan of a Job whose index *i* works the batch at the *i*-th of `slots` (ascending
    /// positions) of the plan's pending list `pending_list` ([`PlanSummary::pending_list`]): the
    /// slots are written as [`RunPlan::batch_ranges`], a few bytes for a shard's contiguous slots
    /// however scattered its batches. [`RunPlan::batches`] is cleared: a reader of that field
    /// alone would take the slots for batch ids.
    #[must_use]
    pub fn with_pending_slots(
        mut self,
        pending_list: &str,
        slots: impl IntoIterator<Item = u32>,
    ) -> Self {
        self.pending_list = Some(pending_list.to_owned());
        self.batch_ranges = Some(format_ranges(&compact_ranges(slots)));
        self.batches = None;
        self
    }
}

/// The batch Job completion index `index` works under a plan with a pending list: the id at slot
/// *s* of `pending_list_text` (the list file's ranges), where *s* is the `index`-th id of
/// `slot_ranges` (the plan's [`RunPlan::batch_ranges`]), or `index` when there are none. `None`
/// past the end of either, or when either cannot be read. Neither is expanded: a list of a
/// million batches is read range by range.
pub fn resolve_batch(
    pending_list_text: &str,
    slot_ranges: Option<&str>,
    index: u32,
) -> Option<u32> {
    let slot = match slot_ranges {
        Some(ranges) => nth_in_ranges(ranges, index).ok().flatten()?,
        None => index,
    };
    nth_in_ranges(pending_list_text, slot).ok().flatten()
}

/// The `n`-th id of `ranges` (`3-5,9`: the 3rd is 9) without expanding them: `Ok(None)` past
/// their end, `Err` naming the first range that cannot be read before it.
pub fn nth_in_ranges(ranges: &str, n: u32) -> Result<Option<u32>, String> {
    let mut skipped = 0_u32;
    for part in ranges.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (first, last) = parse_range(part)?;
        // A range of all 2^32 ids has no u32 length; no list of batches or slots holds it.
        let len = (last - first)
            .checked_add(1)
            .ok_or_else(|| format!("bad index range {part:?}"))?;
        if n - skipped < len {
            return Ok(Some(first + (n - skipped)));
        }
        // No overflow: the ranges so far hold no more than `n` ids.
        skipped += len;
    }
    Ok(None)
}

/// One part of a ranges text: `7` or `3-9`, first not after last.
fn parse_range(part: &str) -> Result<(u32, u32), String> {
    let bad = || format!("bad index range {part:?}");
    let (first, last) = part.split_once('-').unwrap_or((part, part));
    let (first, last): (u32, u32) = (
        first.parse().map_err(|_| bad())?,
        last.parse().map_err(|_| bad())?,
    );
    if first > last {
        return Err(bad());
    }
    Ok((first, last))
}

/// What `plan` reports (termination message, stdout, and the operator's status).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanSummary {
    /// Valid prompts after `maxSamples`.
    pub prompts: u64,
    /// Rejected dataset lines (listed in `invalid.jsonl`).
    pub invalid: u64,
    /// Batches in the run.
    pub batches: u32,
    /// Batches already done on storage (from an earlier attempt or run).
    pub done: Vec<BatchRange>,
    /// How many batches had a `.done` marker when the plan looked: the whole count, also when
    /// [`PlanSummary::done`] is cut short. Always written; 0 when read from a worker of before it.
    #[serde(default)]
    pub done_count: u32,
    /// `blake3:` digest of the dataset file (as `b3sum` prints it).
    pub dataset_digest: String,
    /// Digest of the generating fields of the spec.
    pub spec_hash: String,
    /// True when `done` lists only its first ranges, so that the summary fits the termination
    /// message; [`PlanSummary::pending_list`] then names the file of the batches not done. Absent
    /// (false) in a full summary.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub done_truncated: bool,
    /// Set exactly when [`PlanSummary::done_truncated`] is: the path, relative to the run's output
    /// directory, of the file listing every batch without a `.done` marker, ascending, as one line
    /// of ranges ([`format_ranges`]: `2,4-9,12`). The plan wrote it (atomically, fsynced) before
    /// it reported; its name, `plan/pending-<16 hex digits>.ranges`, is new on every plan, so a
    /// later plan never rewrites a list that pods of an earlier one still read. A generation Job
    /// works slots of it ([`RunPlan::pending_list`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_list: Option<String>,
    /// Set when rows name container images of their own: the pending batches grouped by image
    /// ([`ImagePlan`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<ImagePlan>,
}

/// Each range serialises to at least `{"first":0,"last":0}`: no summary of `limit` bytes holds
/// more than `limit / MIN_RANGE_JSON_BYTES` of them.
const MIN_RANGE_JSON_BYTES: usize = 20;

impl PlanSummary {
    /// Batches without a `.done` marker at plan time (the length of the pending list).
    pub fn pending_count(&self) -> u32 {
        self.batches.saturating_sub(self.done_count)
    }

    /// The summary as the termination message can hold it. When the whole summary is over `limit`
    /// bytes, `done` is cut to its first ranges that fit with [`PlanSummary::done_truncated`] and
    /// [`PlanSummary::pending_list`] set to `pending_list`, the path of the list the caller writes
    /// before it reports the summary. The ranges kept are the first, so a run resumed after long
    /// progress in order (a few ranges) always keeps them all.
    ///
    /// Work bounded by `limit`, not by the number of ranges: sizes are measured by serialising
    /// into a counter that stops at `limit`, and only prefixes that may fit are tried.
    #[must_use]
    pub fn fitting(mut self, limit: usize, pending_list: &str) -> Self {
        if serialised_within(&self, limit) {
            return self;
        }
        self.done_truncated = true;
        self.pending_list = Some(pending_list.to_owned());
        let all = std::mem::take(&mut self.done);
        let fits = longest_fitting(all.len().min(limit / MIN_RANGE_JSON_BYTES), |n| {
            self.done = all[..n].to_vec();
            serialised_within(&self, limit)
        });
        self.done = all[..fits].to_vec();
        self
    }
}

impl PlanSummary {
    /// The summary with the image groups `groups` ([`PlanSummary::images`]; none when empty), as
    /// many as fit in `limit` bytes with the rest of it. When not all fit, [`ImagePlan::index`]
    /// is `index`, the directory the caller writes every group to in pages before it reports the
    /// summary, and [`ImagePlan::pages`] is for the caller to set. Call it after
    /// [`PlanSummary::fitting`], which decides what the ids are.
    #[must_use]
    pub fn with_images(mut self, groups: Vec<ImageGroup>, limit: usize, index: &str) -> Self {
        if groups.is_empty() {
            return self;
        }
        let count = u32::try_from(groups.len()).unwrap_or(u32::MAX);
        self.images = Some(ImagePlan {
            groups: count,
            listed: groups,
            index: None,
            pages: 0,
        });
        if serialised_within(&self, limit) {
            return self;
        }
        let images = self.images.as_mut().expect("set above");
        let all = std::mem::take(&mut images.listed);
        images.index = Some(index.to_owned());
        // Fitted with the widest count: the caller sets the real one, no wider.
        images.pages = u32::MAX;
        let fits = longest_fitting(all.len(), |n| {
            self.images.as_mut().expect("set above").listed = all[..n].to_vec();
            serialised_within(&self, limit)
        });
        self.images.as_mut().expect("set above").listed = all[..fits].to_vec();
        self
    }
}

/// The longest prefix, of at most `longest` items, for which `fits` holds (0 when none does), by
/// bisection: `fits` is asked of some lengths, and must hold for every length below one it holds
/// for (a size that grows with the prefix).
fn longest_fitting(longest: usize, mut fits: impl FnMut(usize) -> bool) -> usize {
    let (mut fit, mut too_long) = (0, longest + 1);
    while too_long - fit > 1 {
        let middle = fit + (too_long - fit) / 2;
        if fits(middle) {
            fit = middle;
        } else {
            too_long = middle;
        }
    }
    fit
}

/// Whether `value` serialises to JSON of at most `limit` bytes; stops writing past the limit.
fn serialised_within<T: Serialize>(value: &T, limit: usize) -> bool {
    /// Counts bytes, and fails the serialisation once they pass the limit.
    struct Counter {
        written: usize,
        limit: usize,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.written += bytes.len();
            if self.written > self.limit {
                return Err(std::io::ErrorKind::FileTooLarge.into());
            }
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(&mut Counter { written: 0, limit }, value).is_ok()
}

/// What `batch` reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchSummary {
    pub batch: u32,
    pub succeeded: u64,
    pub discarded: u64,
    pub failed: u64,
    /// Records found on storage from an earlier attempt and not redone.
    pub resumed: u64,
    /// Set when the batch stopped early, with the error class (e.g. `unauthorized`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// What the model calls of the batch's records cost, in USD (a decimal string; those of
    /// earlier attempts included), when any was priced: also in its `.done` marker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<String>,
    /// What the whole run had spent on the model when the batch ended, in USD (a decimal string),
    /// as the claims of its processes on storage say: present when the run has prices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_spent: Option<String>,
    /// Whether Landlock confined the batch's terminal commands (absent: not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub landlock: Option<LandlockStatus>,
    /// How long the pod that finished the batch waited for its task image (rows naming one, in
    /// a generation pod): also in its `.done` marker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<PodPull>,
}

/// How long a generation pod waited for its rows' image, measured by its worker on the node's
/// clock from the sockets its sidecars open as they start (the kubelet starts them in order,
/// pulling each one's image first): the run's sandbox, then the first task container, then the
/// worker once every task container started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodPull {
    /// The image (as the rows name it).
    pub image: String,
    /// From the sandbox's start to the first task container's: the image's pull (nothing when
    /// the node holds it) and one container's start.
    pub pull_ms: u64,
    /// From the first task container's start to the worker's: the other task containers' starts.
    pub start_ms: u64,
    /// From the sandbox's start to the batch's end: the pod's time, of which `pull_ms` is the
    /// share spent waiting for the pull.
    pub pod_ms: u64,
}

/// Whether Landlock confines the terminal commands where they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LandlockStatus {
    Enforced,
    /// The kernel where the commands run does not enforce it (`spec.sandbox.landlock: auto`).
    NotEnforced,
    /// Turned off by the run's settings.
    Off,
}

/// A USD amount as summaries and the run's status write it: a decimal string of at most eight
/// places (the cent's millionth, where summing floating-point costs leaves its noise).
pub fn usd_text(amount: f64) -> String {
    let text = format!("{:.8}", (amount * 1e8).round() / 1e8);
    let text = text.trim_end_matches('0');
    text.strip_suffix('.').unwrap_or(text).to_owned()
}

/// What `merge` reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MergeSummary {
    pub trajectories: u64,
    pub discarded: u64,
    pub failed: u64,
    /// Size of `trajectories.jsonl` in bytes.
    pub bytes: u64,
    /// Duplicate or torn lines that were skipped.
    pub skipped_lines: u64,
    /// Kept records whose row's verifier ran (trajectories and `minReward` discards).
    #[serde(default, skip_serializing_if = "is_no_record")]
    pub verified: u64,
    /// Of those, the ones that passed.
    #[serde(default, skip_serializing_if = "is_no_record")]
    pub passed: u64,
    /// What the kept records' model calls cost, in USD (a decimal string: `"12.34"`), when any
    /// was priced (`spec.model.pricing`) or its cost reported by the provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<String>,
    /// What the whole run spent on the model, in USD (a decimal string), conversations without a
    /// record included, as the claims of its processes on storage say: present when they kept
    /// claims (a run with prices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spent: Option<String>,
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if signature"
)]
fn is_no_record(count: &u64) -> bool {
    *count == 0
}

/// An inclusive range of batch ids, for compact lists (`0-41,44`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRange {
    pub first: u32,
    pub last: u32,
}

/// Compacts sorted, de-duplicated ids into ranges.
pub fn compact_ranges(ids: impl IntoIterator<Item = u32>) -> Vec<BatchRange> {
    let mut ranges: Vec<BatchRange> = Vec::new();
    for id in ids {
        match ranges.last_mut() {
            Some(range) if range.last.checked_add(1) == Some(id) => range.last = id,
            Some(range) if range.last >= id => {}
            _ => ranges.push(BatchRange {
                first: id,
                last: id,
            }),
        }
    }
    ranges
}

/// Formats ranges the way Kubernetes formats `completedIndexes`: `0-41,44`.
pub fn format_ranges(ranges: &[BatchRange]) -> String {
    Ranges(ranges).to_string()
}

/// Ranges displayed as [`format_ranges`] writes them, for streaming a long list into a file
/// without building it in memory first.
#[derive(Debug, Clone, Copy)]
pub struct Ranges<'a>(pub &'a [BatchRange]);

impl std::fmt::Display for Ranges<'_> {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (position, range) in self.0.iter().enumerate() {
            if position > 0 {
                out.write_str(",")?;
            }
            if range.first == range.last {
                write!(out, "{}", range.first)?;
            } else {
                write!(out, "{}-{}", range.first, range.last)?;
            }
        }
        Ok(())
    }
}

/// Parses `0-41,44` (Kubernetes' `completedIndexes` format) into ids.
pub fn parse_ranges(text: &str) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for part in text
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
    {
        let (first, last) = parse_range(part)?;
        ids.extend(first..=last);
    }
    Ok(ids)
}

/// What a worker that stopped on an error reports in its termination message, for the operator's
/// status: the error, its `PascalCase` reason (`ModelUnauthorized`, `InvalidDataset`, ...) and the
/// exit code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerFailure {
    pub error: String,
    pub reason: String,
    pub exit_code: i32,
    /// The `spec.model.budget.maxCost` the worker found exhausted (reason `BudgetExhausted`): the
    /// run is held until the budget is raised past it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<f64>,
    /// What the whole run had spent when the worker stopped at the budget, in USD (a decimal
    /// string), as the claims of its processes said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_spent: Option<String>,
}

impl WorkerFailure {
    /// The longest error text reported: with the reason it stays well inside the termination
    /// message's 4 KiB, so the reason always arrives.
    pub const MAX_ERROR_CHARS: usize = 2000;

    pub fn new(error: &str, reason: &str, exit_code: i32) -> Self {
        Self {
            error: error.chars().take(Self::MAX_ERROR_CHARS).collect(),
            reason: reason.to_owned(),
            exit_code,
            budget: None,
            run_spent: None,
        }
    }
}

/// Serialises a summary for the termination message, which Kubernetes caps at 4 KiB.
pub fn termination_message<T: Serialize>(summary: &T) -> String {
    let text =
        serde_json::to_string(summary).unwrap_or_else(|err| format!("{{\"error\":\"{err}\"}}"));
    if text.len() <= TERMINATION_MESSAGE_LIMIT {
        text
    } else {
        // A summary never legitimately grows this large; say so rather than write broken JSON.
        format!("{{\"truncated\":true,\"bytes\":{}}}", text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_show_to_eight_places_without_trailing_zeros() {
        assert_eq!(usd_text(0.1 + 0.2), "0.3");
        assert_eq!(usd_text(12.0), "12");
        assert_eq!(usd_text(0.000_000_014), "0.00000001");
        assert_eq!(usd_text(1_234.567_891_234), "1234.56789123");
    }

    #[test]
    fn the_secret_keys_of_tool_settings_reach_the_worker_once_each() {
        let tools: ToolsSpec = serde_json::from_value(serde_json::json!({
            "web": {"search": {"url": "http://searx:8080",
                               "apiKeySecretRef": {"name": "search", "key": "key"}}},
            "vision": {"baseUrl": "http://vllm-vl:8000/v1", "model": "vl",
                       "apiKey": {"secretKeyRef": {"name": "vl-key", "key": "token"}}},
            "imageGen": {"baseUrl": "http://images:8000/v1", "model": "img",
                         "apiKey": {"secretKeyRef": {"name": "vl-key", "key": "token"}}},
        }))
        .unwrap();
        let names: Vec<String> = secret_env(&tools)
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(
            names,
            ["TRAJ_SECRET_VL_KEY__TOKEN", env::WEB_SEARCH_API_KEY]
        );
    }

    #[test]
    fn ranges_round_trip_in_kubernetes_format() {
        let ids = [0, 1, 2, 3, 5, 7, 8];
        let ranges = compact_ranges(ids);
        assert_eq!(format_ranges(&ranges), "0-3,5,7-8");
        assert_eq!(parse_ranges("0-3,5,7-8").unwrap(), ids);
        assert_eq!(parse_ranges("").unwrap(), Vec::<u32>::new());
        assert!(parse_ranges("3-1").is_err());
        assert!(parse_ranges("x").is_err());
    }

    #[test]
    fn later_attempts_map_indexes_through_the_pending_list() {
        let spec = serde_json::from_value(serde_json::json!({
            "dataset": {"path": "d.jsonl"},
            "model": {"baseUrl": "http://m/v1", "name": "m"},
        }))
        .unwrap();
        let mut plan = RunPlan {
            name: "r".into(),
            namespace: "ns".into(),
            uid: String::new(),
            spec,
            output_path: "runs/ns/r".into(),
            batches: None,
            batch_ranges: None,
            pending_list: None,
        };
        assert_eq!(plan.batch_for_index(7), Some(7));
        assert_eq!(plan.pending_list(), Ok(None));
        plan.batches = Some(vec![4, 9]);
        assert_eq!(plan.batch_for_index(1), Some(9));
        assert_eq!(plan.batch_for_index(2), None);
        assert_eq!(plan.pending_list(), Ok(Some(vec![4, 9])));

        // The ranges win over the list, and are read without expanding them.
        plan.batch_ranges = Some("100000-199999,250000,300000-300001".into());
        let cases = [
            (0, Some(100_000)),
            (99_999, Some(199_999)),
            (100_000, Some(250_000)),
            (100_002, Some(300_001)),
            (100_003, None),
        ];
        for (index, batch) in cases {
            assert_eq!(plan.batch_for_index(index), batch, "index {index}");
        }
        assert_eq!(plan.pending_list().unwrap().unwrap().len(), 100_003);
        plan.batch_ranges = Some("7-x".into());
        assert_eq!(plan.batch_for_index(0), None);
        assert!(plan.pending_list().is_err());

        // With a pending list on storage the ranges are slots of it, and the plan alone cannot
        // name the batch.
        let plan = plan.with_pending_slots("plan/pending-0123456789abcdef.ranges", 5..8);
        assert_eq!(plan.batch_ranges.as_deref(), Some("5-7"));
        assert_eq!(plan.batches, None);
        assert_eq!(plan.slot_for_index(2), Some(7));
        assert_eq!(plan.batch_for_index(2), None);
        let json = serde_json::to_value(&plan).unwrap();
        assert_eq!(json["pendingList"], "plan/pending-0123456789abcdef.ranges");
    }

    #[test]
    fn a_completion_index_resolves_through_its_slot_to_the_pending_batch() {
        let list = "2,4-9,12,100000-199999\n";
        let cases = [
            // (slot ranges, index, batch)
            (None, 0, Some(2)),
            (None, 1, Some(4)),
            (None, 6, Some(9)),
            (None, 7, Some(12)),
            (None, 8, Some(100_000)),
            (None, 100_007, Some(199_999)),
            (None, 100_008, None),
            (Some("7-9"), 0, Some(12)),
            (Some("7-9"), 2, Some(100_001)),
            (Some("7-9"), 3, None),
            (Some("0,100007"), 1, Some(199_999)),
            (Some("100008"), 0, None),
            (Some("x"), 0, None),
        ];
        for (slots, index, batch) in cases {
            assert_eq!(
                resolve_batch(list, slots, index),
                batch,
                "{slots:?} index {index}"
            );
        }
        assert_eq!(resolve_batch("4-2", None, 0), None);
        // Past the end and unreadable are told apart, the unreadable range named.
        assert_eq!(nth_in_ranges("2,4-9", 7), Ok(None));
        assert_eq!(nth_in_ranges("", 0), Ok(None));
        let error = nth_in_ranges("2,9-4,12", 5).unwrap_err();
        assert!(error.contains("\"9-4\""), "{error}");
        assert_eq!(
            nth_in_ranges("0-4294967294", 4_294_967_294),
            Ok(Some(4_294_967_294))
        );
        assert!(nth_in_ranges("0-4294967295", 0).is_err());
    }

    #[test]
    fn a_worker_failure_keeps_its_reason_however_long_the_error() {
        let failure = WorkerFailure::new(
            &"x".repeat(10_000),
            "ModelUnauthorized",
            exit::PERMANENT_CONFIG,
        );
        let message = termination_message(&failure);
        assert!(message.len() <= TERMINATION_MESSAGE_LIMIT);
        let read: WorkerFailure = serde_json::from_str(&message).unwrap();
        assert_eq!(
            (read.reason.as_str(), read.exit_code),
            ("ModelUnauthorized", 78)
        );
        assert!(message.contains("\"exitCode\":78"), "{message}");
    }

    #[test]
    fn a_plan_summary_with_many_gaps_keeps_its_first_done_ranges_within_the_limit() {
        let summary = |done: Vec<BatchRange>| PlanSummary {
            prompts: 2_000_000,
            invalid: 0,
            batches: 1_000_000,
            done,
            dataset_digest: format!("blake3:{}", "0".repeat(64)),
            spec_hash: format!("blake3:{}", "1".repeat(64)),
            done_count: 500_000,
            done_truncated: false,
            pending_list: None,
            images: None,
        };
        // Every other batch done: 500,000 ranges, far beyond 4 KiB.
        let gaps: Vec<BatchRange> = (0..500_000)
            .map(|i| BatchRange {
                first: i * 2,
                last: i * 2,
            })
            .collect();
        let list = "plan/pending-0123456789abcdef.ranges";
        let fitted = summary(gaps.clone()).fitting(TERMINATION_MESSAGE_LIMIT, list);
        let message = termination_message(&fitted);
        assert!(
            message.len() <= TERMINATION_MESSAGE_LIMIT,
            "{}",
            message.len()
        );
        assert!(!message.contains("truncated\":true,\"bytes"), "{message}");
        let read: PlanSummary = serde_json::from_str(&message).unwrap();
        assert!(read.done_truncated);
        assert_eq!(read.pending_list.as_deref(), Some(list));
        assert_eq!((read.done_count, read.pending_count()), (500_000, 500_000));
        assert!(read.done.len() > 100, "{} ranges kept", read.done.len());
        assert_eq!(read.done[..], gaps[..read.done.len()]);
        // The longest prefix that fits: one more range would not.
        let mut longer = read.clone();
        longer.done.push(gaps[read.done.len()]);
        assert!(serde_json::to_string(&longer).unwrap().len() > TERMINATION_MESSAGE_LIMIT);
        // A summary that fits is left whole, and says nothing of truncation or of a list.
        let few = summary(gaps[..3].to_vec()).fitting(TERMINATION_MESSAGE_LIMIT, list);
        assert!(!few.done_truncated && few.done.len() == 3 && few.pending_list.is_none());
        let message = termination_message(&few);
        assert!(!message.contains("doneTruncated") && !message.contains("pendingList"));
        assert!(message.contains("\"doneCount\":500000"), "{message}");
    }

    #[test]
    fn a_plan_summary_of_a_worker_without_a_done_count_reads_as_none_counted() {
        let summary: PlanSummary = serde_json::from_value(serde_json::json!({
            "prompts": 3, "invalid": 0, "batches": 2, "done": [{"first": 0, "last": 0}],
            "datasetDigest": "blake3:0", "specHash": "blake3:1",
        }))
        .unwrap();
        assert_eq!(
            (
                summary.done_count,
                summary.done_truncated,
                summary.pending_list
            ),
            (0, false, None)
        );
    }

    #[test]
    fn a_plan_without_ranges_reads_as_it_always_did() {
        // A ConfigMap written by an operator of an earlier release.
        let plan: RunPlan = serde_json::from_value(serde_json::json!({
            "name": "r", "namespace": "ns", "outputPath": "runs/ns/r", "batches": [3, 5],
            "spec": {"dataset": {"path": "d.jsonl"}, "model": {"baseUrl": "http://m/v1", "name": "m"}},
        }))
        .unwrap();
        assert_eq!(plan.batch_ranges, None);
        assert_eq!(plan.batch_for_index(1), Some(5));
    }

    /// Pages hold at most the termination message's bytes, number themselves in order, and read
    /// back into the groups they were cut from: a group of scattered batches too large for one
    /// page goes over several, cut at range boundaries.
    #[test]
    fn image_groups_are_paged_within_the_limit_and_read_back_whole() {
        let group = |image: &str, ids: String| ImageGroup::new(image.to_owned(), ids);
        let scattered: Vec<String> = (0..3000_u32).step_by(2).map(|id| id.to_string()).collect();
        let groups = vec![
            group("registry.example/swe/a:1", "0-9".into()),
            group("registry.example/swe/scattered:1", scattered.join(",")),
            group("registry.example/swe/b:1", "3001".into()),
        ];
        let pages = image_pages(&groups, TERMINATION_MESSAGE_LIMIT);
        assert!(pages.len() > 2, "{} pages", pages.len());
        for (number, page) in (0_u32..).zip(&pages) {
            assert_eq!(page.page, number);
            let bytes = serde_json::to_string(page).unwrap().len();
            assert!(
                bytes <= TERMINATION_MESSAGE_LIMIT,
                "page {number}: {bytes} bytes"
            );
        }
        assert_eq!(groups_of_pages(&pages), groups);
        assert!(image_pages(&[], TERMINATION_MESSAGE_LIMIT).is_empty());
    }
}

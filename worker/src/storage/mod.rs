//! The run's directory on shared storage, and the write disciplines that make it crash-safe.
//!
//! ```text
//! <root>/<outputPath>/
//!   manifest.json               run identity, dataset and segment digests, batch byte ranges,
//!                               spec hash
//!   invalid.jsonl               rejected dataset lines with reasons
//!   batches/batch-000042/       the batch's records, one file per writer (process running it):
//!     w-<writer>.jsonl          one record per (prompt, sample) it finished, appended whole and
//!                               fsynced; its `OpenAI`-form twin in w-<writer>.openai.jsonl
//!   batches/batch-000042.jsonl  the single records file of workers before per-writer files
//!   batches/batch-000042.done   completion marker with counts (temp + fsync + rename)
//!   trajectories.jsonl          merged output in dataset order
//!   trajectories.tokens.jsonl   each trajectory's token ids and logprobs, line for line beside
//!                               it (runs that keep tokens; in the batch files they end each
//!                               trajectory's line, under `tokens`)
//!   failures.jsonl              failed and discarded prompts
//!   statistics.json             counts, tools, reasoning, tokens, latency
//!   plan/images-<16 hex>/page-<n>.json  the image groups, when a plan's summary could not list
//!                                 them all, a page each termination message holds
//!   plan/pending-<16 hex>.ranges  the batches not done, when a plan's summary could not list
//!                               the done ones (one file per such plan, never rewritten)
//! ```
//!
//! Two rules keep every reader safe from a writer killed at any instant: whole files appear only by
//! rename of a fsynced temp file, and append-only files are read up to their last newline (a torn
//! tail is skipped, never cut: only its writer appends to a file, and a writer starts a new file).
//!
//! A batch's records live in a directory of their own, not beside the other batches' files, so that
//! finding a batch's writers lists a handful of entries: a run of a million batches has millions
//! of entries in `batches/`, and every batch pod (and merge, for every batch) listing those would
//! cost the run quadratic work on NFS.

pub mod object;
mod store;

use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::path::{Path, PathBuf};

pub use object::{AccessKeys, Bucket, BucketMissing, BucketOptions, ObjectUrl};
pub use store::{Output, PART_AGE, PART_RECORDS, RecordsWriter, Store, TurnsWriter};

/// An I/O failure, with the path it happened on.
#[derive(Debug, thiserror::Error)]
#[error("{action} {path}: {source}")]
pub struct StorageError {
    pub action: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl StorageError {
    pub fn new(action: &'static str, path: &Path, source: io::Error) -> Self {
        Self {
            action,
            path: path.to_owned(),
            source,
        }
    }
}

/// What a storage failure means for the step that met it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageFault {
    /// A read or write failed in a way a later attempt may not (EIO, ESTALE on NFS, a timeout).
    Transient,
    /// The volume or the quota is full (ENOSPC, EDQUOT); freeing space fixes it, a retry alone
    /// does not.
    Full,
    /// The volume is mounted read-only (EROFS): no retry of the same pod spec can write.
    ReadOnly,
    /// The pod's user may not write there (EACCES, EPERM), or the bucket refuses these
    /// credentials: no retry can either.
    Denied,
    /// The bucket does not exist: no retry creates it.
    Missing,
}

impl StorageError {
    /// The file or directory is not there.
    pub fn is_not_found(&self) -> bool {
        self.source.kind() == io::ErrorKind::NotFound
    }

    pub fn fault(&self) -> StorageFault {
        if self
            .source
            .get_ref()
            .is_some_and(<dyn std::error::Error + Send + Sync>::is::<BucketMissing>)
        {
            return StorageFault::Missing;
        }
        match self.source.kind() {
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => StorageFault::Full,
            io::ErrorKind::ReadOnlyFilesystem => StorageFault::ReadOnly,
            io::ErrorKind::PermissionDenied => StorageFault::Denied,
            _ => StorageFault::Transient,
        }
    }
}

/// Fails with ENOSPC's kind, before anything is spent, when the filesystem holding `dir` has less
/// than `needed` bytes free for this process's user.
pub fn require_free_space(dir: &Path, needed: u64) -> Result<(), StorageError> {
    let stats = nix::sys::statvfs::statvfs(dir)
        .map_err(|errno| StorageError::new("checking free space in", dir, errno.into()))?;
    #[allow(clippy::useless_conversion)] // the field types differ between platforms
    let free = u64::from(stats.blocks_available()).saturating_mul(u64::from(stats.fragment_size()));
    if free >= needed {
        return Ok(());
    }
    Err(StorageError::new(
        "checking free space in",
        dir,
        io::Error::new(
            io::ErrorKind::StorageFull,
            format!("{free} bytes free, but the batch may write {needed}"),
        ),
    ))
}

/// Shorthand for attaching the path to an I/O result.
pub trait Context<T> {
    fn at(self, action: &'static str, path: &Path) -> Result<T, StorageError>;
}

impl<T> Context<T> for io::Result<T> {
    fn at(self, action: &'static str, path: &Path) -> Result<T, StorageError> {
        self.map_err(|source| StorageError::new(action, path, source))
    }
}

/// How a turn log's name ends (a records file's reader passes it over: a writer id has no dot).
const TURNS_SUFFIX: &str = ".turns.jsonl";

/// How a windows journal's name ends (batch mode's provider batches; passed over likewise).
const WINDOWS_SUFFIX: &str = ".windows.jsonl";

/// The directory of [`RunDir::plan_dir`], relative to the run directory.
const PLAN_DIR: &str = "plan";

/// Paths of one run's output directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    root: PathBuf,
    store: Store,
}

impl RunDir {
    /// A run directory on a volume.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self::on(Store::Volume, root)
    }

    /// A run directory in `store` (on a bucket, `root` is its `s3://` location).
    pub fn on(store: Store, root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            store,
        }
    }

    /// Where the directory's files are, and the operations on them.
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn manifest(&self) -> PathBuf {
        self.root.join("manifest.json")
    }
    pub fn invalid(&self) -> PathBuf {
        self.root.join("invalid.jsonl")
    }
    /// The rows the plan made of a dataset of Harbor tasks, which the run reads as its dataset.
    pub fn harbor_rows(&self) -> PathBuf {
        self.root.join("harbor-tasks.jsonl")
    }
    /// The images a run of Harbor tasks builds, one [`crate::contract::BuildEntry`] a line: line
    /// *i* is built by the build Job's completion index *i*.
    pub fn harbor_builds(&self) -> PathBuf {
        self.root.join("harbor-builds.jsonl")
    }
    /// What the Harbor tasks of each image ask of their containers, one image a line (images
    /// whose tasks ask nothing are left out).
    pub fn harbor_resources(&self) -> PathBuf {
        self.root.join("harbor-resources.jsonl")
    }
    /// The Harbor tasks the plan refused, each with why.
    pub fn harbor_refused(&self) -> PathBuf {
        self.root.join("harbor-refused.jsonl")
    }
    pub fn batches_dir(&self) -> PathBuf {
        self.root.join("batches")
    }
    /// The directory of a batch's records files; zero-padded so that a listing sorts in batch
    /// order too.
    pub fn batch_dir(&self, batch: u32) -> PathBuf {
        self.batches_dir().join(format!("batch-{batch:06}"))
    }
    /// The records file of one writer of a batch.
    pub fn batch_records_of(&self, batch: u32, writer: &WriterId) -> PathBuf {
        self.batch_dir(batch).join(format!("w-{}.jsonl", writer.0))
    }
    /// The `OpenAI`-form twin of [`Self::batch_records_of`].
    pub fn batch_openai_records_of(&self, batch: u32, writer: &WriterId) -> PathBuf {
        self.batch_dir(batch)
            .join(format!("w-{}.openai.jsonl", writer.0))
    }
    /// The turn log of one writer of a batch (see `run::turns`); on a bucket, the base name of
    /// its parts.
    pub fn batch_turns_of(&self, batch: u32, writer: &WriterId) -> PathBuf {
        self.batch_dir(batch)
            .join(format!("w-{}{TURNS_SUFFIX}", writer.0))
    }

    /// Every turn log of a batch (each part on a bucket), in name order.
    pub fn turn_logs(&self, batch: u32) -> Result<Vec<PathBuf>, StorageError> {
        self.writers_files(batch, TURNS_SUFFIX)
    }

    /// Where a writer of a batch keeps the journal of its batch mode windows (see
    /// `run::windows`).
    pub fn batch_windows_of(&self, batch: u32, writer: &WriterId) -> PathBuf {
        self.batch_dir(batch)
            .join(format!("w-{}{WINDOWS_SUFFIX}", writer.0))
    }

    /// Every windows journal of a batch (each part on a bucket), in name order.
    pub fn window_journals(&self, batch: u32) -> Result<Vec<PathBuf>, StorageError> {
        self.writers_files(batch, WINDOWS_SUFFIX)
    }

    /// The files of a batch's writers whose names end with `suffix`, in name order.
    fn writers_files(&self, batch: u32, suffix: &str) -> Result<Vec<PathBuf>, StorageError> {
        let dir = self.batch_dir(batch);
        let mut names: Vec<String> = self
            .store
            .list(&dir)?
            .into_iter()
            .filter(|name| name.starts_with("w-") && name.ends_with(suffix))
            .collect();
        names.sort_unstable();
        Ok(names.into_iter().map(|name| dir.join(name)).collect())
    }

    /// The one records file of a batch as workers before per-writer files wrote it (read, never
    /// written).
    pub fn legacy_batch_records(&self, batch: u32) -> PathBuf {
        self.batches_dir().join(format!("batch-{batch:06}.jsonl"))
    }
    /// The `OpenAI`-form twin of [`Self::legacy_batch_records`].
    pub fn legacy_batch_openai_records(&self, batch: u32) -> PathBuf {
        self.batches_dir()
            .join(format!("batch-{batch:06}.openai.jsonl"))
    }

    /// Every records file of a batch, each with the path of its `OpenAI`-form twin (which may not
    /// exist): the legacy file first, if there is one, then each writer's in name order. The order
    /// is a pure function of the names, so whatever picks "the first" of them picks the same one
    /// on every run.
    pub fn records_files(&self, batch: u32) -> Result<Vec<RecordsFile>, StorageError> {
        let mut files = Vec::new();
        // Workers wrote single records files before object storage existed.
        if !self.store.is_bucket() {
            let legacy = self.legacy_batch_records(batch);
            match fs::symlink_metadata(&legacy) {
                Ok(_) => files.push(RecordsFile {
                    records: legacy,
                    openai: self.legacy_batch_openai_records(batch),
                }),
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => return Err(StorageError::new("reading metadata of", &legacy, err)),
            }
        }
        let mut writers: Vec<WriterId> = self
            .store
            .list(&self.batch_dir(batch))?
            .iter()
            .filter_map(|name| WriterId::of_records_file(name))
            .collect();
        writers.sort_unstable();
        files.extend(writers.into_iter().map(|writer| RecordsFile {
            records: self.batch_records_of(batch, &writer),
            openai: self.batch_openai_records_of(batch, &writer),
        }));
        Ok(files)
    }
    pub fn batch_done(&self, batch: u32) -> PathBuf {
        self.batches_dir().join(format!("batch-{batch:06}.done"))
    }
    pub fn trajectories(&self) -> PathBuf {
        self.root.join("trajectories.jsonl")
    }
    pub fn trajectories_openai(&self) -> PathBuf {
        self.root.join("trajectories.openai.jsonl")
    }

    /// Each trajectory's token ids and logprobs, line for line beside `trajectories.jsonl`
    /// (`spec.model.tokens`).
    pub fn trajectories_tokens(&self) -> PathBuf {
        self.root.join("trajectories.tokens.jsonl")
    }
    pub fn failures(&self) -> PathBuf {
        self.root.join("failures.jsonl")
    }
    pub fn statistics(&self) -> PathBuf {
        self.root.join("statistics.json")
    }
    /// The run's `report.html`, beside its trajectories.
    pub fn report(&self) -> PathBuf {
        self.root.join(crate::contract::paths::REPORT_FILE)
    }
    /// Files a plan leaves for the generation pods (its pending lists).
    /// Where each process spending the run's budget keeps its claim (see `run::budget`).
    pub fn budget_dir(&self) -> PathBuf {
        self.root.join("budget")
    }

    pub fn plan_dir(&self) -> PathBuf {
        self.root.join(PLAN_DIR)
    }

    /// A name for a new plan's pending list, relative to the run directory (the form the plan's
    /// summary and the run plan carry): `plan/pending-<16 random hex digits>.ranges`. Random, so
    /// that a plan run again never rewrites a list that pods of an earlier plan still read.
    pub fn new_pending_list_name() -> String {
        let unique: u64 = rand::random();
        format!("{PLAN_DIR}/pending-{unique:016x}.ranges")
    }

    /// A name for a new plan's image index (every image group in pages, when they do not all
    /// fit the plan's summary), relative to the run directory: the directory
    /// `plan/images-<16 random hex digits>`.
    pub fn new_image_index_name() -> String {
        let unique: u64 = rand::random();
        format!("{PLAN_DIR}/images-{unique:016x}")
    }

    /// Removes the completion markers of `batches` (a marker already gone is fine), then makes the
    /// removals durable: a plan after this sees the batches pending. Unlinking a name is atomic, so
    /// a reader sees the marker whole or not at all.
    pub fn remove_done_markers(&self, batches: &[u32]) -> Result<(), StorageError> {
        for &batch in batches {
            self.store.remove(&self.batch_done(batch))?;
        }
        self.store.sync_dir(&self.batches_dir())
    }

    /// Ids of batches with a completion marker, ascending.
    pub fn done_batches(&self) -> Result<Vec<u32>, StorageError> {
        let mut done: Vec<u32> = self
            .store
            .list(&self.batches_dir())?
            .iter()
            .filter_map(|name| {
                name.strip_prefix("batch-")
                    .and_then(|rest| rest.strip_suffix(".done"))
                    .and_then(|digits| digits.parse().ok())
            })
            .collect();
        done.sort_unstable();
        Ok(done)
    }
}

/// One records file of a batch and its `OpenAI`-form twin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordsFile {
    pub records: PathBuf,
    pub openai: PathBuf,
}

/// The id of one writer of a batch: one process's run of it. Random, because nothing else tells
/// two writers apart: every pod's worker is PID 1, two pods of one index share the index, and a
/// pod re-created with the same name may overlap its predecessor's grace period. 64 random bits
/// make a collision negligible, and the file is created exclusively besides.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriterId(String);

impl WriterId {
    pub fn random() -> Self {
        Self(format!("{:016x}", rand::random::<u64>()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The writer of a records file named `w-<writer>.jsonl` (not its `.openai.jsonl` twin: a
    /// writer id has no dot).
    fn of_records_file(name: &str) -> Option<Self> {
        let writer = name.strip_prefix("w-")?.strip_suffix(".jsonl")?;
        let valid = !writer.is_empty()
            && writer
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_');
        valid.then(|| Self(writer.to_owned()))
    }
}

impl std::fmt::Display for WriterId {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// Writes a whole file atomically: temp file in the same directory, fsync, rename, fsync the
/// directory. A reader sees the old file or the new one, never a partial one.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), StorageError> {
    write_atomic_with(path, |file| file.write_all(contents))
}

/// Like [`write_atomic`], streaming the contents through `write`.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut io::BufWriter<File>) -> io::Result<()>,
) -> Result<(), StorageError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).at("creating", dir)?;
    let temp = temp_path(path);
    let file = File::create(&temp).at("creating", &temp)?;
    let mut writer = io::BufWriter::with_capacity(1 << 20, file);
    write(&mut writer).at("writing", &temp)?;
    let file = writer
        .into_inner()
        .map_err(|err| StorageError::new("writing", &temp, err.into_error()))?;
    file.sync_all().at("syncing", &temp)?;
    fs::rename(&temp, path).at("renaming into place", path)?;
    sync_dir(dir)
}

/// A temp name beside `path`, unique per writer so two writers never share one: the pid alone
/// is not (every pod's worker is PID 1, and two pods of one index may write one `.done`), so a
/// random part follows it.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let unique: u64 = rand::random();
    path.with_file_name(format!(".{name}.tmp-{}-{unique:016x}", std::process::id()))
}

/// An exclusive lock on a run directory, held while a `local` run works in it (released when
/// dropped, or when the process dies).
#[derive(Debug)]
pub struct RunDirLock {
    _lock: Option<nix::fcntl::Flock<File>>,
}

/// Why a run directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it.
    #[error("{0} is locked by another process")]
    Held(PathBuf),
    #[error(transparent)]
    Storage(#[from] StorageError),
}

impl RunDir {
    /// The lock file of the directory.
    pub fn lock_file(&self) -> PathBuf {
        self.root.join(".lock")
    }

    /// Takes the directory's lock, without waiting. `flock` serialises processes on one machine
    /// (what two `local` runs are); it does not reach across NFS clients, which is why batches on
    /// a cluster do not rely on it (see `run::batch`).
    ///
    /// A bucket has no lock that a dead process lets go of: a run there is not locked.
    pub fn lock(&self) -> Result<RunDirLock, LockError> {
        if self.store.is_bucket() {
            return Ok(RunDirLock { _lock: None });
        }
        fs::create_dir_all(&self.root).at("creating", &self.root)?;
        let path = self.lock_file();
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .at("opening", &path)?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(RunDirLock { _lock: Some(lock) }),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(LockError::Held(path)),
            Err((_, errno)) => Err(StorageError::new("locking", &path, errno.into()).into()),
        }
    }
}

/// Makes a rename or a new file in `dir` durable.
pub fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    File::open(dir)
        .and_then(|dir_file| dir_file.sync_all())
        .at("syncing directory", dir)
}

/// An append-only JSONL file whose every line is written whole and fsynced, by the one writer that
/// created it. Dropped while still empty, it removes its file: a writer that recorded nothing
/// (its batch was done by another, or it stopped before its first record) leaves no trace.
#[derive(Debug)]
pub struct AppendLog {
    path: PathBuf,
    file: File,
}

impl AppendLog {
    /// Creates the file for appending; it must not exist. A writer appends only to a file it
    /// created, so it never glues a line onto another writer's torn tail, and never has a reason
    /// to cut one (which would cut another writer's write in progress). Creating it is also the
    /// check that the volume takes writes.
    pub fn create(path: &Path) -> Result<Self, StorageError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).at("creating", dir)?;
        }
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(path)
            .at("creating", path)?;
        Ok(Self {
            path: path.to_owned(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line (a newline is added) and makes it durable before returning.
    pub fn append_line(&mut self, line: &[u8]) -> Result<(), StorageError> {
        self.append_lines(&[line])
    }

    /// Appends several lines with one write and one fsync (group commit under load).
    pub fn append_lines(&mut self, lines: &[&[u8]]) -> Result<(), StorageError> {
        // One gathered write of the whole group: an O_APPEND write lands contiguously at the end.
        write_lines(&mut self.file, lines).at("appending to", &self.path)?;
        self.file.sync_data().at("syncing", &self.path)
    }
}

impl Drop for AppendLog {
    fn drop(&mut self) {
        // Only this writer appends to the file, so empty means it never wrote. The removal is not
        // made durable: an empty file that a crash brings back holds no line, which every reader
        // takes as it is.
        if self
            .file
            .metadata()
            .is_ok_and(|metadata| metadata.len() == 0)
        {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `lines`, each followed by a newline, with as few gathered writes as the kernel allows
/// (no copy into one buffer); a short write goes on with the rest.
pub fn write_lines(file: &mut File, lines: &[&[u8]]) -> io::Result<()> {
    let mut slices = Vec::with_capacity(lines.len() * 2);
    for line in lines {
        debug_assert!(!line.contains(&b'\n'), "a record must be one line");
        slices.push(IoSlice::new(line));
        slices.push(IoSlice::new(b"\n"));
    }
    let mut remaining = &mut slices[..];
    while !remaining.is_empty() {
        // The kernel takes at most IOV_MAX (1024) slices per call.
        let batch = remaining.len().min(1024);
        match file.write_vectored(&remaining[..batch]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut remaining, written),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Byte ranges `(start, end)` of lines within a buffer, newlines excluded.
pub type LineRanges = Vec<(usize, usize)>;

/// The whole lines of a JSONL file (a torn last line is left out), without their newlines.
pub fn read_whole_lines(path: &Path) -> Result<(Vec<u8>, LineRanges), StorageError> {
    read_whole_lines_into(path, Vec::new())
}

/// [`read_whole_lines`] into a buffer whose memory is reused (a fresh one costs a page fault for
/// every 4 KiB).
pub fn read_whole_lines_into(
    path: &Path,
    data: Vec<u8>,
) -> Result<(Vec<u8>, LineRanges), StorageError> {
    let FilesLines { data, lines, .. } = read_files_lines_into(std::iter::once(path), data)?;
    Ok((data, lines))
}

/// The whole lines of several JSONL files, one file after the other in one buffer.
#[derive(Debug, Default)]
pub struct FilesLines {
    pub data: Vec<u8>,
    pub lines: LineRanges,
    /// For each file, the index in `lines` of its first line.
    pub starts: Vec<usize>,
}

impl FilesLines {
    /// Appends the whole lines of one more file's bytes (its torn tail left out).
    pub fn push_file(&mut self, bytes: &[u8]) {
        let file_start = self.data.len();
        self.data.extend_from_slice(bytes);
        let end = split_lines(&self.data, file_start, &mut self.lines);
        self.data.truncate(end);
    }

    /// The index of the file that line `line` came from.
    pub fn file_of(&self, line: usize) -> usize {
        self.starts.partition_point(|start| *start <= line) - 1
    }
}

/// Records the non-empty lines of `data[from..]` in `lines`; returns where the whole lines end
/// (past the last newline).
fn split_lines(data: &[u8], from: usize, lines: &mut LineRanges) -> usize {
    let mut start = from;
    for end in memchr::memchr_iter(b'\n', &data[from..]) {
        let end = from + end;
        if end > start {
            lines.push((start, end));
        }
        start = end + 1;
    }
    start
}

/// The whole lines of each file (a missing file has none), into a reused buffer. Each file's torn
/// tail is dropped before the next file is read, so it never glues onto the next one's first line.
pub fn read_files_lines_into<'a>(
    paths: impl IntoIterator<Item = &'a Path>,
    mut data: Vec<u8>,
) -> Result<FilesLines, StorageError> {
    data.clear();
    let (mut lines, mut starts) = (Vec::new(), Vec::new());
    for path in paths {
        starts.push(lines.len());
        let file_start = data.len();
        let read = File::open(path).and_then(|mut file| {
            let length = file.metadata()?.len();
            data.reserve(usize::try_from(length).unwrap_or(0));
            file.read_to_end(&mut data)
        });
        match read {
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(StorageError::new("reading", path, err)),
        }
        let end = split_lines(&data, file_start, &mut lines);
        data.truncate(end);
    }
    Ok(FilesLines {
        data,
        lines,
        starts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_last_line_is_skipped_on_read_and_never_glued_onto_the_next_file() {
        let dir = tempfile::tempdir().unwrap();
        let (torn, whole) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
        fs::write(&torn, b"{\"a\":1}\n{\"a\":2}\n{\"a\":").unwrap();
        fs::write(&whole, b"{\"b\":1}\n").unwrap();
        let missing = dir.path().join("none.jsonl");
        let read = read_files_lines_into(
            [torn.as_path(), missing.as_path(), whole.as_path()],
            Vec::new(),
        )
        .unwrap();
        let lines: Vec<&[u8]> = read
            .lines
            .iter()
            .map(|&(start, end)| &read.data[start..end])
            .collect();
        assert_eq!(lines, [&b"{\"a\":1}"[..], b"{\"a\":2}", b"{\"b\":1}"]);
        assert_eq!(read.starts, [0, 2, 2]);
        assert_eq!(
            (0..3).map(|line| read.file_of(line)).collect::<Vec<_>>(),
            [0, 0, 2]
        );
        let (_, lines) = read_whole_lines(&torn).unwrap();
        assert_eq!(lines.len(), 2);
    }

    #[test]
    fn a_writer_creates_a_file_of_its_own_and_leaves_an_existing_one_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/w-a.jsonl");
        let mut log = AppendLog::create(&path).unwrap();
        log.append_line(b"{\"a\":1}").unwrap();
        fs::write(&path, b"{\"a\":1}\n{\"a\":").unwrap();
        let error = AppendLog::create(&path).unwrap_err();
        assert_eq!(error.source.kind(), io::ErrorKind::AlreadyExists);
        assert!(error.to_string().contains("w-a.jsonl"), "{error}");
        assert_eq!(fs::read(&path).unwrap(), b"{\"a\":1}\n{\"a\":");
        drop(log);
        assert!(path.exists(), "a log that wrote keeps its file");
        let empty = dir.path().join("sub/w-b.jsonl");
        drop(AppendLog::create(&empty).unwrap());
        assert!(!empty.exists(), "a log that wrote nothing leaves no file");
    }

    #[test]
    fn a_group_of_more_lines_than_one_gathered_write_takes_is_appended_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.jsonl");
        let lines: Vec<String> = (0..3000).map(|i| format!("{{\"i\":{i}}}")).collect();
        let slices: Vec<&[u8]> = lines.iter().map(String::as_bytes).collect();
        let mut log = AppendLog::create(&path).unwrap();
        log.append_lines(&slices).unwrap();
        log.append_line(b"{}").unwrap();
        let expected = lines.join("\n") + "\n{}\n";
        assert_eq!(fs::read_to_string(&path).unwrap(), expected);
    }

    #[test]
    fn a_file_with_only_a_torn_line_has_no_whole_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.jsonl");
        fs::write(&path, vec![b'x'; 200_000]).unwrap();
        let (data, lines) = read_whole_lines(&path).unwrap();
        assert!(lines.is_empty() && data.is_empty());
        assert_eq!(fs::metadata(&path).unwrap().len(), 200_000);
    }

    #[test]
    fn records_files_are_the_legacy_file_then_each_writer_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let (first, second) = (WriterId::random(), WriterId::random());
        let (first, second) = (first.clone().min(second.clone()), first.max(second));
        for path in [
            run.batch_records_of(7, &second),
            run.batch_openai_records_of(7, &second),
            run.batch_records_of(7, &first),
            run.legacy_batch_records(7),
            run.batch_records_of(8, &first),
            run.batch_dir(7).join(".w-x.jsonl.tmp-1-2"),
        ] {
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, b"").unwrap();
        }
        let files = run.records_files(7).unwrap();
        let records: Vec<_> = files.iter().map(|file| file.records.clone()).collect();
        assert_eq!(
            records,
            [
                run.legacy_batch_records(7),
                run.batch_records_of(7, &first),
                run.batch_records_of(7, &second)
            ]
        );
        assert_eq!(files[0].openai, run.legacy_batch_openai_records(7));
        assert_eq!(files[2].openai, run.batch_openai_records_of(7, &second));
        assert!(run.records_files(9).unwrap().is_empty());
        assert_eq!(
            run.batch_records_of(7, &first)
                .strip_prefix(dir.path())
                .unwrap()
                .to_str()
                .unwrap(),
            format!("batches/batch-000007/w-{first}.jsonl")
        );
    }

    #[test]
    fn atomic_write_replaces_whole_files_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/m.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::read_dir(dir.path().join("sub")).unwrap().count(), 1);
    }

    #[test]
    fn temp_names_differ_between_writers_of_one_process_id() {
        let path = Path::new("/run/batches/batch-000001.done");
        assert_ne!(temp_path(path), temp_path(path));
        assert_eq!(temp_path(path).parent(), path.parent());
    }

    #[test]
    fn a_locked_run_directory_refuses_a_second_lock_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path().join("out"));
        let held = run.lock().unwrap();
        assert!(matches!(run.lock(), Err(LockError::Held(_))));
        drop(held);
        run.lock().unwrap();
    }

    #[test]
    fn done_batches_are_listed_in_numeric_order() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        for id in [10, 2, 100] {
            write_atomic(&run.batch_done(id), b"{}").unwrap();
        }
        fs::write(run.batches_dir().join("batch-000003.jsonl"), b"").unwrap();
        fs::create_dir_all(run.batch_dir(4)).unwrap();
        assert_eq!(run.done_batches().unwrap(), [2, 10, 100]);
        run.remove_done_markers(&[10, 11]).unwrap();
        assert_eq!(run.done_batches().unwrap(), [2, 100]);
    }
}

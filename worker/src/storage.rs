//! The run's directory on shared storage, and the write disciplines that make it crash-safe.
//!
//! ```text
//! <root>/<outputPath>/
//!   manifest.json               run identity, dataset and segment digests, batch byte ranges,
//!                               spec hash
//!   invalid.jsonl               rejected dataset lines with reasons
//!   batches/batch-000042.jsonl  one record per (prompt, sample), appended whole and fsynced
//!   batches/batch-000042.done   completion marker with counts (temp + fsync + rename)
//!   trajectories.jsonl          merged output in dataset order
//!   failures.jsonl              failed and discarded prompts
//!   statistics.json             counts, tools, reasoning, tokens, latency
//!   plan/pending-<16 hex>.ranges  the batches not done, when a plan's summary could not list
//!                               the done ones (one file per such plan, never rewritten)
//! ```
//!
//! Two rules keep every reader safe from a writer killed at any instant: whole files appear only by
//! rename of a fsynced temp file, and append-only files are read up to their last newline (a torn
//! tail is cut off before the next append).

use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

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
    /// The pod's user may not write there (EACCES, EPERM): no retry can either.
    Denied,
}

impl StorageError {
    pub fn fault(&self) -> StorageFault {
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

/// The directory of [`RunDir::plan_dir`], relative to the run directory.
const PLAN_DIR: &str = "plan";

/// Paths of one run's output directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    root: PathBuf,
}

impl RunDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
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
    pub fn batches_dir(&self) -> PathBuf {
        self.root.join("batches")
    }
    /// Zero-padded so that a directory listing sorts in batch order too.
    pub fn batch_records(&self, batch: u32) -> PathBuf {
        self.batches_dir().join(format!("batch-{batch:06}.jsonl"))
    }
    pub fn batch_openai_records(&self, batch: u32) -> PathBuf {
        self.batches_dir()
            .join(format!("batch-{batch:06}.openai.jsonl"))
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
    pub fn failures(&self) -> PathBuf {
        self.root.join("failures.jsonl")
    }
    pub fn statistics(&self) -> PathBuf {
        self.root.join("statistics.json")
    }
    /// Files a plan leaves for the generation pods (its pending lists).
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

    /// Ids of batches with a completion marker, ascending.
    pub fn done_batches(&self) -> Result<Vec<u32>, StorageError> {
        let dir = self.batches_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(StorageError::new("listing", &dir, err)),
        };
        let mut done = Vec::new();
        for entry in entries {
            let name = entry.at("listing", &dir)?.file_name();
            let name = name.to_string_lossy();
            if let Some(id) = name
                .strip_prefix("batch-")
                .and_then(|rest| rest.strip_suffix(".done"))
                .and_then(|digits| digits.parse().ok())
            {
                done.push(id);
            }
        }
        done.sort_unstable();
        Ok(done)
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
    _lock: nix::fcntl::Flock<File>,
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
    pub fn lock(&self) -> Result<RunDirLock, LockError> {
        fs::create_dir_all(&self.root).at("creating", &self.root)?;
        let path = self.lock_file();
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .at("opening", &path)?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(RunDirLock { _lock: lock }),
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

/// An append-only JSONL file whose every line is written whole and fsynced.
#[derive(Debug)]
pub struct AppendLog {
    path: PathBuf,
    file: File,
}

impl AppendLog {
    /// Opens (or creates) the file for appending, first cutting off a torn last line left by a
    /// writer that was killed mid-write, so new lines never glue onto garbage.
    pub fn open(path: &Path) -> Result<Self, StorageError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).at("creating", dir)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .at("opening", path)?;
        let length = file.metadata().at("reading metadata of", path)?.len();
        let whole = whole_lines_length(&mut file, length).at("reading", path)?;
        if whole < length {
            file.set_len(whole).at("truncating a torn line of", path)?;
            file.sync_all().at("syncing", path)?;
        }
        Ok(Self {
            path: path.to_owned(),
            file,
        })
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

/// The length of the file up to and including its last newline.
fn whole_lines_length(file: &mut File, length: u64) -> io::Result<u64> {
    const CHUNK: u64 = 64 * 1024;
    let mut end = length;
    let mut buffer = vec![0u8; usize::try_from(CHUNK).unwrap_or(65_536)];
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let size = usize::try_from(end - start).unwrap_or(buffer.len());
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buffer[..size])?;
        if let Some(position) = memchr::memrchr(b'\n', &buffer[..size]) {
            return Ok(start + position as u64 + 1);
        }
        end = start;
    }
    Ok(0)
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
    mut data: Vec<u8>,
) -> Result<(Vec<u8>, LineRanges), StorageError> {
    data.clear();
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
    let mut lines = Vec::new();
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', &data) {
        if end > start {
            lines.push((start, end));
        }
        start = end + 1;
    }
    Ok((data, lines))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_last_line_is_cut_before_the_next_append() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.jsonl");
        fs::write(&path, b"{\"a\":1}\n{\"a\":2}\n{\"a\":").unwrap();
        let (_, lines) = read_whole_lines(&path).unwrap();
        assert_eq!(lines.len(), 2);
        let mut log = AppendLog::open(&path).unwrap();
        log.append_line(b"{\"a\":3}").unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n"
        );
    }

    #[test]
    fn a_group_of_more_lines_than_one_gathered_write_takes_is_appended_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.jsonl");
        let lines: Vec<String> = (0..3000).map(|i| format!("{{\"i\":{i}}}")).collect();
        let slices: Vec<&[u8]> = lines.iter().map(String::as_bytes).collect();
        let mut log = AppendLog::open(&path).unwrap();
        log.append_lines(&slices).unwrap();
        log.append_line(b"{}").unwrap();
        let expected = lines.join("\n") + "\n{}\n";
        assert_eq!(fs::read_to_string(&path).unwrap(), expected);
    }

    #[test]
    fn a_file_with_only_a_torn_line_becomes_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.jsonl");
        fs::write(&path, vec![b'x'; 200_000]).unwrap();
        AppendLog::open(&path).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 0);
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
        assert_eq!(run.done_batches().unwrap(), [2, 10, 100]);
    }
}

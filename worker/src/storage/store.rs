//! One set of file operations over a volume or a bucket, so that every run mode is written once.
//!
//! On a volume they keep the disciplines of the module above (renames of fsynced temp files,
//! append-only files read to their last newline). On a bucket an object appears whole or not at
//! all, so a put replaces a rename; appends become immutable parts (see [`RecordsWriter`]); what
//! must be created once (a batch's completion marker, the manifest, a pending list) is a
//! conditional put.

use std::io::{self, Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::object::{Bucket, ObjectWriter};
use super::{AppendLog, Context, FilesLines, StorageError, sync_dir, temp_path};

/// Where a run's files are: a mounted volume (paths are file paths) or a bucket (paths are
/// `s3://<bucket>/<key>`).
#[derive(Debug, Clone, Default)]
pub enum Store {
    #[default]
    Volume,
    Bucket(Arc<Bucket>),
}

/// A records part is written once it holds this many records...
pub const PART_RECORDS: usize = 64;
/// ...or once its first record has waited this long: what a kill can lose on a bucket.
pub const PART_AGE: Duration = Duration::from_secs(10);

impl Store {
    pub fn is_bucket(&self) -> bool {
        matches!(self, Self::Bucket(_))
    }

    /// The whole file.
    pub fn read(&self, path: &Path) -> Result<Vec<u8>, StorageError> {
        match self {
            Self::Volume => std::fs::read(path).at("reading", path),
            Self::Bucket(bucket) => bucket.read(path).map(Vec::from).at("reading", path),
        }
    }

    /// The whole file, or `None` when there is none.
    pub fn read_optional(&self, path: &Path) -> Result<Option<Vec<u8>>, StorageError> {
        match self.read(path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(error) if error.is_not_found() => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// The file as UTF-8 text.
    pub fn read_to_string(&self, path: &Path) -> Result<String, StorageError> {
        String::from_utf8(self.read(path)?).map_err(|error| {
            StorageError::new(
                "reading",
                path,
                io::Error::new(io::ErrorKind::InvalidData, error),
            )
        })
    }

    /// Bytes `range` of the file.
    pub fn read_range(&self, path: &Path, range: Range<u64>) -> Result<Vec<u8>, StorageError> {
        match self {
            Self::Volume => {
                use std::io::Seek;
                let mut file = std::fs::File::open(path).at("opening", path)?;
                file.seek(io::SeekFrom::Start(range.start))
                    .at("reading", path)?;
                let length = range.end.saturating_sub(range.start);
                let mut data = Vec::with_capacity(usize::try_from(length).unwrap_or(0));
                file.take(length)
                    .read_to_end(&mut data)
                    .at("reading", path)?;
                Ok(data)
            }
            Self::Bucket(bucket) => bucket
                .read_range(path, range)
                .map(Vec::from)
                .at("reading", path),
        }
    }

    /// The file as a stream.
    pub fn open(&self, path: &Path) -> Result<Box<dyn Read + Send>, StorageError> {
        match self {
            Self::Volume => Ok(Box::new(std::fs::File::open(path).at("opening", path)?)),
            Self::Bucket(bucket) => Ok(Box::new(bucket.reader(path).at("opening", path)?)),
        }
    }

    /// Writes the whole file so that a reader sees the old one or the new one, never a part.
    pub fn write_atomic(&self, path: &Path, contents: &[u8]) -> Result<(), StorageError> {
        match self {
            Self::Volume => super::write_atomic(path, contents),
            Self::Bucket(bucket) => bucket
                .put(path, Bytes::copy_from_slice(contents))
                .at("writing", path),
        }
    }

    /// Writes the whole file through `write`, streamed; a reader sees the old file or the new
    /// one, never a part.
    pub fn write_with(
        &self,
        path: &Path,
        write: impl FnOnce(&mut Output) -> io::Result<()>,
    ) -> Result<(), StorageError> {
        let mut output = self.output(path)?;
        write(&mut output).at("writing", path)?;
        output.finish()
    }

    /// Creates the file with `contents` unless it exists; `false` when it did (the first
    /// writer's stays). On a volume the check and the rename are not one step: two writers may
    /// both write, and both wrote the same thing (a batch's marker).
    pub fn create_once(&self, path: &Path, contents: &[u8]) -> Result<bool, StorageError> {
        match self {
            Self::Volume => {
                if std::fs::symlink_metadata(path).is_ok() {
                    return Ok(false);
                }
                super::write_atomic(path, contents).map(|()| true)
            }
            Self::Bucket(bucket) => match bucket.put_new(path, &Bytes::copy_from_slice(contents)) {
                Ok(()) => Ok(true),
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(false),
                Err(error) => Err(StorageError::new("creating", path, error)),
            },
        }
    }

    /// Removes the file; one that is not there is fine.
    pub fn remove(&self, path: &Path) -> Result<(), StorageError> {
        let result = match self {
            Self::Volume => std::fs::remove_file(path),
            Self::Bucket(bucket) => bucket.delete(path),
        };
        match result {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                Err(StorageError::new("removing", path, error))
            }
            _ => Ok(()),
        }
    }

    /// The names in `dir`, unordered; none when it does not exist.
    pub fn list(&self, dir: &Path) -> Result<Vec<String>, StorageError> {
        match self {
            Self::Volume => {
                let entries = match std::fs::read_dir(dir) {
                    Ok(entries) => entries,
                    Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                    Err(error) => return Err(StorageError::new("listing", dir, error)),
                };
                entries
                    .map(|entry| {
                        entry
                            .map(|entry| entry.file_name().to_string_lossy().into_owned())
                            .at("listing", dir)
                    })
                    .collect()
            }
            Self::Bucket(bucket) => bucket.list(dir).at("listing", dir),
        }
    }

    /// Creates `dir` and its parents (a bucket has no directories).
    pub fn create_dir_all(&self, dir: &Path) -> Result<(), StorageError> {
        match self {
            Self::Volume => std::fs::create_dir_all(dir).at("creating", dir),
            Self::Bucket(_) => Ok(()),
        }
    }

    /// Makes the renames and new files in `dir` durable (a bucket's are when acknowledged).
    pub fn sync_dir(&self, dir: &Path) -> Result<(), StorageError> {
        match self {
            Self::Volume => sync_dir(dir),
            Self::Bucket(_) => Ok(()),
        }
    }

    /// A file written as a stream that appears whole at [`Output::finish`], and not at all when
    /// dropped before.
    pub fn output(&self, path: &Path) -> Result<Output, StorageError> {
        match self {
            Self::Volume => {
                let dir = path.parent().unwrap_or(Path::new("."));
                std::fs::create_dir_all(dir).at("creating", dir)?;
                let temp = temp_path(path);
                let file = std::fs::File::create(&temp).at("creating", &temp)?;
                Ok(Output {
                    path: path.to_owned(),
                    sink: Some(Sink::File {
                        temp,
                        file: io::BufWriter::with_capacity(1 << 20, file),
                    }),
                })
            }
            Self::Bucket(bucket) => Ok(Output {
                path: path.to_owned(),
                sink: Some(Sink::Object(bucket.writer(path).at("writing", path)?)),
            }),
        }
    }

    /// The whole lines of each file (a missing file has none), into a reused buffer; see
    /// [`super::read_files_lines_into`].
    pub fn read_files_lines_into<'a>(
        &self,
        paths: impl IntoIterator<Item = &'a Path>,
        data: Vec<u8>,
    ) -> Result<FilesLines, StorageError> {
        match self {
            Self::Volume => super::read_files_lines_into(paths, data),
            Self::Bucket(bucket) => {
                let mut read = FilesLines {
                    data,
                    ..FilesLines::default()
                };
                read.data.clear();
                for path in paths {
                    read.starts.push(read.lines.len());
                    match bucket.read(path) {
                        Ok(bytes) => read.push_file(&bytes),
                        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                        Err(error) => return Err(StorageError::new("reading", path, error)),
                    }
                }
                Ok(read)
            }
        }
    }

    /// The writer of one process's records of a batch, at `records` and, when `openai` is set,
    /// its `OpenAI`-form twin.
    pub fn records_writer(
        &self,
        records: &Path,
        openai: Option<&Path>,
    ) -> Result<RecordsWriter, StorageError> {
        match self {
            Self::Volume => Ok(RecordsWriter::Files {
                main: AppendLog::create(records)?,
                openai: openai.map(AppendLog::create).transpose()?,
            }),
            Self::Bucket(bucket) => Ok(RecordsWriter::Parts(Parts {
                bucket: bucket.clone(),
                records: records.to_owned(),
                openai: openai.map(Path::to_owned),
                written: 0,
                main: Vec::new(),
                twin: Vec::new(),
                count: 0,
                since: None,
            })),
        }
    }
}

impl Store {
    /// The writer of one process's turn log at `path`, created when it first writes.
    pub fn turns_writer(&self, path: &Path) -> TurnsWriter {
        TurnsWriter {
            store: self.clone(),
            path: path.to_owned(),
            log: None,
            parts: 0,
        }
    }
}

/// Where one process appends the turns its conversations finish: every group is durable when
/// [`TurnsWriter::append`] returns, because the conversations wait for it before their next
/// model call. On a volume an append-only file (one write and one fsync per group); on a bucket
/// one immutable part per group (`w-<writer>-<n>.turns.jsonl`), created once.
#[derive(Debug)]
pub struct TurnsWriter {
    store: Store,
    path: PathBuf,
    log: Option<AppendLog>,
    /// Parts written so far (on a bucket).
    parts: u32,
}

impl TurnsWriter {
    /// Whether each append is an object of its own (a PUT) rather than a write to a file.
    pub fn is_on_bucket(&self) -> bool {
        self.store.is_bucket()
    }

    /// Makes `lines` durable, in one write.
    pub fn append(&mut self, lines: &[&[u8]]) -> Result<(), StorageError> {
        match &self.store {
            Store::Volume => {
                let log = match &mut self.log {
                    Some(log) => log,
                    None => self.log.insert(AppendLog::create(&self.path)?),
                };
                log.append_lines(lines)
            }
            Store::Bucket(bucket) => {
                let size = lines.iter().map(|line| line.len() + 1).sum();
                let mut part = Vec::with_capacity(size);
                for line in lines {
                    part.extend_from_slice(line);
                    part.push(b'\n');
                }
                let path = Parts::part_path(&self.path, self.parts);
                bucket
                    .put_new(&path, &Bytes::from(part))
                    .at("writing", &path)?;
                self.parts += 1;
                Ok(())
            }
        }
    }

    /// Removes what this writer wrote: its batch is done, so no conversation will resume from
    /// it.
    pub fn remove(mut self) -> Result<(), StorageError> {
        if let Some(log) = self.log.take() {
            let path = log.path().to_owned();
            drop(log);
            return self.store.remove(&path);
        }
        let Store::Bucket(bucket) = &self.store else {
            return Ok(());
        };
        let parts: Vec<PathBuf> = (0..self.parts)
            .map(|part| Parts::part_path(&self.path, part))
            .collect();
        bucket.delete_all(&parts).at("removing", &self.path)
    }
}

/// A file being written by [`Store::output`].
#[derive(Debug)]
pub struct Output {
    path: PathBuf,
    /// Taken by [`Output::finish`].
    sink: Option<Sink>,
}

#[derive(Debug)]
enum Sink {
    File {
        temp: PathBuf,
        file: io::BufWriter<std::fs::File>,
    },
    Object(ObjectWriter),
}

impl Output {
    /// Makes the file appear, whole (renamed into place and made durable on a volume; the
    /// upload completed on a bucket).
    pub fn finish(mut self) -> Result<(), StorageError> {
        let path = self.path.clone();
        match self.sink.take().expect("finish takes the sink once") {
            Sink::File { temp, file } => {
                let file = file
                    .into_inner()
                    .map_err(|error| StorageError::new("writing", &temp, error.into_error()))?;
                file.sync_all().at("syncing", &temp)?;
                std::fs::rename(&temp, &path).at("renaming into place", &path)?;
                sync_dir(path.parent().unwrap_or(Path::new(".")))
            }
            Sink::Object(writer) => writer.finish().at("writing", &path),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Output {
    fn writer(&mut self) -> &mut dyn Write {
        match self.sink.as_mut().expect("written before finish") {
            Sink::File { file, .. } => file,
            Sink::Object(writer) => writer,
        }
    }
}

impl Write for Output {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.writer().write(data)
    }

    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.writer().write_all(data)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.writer().flush()
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        // Dropped unfinished: the temp file goes (an unfinished upload aborts itself).
        if let Some(Sink::File { temp, .. }) = &self.sink {
            let _ = std::fs::remove_file(temp);
        }
    }
}

/// Where one process appends the records it finished.
#[derive(Debug)]
pub enum RecordsWriter {
    /// Append-only files, every group fsynced as it is written.
    Files {
        main: AppendLog,
        openai: Option<AppendLog>,
    },
    /// Immutable objects of at most [`PART_RECORDS`] records, each written within [`PART_AGE`]
    /// of its first record.
    Parts(Parts),
}

/// The part being gathered on a bucket.
#[derive(Debug)]
pub struct Parts {
    bucket: Arc<Bucket>,
    /// `.../w-<writer>.jsonl`: part `n` is `.../w-<writer>-<n>.jsonl`, which readers take for a
    /// writer of its own (a writer id has no dot, and may hold `-`).
    records: PathBuf,
    openai: Option<PathBuf>,
    /// Parts written so far.
    written: u32,
    main: Vec<u8>,
    twin: Vec<u8>,
    count: usize,
    since: Option<Instant>,
}

impl Parts {
    fn part_path(base: &Path, part: u32) -> PathBuf {
        let name = base
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (stem, extension) = name
            .split_once('.')
            .map_or((name.as_str(), ""), |(stem, rest)| (stem, rest));
        base.with_file_name(format!("{stem}-{part:06}.{extension}"))
    }

    /// Writes the gathered part: the twin first, the records (the source of truth) last, each
    /// created once.
    fn flush(&mut self) -> Result<(), StorageError> {
        if self.count == 0 {
            return Ok(());
        }
        let part = self.written;
        if let Some(openai) = &self.openai {
            let path = Self::part_path(openai, part);
            let twin = Bytes::from(std::mem::take(&mut self.twin));
            self.bucket.put_new(&path, &twin).at("writing", &path)?;
        }
        let path = Self::part_path(&self.records, part);
        let main = Bytes::from(std::mem::take(&mut self.main));
        self.bucket.put_new(&path, &main).at("writing", &path)?;
        self.written += 1;
        self.count = 0;
        self.since = None;
        Ok(())
    }
}

impl RecordsWriter {
    /// Takes a group of records (each with its `OpenAI`-form twin when the run writes one).
    /// Files write and sync it now; parts once they are full.
    pub fn append(&mut self, group: &[(&[u8], Option<&[u8]>)]) -> Result<(), StorageError> {
        match self {
            Self::Files { main, openai } => {
                if let Some(log) = openai.as_mut() {
                    let lines: Vec<&[u8]> = group.iter().filter_map(|(_, twin)| *twin).collect();
                    if !lines.is_empty() {
                        log.append_lines(&lines)?;
                    }
                }
                // The main file is the source of truth, so it is written last.
                let lines: Vec<&[u8]> = group.iter().map(|(line, _)| *line).collect();
                main.append_lines(&lines)
            }
            Self::Parts(parts) => {
                for (line, twin) in group {
                    parts.main.extend_from_slice(line);
                    parts.main.push(b'\n');
                    if let Some(twin) = twin {
                        parts.twin.extend_from_slice(twin);
                        parts.twin.push(b'\n');
                    }
                    parts.count += 1;
                }
                parts.since.get_or_insert_with(Instant::now);
                if parts.count >= PART_RECORDS {
                    parts.flush()?;
                }
                Ok(())
            }
        }
    }

    /// When the gathered part must be written even if no record comes (never for files).
    pub fn deadline(&self) -> Option<Instant> {
        match self {
            Self::Files { .. } => None,
            Self::Parts(parts) => parts.since.map(|since| since + PART_AGE),
        }
    }

    /// Writes what is gathered.
    pub fn flush(&mut self) -> Result<(), StorageError> {
        match self {
            Self::Files { .. } => Ok(()),
            Self::Parts(parts) => parts.flush(),
        }
    }
}

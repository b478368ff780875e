//! `plan`: one streaming pass over the dataset that validates every line, records the batch
//! layout and the run's identity, and finds batches already done.
//!
//! The pass runs on three threads: this one reads big blocks of whole lines, digests them in
//! segments ([`super::segments`]: every byte is hashed once), lays out the batches and writes
//! `invalid.jsonl`; two validators check the lines of alternate blocks, a few blocks behind the
//! reader. Memory is a handful of blocks, whatever the size of the dataset.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
use tracing::{info, warn};

use super::manifest::{
    BatchLayout, DatasetInfo, MANIFEST_VERSION, Manifest, RunIdentity, spec_hash,
};
use super::segments::{SEGMENT_BYTES, SegmentHasher};
use super::{RunError, RunLocation};
use crate::contract::{
    BatchRange, BuildEntry, ImageGroup, ImagePage, PlanSummary, Ranges, TERMINATION_MESSAGE_LIMIT,
    TaskResources, compact_ranges, format_ranges, image_page_path, image_pages, task_batch_prompts,
};
use crate::dataset::{
    Block, LineBlocks, LineInfo, MAX_LINE_BYTES, Rejection, probe, probe_image, without_bom,
};
use crate::distribution::Distribution;
use crate::spec::{DatasetFormat, RunSpec};
use crate::storage::{Context, Output, RunDir, StorageError, Store};
use crate::tools::Registry;
use crate::tools::mcp::{FrozenServer, discover_blocking};
use crate::tools::sandbox::Sandbox;

/// The dataset is read in blocks of this size: large reads, and large updates for the digests
/// (BLAKE3 hashes many 1 KiB chunks at once only when it is given them at once).
const BLOCK_BYTES: usize = 1 << 20;

/// Blocks read ahead of the one whose lines are being laid out.
const BLOCKS_IN_FLIGHT: usize = 4;

/// Threads validating lines: validation is most of the plan's work, and one thread on each core
/// (besides the reader, which mostly waits for the disk or hashes) keeps both busy.
const VALIDATORS: usize = 2;

/// One line of a block as the validator saw it.
#[derive(Debug)]
struct Checked {
    /// End of the line within the block, after its newline.
    next: usize,
    /// `None` when the validator skipped it (the run's `maxSamples` was reached before it); for
    /// a valid row, the image it names for itself.
    result: Option<Result<Option<String>, Rejection>>,
}

/// Frames and validates the lines of a block (the validator thread's work).
fn check_block(block: &Block, prompt_field: &str, skip: bool) -> Vec<Checked> {
    let Block::Lines(lines) = block else {
        return Vec::new();
    };
    let data = lines.bytes();
    let mut checked = Vec::with_capacity(data.len() / 512);
    let mut position = 0;
    while position < data.len() {
        let (end, next) = match memchr::memchr(b'\n', &data[position..]) {
            Some(newline) => (position + newline, position + newline + 1),
            None => (data.len(), data.len()),
        };
        let content = without_bom(lines.offset + position as u64, &data[position..end]);
        let result =
            (!skip).then(|| probe_image(content, content.len() > MAX_LINE_BYTES, prompt_field));
        checked.push(Checked { next, result });
        position = next;
    }
    checked
}

/// The layout being built, block by block, in file order.
struct Layout<'a> {
    max_samples: u64,
    batch_size: u64,
    /// Prompts in a batch of rows naming an image ([`task_batch_prompts`]).
    task_batch_size: u64,
    batches: Vec<BatchLayout>,
    lines: u64,
    prompts: u64,
    invalid: u64,
    bytes: u64,
    batch_start: u64,
    valid_end: u64,
    /// Prompts in the batch being laid out.
    in_batch: u64,
    /// The image of the batch being laid out (a position in `images` from 1; 0: none).
    batch_image: u32,
    invalid_out: Output,
    invalid_path: &'a Path,
    /// The images rows name, each once, in order, with their positions from 1.
    images: Vec<String>,
    image_positions: HashMap<String, u32>,
    /// Per batch, once a row named an image (empty before): its image and first prompt.
    batch_images: Vec<u32>,
    first_prompts: Vec<u64>,
    rows_with_images: RowsWithImages,
}

impl<'a> Layout<'a> {
    fn new(spec: &RunSpec, invalid_out: Output, invalid_path: &'a Path) -> Self {
        Self {
            max_samples: spec.dataset.max_samples.unwrap_or(u64::MAX),
            batch_size: u64::from(spec.batch_size),
            batches: Vec::new(),
            lines: 0,
            prompts: 0,
            invalid: 0,
            bytes: 0,
            batch_start: 0,
            valid_end: 0,
            in_batch: 0,
            batch_image: 0,
            task_batch_size: u64::from(task_batch_prompts(
                spec.batch_size,
                spec.samples_per_prompt,
            )),
            invalid_out,
            invalid_path,
            images: Vec::new(),
            image_positions: HashMap::new(),
            batch_images: Vec::new(),
            first_prompts: Vec::new(),
            rows_with_images: RowsWithImages::default(),
        }
    }
}

impl Layout<'_> {
    /// The position from 1 of the image a valid row names (0: none), noted for the host's
    /// refusal. The first image turns the layout into one of image-homogeneous batches, whose
    /// images and first prompts are listed from then on (the batches before are all full).
    fn note_image(&mut self, image: Option<&String>) -> u32 {
        let Some(image) = image else {
            return 0;
        };
        let listed = &mut self.rows_with_images;
        listed.rows += 1;
        if listed.first_lines.len() < RowsWithImages::LISTED_LINES {
            listed.first_lines.push(self.lines);
        }
        if listed.first_images.len() < RowsWithImages::LISTED_IMAGES
            && !listed.first_images.contains(image)
        {
            listed.first_images.push(image.clone());
        }
        if self.images.is_empty() {
            let batches = self.batches.len() as u64;
            self.batch_images = vec![0; self.batches.len()];
            self.first_prompts = (0..batches).map(|b| b * self.batch_size).collect();
        }
        if let Some(position) = self.image_positions.get(image) {
            return *position;
        }
        self.images.push(image.clone());
        let position = u32::try_from(self.images.len()).unwrap_or(u32::MAX);
        self.image_positions.insert(image.clone(), position);
        position
    }

    /// Lays out one valid row starting at `start`, of the image at `image` (0: none).
    fn add_prompt(&mut self, start: u64, image: u32) {
        if self.in_batch > 0 && image != self.batch_image {
            self.end_batch();
        }
        if self.in_batch == 0 {
            self.batch_start = start;
            self.batch_image = image;
            if !self.images.is_empty() {
                self.first_prompts.push(self.prompts);
            }
        }
        self.prompts += 1;
        self.in_batch += 1;
        self.valid_end = self.bytes;
        let full = if image == 0 {
            self.batch_size
        } else {
            self.task_batch_size
        };
        if self.in_batch == full {
            self.end_batch();
        }
    }

    fn reject(
        &mut self,
        info: &LineInfo,
        content: &[u8],
        rejection: &Rejection,
    ) -> Result<(), StorageError> {
        self.invalid += 1;
        let excerpt = String::from_utf8_lossy(&content[..content.len().min(200)]).into_owned();
        let entry = serde_json::json!({
            "line": info.number,
            "offset": info.offset,
            "reason": rejection.reason.as_str(),
            "message": rejection.message,
            "excerpt": excerpt,
        });
        serde_json::to_writer(&mut self.invalid_out, &entry)
            .map_err(std::io::Error::from)
            .and_then(|()| self.invalid_out.write_all(b"\n"))
            .at("writing", self.invalid_path)
    }

    fn end_batch(&mut self) {
        self.batches
            .push(BatchLayout(self.batch_start, self.valid_end));
        if !self.images.is_empty() {
            self.batch_images.push(self.batch_image);
        }
        self.in_batch = 0;
    }

    /// Lays out one block's lines, with the validator's verdicts.
    fn add(&mut self, block: &Block, checked: &[Checked]) -> Result<(), StorageError> {
        let lines = match block {
            Block::TooLong { offset, length } => {
                self.lines += 1;
                self.bytes = offset + length;
                if self.prompts < self.max_samples {
                    let info = LineInfo {
                        number: self.lines,
                        offset: *offset,
                        length: *length,
                        too_long: true,
                    };
                    let rejection = probe(&[], true, "")
                        .expect_err("a line too long to keep is always rejected");
                    self.reject(&info, &[], &rejection)?;
                }
                return Ok(());
            }
            Block::Lines(lines) => lines,
        };
        let (offset, data) = (lines.offset, lines.bytes());
        let mut position = 0;
        for line in checked {
            let next = line.next;
            self.lines += 1;
            self.bytes = offset + next as u64;
            match &line.result {
                _ if self.prompts >= self.max_samples => {}
                Some(Ok(image)) => {
                    let image = self.note_image(image.as_ref());
                    self.add_prompt(offset + position as u64, image);
                }
                Some(Err(rejection)) => {
                    let end = if data[next - 1] == b'\n' {
                        next - 1
                    } else {
                        next
                    };
                    let info = LineInfo {
                        number: self.lines,
                        offset: offset + position as u64,
                        length: (next - position) as u64,
                        too_long: end - position > MAX_LINE_BYTES,
                    };
                    self.reject(&info, &data[position..end], rejection)?;
                }
                None => unreachable!("the validator skips lines only after maxSamples prompts"),
            }
            position = next;
        }
        Ok(())
    }
}

/// What the pass over the dataset found.
struct Scanned {
    digest: String,
    segment_digests: Vec<String>,
    layout_batches: Vec<BatchLayout>,
    lines: u64,
    prompts: u64,
    invalid: u64,
    bytes: u64,
    invalid_out: Output,
    images: Vec<String>,
    batch_images: Vec<u32>,
    first_prompts: Vec<u64>,
    rows_with_images: RowsWithImages,
}

/// The rows that name a container image of their own: how many, and the first of them.
#[derive(Debug, Clone, Default)]
struct RowsWithImages {
    rows: u64,
    /// The dataset line numbers (from 1) of the first of them.
    first_lines: Vec<u64>,
    /// The first distinct images they name.
    first_images: Vec<String>,
}

impl RowsWithImages {
    /// Line numbers listed: enough to find the rows.
    const LISTED_LINES: usize = 10;
    /// Distinct images listed.
    const LISTED_IMAGES: usize = 5;
}

/// Keeps the disk busy ahead of the reader when the file is not in the page cache: the reader
/// stops reading while it hashes a block, and the kernel's own read-ahead is a few hundred KiB,
/// so the next megabytes are requested in the background (`POSIX_FADV_WILLNEED`) before they are
/// needed. Only hints: reading works the same without them.
struct ReadAhead<'a> {
    file: &'a File,
    requested_until: u64,
}

impl<'a> ReadAhead<'a> {
    /// Bytes requested ahead of the reader.
    const WINDOW: u64 = 16 << 20;

    fn new(file: &'a File) -> Self {
        let _ = posix_fadvise(file, 0, 0, PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL);
        Self {
            file,
            requested_until: 0,
        }
    }

    /// Called with the offset the reader is about to read from.
    fn before_reading(&mut self, offset: u64) {
        if offset + Self::WINDOW / 2 < self.requested_until {
            return;
        }
        let start = self.requested_until.max(offset);
        let until = offset + Self::WINDOW;
        if let (Ok(start), Ok(length)) = (i64::try_from(start), i64::try_from(until - start)) {
            let _ = posix_fadvise(
                self.file,
                start,
                length,
                PosixFadviseAdvice::POSIX_FADV_WILLNEED,
            );
        }
        self.requested_until = until;
    }
}

/// Reads, digests, validates and lays out the whole dataset.
/// `read_ahead` is the file's when the dataset is one (none for a bucket's stream).
fn scan(
    dataset: impl Read,
    mut read_ahead: Option<ReadAhead<'_>>,
    spec: &RunSpec,
    dataset_path: &Path,
    invalid_out: Output,
    invalid_path: &Path,
) -> Result<Scanned, RunError> {
    let from_bucket = read_ahead.is_none();
    let read_error = |err: std::io::Error| -> RunError {
        if from_bucket {
            // The bucket's failures (its retries spent), not the dataset's.
            StorageError::new("reading", dataset_path, err).into()
        } else {
            RunError::InvalidDataset(format!("cannot read {}: {err}", dataset_path.display()))
        }
    };
    let mut layout = Layout::new(spec, invalid_out, invalid_path);
    let mut blocks = LineBlocks::new(dataset, BLOCK_BYTES, MAX_LINE_BYTES);
    let mut segments = SegmentHasher::new();
    let mut offset = 0u64;
    // Set once `maxSamples` prompts are laid out: the validators may skip the rest.
    let enough = AtomicBool::new(layout.max_samples == 0);
    let field = spec.dataset.prompt_field.as_str();
    std::thread::scope(|scope| {
        // Block `n` goes to validator `n % VALIDATORS` and comes back from it, so blocks are laid
        // out in file order.
        let mut to_validators = Vec::with_capacity(VALIDATORS);
        let mut from_validators = Vec::with_capacity(VALIDATORS);
        for _ in 0..VALIDATORS {
            let (to_validator, inbox) = mpsc::sync_channel::<Block>(BLOCKS_IN_FLIGHT);
            let (to_layout, validated) = mpsc::channel::<(Block, Vec<Checked>)>();
            let enough = &enough;
            scope.spawn(move || {
                for block in inbox {
                    let checked = check_block(&block, field, enough.load(Ordering::Relaxed));
                    if to_layout.send((block, checked)).is_err() {
                        break;
                    }
                }
            });
            to_validators.push(to_validator);
            from_validators.push(validated);
        }
        let lost = || RunError::Internal("a dataset validator thread stopped".into());
        let (mut sent, mut received) = (0usize, 0usize);
        let mut reading = true;
        loop {
            if reading && sent - received < BLOCKS_IN_FLIGHT {
                if let Some(read_ahead) = read_ahead.as_mut() {
                    read_ahead.before_reading(offset);
                }
                match blocks
                    .next_block(&mut |chunk| {
                        segments.update(chunk);
                        offset += chunk.len() as u64;
                    })
                    .map_err(read_error)?
                {
                    Some(block) => {
                        to_validators[sent % VALIDATORS]
                            .send(block)
                            .map_err(|_| lost())?;
                        sent += 1;
                        continue;
                    }
                    None => reading = false,
                }
            }
            if sent == received {
                break;
            }
            let (block, checked) = from_validators[received % VALIDATORS]
                .recv()
                .map_err(|_| lost())?;
            received += 1;
            layout.add(&block, &checked)?;
            if layout.prompts >= layout.max_samples {
                enough.store(true, Ordering::Relaxed);
            }
            blocks.recycle(block);
        }
        drop(to_validators);
        Ok::<(), RunError>(())
    })?;
    if layout.in_batch > 0 {
        layout.end_batch();
    }
    let (digest, segment_digests) = segments.finish();
    Ok(Scanned {
        digest,
        segment_digests,
        layout_batches: layout.batches,
        lines: layout.lines,
        prompts: layout.prompts,
        invalid: layout.invalid,
        bytes: layout.bytes,
        invalid_out: layout.invalid_out,
        images: layout.images,
        batch_images: layout.batch_images,
        first_prompts: layout.first_prompts,
        rows_with_images: layout.rows_with_images,
    })
}

/// The batches as the plan laid them out, with their images ([`Manifest::images`]).
struct ImageLayout {
    batches: Vec<BatchLayout>,
    images: Vec<String>,
    batch_images: Vec<u32>,
    first_prompts: Vec<u64>,
}

/// The manifest already on storage, if this run wrote it (a manifest of another dataset or spec is
/// an error, and so is one that laid the batches out otherwise: a worker of before rows' images
/// were honoured), or a new one; and whether it was on storage.
fn run_manifest(
    location: &RunLocation,
    dataset: DatasetInfo,
    catalog: Vec<String>,
    mcp_tools: Vec<FrozenServer>,
    layout: ImageLayout,
) -> Result<(Manifest, bool), RunError> {
    let spec = &location.plan.spec;
    let run_dir = location.run_dir();
    let spec_hash = spec_hash(spec);
    match Manifest::load(&run_dir)? {
        Some(existing) => {
            if existing.dataset.digest != dataset.digest || existing.spec_hash != spec_hash {
                return Err(RunError::OutputMismatch(format!(
                    "output directory {} belongs to a run with dataset {} and spec {}, but this run has \
                     dataset {} and spec {}; restore the dataset and generating fields, or use another \
                     spec.storage.outputPath",
                    run_dir.root().display(),
                    existing.dataset.digest,
                    existing.spec_hash,
                    dataset.digest,
                    spec_hash
                )));
            }
            if existing.batches != layout.batches || existing.batch_images != layout.batch_images {
                return Err(RunError::OutputMismatch(format!(
                    "output directory {} holds batches laid out by an earlier version, before the \
                     rows' own images (`image`, `docker_image`) were honoured; use another \
                     spec.storage.outputPath to run the dataset again",
                    run_dir.root().display()
                )));
            }
            Ok((existing, true))
        }
        None => Ok((
            Manifest {
                version: MANIFEST_VERSION,
                run: RunIdentity {
                    name: location.plan.name.clone(),
                    namespace: location.plan.namespace.clone(),
                    uid: location.plan.uid.clone(),
                },
                created_at: crate::hermes::timestamp(chrono::Utc::now()),
                dataset,
                spec_hash,
                batch_size: spec.batch_size,
                samples_per_prompt: spec.samples_per_prompt,
                tool_catalog: catalog,
                mcp_tools,
                batches: layout.batches,
                images: layout.images,
                batch_images: layout.batch_images,
                first_prompts: layout.first_prompts,
            },
            false,
        )),
    }
}

/// Where a run's prompts are carried out, which decides what a row's own image (`image` /
/// `docker_image`) means to its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Environment {
    /// Pods: the batches of rows naming an image run in pods with a container of that image for
    /// each conversation (the plan's summary groups them by image, [`ImagePlan`]).
    Pods,
    /// This machine, outside any container (`trajectory-worker local`): a row naming an image
    /// would run in the wrong environment, so the plan refuses the run, naming the rows, before
    /// it writes anything.
    Host,
}

/// Validates the dataset and writes `manifest.json` and `invalid.jsonl`, for a run in pods
/// ([`Environment::Pods`]).
pub fn plan(location: &RunLocation) -> Result<(Manifest, PlanSummary), RunError> {
    plan_in(location, Environment::Pods)
}

/// [`plan`] for a run carried out in `environment`.
pub fn plan_in(
    location: &RunLocation,
    environment: Environment,
) -> Result<(Manifest, PlanSummary), RunError> {
    let spec = &location.plan.spec;
    let run_dir = location.run_dir();
    // Refused before the dataset is read, and before any pod starts, rather than in every batch.
    location.read_replay_source(Some(1))?;
    let (catalog, mcp_tools) = tool_catalog(spec, &run_dir)?;
    if spec.dataset.format == DatasetFormat::HarborTasks {
        harbor_rows(location, &run_dir)?;
    }
    let dataset_path = location.dataset_path();
    let store = run_dir.store();
    // Dropped unfinished on an error, the invalid lines' output leaves nothing behind.
    let Scanned {
        digest,
        segment_digests,
        layout_batches: batches,
        lines,
        prompts,
        invalid,
        bytes,
        invalid_out,
        images,
        batch_images,
        first_prompts,
        rows_with_images,
    } = scan_dataset(location, &run_dir, &dataset_path)?;

    let dataset = DatasetInfo {
        path: spec.dataset.path.clone(),
        digest,
        bytes,
        lines,
        prompts,
        invalid,
        segment_bytes: SEGMENT_BYTES,
        segment_digests,
    };
    refuse_what_cannot_run(&dataset, &dataset_path, environment, &rows_with_images)?;
    let layout = ImageLayout {
        batches,
        images,
        batch_images,
        first_prompts,
    };
    let (manifest, existed) = run_manifest(location, dataset, catalog, mcp_tools, layout)?;
    invalid_out.finish()?;
    let manifest = if existed && store.is_bucket() {
        // Objects are not torn: the one there is whole, and writing it again costs a put of it.
        manifest
    } else {
        write_manifest(&run_dir, manifest)?
    };

    let mut done = run_dir.done_batches()?;
    done.retain(|id| *id < manifest.batch_count());
    let summary = PlanSummary {
        prompts: manifest.dataset.prompts,
        invalid: manifest.dataset.invalid,
        batches: manifest.batch_count(),
        // At most the batch count, a u32.
        done_count: u32::try_from(done.len()).unwrap_or(u32::MAX),
        done: compact_ranges(done),
        dataset_digest: manifest.dataset.digest.clone(),
        spec_hash: manifest.spec_hash.clone(),
        done_truncated: false,
        pending_list: None,
        images: None,
    };
    info!(
        prompts = summary.prompts,
        invalid = summary.invalid,
        batches = summary.batches,
        images = manifest.images.len(),
        "planned {}",
        run_dir.root().display()
    );
    Ok((manifest, summary))
}

/// Reads the Harbor tasks `spec.dataset.path` names into the run's rows, and the tasks it
/// refuses, each with why, beside them. Made again by every plan: the same tasks give the same
/// bytes, so a resumed run reads the rows it was planned with (and a changed directory is a
/// changed dataset digest, which the manifest refuses).
fn harbor_rows(location: &RunLocation, run_dir: &RunDir) -> Result<(), RunError> {
    let store = run_dir.store();
    let mut source = location.dataset_source();
    // Tasks on a bucket are read from a copy: a task is a handful of small files, read whole.
    let _copy = if let crate::storage::Store::Bucket(bucket) = store {
        let copy = tempfile::tempdir()
            .map_err(|err| RunError::Internal(format!("a directory for the tasks: {err}")))?;
        // Under the path's own name: a path naming one task names the task by it.
        let into = copy.path().join(source.file_name().unwrap_or_default());
        let files = bucket
            .download_tree(&source, &into)
            .map_err(|err| crate::storage::StorageError::new("reading", &source, err))?;
        if files == 0 {
            return Err(RunError::InvalidDataset(format!(
                "spec.dataset.path: nothing on the bucket under {}",
                source.display()
            )));
        }
        info!(files, from = %source.display(), "read the Harbor tasks from the bucket");
        source = into;
        Some(copy)
    } else {
        None
    };
    let excluded = match location.read_oracle_report()? {
        Some((report, bytes)) => super::oracle::failed_tasks(&bytes, &report)?,
        None => std::collections::BTreeMap::new(),
    };
    let builds = location.plan.spec.sandbox.builds.as_ref();
    let crate::harbor::HarborRows {
        jsonl: rows,
        refused,
        builds,
        resources,
    } = crate::harbor::rows_jsonl(&source, &excluded, builds)
        .map_err(|err| RunError::InvalidDataset(format!("spec.dataset.path: {err}")))?;
    let mut refusals = Vec::new();
    for error in &refused {
        let line = match error {
            crate::harbor::HarborError::Refused { task, why } => {
                serde_json::json!({"task": task.file_name().map(|name| name.to_string_lossy()), "reason": why})
            }
            other => serde_json::json!({"reason": other.to_string()}),
        };
        serde_json::to_writer(&mut refusals, &line).expect("a refusal serialises");
        refusals.push(b'\n');
    }
    store.create_dir_all(run_dir.root())?;
    write_build_contexts(run_dir, &builds)?;
    let mut asked = Vec::new();
    for (image, resources) in &resources {
        let line = serde_json::json!({"image": image, "resources": resources});
        serde_json::to_writer(&mut asked, &line).expect("resources serialise");
        asked.push(b'\n');
    }
    store.write_atomic(&run_dir.harbor_resources(), &asked)?;
    store.write_atomic(&run_dir.harbor_refused(), &refusals)?;
    store.write_atomic(&run_dir.harbor_rows(), &rows)?;
    if !refused.is_empty() {
        warn!(
            refused = refused.len(),
            file = %run_dir.harbor_refused().display(),
            "Harbor tasks refused: {}",
            refused.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
        );
    }
    info!(
        rows = memchr::memchr_iter(b'\n', &rows).count(),
        "Harbor tasks read"
    );
    Ok(())
}

/// Writes each build's packed context (once: its name is its digest) and the build list, which
/// names them, after them.
fn write_build_contexts(
    run_dir: &RunDir,
    builds: &[(BuildEntry, Vec<u8>)],
) -> Result<(), RunError> {
    let store = run_dir.store();
    let mut list = Vec::new();
    if !builds.is_empty() {
        store.create_dir_all(&run_dir.root().join(crate::harbor::BUILDS_DIR))?;
    }
    for (entry, context) in builds {
        // Named by its digest: one that is there already holds these bytes.
        store.create_once(&run_dir.root().join(&entry.context), context)?;
        serde_json::to_writer(&mut list, entry).expect("a build entry serialises");
        list.push(b'\n');
    }
    store.write_atomic(&run_dir.harbor_builds(), &list)?;
    if !builds.is_empty() {
        info!(
            builds = builds.len(),
            "the images of {} tasks are built from {} contexts",
            builds
                .iter()
                .map(|(entry, _)| entry.tasks.len())
                .sum::<usize>(),
            builds.len()
        );
    }
    Ok(())
}

/// What a plan of Harbor tasks knows of an image beyond its batches.
#[derive(Debug, Default)]
struct ImageFacts {
    /// The line of the build list that builds it.
    build: Option<u32>,
    /// What its tasks ask of their containers.
    resources: Option<TaskResources>,
}

/// The build list and the tasks' resources a plan of Harbor tasks wrote, by image; empty for
/// other runs.
fn image_facts(location: &RunLocation) -> Result<BTreeMap<String, ImageFacts>, RunError> {
    let mut facts: BTreeMap<String, ImageFacts> = BTreeMap::new();
    if location.plan.spec.dataset.format != DatasetFormat::HarborTasks {
        return Ok(facts);
    }
    let run_dir = location.run_dir();
    let read_lines = |path: &Path| -> Result<Vec<(usize, String)>, RunError> {
        let text = location.store.read_optional(path)?.unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .lines()
            .map(str::to_owned)
            .enumerate()
            .collect())
    };
    let bad = |path: &Path, line: usize, err: serde_json::Error| {
        RunError::BadBatchInput(format!("{}:{}: {err}", path.display(), line + 1))
    };
    let path = run_dir.harbor_builds();
    for (line, text) in read_lines(&path)? {
        let entry: BuildEntry = serde_json::from_str(&text).map_err(|err| bad(&path, line, err))?;
        facts.entry(entry.image).or_default().build = u32::try_from(line).ok();
    }
    let path = run_dir.harbor_resources();
    for (line, text) in read_lines(&path)? {
        #[derive(serde::Deserialize)]
        struct Asked {
            image: String,
            resources: TaskResources,
        }
        let asked: Asked = serde_json::from_str(&text).map_err(|err| bad(&path, line, err))?;
        facts.entry(asked.image).or_default().resources = Some(asked.resources);
    }
    Ok(facts)
}

/// Writes the run's manifest. On a volume it is written again whole (the same one when it existed).
/// On a bucket it is created once: of two plans at once the first one's stays, and the other
/// takes it up, as it would have found it had it started later; one that is there already is
/// not written again.
fn write_manifest(run_dir: &RunDir, manifest: Manifest) -> Result<Manifest, RunError> {
    let store = run_dir.store();
    let path = run_dir.manifest();
    if !store.is_bucket() {
        // Streamed: a run of a million batches has a manifest of tens of megabytes.
        store.write_with(&path, |out| {
            serde_json::to_writer(std::io::BufWriter::new(out), &manifest)
                .map_err(std::io::Error::from)
        })?;
        store.sync_dir(run_dir.root())?;
        return Ok(manifest);
    }
    let json = serde_json::to_vec(&manifest).map_err(|err| RunError::Internal(err.to_string()))?;
    if store.create_once(&path, &json)? {
        return Ok(manifest);
    }
    let existing = Manifest::require(run_dir)?;
    if existing.dataset.digest != manifest.dataset.digest
        || existing.spec_hash != manifest.spec_hash
        || existing.batches != manifest.batches
    {
        return Err(RunError::OutputMismatch(format!(
            "{} was written by another plan meanwhile, for dataset {} and spec {}, but this plan \
             has dataset {} and spec {}; use another spec.storage.outputPath",
            path.display(),
            existing.dataset.digest,
            existing.spec_hash,
            manifest.dataset.digest,
            manifest.spec_hash
        )));
    }
    Ok(existing)
}

/// Opens the dataset (a file read in place, or an object streamed once) and the run's
/// `invalid.jsonl` output, and scans the one into the other.
fn scan_dataset(
    location: &RunLocation,
    run_dir: &RunDir,
    dataset_path: &Path,
) -> Result<Scanned, RunError> {
    let opened = |err: std::io::Error| -> RunError {
        if err.kind() == std::io::ErrorKind::NotFound || !location.store.is_bucket() {
            RunError::InvalidDataset(format!(
                "cannot open spec.dataset.path {}: {err}",
                dataset_path.display()
            ))
        } else {
            StorageError::new("opening", dataset_path, err).into()
        }
    };
    let spec = &location.plan.spec;
    let store = run_dir.store();
    let invalid_path = run_dir.invalid();
    match store {
        Store::Volume => {
            let file = File::open(dataset_path).map_err(opened)?;
            store.create_dir_all(run_dir.root())?;
            let invalid_out = store.output(&invalid_path)?;
            let read_ahead = Some(ReadAhead::new(&file));
            scan(
                &file,
                read_ahead,
                spec,
                dataset_path,
                invalid_out,
                &invalid_path,
            )
        }
        Store::Bucket(bucket) => {
            let stream = bucket.reader(dataset_path).map_err(opened)?;
            let invalid_out = store.output(&invalid_path)?;
            scan(stream, None, spec, dataset_path, invalid_out, &invalid_path)
        }
    }
}

/// The names of every tool the run's distribution can offer, and its MCP servers' tools.
fn tool_catalog(
    spec: &RunSpec,
    run_dir: &RunDir,
) -> Result<(Vec<String>, Vec<FrozenServer>), RunError> {
    let registry = Registry::builtin(&spec.tools);
    let distribution = Distribution::resolve(&spec.distribution, &registry)
        .map_err(|err| RunError::Spec(err.to_string()))?;
    let mcp_tools = frozen_or_discovered_mcp_tools(run_dir, spec)?;
    let catalog = registry
        .with_frozen_mcp(&mcp_tools)
        .catalog(&distribution.possible_toolsets());
    Ok((catalog, mcp_tools))
}

/// The run's MCP tools. They are listed once, by the first plan of a run; a plan run again (a
/// resumed or re-created run) keeps what the manifest froze, so every record sees the same tools.
/// A manifest of another run is refused later; its frozen tools are not used.
fn frozen_or_discovered_mcp_tools(
    run_dir: &RunDir,
    spec: &RunSpec,
) -> Result<Vec<crate::tools::mcp::FrozenServer>, RunError> {
    Ok(match Manifest::load(run_dir) {
        Ok(Some(existing)) if existing.spec_hash == spec_hash(spec) => existing.mcp_tools,
        _ => discover_blocking(
            &spec.tools.mcp,
            Sandbox::for_sessions(&spec.sandbox).as_ref(),
        )
        .map_err(|err| {
            RunError::Spec(format!(
                "{err}; check that the server is up and its spec.tools.mcp settings"
            ))
        })?,
    })
}

/// A dataset the run cannot carry out: no valid prompt, or rows that need a container on the host.
fn refuse_what_cannot_run(
    dataset: &DatasetInfo,
    dataset_path: &Path,
    environment: Environment,
    rows_with_images: &RowsWithImages,
) -> Result<(), RunError> {
    if dataset.prompts == 0 {
        return Err(RunError::InvalidDataset(format!(
            "{} has no valid prompt ({} lines, {} invalid)",
            dataset_path.display(),
            dataset.lines,
            dataset.invalid
        )));
    }
    if environment == Environment::Host && rows_with_images.rows > 0 {
        return Err(RunError::NeedsContainers(rows_with_images_on_the_host(
            dataset_path,
            rows_with_images,
        )));
    }
    Ok(())
}

/// Why a run on this machine refuses rows that name an image: which, and what to do instead.
fn rows_with_images_on_the_host(dataset: &Path, listed: &RowsWithImages) -> String {
    let listed_lines = listed.first_lines.len() as u64;
    let lines = listed
        .first_lines
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let more = if listed.rows > listed_lines {
        format!(" and {} more", listed.rows - listed_lines)
    } else {
        String::new()
    };
    let images = listed
        .first_images
        .iter()
        .map(|image| format!("`{image}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let (rows, name, own, line) = if listed.rows == 1 {
        ("1 row".to_owned(), "names", "its", "line")
    } else {
        (format!("{} rows", listed.rows), "name", "their", "lines")
    };
    format!(
        "{}: {rows} {name} a container image of {own} own (`image`/`docker_image`; {line} \
         {lines}{more}; {images}), but `trajectory-worker local` runs every prompt on this machine, \
         outside any container, where a task's image (its repository, its tools, its working \
         directory) is not there; nothing was run or written. Run them on a cluster, where each \
         conversation gets a fresh container of its row's image (`scripts/demo-cluster.sh` starts \
         a local one; `kubectl apply` this run file there), or remove the `image` and \
         `docker_image` fields of those rows to run them here",
        dataset.display(),
    )
}

/// `plan` as a pod runs it for the operator: [`plan`], then its summary fitted to the termination
/// message ([`PlanSummary::fitting`]). When the done ranges do not fit, the batches not done are
/// first written to a new pending list on storage, which the summary names.
pub fn plan_for_operator(location: &RunLocation) -> Result<PlanSummary, RunError> {
    let (manifest, summary) = plan(location)?;
    let facts = image_facts(location)?;
    hand_off(
        &location.run_dir(),
        (BatchImages::of(&manifest), &facts),
        summary,
        TERMINATION_MESSAGE_LIMIT,
    )
}

/// Fits `summary` into `limit` bytes, writing the pending list it then names before returning it.
///
/// The lists of earlier plans are left in place: a pod of an earlier plan's Job may start long
/// after a new plan (Jobs start pods as parallelism frees up) and must still find its list, and a
/// list is at most a few MB (a million batches, every other one done: 7 MB), written only by a
/// plan that finds its done set scattered, which happens once per re-created run or lost status.
/// They go with the run's output directory.
fn hand_off(
    run_dir: &RunDir,
    (images, facts): (BatchImages<'_>, &BTreeMap<String, ImageFacts>),
    summary: PlanSummary,
    limit: usize,
) -> Result<PlanSummary, RunError> {
    // Computed before `fitting` cuts `done`; a few ranges unless the done set is scattered.
    let pending = not_done(summary.batches, &summary.done);
    let name = RunDir::new_pending_list_name();
    let summary = summary.fitting(limit, &name);
    let slots = summary.pending_list.is_some();
    let mut groups = image_groups(images, &pending, slots);
    for group in &mut groups {
        if let Some(facts) = facts.get(&group.image) {
            group.build = facts.build;
            group.resources = facts.resources;
        }
    }
    let index = RunDir::new_image_index_name();
    let mut summary = summary.with_images(groups.clone(), limit, &index);
    if let Some(images) = summary
        .images
        .as_mut()
        .filter(|images| images.index.is_some())
    {
        let store = run_dir.store();
        let dir = run_dir.root().join(&index);
        store.create_dir_all(&dir)?;
        let pages = image_pages(&groups, TERMINATION_MESSAGE_LIMIT);
        for page in &pages {
            let path = run_dir.root().join(image_page_path(&index, page.page));
            store.write_with(&path, |out| {
                serde_json::to_writer(out, page).map_err(std::io::Error::from)
            })?;
        }
        store.sync_dir(&dir)?;
        store.sync_dir(&run_dir.plan_dir())?;
        images.pages = u32::try_from(pages.len()).unwrap_or(u32::MAX);
        info!(
            groups = groups.len(),
            pages = pages.len(),
            "the image groups do not fit the summary: wrote them to {} in pages",
            dir.display()
        );
    }
    if slots {
        let path = run_dir.root().join(&name);
        // Never an earlier plan's list: its pods may still read it.
        let list = format!("{}\n", Ranges(&pending));
        if !run_dir.store().create_once(&path, list.as_bytes())? {
            return Err(RunError::Internal(format!(
                "the new pending list {} exists already",
                path.display()
            )));
        }
        // `plan/` may be new: its entry in the run directory must be durable too.
        run_dir.store().sync_dir(run_dir.root())?;
        info!(
            pending = summary.pending_count(),
            ranges = pending.len(),
            "the done batches do not fit the summary: wrote the pending list {}",
            path.display()
        );
    }
    Ok(summary)
}

/// Page `page` of the image index `index` a plan wrote into the run's directory, read back and
/// checked for the operator (`trajectory-worker image-page`).
pub fn image_page(location: &RunLocation, index: &str, page: u32) -> Result<ImagePage, RunError> {
    let relative = image_page_path(index, page);
    if relative.split('/').any(|part| part == "..") || relative.starts_with('/') {
        return Err(RunError::Spec(format!(
            "the image index {index} is not in the run's directory"
        )));
    }
    let path = location.run_dir().root().join(&relative);
    let text = location.store.read_to_string(&path)?;
    let read: ImagePage = serde_json::from_str(&text).map_err(|err| {
        RunError::BadBatchInput(format!(
            "{}: not a page of an image index: {err}",
            path.display()
        ))
    })?;
    if read.page != page {
        return Err(RunError::BadBatchInput(format!(
            "{} holds page {}, not {page}",
            path.display(),
            read.page
        )));
    }
    Ok(read)
}

/// The images of a manifest's batches ([`Manifest::images`], [`Manifest::batch_images`]).
#[derive(Debug, Clone, Copy, Default)]
struct BatchImages<'a> {
    images: &'a [String],
    of_batch: &'a [u32],
}

impl<'a> BatchImages<'a> {
    fn of(manifest: &'a Manifest) -> Self {
        Self {
            images: &manifest.images,
            of_batch: &manifest.batch_images,
        }
    }
}

/// The pending batches of rows naming an image, grouped by image in the order the dataset first
/// names them: batch ids, or (`slots`) their positions in the pending list.
fn image_groups(images: BatchImages<'_>, pending: &[BatchRange], slots: bool) -> Vec<ImageGroup> {
    if images.images.is_empty() {
        return Vec::new();
    }
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); images.images.len()];
    let batches = pending.iter().flat_map(|range| range.first..=range.last);
    for (slot, batch) in (0_u32..).zip(batches) {
        let position = images.of_batch.get(batch as usize).copied().unwrap_or(0);
        if let Some(group) = (position as usize).checked_sub(1) {
            ids[group].push(if slots { slot } else { batch });
        }
    }
    images
        .images
        .iter()
        .zip(ids)
        .filter(|(_, ids)| !ids.is_empty())
        .map(|(image, ids)| ImageGroup::new(image.clone(), format_ranges(&compact_ranges(ids))))
        .collect()
}

/// The ranges of `0..batches` not in `done` (ascending, disjoint ranges).
fn not_done(batches: u32, done: &[BatchRange]) -> Vec<BatchRange> {
    let mut pending = Vec::with_capacity(done.len() + 1);
    let mut next = 0;
    for range in done {
        if range.first > next {
            pending.push(BatchRange {
                first: next,
                last: range.first - 1,
            });
        }
        next = next.max(range.last.saturating_add(1));
    }
    if next < batches {
        pending.push(BatchRange {
            first: next,
            last: batches - 1,
        });
    }
    pending
}

#[cfg(test)]
mod tests {
    use std::io::BufReader;

    use super::*;
    use crate::contract::resolve_batch;
    use crate::dataset::{LineReader, parse_row};

    /// The layout computed line by line: `batch_size` valid lines per batch, each batch from its
    /// first valid line's start to its last one's end.
    fn reference(data: &[u8], batch_size: usize, max_samples: usize) -> Vec<BatchLayout> {
        let mut reader = LineReader::new(BufReader::new(data), MAX_LINE_BYTES);
        let mut buffer = Vec::new();
        let mut valid = Vec::new();
        while let Some(info) = reader.next_line(&mut buffer, &mut |_| {}).unwrap() {
            if valid.len() < max_samples && !info.too_long && parse_row(&buffer, "prompt").is_ok() {
                valid.push((info, ()));
            }
        }
        valid
            .chunks(batch_size)
            .map(|batch| {
                let (first, last) = (&batch[0].0, &batch[batch.len() - 1].0);
                BatchLayout(first.offset, last.offset + last.length)
            })
            .collect()
    }

    fn location(root: &Path, max_samples: Option<u64>) -> RunLocation {
        let spec: RunSpec = serde_json::from_value(serde_json::json!({
            "dataset": {"path": "data.jsonl", "maxSamples": max_samples},
            "batchSize": 7,
            "model": {"baseUrl": "http://127.0.0.1:9/v1", "name": "m"},
            "storage": {"outputPath": "out"},
        }))
        .unwrap();
        RunLocation {
            storage_root: root.to_path_buf(),
            store: crate::storage::Store::Volume,
            plan: crate::contract::RunPlan {
                name: "t".into(),
                namespace: "local".into(),
                uid: String::new(),
                output_path: "out".into(),
                spec,
                batches: None,
                batch_ranges: None,
                pending_list: None,
            },
        }
    }

    /// Rows naming an image of their own (`image` winning over `docker_image`, read on the fast
    /// path and the full check alike) get batches of their image alone: a batch is cut where the
    /// image changes, and the summary groups the batches by image, in the order the dataset first
    /// names them. A row whose image is not a string names none.
    #[test]
    fn rows_naming_images_get_batches_of_one_image_grouped_in_the_summary() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"prompt": "a", "image": "python:3.12"}"#,
            r#"{"prompt": "b"}"#,
            r#"{"prompt": "c", "docker_image": "swe/task-1"}"#,
            r#"{"prompt": "d", "image": "repo:main", "docker_image": "swe/task-2"}"#,
            r#"{"prompt": "e", "image": "task:latest"}"#,
            // An escape sends the row through the full check, which reads its image too.
            r#"{"prompt": "fA", "image": "python:3.12"}"#,
            r#"{"prompt": "g", "image": 7}"#,
            r#"{"prompt": "h"}"#,
        ];
        std::fs::write(dir.path().join("data.jsonl"), lines.join("\n") + "\n").unwrap();
        let location = location(dir.path(), None);
        let (manifest, summary) = plan(&location).unwrap();
        assert_eq!(summary.prompts, 8);
        assert_eq!(
            manifest.images,
            ["python:3.12", "swe/task-1", "repo:main", "task:latest"]
        );
        assert_eq!(manifest.batch_images, [1, 0, 2, 3, 4, 1, 0]);
        assert_eq!(manifest.first_prompts, [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(manifest.prompts_in(6), 2, "g and h: no image, one batch");
        assert_eq!(manifest.image_of(5), Some("python:3.12"));
        assert_eq!(manifest.image_of(6), None);
        let handed = hand_off(
            &location.run_dir(),
            (BatchImages::of(&manifest), &BTreeMap::new()),
            summary,
            4096,
        )
        .unwrap();
        let images = handed.images.expect("grouped");
        assert_eq!(images.groups, 4);
        assert_eq!(images.index, None);
        let groups: Vec<(&str, &str)> = images
            .listed
            .iter()
            .map(|group| (group.image.as_str(), group.ids.as_str()))
            .collect();
        assert_eq!(
            groups,
            [
                ("python:3.12", "0,5"),
                ("swe/task-1", "2"),
                ("repo:main", "3"),
                ("task:latest", "4")
            ]
        );
    }

    /// A batch of an image holds at most as many prompts as leave each conversation a task
    /// container of its own (16 in all: 5 prompts of 3 samples), and rows without an image
    /// after them get batches of `batchSize` again; a dataset naming no image keeps the plain
    /// layout, without the lists.
    #[test]
    fn a_batch_of_an_image_holds_no_more_conversations_than_a_pod_has_task_containers() {
        let dir = tempfile::tempdir().unwrap();
        let mut lines: Vec<String> = (0..12)
            .map(|i| format!(r#"{{"prompt": "p{i}", "image": "task/one"}}"#))
            .collect();
        lines.extend((0..9).map(|i| format!(r#"{{"prompt": "q{i}"}}"#)));
        std::fs::write(dir.path().join("data.jsonl"), lines.join("\n") + "\n").unwrap();
        let mut location = location(dir.path(), None);
        location.plan.spec.samples_per_prompt = 3;
        let (manifest, _) = plan(&location).unwrap();
        assert_eq!(manifest.first_prompts, [0, 5, 10, 12, 19]);
        assert_eq!(manifest.batch_images, [1, 1, 1, 0, 0]);
        let sizes: Vec<u64> = (0..5).map(|b| manifest.prompts_in(b)).collect();
        assert_eq!(sizes, [5, 5, 2, 7, 2]);

        std::fs::write(
            dir.path().join("plain.jsonl"),
            "{\"prompt\": \"x\"}\n".repeat(9),
        )
        .unwrap();
        location.plan.spec.dataset.path = "plain.jsonl".into();
        location.plan.output_path = "out-plain".into();
        let (plain, summary) = plan(&location).unwrap();
        assert!(plain.images.is_empty() && plain.batch_images.is_empty());
        assert!(plain.first_prompts.is_empty());
        assert_eq!((plain.batch_count(), plain.prompts_in(1)), (2, 2));
        assert_eq!(summary.images, None);
    }

    /// Groups beyond what the termination message holds are all written to the plan's image
    /// index on storage; the summary lists the first of them and names the file.
    #[test]
    fn image_groups_that_do_not_fit_the_summary_are_handed_off_in_an_index_on_storage() {
        let dir = tempfile::tempdir().unwrap();
        let lines: Vec<String> = (0..300)
            .map(|i| {
                format!(r#"{{"prompt": "p{i}", "image": "registry.example/swe/task-{i:04}:v1"}}"#)
            })
            .collect();
        std::fs::write(dir.path().join("data.jsonl"), lines.join("\n") + "\n").unwrap();
        let location = location(dir.path(), None);
        let (manifest, summary) = plan(&location).unwrap();
        let handed = hand_off(
            &location.run_dir(),
            (BatchImages::of(&manifest), &BTreeMap::new()),
            summary,
            4096,
        )
        .unwrap();
        assert!(serde_json::to_string(&handed).unwrap().len() <= 4096);
        let images = handed.images.expect("grouped");
        assert_eq!(images.groups, 300);
        assert!(!images.listed.is_empty() && images.listed.len() < 300);
        let index = images.index.expect("an index on storage");
        let pages: Vec<crate::contract::ImagePage> = (0..images.pages)
            .map(|page| {
                let path = location
                    .run_dir()
                    .root()
                    .join(image_page_path(&index, page));
                let text = std::fs::read_to_string(path).unwrap();
                assert!(text.len() <= 4096, "page {page}: {} bytes", text.len());
                serde_json::from_str(&text).unwrap()
            })
            .collect();
        assert!(pages.len() > 1);
        assert_eq!(image_page(&location, &index, 1).unwrap(), pages[1]);
        assert!(image_page(&location, &index, images.pages).is_err());
        assert!(image_page(&location, "../elsewhere", 0).is_err());
        let all = crate::contract::groups_of_pages(&pages);
        assert_eq!(all.len(), 300);
        assert_eq!(all[..images.listed.len()], images.listed[..]);
        assert_eq!(all[299].image, "registry.example/swe/task-0299:v1");
        assert_eq!(all[299].ids, "299");
    }

    /// On the host every row with an image is refused, however many: the first ten lines are
    /// named with the count of the rest, and no manifest or `invalid.jsonl` is left behind.
    #[test]
    fn a_plan_on_the_host_refuses_rows_with_images_naming_the_first_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut lines: Vec<String> = (0..12)
            .map(|i| format!(r#"{{"prompt": "p{i}", "docker_image": "task/{}"}}"#, i % 7))
            .collect();
        lines.insert(0, r#"{"prompt": "no image"}"#.to_owned());
        lines.push("not json".to_owned());
        std::fs::write(dir.path().join("data.jsonl"), lines.join("\n") + "\n").unwrap();
        let location = location(dir.path(), None);
        let error = plan_in(&location, Environment::Host).unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, RunError::NeedsContainers(_)), "{message}");
        assert!(
            message.contains("12 rows name a container image of their own"),
            "{message}"
        );
        assert!(
            message.contains("lines 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 and 2 more;"),
            "{message}"
        );
        assert!(
            message.contains("`task/0`, `task/1`, `task/2`, `task/3`, `task/4`)"),
            "{message}"
        );
        assert!(message.contains("scripts/demo-cluster.sh"), "{message}");
        let run_dir = location.run_dir();
        assert!(!run_dir.manifest().exists() && !run_dir.invalid().exists());
        let (manifest, _) = plan(&location).unwrap();
        assert_eq!(manifest.images.len(), 7, "a plan for pods runs them");
    }

    /// A resume of a million batches, 40 % done at random: about 240,000 done ranges, which no
    /// termination message holds.
    #[test]
    fn a_scattered_resume_of_a_million_batches_hands_off_its_pending_list_on_storage() {
        use rand::{Rng, SeedableRng};
        const BATCHES: u32 = 1_000_000;
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let is_done: Vec<bool> = (0..BATCHES).map(|_| rng.random_bool(0.4)).collect();
        let done: Vec<u32> = (0..BATCHES).filter(|id| is_done[*id as usize]).collect();
        let expected: Vec<u32> = (0..BATCHES).filter(|id| !is_done[*id as usize]).collect();
        let summary = PlanSummary {
            prompts: u64::from(BATCHES),
            invalid: 0,
            batches: BATCHES,
            done_count: u32::try_from(done.len()).unwrap(),
            done: compact_ranges(done.iter().copied()),
            dataset_digest: format!("blake3:{}", "0".repeat(64)),
            spec_hash: format!("blake3:{}", "1".repeat(64)),
            done_truncated: false,
            pending_list: None,
            images: None,
        };
        assert!(
            summary.done.len() > 200_000,
            "{} ranges",
            summary.done.len()
        );
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path().join("out"));

        let started = std::time::Instant::now();
        let fitted = hand_off(
            &run_dir,
            (BatchImages::default(), &BTreeMap::new()),
            summary.clone(),
            TERMINATION_MESSAGE_LIMIT,
        )
        .unwrap();
        let took = started.elapsed();

        let message = crate::contract::termination_message(&fitted);
        assert!(
            message.len() <= TERMINATION_MESSAGE_LIMIT,
            "{} bytes",
            message.len()
        );
        let read: PlanSummary = serde_json::from_str(&message).unwrap();
        assert_eq!(read.done_count as usize, done.len());
        assert!(read.done_truncated);
        assert_eq!(read.done[..], summary.done[..read.done.len()]);
        let list = read.pending_list.clone().expect("a pending list");
        let unique = list
            .strip_prefix("plan/pending-")
            .and_then(|rest| rest.strip_suffix(".ranges"))
            .expect("plan/pending-<hex>.ranges");
        assert!(
            unique.len() == 16 && unique.bytes().all(|b| b.is_ascii_hexdigit()),
            "{list}"
        );
        let text = std::fs::read_to_string(run_dir.root().join(&list)).unwrap();
        assert_eq!(text.lines().count(), 1);
        assert_eq!(crate::contract::parse_ranges(&text).unwrap(), expected);
        assert_eq!(read.pending_count() as usize, expected.len());

        // Job indexes count into the list: slots 0, the middle and the last.
        let (middle, final_slot) = (expected.len() / 2, expected.len() - 1);
        for slot in [0, middle, final_slot] {
            let index = u32::try_from(slot).unwrap();
            assert_eq!(
                resolve_batch(&text, None, index),
                Some(expected[slot]),
                "slot {slot}"
            );
        }
        let shard = format!("{middle}-{final_slot}");
        assert_eq!(
            resolve_batch(&text, Some(&shard), 1),
            Some(expected[middle + 1])
        );
        assert_eq!(
            resolve_batch(&text, None, u32::try_from(final_slot + 1).unwrap()),
            None
        );

        // Linear work, bounded by the ranges (quadratic would take hours): well under a second
        // in a release build, a few in a debug one on a loaded machine.
        assert!(took < std::time::Duration::from_secs(30), "{took:?}");

        // A plan run again writes a list of its own and leaves the earlier one for its pods.
        let again = hand_off(
            &run_dir,
            (BatchImages::default(), &BTreeMap::new()),
            summary,
            TERMINATION_MESSAGE_LIMIT,
        )
        .unwrap();
        let other = again.pending_list.expect("a pending list");
        assert_ne!(other, list);
        assert_eq!(
            std::fs::read_to_string(run_dir.root().join(&list)).unwrap(),
            text
        );
        assert_eq!(std::fs::read_dir(run_dir.plan_dir()).unwrap().count(), 2);
    }

    #[test]
    fn a_summary_that_fits_writes_no_pending_list() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let summary = PlanSummary {
            prompts: 10,
            invalid: 0,
            batches: 10,
            done_count: 3,
            done: compact_ranges([0, 1, 5]),
            dataset_digest: String::new(),
            spec_hash: String::new(),
            done_truncated: false,
            pending_list: None,
            images: None,
        };
        let fitted = hand_off(
            &run_dir,
            (BatchImages::default(), &BTreeMap::new()),
            summary.clone(),
            TERMINATION_MESSAGE_LIMIT,
        )
        .unwrap();
        assert_eq!(fitted, summary);
        assert!(!run_dir.plan_dir().exists());
    }

    #[test]
    fn the_batches_not_done_are_the_gaps_between_the_done_ranges() {
        let pending = |batches, done: &[u32]| {
            crate::contract::format_ranges(&not_done(
                batches,
                &compact_ranges(done.iter().copied()),
            ))
        };
        assert_eq!(pending(10, &[]), "0-9");
        assert_eq!(pending(10, &[0, 1, 5, 9]), "2-4,6-8");
        assert_eq!(pending(10, &[3]), "0-2,4-9");
        assert_eq!(pending(3, &[0, 1, 2]), "");
        assert_eq!(pending(0, &[]), "");
    }

    #[test]
    fn blocks_lay_out_batches_as_line_by_line_reading_does() {
        // Several blocks' worth, with invalid lines of every kind among valid ones, CRLF endings,
        // a line too long to keep that spans blocks, and no newline at the end.
        let mut data = Vec::new();
        for index in 0..6000 {
            let line = match index % 13 {
                3 => "not json".to_owned(),
                5 => String::new(),
                7 => format!("{{\"prompt\": \"  \", \"i\": {index}}}"),
                9 => format!("{{\"prompt\": \"crlf {index}\"}}\r"),
                11 if index == 2000 => format!("{{\"prompt\": \"{}\"}}", "y".repeat(3 << 20)),
                _ => format!(
                    "{{\"id\": {index}, \"prompt\": \"{}é\"}}",
                    "x".repeat(index % 700)
                ),
            };
            data.extend_from_slice(line.as_bytes());
            data.push(b'\n');
        }
        data.extend_from_slice(b"{\"prompt\": \"last, without a newline\"}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("data.jsonl"), &data).unwrap();

        for max_samples in [None, Some(1000)] {
            let _ = std::fs::remove_dir_all(dir.path().join("out"));
            let (manifest, _) = plan(&location(dir.path(), max_samples)).unwrap();
            let cap = usize::try_from(max_samples.unwrap_or(u64::MAX)).unwrap_or(usize::MAX);
            let expected = reference(&data, 7, cap);
            assert_eq!(manifest.batches, expected);
            assert_eq!(
                manifest.dataset.prompts,
                expected.len() as u64 * 7 - (7 - manifest.prompts_in(manifest.batch_count() - 1))
            );
            assert_eq!(manifest.dataset.lines, 6001);
            assert_eq!(manifest.dataset.bytes, data.len() as u64);
            assert_eq!(
                manifest.dataset.digest,
                format!("blake3:{}", blake3::hash(&data).to_hex())
            );
            let invalid = std::fs::read_to_string(dir.path().join("out/invalid.jsonl")).unwrap();
            let reasons: Vec<String> = invalid
                .lines()
                .map(|line| {
                    serde_json::from_str::<serde_json::Value>(line).unwrap()["reason"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                })
                .collect();
            assert_eq!(reasons.len() as u64, manifest.dataset.invalid);
            if max_samples.is_none() {
                assert!(reasons.iter().any(|reason| reason == "too_long"));
                assert_eq!(manifest.dataset.prompts + manifest.dataset.invalid, 6001);
            }
        }
    }
}

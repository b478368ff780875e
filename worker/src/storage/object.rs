//! A run's storage in an S3 bucket (AWS S3 or any S3-compatible server).
//!
//! The run modes work on paths; on a bucket those paths are `s3://<bucket>/<key>` and name
//! objects. [`Bucket`] gives the few operations the write path needs, blocking, so the same code
//! runs on a volume and on a bucket:
//! - reads whole, by byte range, or streamed;
//! - puts of whole objects, overwriting or conditional (`If-None-Match: *`: created once, by the
//!   first writer; what locks and renames give on a filesystem);
//! - listings of the names under a prefix;
//! - streamed uploads that appear whole when they complete (multipart past one part).
//!
//! The client retries throttling (503 `SlowDown`, 429), 5xx, timeouts and broken connections with
//! jittered backoff for up to [`RETRY_TIMEOUT`]; what is left is reported as an [`io::Error`]
//! whose kind says what it means to the run (see [`super::StorageError::fault`]). Credentials come
//! from the environment as AWS SDKs read them (keys, a web-identity token on EKS, the container
//! credentials endpoint of EKS Pod Identity), never from the run's spec.

use std::future::Future;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use crate::object_url::{ObjectUrl, SCHEME, is_object_location};
use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientOptions, MultipartUpload, ObjectStore, ObjectStoreExt, PutMode,
    PutOptions, PutPayload, RetryConfig,
};

/// How long one operation may be retried before it is reported.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(120);

/// Attempts after the first of the writes the client does not retry itself.
const OWN_RETRIES: u32 = 4;
/// The pause before such an attempt, times its number.
const OWN_BACKOFF: Duration = Duration::from_millis(250);

/// The size of each part of a multipart upload (S3 takes parts of 5 MiB to 5 GiB).
const PART_SIZE: usize = 16 << 20;

/// Chunks of a streamed read waiting for the reader.
const READ_AHEAD: usize = 8;

/// How to reach the bucket's server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BucketOptions {
    /// The server's URL (`https://s3.eu-west-1.amazonaws.com`, `http://minio:9000`); AWS's own
    /// for the region when unset.
    pub endpoint: Option<String>,
    /// The region requests are signed for (default: `AWS_REGION`, else `us-east-1`).
    pub region: Option<String>,
    /// Address buckets as `<endpoint>/<bucket>` rather than `<bucket>.<endpoint>`: most
    /// self-hosted servers need it.
    pub path_style: bool,
    /// Keys given by a program that embeds the worker (its tests); the command line never sets
    /// them, and without them the environment's credentials are used.
    pub keys: Option<AccessKeys>,
}

/// An access key pair.
#[derive(Clone, PartialEq, Eq)]
pub struct AccessKeys {
    pub id: String,
    pub secret: String,
}

impl std::fmt::Debug for AccessKeys {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("AccessKeys")
            .field("id", &self.id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// The bucket is not there: every operation would fail the same way.
#[derive(Debug, thiserror::Error)]
#[error("the bucket {bucket:?} does not exist (or this identity may not see it)")]
pub struct BucketMissing {
    pub bucket: String,
}

/// One bucket, reached through a client that retries what can be retried.
pub struct Bucket {
    url: ObjectUrl,
    store: Arc<AmazonS3>,
    /// The client's own runtime: its operations are driven here and waited for by blocking
    /// calls, from plain threads and async tasks alike (a blocking wait on another runtime's
    /// future from inside a runtime would deadlock or panic).
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Bucket")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Drop for Bucket {
    fn drop(&mut self) {
        // Dropping a runtime waits for its tasks, which an async context must not do.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Bucket {
    /// A client for `url`'s bucket; checks nothing on the network (see [`Self::check`]).
    pub fn open(url: &ObjectUrl, options: &BucketOptions) -> io::Result<Self> {
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(&url.bucket)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            .with_virtual_hosted_style_request(!options.path_style)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(10),
                    base: 2.0,
                },
                max_retries: 15,
                retry_timeout: RETRY_TIMEOUT,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(10))
                    .with_timeout(Duration::from_secs(60)),
            );
        if let Some(keys) = &options.keys {
            builder = builder
                .with_access_key_id(&keys.id)
                .with_secret_access_key(&keys.secret);
        }
        if let Some(endpoint) = &options.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"));
        }
        let region = options
            .region
            .clone()
            .or_else(|| std::env::var("AWS_REGION").ok())
            .or_else(|| std::env::var("AWS_DEFAULT_REGION").ok())
            .unwrap_or_else(|| "us-east-1".to_owned());
        builder = builder.with_region(region);
        let store = builder
            .build()
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error.to_string()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("object-storage")
            .enable_all()
            .build()?;
        Ok(Self {
            url: url.clone(),
            store: Arc::new(store),
            runtime: Some(runtime),
        })
    }

    pub fn url(&self) -> &ObjectUrl {
        &self.url
    }

    /// Lists the run's prefix once: fails with [`BucketMissing`] when the bucket is not there,
    /// and with the server's answer when it cannot be reached or refuses these credentials.
    pub fn check(&self) -> io::Result<()> {
        let root = self.url.root();
        self.list(&root).map(drop)
    }

    /// The object key of `path` (`s3://<bucket>/<key>`).
    fn key(&self, path: &Path) -> io::Result<Key> {
        let text = path.to_str().unwrap_or_default();
        let key = text
            .strip_prefix(SCHEME)
            .and_then(|rest| rest.strip_prefix(self.url.bucket.as_str()))
            .and_then(|rest| rest.strip_prefix('/').or(rest.is_empty().then_some("")))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} is not in the bucket {}",
                        path.display(),
                        self.url.bucket
                    ),
                )
            })?;
        Key::parse(key).map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error))
    }

    /// Runs `future` on the client's runtime and waits for it.
    fn block<T: Send + 'static>(
        &self,
        future: impl Future<Output = object_store::Result<T>> + Send + 'static,
    ) -> io::Result<T> {
        let runtime = self
            .runtime
            .as_ref()
            .expect("the runtime lives as long as the bucket");
        let task = runtime.spawn(future);
        // Unconstrained: waited for from inside a task of another runtime, the join handle
        // would count against that task's cooperative budget, which nothing restores while this
        // thread blocks; once spent, every poll answers "not yet" and the wait spins forever
        // (a batch reading its 129th object in one go, as the turn log's parts are read).
        match futures::executor::block_on(tokio::task::unconstrained(task)) {
            Ok(result) => result.map_err(|error| self.io_error(&error)),
            Err(join) => Err(io::Error::other(format!(
                "object storage task failed: {join}"
            ))),
        }
    }

    /// What an error of the client means to the run, as an [`io::Error`] kind.
    fn io_error(&self, error: &object_store::Error) -> io::Error {
        use object_store::Error as E;
        let text = error.to_string();
        if text.contains("NoSuchBucket") {
            return io::Error::other(BucketMissing {
                bucket: self.url.bucket.clone(),
            });
        }
        let kind = match error {
            E::NotFound { .. } => io::ErrorKind::NotFound,
            E::AlreadyExists { .. } | E::Precondition { .. } | E::NotModified { .. } => {
                io::ErrorKind::AlreadyExists
            }
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => {
                io::ErrorKind::PermissionDenied
            }
            E::InvalidPath { .. } | E::NotSupported { .. } | E::NotImplemented { .. } => {
                io::ErrorKind::Unsupported
            }
            _ if text.contains("AccessDenied")
                || text.contains("InvalidAccessKeyId")
                || text.contains("SignatureDoesNotMatch") =>
            {
                io::ErrorKind::PermissionDenied
            }
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, text)
    }

    /// The whole object (`NotFound` when there is none).
    pub fn read(&self, path: &Path) -> io::Result<Bytes> {
        let (store, key) = (self.store.clone(), self.key(path)?);
        self.block(async move { store.get(&key).await?.bytes().await })
    }

    /// Bytes `range` of the object.
    pub fn read_range(&self, path: &Path, range: Range<u64>) -> io::Result<Bytes> {
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let (store, key) = (self.store.clone(), self.key(path)?);
        self.block(async move { store.get_range(&key, range).await })
    }

    /// The object's size.
    pub fn size(&self, path: &Path) -> io::Result<u64> {
        let (store, key) = (self.store.clone(), self.key(path)?);
        self.block(async move { store.head(&key).await.map(|meta| meta.size) })
    }

    /// The object as a stream of bytes, fetched ahead of the reader a few chunks at a time.
    pub fn reader(&self, path: &Path) -> io::Result<ObjectReader> {
        let (store, key) = (self.store.clone(), self.key(path)?);
        let mut stream = self
            .block(async move { store.get(&key).await })?
            .into_stream();
        let (sender, receiver) = std::sync::mpsc::sync_channel(READ_AHEAD);
        let runtime = self
            .runtime
            .as_ref()
            .expect("the runtime lives as long as the bucket");
        let bucket = self.url.bucket.clone();
        runtime.spawn_blocking(move || {
            let handle = tokio::runtime::Handle::current();
            while let Some(chunk) = handle.block_on(stream.next()) {
                let chunk = chunk.map_err(|error| {
                    io::Error::other(format!("reading from the bucket {bucket}: {error}"))
                });
                let failed = chunk.is_err();
                if sender.send(chunk).is_err() || failed {
                    break;
                }
            }
        });
        Ok(ObjectReader {
            receiver,
            chunk: Bytes::new(),
        })
    }

    /// Writes the whole object, replacing any.
    pub fn put(&self, path: &Path, contents: Bytes) -> io::Result<()> {
        self.put_key(self.key(path)?, contents)
    }

    fn put_key(&self, key: Key, contents: Bytes) -> io::Result<()> {
        let store = self.store.clone();
        self.block(async move { store.put(&key, PutPayload::from(contents)).await.map(drop) })
    }

    /// Creates the object only if there is none (`AlreadyExists` otherwise): of two writers, the
    /// first one's object stays.
    ///
    /// A put whose connection broke after it was sent may have landed; the client retries some
    /// of those and this retries the others, a few times. A put refused because the object
    /// exists with exactly these bytes finds its own earlier attempt, which landed though its
    /// answer was lost (the objects written once have names of their writer's own, so no other
    /// writer's object has them).
    pub fn put_new(&self, path: &Path, contents: &Bytes) -> io::Result<()> {
        let key = self.key(path)?;
        let result = Self::with_own_retries(|| {
            let (store, key) = (self.store.clone(), key.clone());
            let options = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            let payload = PutPayload::from(contents.clone());
            self.block(async move { store.put_opts(&key, payload, options).await.map(drop) })
        });
        match result {
            // The client may have retried too (a connection closed before the answer).
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => match self.read(path) {
                Ok(held) if held == *contents => Ok(()),
                _ => Err(error),
            },
            result => result,
        }
    }

    /// Deletes the object (one that is not there is fine). Retried here too: the client does not
    /// retry a delete whose connection broke, and deleting again is harmless.
    pub fn delete(&self, path: &Path) -> io::Result<()> {
        let key = self.key(path)?;
        let result = Self::with_own_retries(|| {
            let (store, key) = (self.store.clone(), key.clone());
            self.block(async move { store.delete(&key).await })
        });
        match result {
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            result => result,
        }
    }

    /// Removes the objects `paths`, up to a thousand in one request (S3's `DeleteObjects`); an
    /// object that is not there is fine.
    pub fn delete_all(&self, paths: &[PathBuf]) -> io::Result<()> {
        use futures::StreamExt;
        let keys = paths
            .iter()
            .map(|path| self.key(path))
            .collect::<io::Result<Vec<Key>>>()?;
        let store = self.store.clone();
        let failures = self.block(async move {
            let locations = futures::stream::iter(keys.into_iter().map(Ok)).boxed();
            let results: Vec<object_store::Result<Key>> =
                store.delete_stream(locations).collect().await;
            Ok(results
                .into_iter()
                .filter_map(Result::err)
                .filter(|error| !matches!(error, object_store::Error::NotFound { .. }))
                .collect::<Vec<_>>())
        })?;
        match failures.first() {
            Some(error) => Err(self.io_error(error)),
            None => Ok(()),
        }
    }

    /// Runs `operation` again, a few times with a growing pause, while it fails in a way that
    /// may pass (an `Other` error: a broken connection, a server error past the client's retries).
    fn with_own_retries<T>(mut operation: impl FnMut() -> io::Result<T>) -> io::Result<T> {
        let mut attempt = 0;
        loop {
            match operation() {
                Err(error) if error.kind() == io::ErrorKind::Other && attempt < OWN_RETRIES => {
                    attempt += 1;
                    std::thread::sleep(OWN_BACKOFF * attempt);
                }
                result => return result,
            }
        }
    }

    /// The objects anywhere under `dir`, as paths relative to it, unordered; none when there is
    /// nothing under it.
    pub fn list_tree(&self, dir: &Path) -> io::Result<Vec<String>> {
        use futures::TryStreamExt;
        let (store, key) = (self.store.clone(), self.key(dir)?);
        let prefix = key.as_ref().to_owned();
        let objects = self.block(async move {
            let prefix = (!key.as_ref().is_empty()).then_some(key);
            store
                .list(prefix.as_ref())
                .map_ok(|object| object.location.as_ref().to_owned())
                .try_collect::<Vec<String>>()
                .await
        })?;
        Ok(objects
            .into_iter()
            .filter_map(|location| {
                let relative = match prefix.as_str() {
                    "" => location.as_str(),
                    prefix => location.strip_prefix(prefix)?.strip_prefix('/')?,
                };
                Some(relative.to_owned())
            })
            .collect())
    }

    /// Copies the objects under `dir` into the local directory `into`, as they lie under it,
    /// eight at a time; returns how many. A bucket keeps no file modes: a file copied is
    /// executable when its name ends in `.sh`.
    pub fn download_tree(&self, dir: &Path, into: &Path) -> io::Result<usize> {
        use std::os::unix::fs::PermissionsExt as _;
        let names = self.list_tree(dir)?;
        let threads = 8.min(names.len().max(1));
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|first| {
                    let names = &names;
                    scope.spawn(move || -> io::Result<()> {
                        for name in names.iter().skip(first).step_by(threads) {
                            let target = into.join(name);
                            if let Some(parent) = target.parent() {
                                std::fs::create_dir_all(parent)?;
                            }
                            std::fs::write(&target, self.read(&dir.join(name))?)?;
                            if target.extension().is_some_and(|ext| ext == "sh") {
                                let executable = std::fs::Permissions::from_mode(0o755);
                                std::fs::set_permissions(&target, executable)?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|worker| worker.join().expect("a download thread panicked"))
        })?;
        Ok(names.len())
    }

    /// The names directly under `dir` (objects and "directories" alike), unordered; none when
    /// there is nothing under it.
    pub fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let (store, key) = (self.store.clone(), self.key(dir)?);
        let listing = self.block(async move {
            let prefix = (!key.as_ref().is_empty()).then_some(key);
            store.list_with_delimiter(prefix.as_ref()).await
        })?;
        let names = listing
            .objects
            .iter()
            .map(|object| &object.location)
            .chain(&listing.common_prefixes)
            .filter_map(|location| location.filename().map(str::to_owned))
            .collect();
        Ok(names)
    }

    /// A streamed upload of `path`; nothing appears until [`ObjectWriter::finish`].
    pub fn writer(self: &Arc<Self>, path: &Path) -> io::Result<ObjectWriter> {
        Ok(ObjectWriter {
            bucket: self.clone(),
            key: self.key(path)?,
            buffer: Vec::new(),
            upload: None,
        })
    }
}

/// A streamed read of one object.
#[derive(Debug)]
pub struct ObjectReader {
    receiver: std::sync::mpsc::Receiver<io::Result<Bytes>>,
    chunk: Bytes,
}

impl Read for ObjectReader {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        while self.chunk.is_empty() {
            match self.receiver.recv() {
                Ok(chunk) => self.chunk = chunk?,
                // The stream ended.
                Err(_) => return Ok(0),
            }
        }
        let count = buffer.len().min(self.chunk.len());
        buffer[..count].copy_from_slice(&self.chunk.split_to(count));
        Ok(count)
    }
}

/// An object written as a stream: one put when it stays under a part, a multipart upload past
/// that, completed (the object appears whole) by [`Self::finish`]; dropped unfinished, the upload
/// is aborted and nothing appears.
#[derive(Debug)]
pub struct ObjectWriter {
    bucket: Arc<Bucket>,
    key: Key,
    buffer: Vec<u8>,
    upload: Option<Box<dyn MultipartUpload>>,
}

impl ObjectWriter {
    fn send_part(&mut self) -> io::Result<()> {
        if self.upload.is_none() {
            let (store, key) = (self.bucket.store.clone(), self.key.clone());
            self.upload = Some(
                self.bucket
                    .block(async move { store.put_multipart(&key).await })?,
            );
        }
        let part = std::mem::take(&mut self.buffer);
        let upload = self.upload.as_mut().expect("started above");
        let sent = upload.put_part(PutPayload::from(part));
        self.bucket.block(sent)
    }

    /// Makes the object appear, whole.
    pub fn finish(mut self) -> io::Result<()> {
        let Some(mut upload) = self.upload.take() else {
            let contents = Bytes::from(std::mem::take(&mut self.buffer));
            return self.bucket.put_key(self.key.clone(), contents);
        };
        if !self.buffer.is_empty() {
            let part = std::mem::take(&mut self.buffer);
            self.bucket.block(upload.put_part(PutPayload::from(part)))?;
        }
        self.bucket
            .block(async move { upload.complete().await.map(drop) })
    }
}

impl Write for ObjectWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buffer.extend_from_slice(data);
        if self.buffer.len() >= PART_SIZE {
            self.send_part()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        if let Some(mut upload) = self.upload.take() {
            let _ = self.bucket.block(async move { upload.abort().await });
        }
    }
}

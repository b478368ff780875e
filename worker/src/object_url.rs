//! `s3://bucket/prefix` locations: where a run's files are when its storage is a bucket. Parsed
//! here, without the client, so that a spec's `storage.object.url` is checked wherever the spec
//! is (the operator's validation included).

use std::path::PathBuf;

/// The scheme of object-storage locations.
pub const SCHEME: &str = "s3://";

/// Whether `text` names a location in object storage.
pub fn is_object_location(text: &str) -> bool {
    text.starts_with(SCHEME)
}

/// An `s3://bucket/prefix` URL: where a run's files live in object storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectUrl {
    pub bucket: String,
    /// The key prefix, without leading or trailing `/` (empty: the bucket's root).
    pub prefix: String,
}

impl ObjectUrl {
    /// Parses `s3://bucket[/prefix]`; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest = text
            .strip_prefix(SCHEME)
            .ok_or_else(|| format!("{text:?} is not an s3:// URL"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        // S3's bucket naming rules: 3 to 63 lowercase letters, digits, dots and hyphens.
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket.bytes().all(|byte| {
                byte.is_ascii_lowercase() || byte.is_ascii_digit() || b".-".contains(&byte)
            });
        if !valid_bucket {
            return Err(format!(
                "{text:?}: {bucket:?} is not a bucket name (3 to 63 lowercase letters, digits, dots \
                 and hyphens)"
            ));
        }
        let prefix = prefix.trim_matches('/');
        if prefix
            .split('/')
            .any(|part| part == "." || part == ".." || (part.is_empty() && !prefix.is_empty()))
        {
            return Err(format!(
                "{text:?}: the prefix may not hold empty, \".\" or \"..\" segments"
            ));
        }
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        })
    }

    /// The location as a path, the form the run modes join file names to.
    pub fn root(&self) -> PathBuf {
        if self.prefix.is_empty() {
            PathBuf::from(format!("{SCHEME}{}", self.bucket))
        } else {
            PathBuf::from(format!("{SCHEME}{}/{}", self.bucket, self.prefix))
        }
    }
}

impl std::fmt::Display for ObjectUrl {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}", self.root().display())
    }
}

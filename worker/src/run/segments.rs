//! Digests of the dataset in fixed segments: every byte is hashed once, and the pieces give both
//! the digest of the whole file and a check for each batch.
//!
//! The file is cut at every [`SEGMENT_BYTES`] of offset. The plan hashes each segment as a BLAKE3
//! subtree (its chaining value, see [`blake3::hazmat`]) and records the segments' digests in the
//! manifest; merging the chaining values in BLAKE3's own tree shape gives the plain BLAKE3 hash of
//! the whole file, the same as `b3sum` prints, without hashing anything twice. A batch checks the
//! segments its byte range touches against the manifest before it trusts its lines: at most
//! `2 × SEGMENT_BYTES` more to read than its own range.

use blake3::hazmat::{ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root};

/// Bytes of one segment: 64 BLAKE3 chunks, so that a segment is a whole subtree of the file's
/// BLAKE3 tree (a power of two of chunks) and is hashed 8 or 16 chunks at a time with SIMD.
pub const SEGMENT_BYTES: u64 = 64 * 1024;

/// Hex digits of a segment digest kept in the manifest (128 bits: enough to notice a change).
const DIGEST_HEX: usize = 32;

/// The digest the manifest keeps for the segment starting at `offset` with these bytes.
pub fn segment_digest(offset: u64, bytes: &[u8]) -> String {
    let chaining_value = blake3::Hasher::new()
        .set_input_offset(offset)
        .update(bytes)
        .finalize_non_root();
    short_hex(&chaining_value)
}

fn short_hex(chaining_value: &ChainingValue) -> String {
    blake3::Hash::from_bytes(*chaining_value).to_hex()[..DIGEST_HEX].to_owned()
}

/// Hashes a stream segment by segment.
#[derive(Debug)]
pub struct SegmentHasher {
    hasher: blake3::Hasher,
    length: u64,
    chaining_values: Vec<ChainingValue>,
    /// The root hash of the first segment, in case the file is exactly that segment.
    first_root: Option<blake3::Hash>,
}

impl Default for SegmentHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl SegmentHasher {
    pub fn new() -> Self {
        Self {
            hasher: blake3::Hasher::new(),
            length: 0,
            chaining_values: Vec::new(),
            first_root: None,
        }
    }

    /// Adds the next bytes of the stream.
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let room = SEGMENT_BYTES - self.length % SEGMENT_BYTES;
            let take = usize::try_from(room).map_or(bytes.len(), |room| room.min(bytes.len()));
            self.hasher.update(&bytes[..take]);
            self.length += take as u64;
            bytes = &bytes[take..];
            if self.length.is_multiple_of(SEGMENT_BYTES) {
                if self.chaining_values.is_empty() {
                    self.first_root = Some(self.hasher.finalize());
                }
                self.chaining_values.push(self.hasher.finalize_non_root());
                self.hasher = blake3::Hasher::new();
                self.hasher.set_input_offset(self.length);
            }
        }
    }

    /// The `blake3:` digest of the whole stream and the digest of each segment.
    pub fn finish(mut self) -> (String, Vec<String>) {
        if !self.length.is_multiple_of(SEGMENT_BYTES) {
            if self.chaining_values.is_empty() {
                self.first_root = Some(self.hasher.finalize());
            }
            self.chaining_values.push(self.hasher.finalize_non_root());
        }
        let root = match self.chaining_values.len() {
            0 => blake3::hash(b""),
            1 => self.first_root.expect("the first segment's root is kept"),
            _ => {
                let left = left_subtree_len(self.length);
                let split = usize::try_from(left / SEGMENT_BYTES).unwrap_or(usize::MAX);
                blake3::hazmat::merge_subtrees_root(
                    &subtree(&self.chaining_values[..split], left),
                    &subtree(&self.chaining_values[split..], self.length - left),
                    Mode::Hash,
                )
            }
        };
        (
            format!("blake3:{}", root.to_hex()),
            self.chaining_values.iter().map(short_hex).collect(),
        )
    }
}

/// The chaining value of the subtree made of these whole segments (`length` bytes). BLAKE3's left
/// subtrees hold a power of two of chunks, at least a segment's worth here, so every split falls
/// on a segment boundary.
fn subtree(chaining_values: &[ChainingValue], length: u64) -> ChainingValue {
    if let [only] = chaining_values {
        return *only;
    }
    let left = left_subtree_len(length);
    let split = usize::try_from(left / SEGMENT_BYTES).unwrap_or(usize::MAX);
    merge_subtrees_non_root(
        &subtree(&chaining_values[..split], left),
        &subtree(&chaining_values[split..], length - left),
        Mode::Hash,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(length: usize) -> Vec<u8> {
        (0..length)
            .map(|index| u8::try_from(index * 7 % 251).unwrap())
            .collect()
    }

    #[test]
    fn the_whole_digest_is_plain_blake3_for_every_shape_of_tree() {
        let segment = usize::try_from(SEGMENT_BYTES).unwrap();
        for length in [
            0,
            1,
            1024,
            segment - 1,
            segment,
            segment + 1,
            2 * segment,
            3 * segment - 5,
            4 * segment,
            5 * segment + 77,
            7 * segment,
            9 * segment + 1,
        ] {
            let bytes = data(length);
            for piece in [1000, 4096, 1 << 20] {
                let mut hasher = SegmentHasher::new();
                for part in bytes.chunks(piece) {
                    hasher.update(part);
                }
                let (whole, segments) = hasher.finish();
                assert_eq!(
                    whole,
                    format!("blake3:{}", blake3::hash(&bytes).to_hex()),
                    "{length}"
                );
                assert_eq!(segments.len(), length.div_ceil(segment));
                for (index, digest) in segments.iter().enumerate() {
                    let start = index * segment;
                    let end = (start + segment).min(length);
                    assert_eq!(
                        *digest,
                        segment_digest(start as u64, &bytes[start..end]),
                        "{length} {index}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_changed_byte_changes_its_segment_only() {
        let segment = usize::try_from(SEGMENT_BYTES).unwrap();
        let digests = |bytes: &[u8]| -> Vec<String> {
            bytes
                .chunks(segment)
                .enumerate()
                .map(|(index, part)| segment_digest((index * segment) as u64, part))
                .collect()
        };
        let mut bytes = data(3 * segment);
        let before = digests(&bytes);
        bytes[segment + 10] ^= 1;
        let after = digests(&bytes);
        assert_eq!(before[0], after[0]);
        assert_ne!(before[1], after[1]);
        assert_eq!(before[2], after[2]);
    }
}

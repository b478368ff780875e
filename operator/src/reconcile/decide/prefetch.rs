//! Pulling ahead (`spec.sandbox.prefetch`): while the window's Jobs run, the images of the pieces
//! next in line are pulled onto a node by a one-pod Job each, and the piece's Job, once it
//! starts, prefers that node. A prefetch Job lives while its piece is next in line: it is deleted
//! once the piece starts (or the run stops), so that at most `prefetch` exist.
//!
//! A queued run pulls nothing ahead: its queue decides when, and on which nodes, its Jobs run.

use kube::ResourceExt;

use super::images::{Piece, Work};
use crate::reconcile::children::{Component, MAX_NAME_LENGTH};
use crate::reconcile::decide::Child;
use crate::reconcile::observe::Observed;
use crate::reconcile::validate::ValidatedRun;

/// The prefetch Jobs of the first `spec.sandbox.prefetch` pieces of `upcoming` (those naming an
/// image that is not known to be unbuildable), and the deletion of the others.
pub fn prefetch<'a>(
    run: &ValidatedRun<'_>,
    observed: &Observed,
    upcoming: impl Iterator<Item = &'a Piece>,
    work: &mut Work,
) {
    let round = observed.round;
    let name = |shard| run.child_name(Component::Prefetch { round, shard });
    let ahead = if run.spec.queue_name.is_some() || run.spec.suspend {
        0
    } else {
        usize::try_from(run.spec.sandbox.prefetch).unwrap_or(usize::MAX)
    };
    let wanted: Vec<(u32, String)> = upcoming
        .filter(|piece| piece.build_failed.is_none())
        .filter_map(|piece| Some((piece.shard, piece.image.clone()?)))
        // A name past the limit (a long run name, thousands of images): that image is not
        // pulled ahead, its Job pulls it as without prefetch.
        .filter(|(shard, _)| name(*shard).len() <= MAX_NAME_LENGTH)
        .take(ahead)
        .collect();
    for (shard, image) in &wanted {
        let job = name(*shard);
        let exists = observed
            .prefetch_jobs
            .iter()
            .any(|existing| existing.name_any() == job);
        work.children.push(Child::Prefetch {
            round,
            shard: *shard,
            image: image.clone(),
            exists,
        });
    }
    for job in &observed.prefetch_jobs {
        let job = job.name_any();
        if !wanted.iter().any(|(shard, _)| name(*shard) == job) {
            work.delete.push(job);
        }
    }
}

/// The node that pulled the image of piece `shard` ahead, once its prefetch pod succeeded.
pub fn node_of(observed: &Observed, shard: u32) -> Option<String> {
    observed.prefetched.get(&shard).cloned()
}

//! What identifies the children of a run: their names, labels, field manager, and the worker
//! container the pod failure policy names. Observe finds children by these, validate checks the
//! names fit, build stamps them on every object.

/// Kubernetes limits label values (and so Job names, which become the `job-name` label) to 63.
pub const MAX_NAME_LENGTH: usize = 63;

/// Attempts are numbered from 1; this many digits are reserved for the attempt in name checks.
pub const ATTEMPT_DIGITS: usize = 3;

/// Generation attempts a round makes before it merges what is done.
pub const ATTEMPTS_PER_ROUND: u32 = 3;

/// Rounds a run makes at most. A round is a plan, its attempts and a merge; the next one starts
/// only when the merge found batches marked done without all their records (and cleared their
/// markers), so that it plans and generates just those again.
pub const MAX_ROUNDS: u32 = 3;

/// The longest run name whose children's names all fit in [`MAX_NAME_LENGTH`].
pub const MAX_RUN_NAME_LENGTH: usize = MAX_NAME_LENGTH - "-gen-".len() - ATTEMPT_DIGITS;

/// Label keys.
pub mod labels {
    pub const NAME: &str = "app.kubernetes.io/name";
    pub const INSTANCE: &str = "app.kubernetes.io/instance";
    pub const COMPONENT: &str = "app.kubernetes.io/component";
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    /// The run a child belongs to (the selector the controller uses).
    pub const RUN: &str = "trajectories.dev/run";
    /// The generation attempt of a `gen` Job.
    pub const ATTEMPT: &str = "trajectories.dev/attempt";
    /// The shard of a `gen` Job past the first, when an attempt runs as several Jobs.
    pub const SHARD: &str = "trajectories.dev/shard";
    /// The round of a child past the first round (a round's children carry it; the first
    /// round's are labelled as they always were).
    pub const ROUND: &str = "trajectories.dev/round";
    /// Kueue admits Jobs carrying this label through the named `LocalQueue`.
    pub const KUEUE_QUEUE: &str = "kueue.x-k8s.io/queue-name";
}

/// Annotations of generation Jobs of rows that name an image.
pub mod annotations {
    /// The image, as the rows name it.
    pub const IMAGE: &str = "trajectories.dev/image";
    /// Set on the Job that records the rows of an image that could not be pulled: why.
    pub const IMAGE_UNAVAILABLE: &str = "trajectories.dev/image-unavailable";
    /// Set (`"true"`) beside [`IMAGE_UNAVAILABLE`] when the image could not be built.
    pub const IMAGE_BUILD_FAILED: &str = "trajectories.dev/image-build-failed";
}

/// The name of the Job recording as unavailable the rows of the generation Job `job`.
pub fn unavailable_job_name(job: &str) -> String {
    format!("{job}-na")
}

/// The `ConfigMap` in which the operator keeps the image groups of a round's plan, once read.
pub fn image_index_name(run: &str, round: u32) -> String {
    match round {
        ..=1 => format!("{run}-images"),
        round => format!("{run}-images-{round}"),
    }
}

/// Value of `app.kubernetes.io/managed-by`, and the server-side apply field manager.
pub const MANAGER: &str = "trajectory-operator";

/// The worker container's name (named in the pod failure policy's exit-code rules).
pub const CONTAINER: &str = "worker";

/// The privileged container of a build pod, which builds and reports (its worker container
/// readies the build).
pub const BUILD_CONTAINER: &str = "build";

/// The part of a run a child Job (and its plan `ConfigMap`) serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// `trajectory-worker plan`: validate the dataset, write the manifest; once per round.
    Plan { round: u32 },
    /// `trajectory-worker batch`: an Indexed Job of one attempt. An attempt of more batches than
    /// one Job may hold runs as several Jobs, its shards, numbered from 0. Attempts are numbered
    /// on across rounds: round *r* makes attempts `(r-1)·3+1` to `r·3`.
    Generate { attempt: u32, shard: u32 },
    /// `trajectory-worker merge`; once per round.
    Merge { round: u32 },
    /// `trajectory-worker image-page`: an Indexed Job reporting the pages of a plan's image index
    /// (when its summary could not list every image group), one per index; once per round, and
    /// only then.
    ImagePages { round: u32 },
    /// `trajectory-worker build`: an Indexed Job building the images of the round's plan's
    /// build list (`spec.sandbox.builds`), one per index; once per round, and only then.
    Build { round: u32 },
    /// A one-pod Job pulling the image of a piece of the round's generation work onto a node
    /// ahead of that piece's Job (`spec.sandbox.prefetch`); its container runs the executor's
    /// `pulled`, which exits at once.
    Prefetch { round: u32, shard: u32 },
}

impl Component {
    /// The `app.kubernetes.io/component` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Plan { .. } => "plan",
            Self::Generate { .. } => "generate",
            Self::Merge { .. } => "merge",
            Self::ImagePages { .. } => "image-pages",
            Self::Build { .. } => "build",
            Self::Prefetch { .. } => "prefetch",
        }
    }

    /// The round the child belongs to.
    pub fn round(self) -> u32 {
        match self {
            Self::Plan { round }
            | Self::Merge { round }
            | Self::ImagePages { round }
            | Self::Build { round }
            | Self::Prefetch { round, .. } => round,
            Self::Generate { attempt, .. } => round_of_attempt(attempt),
        }
    }

    /// The worker subcommand its pods run (the executor's, for a prefetch pod).
    pub fn command(self) -> &'static str {
        match self {
            Self::Plan { .. } => "plan",
            Self::Generate { .. } => "batch",
            Self::Merge { .. } => "merge",
            Self::ImagePages { .. } => "image-page",
            Self::Build { .. } => "build",
            Self::Prefetch { .. } => "pulled",
        }
    }

    /// The first generation Job of `attempt`.
    pub fn generation(attempt: u32) -> Self {
        Self::Generate { attempt, shard: 0 }
    }

    /// The child's name: `{run}-plan`, `{run}-gen-{attempt}` (shard 0; `-{shard}` appended for
    /// the others), `{run}-merge`; a later round's plan and merge end in `-{round}`. It fits in
    /// [`MAX_NAME_LENGTH`] for every run name validation accepts ([`MAX_RUN_NAME_LENGTH`]) up to
    /// shard 9; decide checks the rest (and pulls no image ahead whose Job's name would not fit).
    pub fn child_name(self, run: &str) -> String {
        match self {
            Self::Plan { round: ..=1 } => format!("{run}-plan"),
            Self::Plan { round } => format!("{run}-plan-{round}"),
            Self::Generate { attempt, shard: 0 } => format!("{run}-gen-{attempt}"),
            Self::Generate { attempt, shard } => format!("{run}-gen-{attempt}-{shard}"),
            Self::Merge { round: ..=1 } => format!("{run}-merge"),
            Self::Merge { round } => format!("{run}-merge-{round}"),
            Self::ImagePages { round: ..=1 } => format!("{run}-img"),
            Self::ImagePages { round } => format!("{run}-img-{round}"),
            Self::Build { round: ..=1 } => format!("{run}-build"),
            Self::Build { round } => format!("{run}-build-{round}"),
            Self::Prefetch { round: ..=1, shard } => format!("{run}-pull-{shard}"),
            Self::Prefetch { round, shard } => format!("{run}-pull{round}-{shard}"),
        }
    }
}

/// The round an attempt belongs to.
pub fn round_of_attempt(attempt: u32) -> u32 {
    attempt.saturating_sub(1) / ATTEMPTS_PER_ROUND + 1
}

/// The first attempt of `round`.
pub fn first_attempt_of(round: u32) -> u32 {
    round.saturating_sub(1) * ATTEMPTS_PER_ROUND + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_have_deterministic_names() {
        let cases = [
            (Component::Plan { round: 1 }, "coding-v1-plan"),
            (Component::Plan { round: 2 }, "coding-v1-plan-2"),
            (Component::generation(1), "coding-v1-gen-1"),
            (Component::generation(12), "coding-v1-gen-12"),
            (
                Component::Generate {
                    attempt: 2,
                    shard: 3,
                },
                "coding-v1-gen-2-3",
            ),
            (Component::Merge { round: 1 }, "coding-v1-merge"),
            (Component::Merge { round: 3 }, "coding-v1-merge-3"),
        ];
        for (component, expected) in cases {
            assert_eq!(component.child_name("coding-v1"), expected);
        }
    }

    #[test]
    fn the_longest_run_name_leaves_room_for_every_child() {
        let longest = "r".repeat(MAX_RUN_NAME_LENGTH);
        let last_attempt = MAX_ROUNDS * ATTEMPTS_PER_ROUND;
        assert!(
            last_attempt < 10,
            "attempts take one digit, leaving room for shards 0 to 9"
        );
        let children = [
            Component::Plan { round: MAX_ROUNDS },
            Component::generation(999),
            Component::Generate {
                attempt: last_attempt,
                shard: 9,
            },
            Component::Merge { round: MAX_ROUNDS },
            Component::ImagePages { round: MAX_ROUNDS },
            Component::Build { round: MAX_ROUNDS },
        ];
        for component in children {
            assert!(component.child_name(&longest).len() <= MAX_NAME_LENGTH);
        }
    }

    #[test]
    fn attempts_are_numbered_on_across_rounds() {
        let rounds: Vec<u32> = (1..=7).map(round_of_attempt).collect();
        assert_eq!(rounds, [1, 1, 1, 2, 2, 2, 3]);
        assert_eq!([1, 2, 3].map(first_attempt_of), [1, 4, 7]);
        assert_eq!(Component::generation(5).round(), 2);
        assert_eq!(Component::Merge { round: 2 }.round(), 2);
    }
}

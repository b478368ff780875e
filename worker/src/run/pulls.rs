//! How long a generation pod waited for its rows' image, for the report and the run's status.
//!
//! The kubelet starts a pod's sidecars one after the other, pulling each one's image first, and
//! the worker once every one of them started. Each sidecar's executor creates its socket as it
//! starts, so the sockets' times on the node's clock tell the pod's start apart: the run's sandbox
//! (the worker image, or `spec.sandbox.image`), then the first task container (after its image's
//! pull), then the worker.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use serde_json::{Value, json};

use crate::contract::{PodPull, paths};

/// When a generation pod's containers started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodStart {
    sandbox: SystemTime,
    first_task: SystemTime,
    worker: SystemTime,
}

impl PodStart {
    /// Read by the worker as it starts (`now`), from the sandbox's socket and the first task
    /// container's under `task_sockets`; `None` when either socket's time cannot be read (a pod
    /// without task containers, or a file system that keeps no times).
    pub fn read(sandbox_socket: &Path, task_sockets: &Path, now: SystemTime) -> Option<Self> {
        let created = |socket: &Path| std::fs::symlink_metadata(socket).ok()?.modified().ok();
        Some(Self {
            sandbox: created(sandbox_socket)?,
            first_task: created(&paths::task_socket(task_sockets, 0))?,
            worker: now,
        })
    }

    /// What the pod waited for `image`, its batch ending at `end`.
    pub fn pull(&self, image: &str, end: SystemTime) -> PodPull {
        let millis = |from: SystemTime, to: SystemTime| {
            to.duration_since(from).map_or(0, |elapsed| {
                u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
            })
        };
        PodPull {
            image: image.to_owned(),
            pull_ms: millis(self.sandbox, self.first_task),
            start_ms: millis(self.first_task, self.worker),
            pod_ms: millis(self.sandbox, end),
        }
    }
}

/// What the pods that finished a run's batches waited for their images, per image.
#[derive(Debug, Default)]
pub struct PullTotals {
    images: BTreeMap<String, ImageWaits>,
}

/// One image's pods and their waits, in milliseconds.
#[derive(Debug, Default, Clone, Copy)]
struct ImageWaits {
    pods: u64,
    pull_ms: u64,
    start_ms: u64,
    pod_ms: u64,
}

impl PullTotals {
    pub fn add(&mut self, pull: &PodPull) {
        let waits = self.images.entry(pull.image.clone()).or_default();
        waits.pods += 1;
        waits.pull_ms += pull.pull_ms;
        waits.start_ms += pull.start_ms;
        waits.pod_ms += pull.pod_ms;
    }

    pub fn absorb(&mut self, other: Self) {
        for (image, more) in other.images {
            let waits = self.images.entry(image).or_default();
            waits.pods += more.pods;
            waits.pull_ms += more.pull_ms;
            waits.start_ms += more.start_ms;
            waits.pod_ms += more.pod_ms;
        }
    }

    /// `statistics.json`'s `task_images.pulls`: the pods' time in total, the share of it spent
    /// waiting for pulls, and the same per image; `None` when no pod said (a local run).
    pub fn summary(&self) -> Option<Value> {
        if self.images.is_empty() {
            return None;
        }
        let total = self
            .images
            .values()
            .fold(ImageWaits::default(), |sum, waits| ImageWaits {
                pods: sum.pods + waits.pods,
                pull_ms: sum.pull_ms + waits.pull_ms,
                start_ms: sum.start_ms + waits.start_ms,
                pod_ms: sum.pod_ms + waits.pod_ms,
            });
        let mut summary = total.summary();
        summary["images"] = self
            .images
            .iter()
            .map(|(image, waits)| (image.clone(), waits.summary()))
            .collect::<serde_json::Map<_, _>>()
            .into();
        Some(summary)
    }
}

impl ImageWaits {
    fn summary(self) -> Value {
        let seconds = |millis: u64| (millis as f64 / 1000.0 * 10.0).round() / 10.0;
        let share = if self.pod_ms == 0 {
            0.0
        } else {
            (self.pull_ms as f64 / self.pod_ms as f64 * 1000.0).round() / 1000.0
        };
        json!({
            "pods": self.pods,
            "pull_seconds": seconds(self.pull_ms),
            "start_seconds": seconds(self.start_ms),
            "pod_seconds": seconds(self.pod_ms),
            "pull_share": share,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_sockets_times_split_the_pods_start_into_pull_and_starts() {
        let dir = tempfile::tempdir().unwrap();
        let sandbox = dir.path().join("sandbox.sock");
        let _sandbox = UnixListener::bind(&sandbox).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let tasks = dir.path().join("tasks");
        let first = paths::task_socket(&tasks, 0);
        std::fs::create_dir_all(first.parent().unwrap()).unwrap();
        let _first = UnixListener::bind(&first).unwrap();
        let worker = SystemTime::now() + Duration::from_millis(200);
        let start = PodStart::read(&sandbox, &tasks, worker).unwrap();
        let pull = start.pull("python:3.12", worker + Duration::from_secs(2));
        assert_eq!(pull.image, "python:3.12");
        assert!((250..1000).contains(&pull.pull_ms), "{pull:?}");
        assert!((150..1000).contains(&pull.start_ms), "{pull:?}");
        assert!(
            pull.pod_ms >= pull.pull_ms + pull.start_ms + 2000,
            "{pull:?}"
        );
        // No task container: nothing to say.
        assert!(PodStart::read(&sandbox, &dir.path().join("none"), worker).is_none());
    }

    #[test]
    fn pull_totals_give_the_share_of_the_pods_time_in_total_and_per_image() {
        let pull = |image: &str, pull_ms, pod_ms| PodPull {
            image: image.to_owned(),
            pull_ms,
            start_ms: 100,
            pod_ms,
        };
        let mut totals = PullTotals::default();
        assert!(totals.summary().is_none());
        totals.add(&pull("a", 3000, 10_000));
        let mut other = PullTotals::default();
        other.add(&pull("a", 0, 5000));
        other.add(&pull("b", 1000, 5000));
        totals.absorb(other);
        let summary = totals.summary().unwrap();
        assert_eq!(summary["pods"], 3);
        assert_eq!(summary["pull_seconds"], 4.0);
        assert_eq!(summary["pod_seconds"], 20.0);
        assert_eq!(summary["start_seconds"], 0.3);
        assert_eq!(summary["pull_share"], 0.2);
        assert_eq!(summary["images"]["a"]["pods"], 2);
        assert_eq!(summary["images"]["a"]["pull_share"], 0.2);
        assert_eq!(summary["images"]["b"]["pull_seconds"], 1.0);
    }
}

//! The circuit of one batch: it opens after a run of failed model calls with no success between.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Counts consecutive failed model calls (attempts a retry may fix) across a batch's
/// conversations. Once `threshold` fail in a row, it opens and stays open: the batch starts no
/// more conversations, lets the ones in flight finish, and stops as transient, so the Job retries
/// it later with backoff instead of every conversation spending its own retries on an outage.
///
/// Deliberately simple: no half-open state within a batch. The Job's retry (a new pod, after its
/// backoff) is the probe.
#[derive(Debug)]
pub struct Circuit {
    threshold: u32,
    consecutive: AtomicU32,
    open: AtomicBool,
}

impl Circuit {
    /// A closed circuit that opens after `threshold` (at least 1) failures in a row.
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold: threshold.max(1),
            consecutive: AtomicU32::new(0),
            open: AtomicBool::new(false),
        }
    }

    /// The threshold a batch with `concurrency` conversations in flight uses: every conversation
    /// failed about twice in a row, and never fewer than 8, so that one burst of errors answered
    /// to every request in flight does not open it.
    pub fn for_concurrency(concurrency: usize) -> Self {
        let twice = u32::try_from(concurrency.saturating_mul(2)).unwrap_or(u32::MAX);
        Self::new(twice.max(8))
    }

    /// A call failed in a way a retry may fix.
    pub fn failure(&self) {
        let failures = self.consecutive.fetch_add(1, Ordering::SeqCst) + 1;
        if failures >= self.threshold && !self.open.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                failures,
                "the circuit opened: no new conversation starts in this batch"
            );
        }
    }

    /// The server answered (a completion, or a refusal that shows it is up).
    pub fn success(&self) {
        self.consecutive.store(0, Ordering::SeqCst);
    }

    /// Whether `threshold` calls failed in a row at some point.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Whether the latest call failed (no success since).
    pub fn is_failing(&self) -> bool {
        self.consecutive.load(Ordering::SeqCst) > 0
    }

    /// The number of consecutive failures it opens at.
    pub fn threshold(&self) -> u32 {
        self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_only_and_stays_open() {
        let circuit = Circuit::new(3);
        circuit.failure();
        circuit.failure();
        circuit.success();
        circuit.failure();
        circuit.failure();
        assert!(!circuit.is_open() && circuit.is_failing());
        circuit.failure();
        assert!(circuit.is_open());
        circuit.success();
        assert!(circuit.is_open() && !circuit.is_failing());
        assert_eq!(Circuit::for_concurrency(2).threshold(), 8);
        assert_eq!(Circuit::for_concurrency(16).threshold(), 32);
    }
}

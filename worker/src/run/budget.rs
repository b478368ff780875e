//! `spec.model.budget`: at most `maxCost` USD on the model, over the whole run.
//!
//! What was spent is counted as it happens: the model client adds every completion's cost to
//! the run's [`Spending`], and a resumed run starts from what its records on storage cost. A
//! conversation reserves, before it starts, what a conversation has cost on average so far, and
//! gives the reservation back when it ends (its real cost is then in the spending). A new
//! conversation starts only while what was spent and what is reserved leave room for it, so the
//! run spends at most the budget plus what the conversations in flight spend beyond their
//! reservations; those are never cut short (what they spent would be lost with them).

use std::sync::{Arc, Mutex};

use serde::Deserialize;

use super::RunError;
use super::manifest::Manifest;
use crate::model::Spending;
use crate::spec::BudgetSpec;
use crate::storage::{RunDir, read_files_lines_into};

/// The run's budget, shared by its batches' conversations.
#[derive(Debug)]
pub struct Budget {
    max_cost: f64,
    /// Spent by earlier runs of this output directory (their records' costs).
    before: f64,
    spending: Arc<Spending>,
    reservations: Mutex<Reservations>,
}

#[derive(Debug, Default)]
struct Reservations {
    /// USD reserved by the conversations in flight.
    reserved: f64,
    /// Conversations that ended with a known cost, and what they cost in all: the estimate of
    /// the next one.
    ended: u64,
    ended_cost: f64,
}

/// A conversation's reservation; given back when dropped (or [`Ticket::end`]ed with its cost,
/// which the next estimates learn from).
#[derive(Debug)]
pub struct Ticket {
    budget: Arc<Budget>,
    reserved: f64,
}

impl Budget {
    /// A budget of `spec.maxCost` of which `before` was spent by earlier runs; the model client
    /// counts into [`Budget::spending`].
    pub fn new(spec: &BudgetSpec, before: f64) -> Arc<Self> {
        Arc::new(Self {
            max_cost: spec.max_cost,
            before,
            spending: Arc::new(Spending::default()),
            reservations: Mutex::new(Reservations::default()),
        })
    }

    /// Where the model client counts what each completion cost.
    pub fn spending(&self) -> Arc<Spending> {
        self.spending.clone()
    }

    /// USD spent so far, by this run and the earlier ones.
    pub fn spent(&self) -> f64 {
        self.before + self.spending.total()
    }

    pub fn max_cost(&self) -> f64 {
        self.max_cost
    }

    /// A reservation for one more conversation, or `None` when the budget has no room for it.
    pub fn start(self: &Arc<Self>) -> Option<Ticket> {
        let mut reservations = lock(&self.reservations);
        #[allow(clippy::cast_precision_loss)] // conversation counts stay far below 2^52
        let estimate = if reservations.ended == 0 {
            0.0
        } else {
            reservations.ended_cost / reservations.ended as f64
        };
        let committed = self.spent() + reservations.reserved;
        if committed >= self.max_cost || committed + estimate > self.max_cost {
            return None;
        }
        reservations.reserved += estimate;
        Some(Ticket {
            budget: self.clone(),
            reserved: estimate,
        })
    }
}

impl Ticket {
    /// The conversation ended having cost `cost` (USD), if known.
    pub fn end(self, cost: Option<f64>) {
        if let Some(cost) = cost {
            let mut reservations = lock(&self.budget.reservations);
            reservations.ended += 1;
            reservations.ended_cost += cost;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut reservations = lock(&self.budget.reservations);
        reservations.reserved = (reservations.reserved - self.reserved).max(0.0);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the records of the run on storage cost: every batch's records files, each line's
/// `cost.total`.
pub fn spent_on_storage(run_dir: &RunDir, manifest: &Manifest) -> Result<f64, RunError> {
    #[derive(Deserialize)]
    struct Record {
        cost: Option<RecordCost>,
    }
    #[derive(Deserialize)]
    struct RecordCost {
        total: f64,
    }
    let mut spent = 0.0;
    for batch in 0..manifest.batch_count() {
        let files = run_dir.records_files(batch)?;
        let read =
            read_files_lines_into(files.iter().map(|file| file.records.as_path()), Vec::new())?;
        for &(start, end) in &read.lines {
            if let Ok(Record { cost: Some(cost) }) =
                serde_json::from_slice::<Record>(&read.data[start..end])
            {
                spent += cost.total;
            }
        }
    }
    Ok(spent)
}

/// The error that stops a batch at the run's budget, `not_started` of its conversations not run.
pub fn exhausted(budget: &Budget, not_started: usize) -> RunError {
    RunError::BudgetExhausted(format!(
        "the run spent {} USD of its budget of {} USD (spec.model.budget.maxCost), and \
         {not_started} conversations of a batch were not started; raise the budget and run \
         again to finish them (what is done stays done)",
        super::costs::usd_text(budget.spent()),
        super::costs::usd_text(budget.max_cost()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max_cost: f64, before: f64) -> Arc<Budget> {
        Budget::new(&BudgetSpec { max_cost }, before)
    }

    #[test]
    fn conversations_start_while_spent_and_reserved_leave_room() {
        let budget = budget(1.0, 0.25);
        // Nothing ended yet: nothing to estimate from, so conversations start until the spending
        // reaches the budget.
        let first = budget.start().expect("room");
        budget.spending().add(0.5);
        first.end(Some(0.5));
        // Now each reserves 0.5: 0.75 spent leaves no room for 0.5 more.
        assert!(budget.start().is_none());
        assert!((budget.spent() - 0.75).abs() < 1e-9);
    }

    #[test]
    fn reservations_hold_room_until_their_conversation_ends() {
        let budget = budget(1.0, 0.0);
        budget.start().unwrap().end(Some(0.3));
        let second = budget.start().expect("0.3 reserved of 1.0");
        let third = budget.start().expect("0.6 reserved");
        let fourth = budget.start().expect("0.9 reserved");
        assert!(
            budget.start().is_none(),
            "0.9 reserved: no room for 0.3 more"
        );
        drop(second);
        let fifth = budget
            .start()
            .expect("room again once one gave its reservation back");
        drop((third, fourth, fifth));
        budget.spending().add(1.0);
        assert!(budget.start().is_none(), "spent");
    }
}

//! What a run spends on the model, counted across every process that spends it (a local run,
//! or the pods of a cluster run), and `spec.model.budget`: at most `maxCost` USD over the whole
//! run.
//!
//! Each process keeps a **claim**, a file of its own under the run's `budget/` directory: what it
//! spent, the conversations it ended and what they cost, and its **allowance**, the part of the
//! budget it may spend. A conversation reserves, before it starts, what a conversation has cost on
//! average so far (over every process of the run), and gives the reservation back when it ends
//! (its real cost is then in the process's spending). When its allowance has no room for the next
//! conversation, the process reads every claim and grows its allowance by a `1/processes` share
//! of what nobody holds (at least one conversation's worth while that much is free), so the
//! allowances of the processes running at once never add up to more than the budget. A
//! conversation in flight holds the larger of its reservation and what it has spent so far
//! (its calls count in the process's spending as they are answered, not twice). What is
//! left when that share cannot hold a conversation is the end of the budget: no new conversation
//! starts, and the process gives back what it holds beyond what it committed.
//!
//! A process writes its claim when it grows or gives back its allowance and, while its spending
//! changes, every [`CLAIM_REFRESH`] ([`Ledger::keep_fresh`]): what the claims say was spent lags
//! the truth by a second, not by a whole allowance. A pod stopping at the budget reports the run's
//! spending from the claims (and the operator shows it), read once every claim had time to be
//! written again ([`Ledger::settled_spent`]).
//!
//! A claim counts as the larger of its allowance and what its process spent while the process
//! lives, and as what it spent once the process finished (and wrote so). A process killed before
//! it could write that keeps its whole allowance counted: it may have spent it, and a cap is not
//! guessed at. Nothing is shared but files each written by one process, so this needs no lock
//! across nodes (none reaches across NFS clients) and holds on object storage alike.
//!
//! A process starting **adopts** a finished claim (renames it to its own name and carries its
//! figures on), so the run has about as many claims as processes run at once, however many
//! batches it has: reading every claim stays cheap.
//!
//! Until some conversation of the run has ended there is no estimate, and each process runs one
//! conversation at a time: a run learns what a conversation costs before it starts many.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::warn;

use super::RunError;
use crate::model::Spending;
use crate::spec::{BudgetSpec, RunSpec};
use crate::storage::{RunDir, StorageError, Store, WriterId};

/// Sums of USD amounts differ from their exact value by far less than this (one millionth of a
/// cent): a conversation that fits exactly is not refused for a rounding.
const ROUNDING: f64 = 1e-8;

/// How long a process's claim may say less than it spent: one small write a second at most while
/// it spends (on object storage, one request).
pub const CLAIM_REFRESH: Duration = Duration::from_secs(1);

/// How many times the claims are read again when one was renamed while they were read.
const MAX_CLAIM_READS: u32 = 100;

/// One process's claim, as its file holds it (with what the claims it adopted carried).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Claim {
    /// USD the process may spend (spent plus reserved stays within it).
    allowance: f64,
    /// USD its model calls cost, as of the claim's last write.
    spent: f64,
    /// Conversations it ended with a known cost, and what they cost in all: the run's estimate.
    ended: u64,
    ended_cost: f64,
    /// The process ended and wrote its last spending: its allowance no longer counts.
    finished: bool,
}

impl Claim {
    /// What the claim holds of the budget.
    fn committed(&self) -> f64 {
        if self.finished {
            self.spent
        } else {
            self.allowance.max(self.spent)
        }
    }
}

/// The other processes' claims, summed, as last read.
#[derive(Debug, Clone, Copy, Default)]
struct Others {
    committed: f64,
    spent: f64,
    ended: u64,
    ended_cost: f64,
}

/// The run's spending and budget as one process holds them, shared by its batches'
/// conversations.
#[derive(Debug)]
pub struct Ledger {
    /// `spec.model.budget.maxCost`; without one, the process only counts what it spends.
    max_cost: Option<f64>,
    /// How many processes may hold allowances at once: a new allowance is a share of what is free.
    processes: u32,
    dir: PathBuf,
    claim_path: PathBuf,
    store: Store,
    spending: Arc<Spending>,
    state: Mutex<State>,
    /// Held while the claims are read and this process's is written (growing is rare, and two
    /// batches of one process growing at once would only read the same claims twice), and while
    /// it is written finished: a write under way must not bring the live name back after that.
    growing: Mutex<()>,
    /// This process's claim as last written.
    written: Mutex<Claim>,
}

#[derive(Debug, Default)]
struct State {
    allowance: f64,
    /// The figures of the finished claim this process adopted.
    carried: Claim,
    /// The reservations of this process's conversations in flight.
    in_flight: Vec<Reservation>,
    ended: u64,
    ended_cost: f64,
    others: Others,
    finished: bool,
}

impl State {
    /// What this process's claim holds of the budget besides its unused allowance: what it spent
    /// (with what the claim it adopted had, and what its conversations in flight spent so far),
    /// and what those conversations reserved beyond what they spent.
    fn committed(&self, spending: &Spending) -> f64 {
        let unspent: f64 = self
            .in_flight
            .iter()
            .map(|reservation| (reservation.amount - reservation.spent.total()).max(0.0))
            .sum();
        self.carried.spent + spending.total() + unspent
    }

    /// What a conversation costs on average over the run, once any ended.
    fn estimate(&self) -> Option<f64> {
        let ended = self.ended + self.carried.ended + self.others.ended;
        let ended_cost = self.ended_cost + self.carried.ended_cost + self.others.ended_cost;
        #[allow(clippy::cast_precision_loss)] // conversation counts stay far below 2^52
        (ended > 0).then(|| ended_cost / ended as f64)
    }
}

/// Whether a conversation may start.
#[derive(Debug)]
pub enum Admission {
    /// It may: its reservation, given back when dropped.
    Start(Ticket),
    /// Not yet: the run knows no conversation's cost, and one of this process is in flight.
    Wait,
    /// The budget has no room for it.
    Exhausted,
}

/// What a conversation in flight reserved, and what it has spent so far (its own spending,
/// which also tells its ticket's reservation apart).
#[derive(Debug)]
struct Reservation {
    amount: f64,
    spent: Arc<Spending>,
}

/// A conversation's reservation; given back when dropped (or [`Ticket::end`]ed with its cost,
/// which the next estimates learn from).
#[derive(Debug)]
pub struct Ticket {
    ledger: Arc<Ledger>,
    spent: Arc<Spending>,
}

impl Ledger {
    /// This process's claim in `run_dir`, on a budget of `spec.maxCost` (when the run has one)
    /// spent by up to `processes` processes at once: adopts a finished claim, reads the others,
    /// and takes a first allowance.
    pub fn open(
        spec: Option<&BudgetSpec>,
        run_dir: &RunDir,
        processes: u32,
    ) -> Result<Arc<Self>, RunError> {
        let dir = run_dir.budget_dir();
        let claim_path = dir.join(format!("{}.json", WriterId::random()));
        let budget = Arc::new(Self {
            max_cost: spec.map(|spec| spec.max_cost),
            processes: processes.max(1),
            dir,
            claim_path,
            store: run_dir.store().clone(),
            spending: Arc::new(Spending::default()),
            state: Mutex::new(State::default()),
            growing: Mutex::new(()),
            written: Mutex::new(Claim::default()),
        });
        let carried = budget.adopt()?;
        lock(&budget.state).carried = carried;
        budget.grow()?;
        Ok(budget)
    }

    /// The ledger of a run with prices or a budget (`None` for one without: nothing it spends
    /// is known), as one of `processes` processes spending it at once.
    pub fn for_run(
        spec: &RunSpec,
        run_dir: &RunDir,
        processes: u32,
    ) -> Result<Option<Arc<Self>>, RunError> {
        let model = &spec.model;
        if model.pricing.is_none() && model.budget.is_none() {
            return Ok(None);
        }
        Self::open(model.budget.as_ref(), run_dir, processes).map(Some)
    }

    /// Takes over a finished claim, if there is one: renamed to this process's name, its figures
    /// carried on in this process's claim.
    ///
    /// On a bucket there is no rename that only one of two processes can win: every process
    /// keeps a claim of its own there (a run has one per pod that spent, not one per pod at once).
    fn adopt(&self) -> Result<Claim, StorageError> {
        if self.store.is_bucket() {
            return Ok(Claim::default());
        }
        let finished_names = claim_paths(&self.store, &self.dir)?
            .into_iter()
            .filter(|path| is_finished_name(path));
        for path in finished_names {
            match read_claim(&self.store, &path) {
                Ok(claim) if claim.finished => {}
                Ok(_) => continue,
                // Adopted (and renamed) by another process meanwhile.
                Err(error) if error.is_not_found() => continue,
                Err(error) => return Err(error),
            }
            // Whatever the rename answers (over NFS a retried rename may report a failure that
            // happened), the claim is this process's exactly when it is under its name now.
            let _ = std::fs::rename(&path, &self.claim_path);
            match read_claim(&self.store, &self.claim_path) {
                Ok(claim) => {
                    return Ok(Claim {
                        allowance: 0.0,
                        finished: false,
                        ..claim
                    });
                }
                Err(error) if error.is_not_found() => {}
                Err(error) => return Err(error),
            }
        }
        Ok(Claim::default())
    }

    /// Where the model client counts what each completion cost.
    pub fn spending(&self) -> Arc<Spending> {
        self.spending.clone()
    }

    /// USD spent so far by the whole run: this process, and the others as last read.
    pub fn spent(&self) -> f64 {
        let state = lock(&self.state);
        state.others.spent + state.carried.spent + self.spending.total()
    }

    /// `spec.model.budget.maxCost`, when the run has a budget.
    pub fn max_cost(&self) -> Option<f64> {
        self.max_cost
    }

    /// Whether the next conversation may start; grows the allowance (reading and writing claims,
    /// off the async threads) when it has no room.
    pub async fn admit(self: &Arc<Self>) -> Result<Admission, RunError> {
        if self.max_cost.is_none() {
            let mut state = lock(&self.state);
            return Ok(self.reserve(&mut state, 0.0));
        }
        if let Some(admission) = self.admit_within_allowance() {
            return Ok(admission);
        }
        let budget = self.clone();
        let admission = tokio::task::spawn_blocking(move || {
            budget.grow()?;
            if let Some(admission) = budget.admit_within_allowance() {
                return Ok(admission);
            }
            // What this process holds beyond what it committed is too little for a conversation
            // here, and may be what another process lacks for one.
            budget.give_back()?;
            Ok::<_, StorageError>(Admission::Exhausted)
        });
        Ok(admission
            .await
            .map_err(|err| RunError::Internal(err.to_string()))??)
    }

    /// Shrinks the allowance to what this process spent and reserved.
    fn give_back(&self) -> Result<(), StorageError> {
        let _growing = lock(&self.growing);
        let claim = {
            let mut state = lock(&self.state);
            state.allowance = state.allowance.min(state.committed(&self.spending));
            self.claim(&state)
        };
        self.write(&claim)
    }

    /// The admission the allowance decides alone; `None` when it has no room.
    fn admit_within_allowance(self: &Arc<Self>) -> Option<Admission> {
        let mut state = lock(&self.state);
        let Some(estimate) = state.estimate() else {
            if !state.in_flight.is_empty() {
                return Some(Admission::Wait);
            }
            // The run's first conversation here: it shows what one costs.
            let committed = state.committed(&self.spending);
            return (committed < state.allowance).then(|| self.reserve(&mut state, 0.0));
        };
        let committed = state.committed(&self.spending);
        (committed < state.allowance && committed + estimate <= state.allowance + ROUNDING)
            .then(|| self.reserve(&mut state, estimate))
    }

    fn reserve(self: &Arc<Self>, state: &mut State, estimate: f64) -> Admission {
        let spent = Spending::part_of(&self.spending);
        state.in_flight.push(Reservation {
            amount: estimate,
            spent: Arc::clone(&spent),
        });
        Admission::Start(Ticket {
            ledger: self.clone(),
            spent,
        })
    }

    /// Reads the other claims and adds a share of what they leave free to this allowance (with
    /// no budget, only writes this process's claim).
    fn grow(&self) -> Result<(), StorageError> {
        let _growing = lock(&self.growing);
        let Some(max_cost) = self.max_cost else {
            // Nothing to share out: the others' claims are read once, at the end (`finish`).
            let claim = self.claim(&lock(&self.state));
            return self.write(&claim);
        };
        let others = self.read_others()?;
        let claim = {
            let mut state = lock(&self.state);
            state.others = others;
            let mine = state.allowance.max(state.committed(&self.spending));
            let free = max_cost - others.committed - mine;
            let share = free / f64::from(self.processes);
            let grant = match state.estimate() {
                // At least one conversation's worth while that much is free: shares of a small
                // rest would each be too small to start one.
                Some(estimate) => share.max(estimate.min(free)),
                None => share,
            };
            if grant > 0.0 {
                state.allowance = mine + grant;
            }
            self.claim(&state)
        };
        self.write(&claim)
    }

    /// This process's claim as its state says.
    fn claim(&self, state: &State) -> Claim {
        Claim {
            allowance: state.allowance,
            spent: state.carried.spent + self.spending.total(),
            ended: state.carried.ended + state.ended,
            ended_cost: state.carried.ended_cost + state.ended_cost,
            finished: state.finished,
        }
    }

    /// Writes the claim while the process runs. Once it finished, its claim is under its finished
    /// name: a late write (an admission that ends after the batch) must not bring the live name
    /// back beside it, which would count its spending twice.
    fn write(&self, claim: &Claim) -> Result<(), StorageError> {
        if claim.finished {
            return Ok(());
        }
        self.write_any(claim)
    }

    fn write_any(&self, claim: &Claim) -> Result<(), StorageError> {
        let json = serde_json::to_vec(claim).expect("a claim serialises to JSON");
        self.store.write_atomic(&self.claim_path, &json)?;
        *lock(&self.written) = *claim;
        Ok(())
    }

    /// Writes this process's claim when what it says changed since its last write. Skipped while
    /// another write is under way (a growth writes the same figures).
    fn refresh(&self) -> Result<(), StorageError> {
        let Ok(_writing) = self.growing.try_lock() else {
            return Ok(());
        };
        let claim = self.claim(&lock(&self.state));
        if claim == *lock(&self.written) {
            return Ok(());
        }
        self.write(&claim)
    }

    /// Writes the claim again every [`CLAIM_REFRESH`] while it changes, until the process
    /// finishes: the other processes then read what this one spent a second ago, not at its last
    /// growth. A failed write only leaves its spending behind (its allowance still counts).
    pub fn keep_fresh(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let ledger = Arc::clone(self);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(CLAIM_REFRESH);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !lock(&ledger.state).finished {
                ticks.tick().await;
                let writer = Arc::clone(&ledger);
                match tokio::task::spawn_blocking(move || writer.refresh()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => warn!(%error, "the budget claim could not be written"),
                    Err(error) => warn!(%error, "the budget claim's write did not finish"),
                }
            }
        })
    }

    /// The claims of every other process. A claim that cannot be read is a fault of the storage,
    /// not room in the budget; one gone between the listing and its reading was adopted (renamed)
    /// by a process starting meanwhile, whose claim under its new name the listing missed, so
    /// the claims are read again until none is (adoptions are rare: one a process start).
    fn read_others(&self) -> Result<Others, StorageError> {
        self.read_claims(true)
    }

    /// [`Ledger::read_others`], or with `others_only` false every claim: this process's
    /// finished one included under whichever name it has now (a process starting may have
    /// adopted it, its figures carried on in that process's claim), so that it counts once.
    fn read_claims(&self, others_only: bool) -> Result<Others, StorageError> {
        let mut attempts = 0;
        'read: loop {
            let mut others = Others::default();
            let finished = finished_path(&self.claim_path);
            for path in claim_paths(&self.store, &self.dir)? {
                if others_only && (path == self.claim_path || path == finished) {
                    continue;
                }
                let claim = match read_claim(&self.store, &path) {
                    Ok(claim) => claim,
                    Err(error) if error.is_not_found() && attempts < MAX_CLAIM_READS => {
                        attempts += 1;
                        continue 'read;
                    }
                    Err(error) => return Err(error),
                };
                others.committed += claim.committed();
                others.spent += claim.spent;
                others.ended += claim.ended;
                others.ended_cost += claim.ended_cost;
            }
            return Ok(others);
        }
    }

    /// Writes this process's last spending as finished (its allowance no longer counts), and
    /// returns what the whole run spent as the claims then say. Also done when the ledger is
    /// dropped; calling it first reports a failure to write.
    pub fn finish(&self) -> Result<f64, StorageError> {
        self.write_finished()?;
        self.run_spent()
    }

    /// What the whole run spent, read again once every live process had time to write its claim
    /// since (call after [`Ledger::finish`]): the figure a process stopping at the budget reports.
    pub fn settled_spent(&self) -> Result<f64, StorageError> {
        std::thread::sleep(2 * CLAIM_REFRESH);
        self.run_spent()
    }

    /// Every claim's spending, once this process's claim is finished. Not the others' plus this
    /// one's: by now a process starting may have adopted this one, and would count it twice.
    fn run_spent(&self) -> Result<f64, StorageError> {
        let all = self.read_claims(false)?;
        let mine = lock(&self.written).spent;
        // What `spent` adds to this process's own from now on.
        lock(&self.state).others.spent = all.spent - mine;
        Ok(all.spent)
    }

    fn write_finished(&self) -> Result<Claim, StorageError> {
        let _writing = lock(&self.growing);
        let claim = {
            let mut state = lock(&self.state);
            state.finished = true;
            self.claim(&state)
        };
        self.write_any(&claim)?;
        if !self.store.is_bucket() {
            // Adoptable from now on, under a name no live claim has: a claim adopted a moment
            // ago still reads finished under its adopter's name until the adopter writes it, and
            // a second adopter taking it then would count its spending twice.
            let finished = finished_path(&self.claim_path);
            std::fs::rename(&self.claim_path, &finished)
                .map_err(|error| StorageError::new("renaming", &finished, error))?;
        }
        Ok(claim)
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        if lock(&self.state).finished {
            return;
        }
        if let Err(error) = self.write_finished() {
            warn!(%error, "the budget claim could not be marked finished; its allowance stays counted");
        }
    }
}

/// The prefix of a finished claim's name, the only claims a starting process adopts.
const FINISHED_PREFIX: &str = "finished-";

/// The name a finished claim of `claim` (`<writer>.json`) takes: `finished-<writer>.json`.
fn finished_path(claim: &Path) -> PathBuf {
    let name = claim
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    claim.with_file_name(format!("{FINISHED_PREFIX}{name}"))
}

fn is_finished_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with(FINISHED_PREFIX))
}

/// A claim's file: `<writer>.json` while its process runs, `finished-<writer>.json` once it
/// finished (the temp files of writes under way start with a dot).
fn is_claim(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|name| name.to_str())
        .is_none_or(|name| name.starts_with('.'));
    !hidden
        && path
            .extension()
            .is_some_and(|extension| extension == "json")
}

fn read_claim(store: &Store, path: &Path) -> Result<Claim, StorageError> {
    let bytes = store.read(path)?;
    serde_json::from_slice(&bytes).map_err(|error| {
        StorageError::new(
            "reading",
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, error),
        )
    })
}

impl Ticket {
    /// Where the conversation counts what its calls cost: part of the process's spending, and
    /// what its reservation is settled against while it runs.
    pub fn spending(&self) -> Arc<Spending> {
        Arc::clone(&self.spent)
    }

    /// The conversation ended having cost `cost` (USD), if known.
    pub fn end(self, cost: Option<f64>) {
        if let Some(cost) = cost {
            let mut state = lock(&self.ledger.state);
            state.ended += 1;
            state.ended_cost += cost;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = lock(&self.ledger.state);
        state
            .in_flight
            .retain(|reservation| !Arc::ptr_eq(&reservation.spent, &self.spent));
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What every claim in `run_dir` says its process spent (`None` when the run kept none).
pub fn spent_by_claims(run_dir: &RunDir) -> Result<Option<f64>, StorageError> {
    let paths = claim_paths(run_dir.store(), &run_dir.budget_dir())?;
    if paths.is_empty() {
        return Ok(None);
    }
    let mut spent = 0.0;
    for path in paths {
        spent += read_claim(run_dir.store(), &path)?.spent;
    }
    Ok(Some(spent))
}

/// The claims' files in `dir` (temp files of writes under way are not claims).
fn claim_paths(store: &Store, dir: &Path) -> Result<Vec<PathBuf>, StorageError> {
    Ok(store
        .list(dir)?
        .into_iter()
        .map(|name| dir.join(name))
        .filter(|path| is_claim(path))
        .collect())
}

/// The error that stops a batch at the run's budget, `not_started` of its conversations not run.
pub fn exhausted(budget: &Ledger, not_started: usize) -> RunError {
    RunError::BudgetExhausted {
        max_cost: budget.max_cost().unwrap_or_default(),
        spent: budget.spent(),
        not_started,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(run_dir: &RunDir, max_cost: f64, processes: u32) -> Arc<Ledger> {
        Ledger::open(Some(&BudgetSpec { max_cost }), run_dir, processes).unwrap()
    }

    async fn start(budget: &Arc<Ledger>) -> Ticket {
        match budget.admit().await.unwrap() {
            Admission::Start(ticket) => ticket,
            other => panic!("expected a start, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_first_conversation_runs_alone_and_then_each_reserves_the_average() {
        let dir = tempfile::tempdir().unwrap();
        let budget = open(&RunDir::new(dir.path()), 1.0, 1);
        let first = start(&budget).await;
        assert!(matches!(budget.admit().await.unwrap(), Admission::Wait));
        budget.spending().add(0.25);
        first.end(Some(0.25));
        // 0.25 spent: three more fit, each reserving 0.25.
        let held: Vec<Ticket> = vec![
            start(&budget).await,
            start(&budget).await,
            start(&budget).await,
        ];
        assert!(matches!(
            budget.admit().await.unwrap(),
            Admission::Exhausted
        ));
        drop(held);
        assert!(matches!(budget.admit().await.unwrap(), Admission::Start(_)));
    }

    #[tokio::test]
    async fn what_a_conversation_in_flight_spent_counts_once_within_its_reservation() {
        let dir = tempfile::tempdir().unwrap();
        let budget = open(&RunDir::new(dir.path()), 1.0, 1);
        let first = start(&budget).await;
        first.spending().add(0.25);
        first.end(Some(0.25));
        // Two conversations reserve 0.25 each and make their first call, of 0.125.
        let held = [start(&budget).await, start(&budget).await];
        for ticket in &held {
            ticket.spending().add(0.125);
        }
        assert!((budget.spent() - 0.5).abs() < 1e-9, "{}", budget.spent());
        // Their calls are inside their reservations: 0.75 is committed, and a fourth fits.
        // (Counted on top of them, 1.0 was, and the run stopped with a quarter unspent.)
        let fourth = start(&budget).await;
        assert!(matches!(
            budget.admit().await.unwrap(),
            Admission::Exhausted
        ));
        // Past its reservation, a conversation holds what it spent.
        drop(fourth);
        held[0].spending().add(0.375);
        assert!(matches!(
            budget.admit().await.unwrap(),
            Admission::Exhausted
        ));
        drop(held);
        assert!((budget.spent() - 0.875).abs() < 1e-9, "{}", budget.spent());
    }

    #[tokio::test]
    async fn processes_at_once_never_hold_more_than_the_budget_and_finished_ones_give_back() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let committed = |run_dir: &RunDir| -> f64 {
            std::fs::read_dir(run_dir.budget_dir())
                .unwrap()
                .map(|entry| {
                    read_claim(&Store::Volume, &entry.unwrap().path())
                        .unwrap()
                        .committed()
                })
                .sum()
        };
        let budgets: Vec<Arc<Ledger>> = (0..4).map(|_| open(&run_dir, 1.0, 4)).collect();
        assert!(committed(&run_dir) <= 1.0 + 1e-9, "{}", committed(&run_dir));
        // Each learns a conversation costs 0.1 and spends until its allowance ends, growing it
        // from what the others leave free.
        for budget in &budgets {
            let ticket = start(budget).await;
            budget.spending().add(0.1);
            ticket.end(Some(0.1));
        }
        let mut started = 4;
        for _ in 0..20 {
            for budget in &budgets {
                if let Admission::Start(ticket) = budget.admit().await.unwrap() {
                    budget.spending().add(0.1);
                    ticket.end(Some(0.1));
                    started += 1;
                }
            }
        }
        assert_eq!(
            started, 10,
            "a budget of 1.0 holds ten conversations of 0.1"
        );
        assert!(committed(&run_dir) <= 1.0 + 1e-9);
        // Finished, they say what the whole run spent; a process opened on a raised budget
        // adopts one of their claims (the run keeps four) and starts from what they spent.
        let spent: Vec<f64> = budgets.iter().map(|b| b.finish().unwrap()).collect();
        assert!((spent[3] - 1.0).abs() < 1e-9, "{spent:?}");
        drop(budgets);
        let raised = open(&run_dir, 1.5, 4);
        assert_eq!(std::fs::read_dir(run_dir.budget_dir()).unwrap().count(), 4);
        assert!((raised.spent() - 1.0).abs() < 1e-9, "{}", raised.spent());
        let mut more = 0;
        while let Admission::Start(ticket) = raised.admit().await.unwrap() {
            raised.spending().add(0.1);
            ticket.end(Some(0.1));
            more += 1;
        }
        assert_eq!(more, 5, "0.5 more holds five");
        assert!((raised.finish().unwrap() - 1.5).abs() < 1e-9);
    }

    #[tokio::test]
    async fn without_a_budget_the_ledger_only_counts() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let ledgers: Vec<Arc<Ledger>> = (0..2)
            .map(|_| Ledger::open(None, &run_dir, 2).unwrap())
            .collect();
        let mut tickets = Vec::new();
        for i in 0..40 {
            match ledgers[i % 2].admit().await.unwrap() {
                Admission::Start(ticket) => tickets.push(ticket),
                other => panic!("nothing limits the run: {other:?}"),
            }
        }
        ledgers[0].spending().add(2.5);
        ledgers[1].spending().add(1.0);
        drop(tickets);
        ledgers[0].finish().unwrap();
        assert!((ledgers[1].finish().unwrap() - 3.5).abs() < 1e-9);
    }

    #[test]
    fn a_claim_adopted_a_moment_ago_is_not_adopted_again() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let first = Ledger::open(None, &run_dir, 2).unwrap();
        first.spending().add(0.042);
        assert!((first.finish().unwrap() - 0.042).abs() < 1e-9);
        drop(first);
        // A second process adopts it: renamed to its own name, where it reads finished until
        // that process writes it (here, never: it is caught in between).
        let adopter_path = run_dir.budget_dir().join("0123456789abcdef.json");
        let finished = claim_paths(&Store::Volume, &run_dir.budget_dir()).unwrap();
        assert_eq!(finished.len(), 1);
        assert!(is_finished_name(&finished[0]), "{finished:?}");
        std::fs::rename(&finished[0], &adopter_path).unwrap();
        // A third process starting then finds no finished claim to adopt...
        let third = Ledger::open(None, &run_dir, 2).unwrap();
        assert!(
            lock(&third.state).carried.spent.abs() < 1e-12,
            "adopted nothing"
        );
        // ...so when the adopter writes its claim (carrying the same spending), the run's total
        // counts it once.
        std::fs::write(
            &adopter_path,
            r#"{"allowance":0.0,"spent":0.042,"ended":0,"endedCost":0.0,"finished":false}"#,
        )
        .unwrap();
        assert!((third.finish().unwrap() - 0.042).abs() < 1e-9);
        assert!((spent_by_claims(&run_dir).unwrap().unwrap() - 0.042).abs() < 1e-9);
    }

    #[tokio::test]
    async fn a_process_that_never_finished_keeps_its_allowance_counted() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let killed = open(&run_dir, 1.0, 2);
        let kept = lock(&killed.state).allowance;
        assert!((kept - 0.5).abs() < 1e-9, "a half share: {kept}");
        // Killed: its claim is never marked finished.
        std::mem::forget(killed);
        let next = open(&run_dir, 1.0, 2);
        let allowance = lock(&next.state).allowance;
        assert!(
            (allowance - 0.25).abs() < 1e-9,
            "half of the half left: {allowance}"
        );
    }

    /// A process starting while a finished one reads the run's spending may adopt the finished
    /// one's claim (its figures carried on under the new name): the total counts it once. (The
    /// flaw: the finished process added its own spending to the others', the adopter's among
    /// them: 0.126 USD reported of 0.1 spent.)
    #[test]
    fn a_claim_adopted_while_its_process_reads_the_total_counts_once() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let finished = Ledger::open(None, &run_dir, 2).unwrap();
        finished.spending().add(0.026);
        let other = Ledger::open(None, &run_dir, 2).unwrap();
        other.spending().add(0.074);
        assert!(
            (finished.finish().unwrap() - 0.026).abs() < 1e-9,
            "the other's unwritten"
        );
        other.refresh().unwrap();
        // A process starts and adopts the finished claim before the total is read again.
        let adopter = Ledger::open(None, &run_dir, 2).unwrap();
        assert!((lock(&adopter.state).carried.spent - 0.026).abs() < 1e-9);
        let total = finished.run_spent().unwrap();
        assert!((total - 0.1).abs() < 1e-9, "{total}");
        assert!(
            (finished.spent() - 0.1).abs() < 1e-9,
            "{}",
            finished.spent()
        );
    }

    /// The flaw this guards against: a pod stopping at the budget reported the run's spending
    /// from claims last written when their processes grew their allowances, 0.002 USD of 0.1
    /// spent, and the operator showed that.
    #[tokio::test(start_paused = true)]
    async fn a_claim_says_within_a_second_what_its_process_spent_until_it_finishes() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::new(dir.path());
        let (spender, reader) = (open(&run_dir, 1.0, 2), open(&run_dir, 1.0, 2));
        let fresh = spender.keep_fresh();
        let ticket = start(&spender).await;
        ticket.spending().add(0.125);
        // A call answered mid-conversation: not read by the others until the next write...
        assert!(reader.read_others().unwrap().spent.abs() < 1e-12);
        let written = || lock(&spender.written).spent;
        for _ in 0..20 {
            tokio::time::sleep(CLAIM_REFRESH / 4).await;
            if (written() - 0.125).abs() < 1e-9 {
                break;
            }
        }
        // ...which comes within the second, with nothing grown.
        let others = reader.read_others().unwrap();
        assert!((others.spent - 0.125).abs() < 1e-9, "{others:?}");
        ticket.end(Some(0.125));
        // Finished, its claim is under the finished name alone and the refresher stops: a write
        // under the live name beside it would count its spending twice.
        assert!((spender.finish().unwrap() - 0.125).abs() < 1e-9);
        tokio::time::timeout(2 * CLAIM_REFRESH, fresh)
            .await
            .expect("the refresher stops once its process finished")
            .unwrap();
        assert_eq!(
            claim_paths(&Store::Volume, &run_dir.budget_dir())
                .unwrap()
                .len(),
            2
        );
        assert!((reader.finish().unwrap() - 0.125).abs() < 1e-9);
    }
}

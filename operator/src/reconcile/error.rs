//! Why a reconcile failed: one variant per stage of the pipeline, with its source. Whether an
//! error is permanent (only a change of the run can fix it: the run stalls and waits) or transient
//! (retried with backoff) follows from the stage's own error type.

use kube::ResourceExt;

use super::api_error::is_refused;
use super::observe::ObserveError;
use super::validate::Invalid;
use crate::api::TrajectoryRun;
use crate::metrics::ErrorClass;

/// The stages of the pipeline that can fail, as metrics and logs name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Observe,
    Validate,
    Apply,
    Status,
}

impl Stage {
    pub const ALL: [Self; 4] = [Self::Observe, Self::Validate, Self::Apply, Self::Status];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Observe => "observe",
            Self::Validate => "validate",
            Self::Apply => "apply",
            Self::Status => "status",
        }
    }
}

/// Why a reconcile failed, by stage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("observing the children of {run}: {source}")]
    Observe {
        run: String,
        #[source]
        source: ObserveError,
    },
    #[error("validating {run}: {source}")]
    Validate {
        run: String,
        #[source]
        source: Invalid,
    },
    #[error("applying the children of {run}: {source}")]
    Apply {
        run: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of {run}: {source}")]
    Status {
        run: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    pub fn observe(run: &TrajectoryRun) -> impl FnOnce(ObserveError) -> Self {
        let run = run.name_any();
        move |source| Self::Observe { run, source }
    }

    pub fn validate(run: &TrajectoryRun) -> impl FnOnce(Invalid) -> Self {
        let run = run.name_any();
        move |source| Self::Validate { run, source }
    }

    pub fn apply(run: &TrajectoryRun) -> impl FnOnce(kube::Error) -> Self {
        let run = run.name_any();
        move |source| Self::Apply { run, source }
    }

    pub fn status(run: &TrajectoryRun) -> impl FnOnce(kube::Error) -> Self {
        let run = run.name_any();
        move |source| Self::Status { run, source }
    }

    /// True when only a change of the run can fix it.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Observe { source, .. } => source.is_permanent(),
            Self::Validate { source, .. } => source.is_permanent(),
            Self::Apply { source, .. } | Self::Status { source, .. } => is_refused(source),
        }
    }

    pub fn class(&self) -> ErrorClass {
        if self.is_permanent() {
            ErrorClass::Permanent
        } else {
            ErrorClass::Transient
        }
    }

    /// The stage that failed.
    pub fn stage(&self) -> Stage {
        match self {
            Self::Observe { .. } => Stage::Observe,
            Self::Validate { .. } => Stage::Validate,
            Self::Apply { .. } => Stage::Apply,
            Self::Status { .. } => Stage::Status,
        }
    }

    /// Whether the run's status should say that it stalled: a permanent error of any stage but
    /// the status write itself (which would fail again writing that).
    pub fn stalls(&self) -> bool {
        self.is_permanent() && !matches!(self, Self::Status { .. })
    }

    /// What the stalled run's conditions say: the cause alone (for a child the API server refused,
    /// its message names the field).
    pub fn stall_message(&self) -> String {
        match self {
            Self::Validate { source, .. } => source.to_string(),
            Self::Observe { source, .. } => source.to_string(),
            Self::Apply {
                source: kube::Error::Api(status),
                ..
            } => format!(
                "the API server refused a child of the run: {}",
                status.message
            ),
            other => other.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::core::Status;

    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            Status::failure("refused", "Refused")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn errors_are_permanent_only_when_retrying_cannot_help() {
        let apply = |code| Error::Apply {
            run: "r".into(),
            source: api_error(code),
        };
        let cases = [
            (400, true),
            (422, true),
            // RBAC and credentials get fixed without a change of the run.
            (401, false),
            (403, false),
            (404, false),
            (409, false),
            (429, false),
            (500, false),
            (503, false),
        ];
        for (code, permanent) in cases {
            assert_eq!(apply(code).is_permanent(), permanent, "HTTP {code}");
        }
        let validate = |source| Error::Validate {
            run: "r".into(),
            source,
        };
        assert!(validate(Invalid::MissingVolume).is_permanent());
        assert!(!validate(Invalid::NotStored).is_permanent());
        assert_eq!(apply(500).stage().as_str(), "apply");
        assert_eq!(apply(500).class(), ErrorClass::Transient);
    }

    #[test]
    fn a_permanent_error_stalls_the_run_unless_it_is_the_status_write() {
        let refused = || api_error(422);
        let apply = Error::Apply {
            run: "r".into(),
            source: refused(),
        };
        assert!(apply.stalls());
        assert_eq!(
            apply.stall_message(),
            "the API server refused a child of the run: refused"
        );
        let status = Error::Status {
            run: "r".into(),
            source: refused(),
        };
        assert!(status.is_permanent() && !status.stalls());
        let observe = Error::Observe {
            run: "r".into(),
            source: ObserveError::BadIndexes {
                job: "r-gen-1".into(),
                text: "x".into(),
                reason: "not a number".into(),
            },
        };
        assert!(observe.stalls());
        assert!(
            !Error::Observe {
                run: "r".into(),
                source: ObserveError::Api(api_error(503)),
            }
            .stalls()
        );
    }

    #[test]
    fn every_stage_has_a_distinct_label() {
        let labels: std::collections::BTreeSet<_> = Stage::ALL.map(Stage::as_str).into();
        assert_eq!(labels.len(), Stage::ALL.len());
    }
}

//! `trajectory-worker export RUN_DIR --format F`: a merged run's trajectories in the formats
//! trainers and trajectory tools read, from `trajectories.jsonl` and, where the run kept tokens,
//! the tokens beside it (`trajectories.tokens.jsonl`, see [`crate::training`]), a JSON line per
//! trajectory, sample or group.
//!
//! The sample formats of reinforcement-learning trainers ([`samples`]) train on ids, so a
//! trajectory whose ids are not all the server's own (`tokenization.source` other than
//! `server`) is refused, naming it, unless `--force`: then those whose ids were made again from
//! text (`retokenized`) are written and the rest left out (both counted). The conversation formats
//! (ATIF, ADP, `ShareGPT`, `OpenAI` messages) need no ids: they read the Hermes turns back into
//! calls and results ([`hermes_text`]), and ATIF adds each call's ids and logprobs where kept.

mod adp;
mod atif;
mod hermes_text;
mod messages;
mod samples;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use atif::SCHEMA_VERSION as ATIF_SCHEMA_VERSION;

/// The formats `export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// verl's agent loop: `prompt_ids`, `response_ids`, `response_mask`, `response_logprobs`,
    /// `reward_score`, `num_turns`; a line per sample.
    Verl,
    /// `SkyRL`'s generator output, a line per sample: `prompt_token_ids`, `response_ids`,
    /// `loss_masks`, `rollout_logprobs`, `rewards`, `stop_reasons`, `trajectory_ids`,
    /// `is_last_step`.
    Skyrl,
    /// slime's `Sample`: `tokens` (prompt and response), `response_length`, `loss_mask` (over
    /// the response), `rollout_log_probs`, `reward`, `status`; a line per sample.
    Slime,
    /// Atropos' `ScoredDataGroup`, a line per prompt (its samples together): `tokens`, `masks`
    /// (-100 where not trained, else the token's id), `scores`, `inference_logprobs` (1.0 where
    /// not trained).
    Atropos,
    /// prime-rl's trajectory steps (verifiers' `TrajectoryStep` tokens), a line per trajectory:
    /// each call's `prompt_ids`, `prompt_mask`, `completion_ids`, `completion_mask`,
    /// `completion_logprobs`, `is_truncated`.
    PrimeRl,
    /// Harbor's Agent Trajectory Interchange Format (`ATIF-v1.8`), a document per line: steps
    /// with tool calls, observations and per-call metrics (token ids and logprobs where kept).
    Atif,
    /// The Agent Data Protocol's standardized trajectory, a line per trajectory: alternating
    /// actions (messages, function calls) and observations.
    Adp,
    /// `ShareGPT`: `id`, `prompt_index`, `sample`, `reward`, `conversations` (the Hermes turns).
    Sharegpt,
    /// `OpenAI` chat messages with structured tool calls, and `tools`.
    Openai,
}

impl ExportFormat {
    /// Whether the format reads the tokens file (ATIF carries the ids where kept; the others
    /// that need none do not open it).
    fn reads_tokens(self) -> bool {
        self.trains_on_ids() || self == Self::Atif
    }

    /// Whether the format is made of token ids (and so refuses ids that are not the server's).
    pub fn trains_on_ids(self) -> bool {
        matches!(
            self,
            Self::Verl | Self::Skyrl | Self::Slime | Self::Atropos | Self::PrimeRl
        )
    }
}

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error(
        "{path}:{line}: trajectory {prompt_index}/{sample} has no exact ids (tokenization.source \
         {id_source:?}): these formats train on ids, and ids made again from text are not the \
         model's; run with a server that gives them (docs/training-data.md), or pass --force to \
         write those with ids made again from text and leave the rest out"
    )]
    NotExact {
        path: PathBuf,
        line: usize,
        prompt_index: u64,
        sample: u32,
        id_source: String,
    },
}

/// What an export wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ExportSummary {
    pub trajectories: u64,
    /// Lines of samples (the sample formats), else trajectories written.
    pub samples: u64,
    /// Trajectories left out for want of ids (`--force`).
    pub skipped: u64,
    /// Trajectories written with ids made again from text (`--force`).
    pub retokenized: u64,
}

/// One call's tokens, as the tokens line keeps them.
#[derive(Debug, Clone, Default, Deserialize)]
struct StepIds {
    #[serde(default)]
    conversation_index: Option<usize>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    /// The ids after the call before's prompt and completion, where the prompt extends them
    /// (read into `prompt_token_ids` by [`TokensLine::whole_prompts`]).
    #[serde(default)]
    prompt_token_ids_new: Option<Vec<u32>>,
    #[serde(default)]
    completion_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Vec<f32>,
    #[serde(default)]
    top_logprobs: Vec<Value>,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    cached_tokens: u64,
}

#[derive(Debug, Deserialize)]
struct TokensLine {
    prompt_index: u64,
    #[serde(default)]
    sample: u32,
    #[serde(default)]
    id: Option<String>,
    tokenization: Tokenization,
    #[serde(default)]
    sampling: Map<String, Value>,
    #[serde(default)]
    steps: Vec<StepIds>,
}

impl TokensLine {
    /// Sets each call's whole prompt ids where the line keeps only what it added to the call
    /// before.
    fn whole_prompts(&mut self) {
        let whole = crate::training::whole_prompt_ids(self.steps.iter().map(|step| {
            (
                step.prompt_token_ids.as_deref(),
                step.prompt_token_ids_new.as_deref(),
                step.completion_token_ids.as_deref(),
            )
        }));
        for (step, prompt) in self.steps.iter_mut().zip(whole) {
            step.prompt_token_ids = prompt;
            step.prompt_token_ids_new = None;
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
struct Tokenization {
    source: String,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

impl Tokenization {
    fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The record's keys every conversation format keeps in its free-form part.
const OUTCOME_KEYS: [&str; 5] = ["prompt_index", "sample", "completed", "partial", "reward"];

/// The values of `keys` that `record` has, for a format's free-form part.
fn copied(record: &Value, keys: &[&str]) -> Map<String, Value> {
    keys.iter()
        .filter_map(|key| Some(((*key).to_owned(), record.get(*key)?.clone())))
        .collect()
}

/// Writes the merged run in `run_dir` as `format` to `out`, a JSON line at a time.
pub fn export(
    run_dir: &Path,
    format: ExportFormat,
    force: bool,
    out: &mut impl Write,
) -> Result<ExportSummary, ExportError> {
    let records_path = run_dir.join("trajectories.jsonl");
    let tokens_path = run_dir.join("trajectories.tokens.jsonl");
    let records = open_reading(&records_path)?;
    let tokens = open_tokens(&tokens_path, format)?;
    let mut summary = ExportSummary::default();
    let mut emit = |value: &Value| {
        serde_json::to_writer(&mut *out, value)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"))
            .map_err(|source| ExportError::Io {
                action: "writing",
                path: PathBuf::from("<output>"),
                source,
            })
    };
    let mut rl = samples::RlWriter::new(format);
    let mut tokens_lines = tokens.map(BufRead::lines);
    for (number, record) in records.lines().enumerate() {
        let line = number + 1;
        let tokens = tokens_lines.as_mut().map(|lines| {
            lines.next().unwrap_or_else(|| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "fewer lines than trajectories.jsonl: the files are not of one merge",
                ))
            })
        });
        let (record, tokens) = parse_pair((&records_path, record), (&tokens_path, tokens), line)?;
        let bad_turns = |error: hermes_text::TurnError| ExportError::Line {
            path: records_path.clone(),
            line,
            message: error.to_string(),
        };
        let written = match (format, &tokens) {
            (ExportFormat::Atif, _) => {
                let turns = hermes_text::parse(&record["conversations"]).map_err(bad_turns)?;
                emit(&atif::trajectory(&record, &turns, tokens.as_ref()))?;
                1
            }
            (ExportFormat::Adp, _) => {
                let turns = hermes_text::parse(&record["conversations"]).map_err(bad_turns)?;
                emit(&adp::trajectory(&record, &turns))?;
                1
            }
            (ExportFormat::Openai, _) => {
                let turns = hermes_text::parse(&record["conversations"]).map_err(bad_turns)?;
                emit(&messages::openai(&record, &turns))?;
                1
            }
            (ExportFormat::Sharegpt, _) => {
                emit(&messages::sharegpt(&record))?;
                1
            }
            (_, None) => unreachable!("the sample formats need the tokens file, opened above"),
            (_, Some(tokens)) if force && tokens.tokenization.source == "retokenized" => {
                summary.retokenized += 1;
                rl.trajectory(&record, tokens, &mut emit)?
            }
            (_, Some(tokens)) if tokens.tokenization.source != "server" => {
                if force {
                    summary.skipped += 1;
                    continue;
                }
                return Err(ExportError::NotExact {
                    path: tokens_path,
                    line,
                    prompt_index: tokens.prompt_index,
                    sample: tokens.sample,
                    id_source: tokens.tokenization.source.clone(),
                });
            }
            (_, Some(tokens)) => rl.trajectory(&record, tokens, &mut emit)?,
        };
        summary.trajectories += 1;
        summary.samples += written;
    }
    rl.finish(&mut emit)?;
    Ok(summary)
}

fn open_reading(path: &Path) -> Result<BufReader<std::fs::File>, ExportError> {
    std::fs::File::open(path)
        .map(BufReader::new)
        .map_err(|source| ExportError::Io {
            action: "reading",
            path: path.to_owned(),
            source,
        })
}

/// The tokens file, if `format` reads it: required by the sample formats, optional for ATIF.
fn open_tokens(
    tokens_path: &Path,
    format: ExportFormat,
) -> Result<Option<BufReader<std::fs::File>>, ExportError> {
    Ok(
        match format.reads_tokens().then(|| open_reading(tokens_path)) {
            None => None,
            Some(Ok(tokens)) => Some(tokens),
            Some(Err(ExportError::Io { source, .. }))
                if source.kind() == std::io::ErrorKind::NotFound && !format.trains_on_ids() =>
            {
                None
            }
            Some(Err(ExportError::Io { path, source, .. }))
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(ExportError::Line {
                    path,
                    line: 0,
                    message: "missing: the run did not keep tokens (spec.model.tokens)".to_owned(),
                });
            }
            Some(Err(other)) => return Err(other),
        },
    )
}

/// The trajectory and the tokens line (if the run kept tokens) of line `line` of the two files,
/// checked to be of the same conversation.
fn parse_pair(
    (records_path, record): (&Path, std::io::Result<String>),
    (tokens_path, tokens): (&Path, Option<std::io::Result<String>>),
    line: usize,
) -> Result<(Value, Option<TokensLine>), ExportError> {
    let read = |result: std::io::Result<String>, path: &Path| {
        result.map_err(|source| ExportError::Io {
            action: "reading",
            path: path.to_owned(),
            source,
        })
    };
    let bad = |path: &Path, message: String| ExportError::Line {
        path: path.to_owned(),
        line,
        message,
    };
    let record: Value = serde_json::from_str(&read(record, records_path)?)
        .map_err(|err| bad(records_path, err.to_string()))?;
    let Some(tokens) = tokens else {
        return Ok((record, None));
    };
    let mut tokens: TokensLine = serde_json::from_str(&read(tokens, tokens_path)?)
        .map_err(|err| bad(tokens_path, err.to_string()))?;
    tokens.whole_prompts();
    let key = (
        record["prompt_index"].as_u64().unwrap_or(u64::MAX),
        record["sample"]
            .as_u64()
            .and_then(|sample| u32::try_from(sample).ok())
            .unwrap_or(0),
    );
    if key != (tokens.prompt_index, tokens.sample) {
        return Err(bad(
            tokens_path,
            format!(
                "the tokens of {}/{} beside the trajectory of {}/{}: the files are not of one merge",
                tokens.prompt_index, tokens.sample, key.0, key.1
            ),
        ));
    }
    Ok((record, Some(tokens)))
}

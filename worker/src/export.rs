//! `trajectory-worker export RUN_DIR --format F`: a merged run's trajectories as the samples a
//! reinforcement-learning trainer reads, from `trajectories.jsonl` and the tokens beside it
//! (`trajectories.tokens.jsonl`, see [`crate::training`]).
//!
//! A conversation's model calls become samples the way prime-rl merges them: calls are joined
//! into one sample while each call's prompt ids extend the sample so far (its prompt, then every
//! earlier completion and the tool results between them), and a call whose prompt does not
//! (a chat template that renders an earlier reply otherwise than it was sampled) starts a new
//! sample. The loss mask is 1 on the model's sampled tokens only: the tokens between two calls
//! (tool results, the template's framing) are in the response with mask 0, never trained as the
//! model's.
//!
//! Every format here trains on ids, so a trajectory whose ids are not all the server's own
//! (`tokenization.source` other than `server`) is refused, naming it, unless `--force` skips it
//! (counted).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The sample shapes `export` writes.
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
         leave such trajectories out"
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
    pub samples: u64,
    /// Trajectories left out for want of exact ids (`--force`).
    pub skipped: u64,
}

/// One call's ids, as the tokens line keeps them.
#[derive(Debug, Clone, Default, Deserialize)]
struct StepIds {
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    completion_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Vec<f32>,
    #[serde(default)]
    finish_reason: Option<String>,
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
    steps: Vec<StepIds>,
}

#[derive(Debug, Deserialize)]
struct Tokenization {
    source: String,
}

/// One trainable sequence: a prompt and a response of sampled and in-between tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// 1 on tokens the model sampled, 0 on those between its calls.
    pub mask: Vec<u8>,
    /// The sampled tokens' logprobs; 0 on masked tokens.
    pub logprobs: Vec<f32>,
    /// Model calls joined into it.
    pub calls: u32,
    /// The finish reason of its last call.
    pub finish_reason: Option<String>,
}

/// The samples of a conversation's calls (see the module's documentation). Calls without both
/// ids are skipped (a trajectory reaches here only when all have them).
fn samples(steps: &[StepIds]) -> Vec<Sample> {
    let mut done = Vec::new();
    let mut current: Option<Sample> = None;
    for step in steps {
        let (Some(prompt), Some(completion)) = (&step.prompt_token_ids, &step.completion_token_ids)
        else {
            continue;
        };
        let logprobs = if step.logprobs.len() == completion.len() {
            step.logprobs.clone()
        } else {
            vec![0.0; completion.len()]
        };
        let extends = current.as_ref().is_some_and(|sample| {
            let so_far = sample.prompt.len() + sample.response.len();
            prompt.len() >= so_far
                && prompt[..sample.prompt.len()] == sample.prompt[..]
                && prompt[sample.prompt.len()..so_far] == sample.response[..]
        });
        if let Some(sample) = current.as_mut().filter(|_| extends) {
            let between = &prompt[sample.prompt.len() + sample.response.len()..];
            sample.response.extend_from_slice(between);
            sample.mask.extend(std::iter::repeat_n(0, between.len()));
            sample
                .logprobs
                .extend(std::iter::repeat_n(0.0, between.len()));
            sample.response.extend_from_slice(completion);
            sample.mask.extend(std::iter::repeat_n(1, completion.len()));
            sample.logprobs.extend(logprobs);
            sample.calls += 1;
            sample.finish_reason.clone_from(&step.finish_reason);
        } else {
            done.extend(current.take());
            current = Some(Sample {
                prompt: prompt.clone(),
                response: completion.clone(),
                mask: vec![1; completion.len()],
                logprobs,
                calls: 1,
                finish_reason: step.finish_reason.clone(),
            });
        }
    }
    done.extend(current);
    done
}

/// What a trajectory contributes besides its ids.
struct Trajectory<'a> {
    id: String,
    prompt_index: u64,
    reward: Option<f64>,
    samples: &'a [Sample],
}

fn sample_line(format: ExportFormat, trajectory: &Trajectory<'_>, index: usize) -> Value {
    let sample = &trajectory.samples[index];
    let last = index + 1 == trajectory.samples.len();
    let reward = trajectory.reward;
    match format {
        ExportFormat::Verl => json!({
            "id": trajectory.id,
            "prompt_ids": sample.prompt,
            "response_ids": sample.response,
            "response_mask": sample.mask,
            "response_logprobs": sample.logprobs,
            "reward_score": reward,
            "num_turns": sample.calls,
        }),
        ExportFormat::Skyrl => json!({
            "trajectory_ids": trajectory.id,
            "prompt_token_ids": sample.prompt,
            "response_ids": sample.response,
            "loss_masks": sample.mask,
            "rollout_logprobs": sample.logprobs,
            "rewards": reward,
            "stop_reasons": sample.finish_reason,
            "is_last_step": last,
        }),
        ExportFormat::Slime => {
            let mut tokens = sample.prompt.clone();
            tokens.extend_from_slice(&sample.response);
            json!({
                "id": trajectory.id,
                "tokens": tokens,
                "response_length": sample.response.len(),
                "loss_mask": sample.mask,
                "rollout_log_probs": sample.logprobs,
                "reward": reward,
                "status": if sample.finish_reason.as_deref() == Some("length") { "truncated" } else { "completed" },
            })
        }
        ExportFormat::Atropos | ExportFormat::PrimeRl => {
            unreachable!("written per prompt or per trajectory")
        }
    }
}

/// Atropos' tokens, masks and logprobs of one sample: prompt and response, -100 and 1.0 where
/// nothing is trained.
fn atropos_sample(sample: &Sample) -> (Vec<u32>, Vec<i64>, Vec<f32>) {
    let mut tokens = sample.prompt.clone();
    tokens.extend_from_slice(&sample.response);
    let mut masks: Vec<i64> = vec![-100; sample.prompt.len()];
    let mut logprobs = vec![1.0; sample.prompt.len()];
    for ((token, trained), logprob) in sample
        .response
        .iter()
        .zip(&sample.mask)
        .zip(&sample.logprobs)
    {
        masks.push(if *trained == 1 {
            i64::from(*token)
        } else {
            -100
        });
        logprobs.push(if *trained == 1 { *logprob } else { 1.0 });
    }
    (tokens, masks, logprobs)
}

fn prime_rl_line(trajectory: &Trajectory<'_>, steps: &[StepIds]) -> Value {
    let steps: Vec<Value> = steps
        .iter()
        .filter_map(|step| {
            let (prompt, completion) = (
                step.prompt_token_ids.as_ref()?,
                step.completion_token_ids.as_ref()?,
            );
            Some(json!({"tokens": {
                "prompt_ids": prompt,
                "prompt_mask": vec![0u8; prompt.len()],
                "completion_ids": completion,
                "completion_mask": vec![1u8; completion.len()],
                "completion_logprobs": step.logprobs,
                "is_truncated": step.finish_reason.as_deref() == Some("length"),
            }}))
        })
        .collect();
    json!({"id": trajectory.id, "reward": trajectory.reward, "steps": steps})
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
    let open = |path: &Path| {
        std::fs::File::open(path)
            .map(BufReader::new)
            .map_err(|source| ExportError::Io {
                action: "reading",
                path: path.to_owned(),
                source,
            })
    };
    let records = open(&records_path)?;
    let tokens = open(&tokens_path).map_err(|err| match err {
        ExportError::Io { path, source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            ExportError::Line {
                path,
                line: 0,
                message: "missing: the run did not keep tokens (spec.model.tokens)".to_owned(),
            }
        }
        other => other,
    })?;
    let mut summary = ExportSummary::default();
    let write_line = |out: &mut dyn Write, value: &Value| {
        serde_json::to_writer(&mut *out, value)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"))
            .map_err(|source| ExportError::Io {
                action: "writing",
                path: PathBuf::from("<output>"),
                source,
            })
    };
    // Atropos groups a prompt's samples: the group so far and its prompt.
    let mut group: Option<(u64, Vec<Value>)> = None;
    let mut lines = records.lines().zip(tokens.lines()).enumerate();
    for (number, (record, tokens)) in lines.by_ref() {
        let line = number + 1;
        let (record, tokens) = parse_pair((&records_path, record), (&tokens_path, tokens), line)?;
        let key = (tokens.prompt_index, tokens.sample);
        if tokens.tokenization.source != "server" {
            if force {
                summary.skipped += 1;
                continue;
            }
            return Err(ExportError::NotExact {
                path: tokens_path,
                line,
                prompt_index: key.0,
                sample: key.1,
                id_source: tokens.tokenization.source,
            });
        }
        let samples = samples(&tokens.steps);
        let trajectory = Trajectory {
            id: tokens
                .id
                .clone()
                .unwrap_or_else(|| format!("{}-{}", key.0, key.1)),
            prompt_index: key.0,
            reward: record["reward"].as_f64(),
            samples: &samples,
        };
        summary.trajectories += 1;
        summary.samples += samples.len() as u64;
        match format {
            ExportFormat::PrimeRl => write_line(out, &prime_rl_line(&trajectory, &tokens.steps))?,
            ExportFormat::Atropos => {
                if let Some((prompt, members)) =
                    group.take_if(|(prompt, _)| *prompt != trajectory.prompt_index)
                {
                    write_line(out, &atropos_group(prompt, &members))?;
                }
                let members = &mut group
                    .get_or_insert_with(|| (trajectory.prompt_index, Vec::new()))
                    .1;
                for sample in &samples {
                    let (tokens, masks, logprobs) = atropos_sample(sample);
                    members.push(json!({"tokens": tokens, "masks": masks, "score": trajectory.reward.unwrap_or(0.0), "inference_logprobs": logprobs}));
                }
            }
            _ => {
                for index in 0..samples.len() {
                    write_line(out, &sample_line(format, &trajectory, index))?;
                }
            }
        }
    }
    if let Some((prompt, members)) = group {
        write_line(out, &atropos_group(prompt, &members))?;
    }
    Ok(summary)
}

/// The trajectory and the tokens line of line `line` of the two files, checked to be of the
/// same conversation.
fn parse_pair(
    (records_path, record): (&Path, std::io::Result<String>),
    (tokens_path, tokens): (&Path, std::io::Result<String>),
    line: usize,
) -> Result<(Value, TokensLine), ExportError> {
    let read = |result: std::io::Result<String>, path: &Path| {
        result.map_err(|source| ExportError::Io {
            action: "reading",
            path: path.to_owned(),
            source,
        })
    };
    let record = read(record, records_path)?;
    let tokens = read(tokens, tokens_path)?;
    let bad = |path: &Path, message: String| ExportError::Line {
        path: path.to_owned(),
        line,
        message,
    };
    let record: Value =
        serde_json::from_str(&record).map_err(|err| bad(records_path, err.to_string()))?;
    let tokens: TokensLine =
        serde_json::from_str(&tokens).map_err(|err| bad(tokens_path, err.to_string()))?;
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
    Ok((record, tokens))
}

/// One Atropos `ScoredDataGroup` of a prompt's samples.
fn atropos_group(prompt_index: u64, members: &[Value]) -> Value {
    let field =
        |key: &str| -> Vec<Value> { members.iter().map(|member| member[key].clone()).collect() };
    json!({
        "prompt_index": prompt_index,
        "tokens": field("tokens"),
        "masks": field("masks"),
        "scores": field("score"),
        "inference_logprobs": field("inference_logprobs"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(prompt: &[u32], completion: &[u32]) -> StepIds {
        StepIds {
            prompt_token_ids: Some(prompt.to_vec()),
            completion_token_ids: Some(completion.to_vec()),
            logprobs: completion.iter().map(|_| -0.5).collect(),
            finish_reason: Some("tool_calls".into()),
        }
    }

    #[test]
    fn calls_join_while_each_prompt_extends_the_sample_and_split_where_one_does_not() {
        let steps = [
            step(&[1, 2], &[3, 4]),
            // Its prompt: the first prompt, the reply, then a tool result (7, 8).
            step(&[1, 2, 3, 4, 7, 8], &[9]),
            // The template rendered the earlier reply otherwise: a new sample.
            step(&[1, 2, 30, 4, 7, 8, 9, 5], &[6]),
        ];
        let samples = samples(&steps);
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].prompt, vec![1, 2]);
        assert_eq!(samples[0].response, vec![3, 4, 7, 8, 9]);
        assert_eq!(
            samples[0].mask,
            vec![1, 1, 0, 0, 1],
            "the tool's tokens are not trained"
        );
        assert_eq!(samples[0].logprobs, vec![-0.5, -0.5, 0.0, 0.0, -0.5]);
        assert_eq!(samples[0].calls, 2);
        assert_eq!(samples[1].prompt, vec![1, 2, 30, 4, 7, 8, 9, 5]);
        assert_eq!(samples[1].mask, vec![1]);
    }

    #[test]
    fn atropos_masks_what_is_not_trained_with_minus_100_and_logprob_one() {
        let sample = &samples(&[step(&[1], &[2]), step(&[1, 2, 5], &[6])])[0];
        let (tokens, masks, logprobs) = atropos_sample(sample);
        assert_eq!(tokens, vec![1, 2, 5, 6]);
        assert_eq!(masks, vec![-100, 2, -100, 6]);
        assert_eq!(logprobs, vec![1.0, -0.5, 1.0, -0.5]);
    }
}

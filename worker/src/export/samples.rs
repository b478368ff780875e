//! The reinforcement-learning trainers' sample shapes (verl, `SkyRL`, slime, Atropos,
//! prime-rl), made from the kept token ids.
//!
//! A conversation's model calls become samples the way prime-rl merges them: calls are joined
//! into one sample while each call's prompt ids extend the sample so far (its prompt, then every
//! earlier completion and the tool results between them), and a call whose prompt does not
//! (a chat template that renders an earlier reply otherwise than it was sampled) starts a new
//! sample. The loss mask is 1 on the model's sampled tokens only: the tokens between two calls
//! (tool results, the template's framing) are in the response with mask 0, never trained as the
//! model's.

use serde_json::{Value, json};

use super::{ExportError, ExportFormat, StepIds, TokensLine};

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
        _ => unreachable!("{format:?} is written per prompt or per trajectory, or has no samples"),
    }
}

/// Writes the lines of the sample formats, a trajectory at a time; Atropos' groups gather a
/// prompt's trajectories, so a group is written when the next prompt's begins, or at the end.
pub struct RlWriter {
    format: ExportFormat,
    group: Option<(u64, Vec<Value>)>,
}

impl RlWriter {
    pub fn new(format: ExportFormat) -> Self {
        Self {
            format,
            group: None,
        }
    }

    /// Writes one trajectory's samples through `emit`; returns how many it had.
    pub fn trajectory(
        &mut self,
        record: &Value,
        tokens: &TokensLine,
        emit: &mut impl FnMut(&Value) -> Result<(), ExportError>,
    ) -> Result<u64, ExportError> {
        let samples = samples(&tokens.steps);
        let trajectory = Trajectory {
            id: tokens
                .id
                .clone()
                .unwrap_or_else(|| format!("{}-{}", tokens.prompt_index, tokens.sample)),
            prompt_index: tokens.prompt_index,
            reward: record["reward"].as_f64(),
            samples: &samples,
        };
        match self.format {
            ExportFormat::PrimeRl => emit(&prime_rl_line(&trajectory, &tokens.steps))?,
            ExportFormat::Atropos => {
                if let Some((prompt, members)) = self
                    .group
                    .take_if(|(prompt, _)| *prompt != trajectory.prompt_index)
                {
                    emit(&atropos_group(prompt, &members))?;
                }
                let members = &mut self
                    .group
                    .get_or_insert_with(|| (trajectory.prompt_index, Vec::new()))
                    .1;
                for sample in &samples {
                    let (tokens, masks, logprobs) = atropos_sample(sample);
                    members.push(json!({"tokens": tokens, "masks": masks, "score": trajectory.reward.unwrap_or(0.0), "inference_logprobs": logprobs}));
                }
            }
            format => {
                for index in 0..samples.len() {
                    emit(&sample_line(format, &trajectory, index))?;
                }
            }
        }
        Ok(samples.len() as u64)
    }

    /// Writes what is still gathered (Atropos' last group).
    pub fn finish(
        self,
        emit: &mut impl FnMut(&Value) -> Result<(), ExportError>,
    ) -> Result<(), ExportError> {
        match self.group {
            Some((prompt, members)) => emit(&atropos_group(prompt, &members)),
            None => Ok(()),
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
            ..StepIds::default()
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

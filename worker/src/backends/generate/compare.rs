//! The CPU's forward pass against another device's on the same GGUF file:
//! whether a difference in generated text is a bug or a near-tie.
//!
//! On an H100, greedy `generate` on CUDA and on the CPU parted at the 5th
//! token of a 2-block cut of SmolLM2 ("( and I I I," against "( and I
//! Iensely,"). Two correct implementations sum in different orders (and
//! CUDA quantizes activations its own way), so their logits differ a
//! little; on a cut model, whose logits are flat, a little is enough to
//! swap two candidates. Here both devices are fed the same tokens (the
//! CPU's greedy choices, teacher-forced), and every step's logits are
//! compared: whether the top token agrees, how many of the top five are
//! shared, the largest difference of any logit, and how far the CPU's top
//! token led its runner-up. A disagreement where the lead is within the
//! difference is a near-tie; one where the lead is larger than anything
//! the devices differ by is a bug.
//!
//! `berth-worker --compare-devices FILE --device cuda:0` prints it as
//! JSON (the GPU script runs it; `docs/gpu.md` has its figures).

use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{Value, json};

use super::gguf::{md_str, parse_gguf, tokenizer_from_gguf};
use super::model::{Llama, Sequence};
use super::request::{Message, Role};
use super::template::ChatMl;

/// How many of the top logits are compared per step.
const TOP: usize = 5;

/// One step's comparison.
#[derive(Debug, Clone, PartialEq)]
struct Step {
    /// The CPU's top token, and the other device's.
    cpu: u32,
    other: u32,
    /// Of the CPU's top five, how many the other device has in its own.
    shared_top: usize,
    max_diff: f32,
    /// The CPU's top logit less its second.
    lead: f32,
}

/// The indices of the `n` largest values, largest first.
fn top(values: &[f32], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    order.truncate(n);
    order
}

fn step_of(cpu: &[f32], other: &[f32]) -> Step {
    let (a, b) = (top(cpu, TOP), top(other, TOP));
    Step {
        cpu: a[0] as u32,
        other: b[0] as u32,
        shared_top: a.iter().filter(|i| b.contains(i)).count(),
        max_diff: cpu
            .iter()
            .zip(other)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max),
        lead: a
            .get(1)
            .map_or(f32::INFINITY, |&second| cpu[a[0]] - cpu[second]),
    }
}

/// The verdict on the steps: every top token agrees; or each that does not
/// was a near-tie (the CPU's lead at most twice the largest difference
/// there); or the first step that was not, which is a bug to chase.
fn verdict(steps: &[Step]) -> Value {
    let parted: Vec<(usize, &Step)> = steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.cpu != s.other)
        .collect();
    match parted.iter().find(|(_, s)| s.lead > 2.0 * s.max_diff) {
        _ if parted.is_empty() => json!({ "verdict": "agree" }),
        None => json!({
            "verdict": "near_ties",
            "parted_at": parted.iter().map(|(i, _)| i).collect::<Vec<_>>(),
        }),
        Some((i, s)) => json!({
            "verdict": "bug",
            "step": i,
            "why": format!(
                "at step {i} the CPU's top token ({}) led by {:.4}, yet the other device chose {} \
                 while no logit differed by more than {:.4}",
                s.cpu, s.lead, s.other, s.max_diff
            ),
        }),
    }
}

fn logits(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_device(&Device::Cpu)?.to_vec1::<f32>()
}

/// Compares the CPU with `other` on `file`, over `prompt` (one user
/// message, in the file's ChatML) and `steps` greedy tokens.
pub fn compare_devices(
    file: &Path,
    prompt: &str,
    steps: usize,
    other: &Device,
) -> Result<Value, String> {
    let shown = file.display().to_string();
    let data = std::fs::read(file).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
    let read = || parse_gguf(&data, &shown, &crate::Progress::default());
    let content = read()?;
    let template = md_str(&content.metadata, "tokenizer.chat_template")
        .ok_or_else(|| format!("`{shown}` has no chat template"))?;
    let chat = ChatMl::from_template(template)?;
    let tokenizer = tokenizer_from_gguf(&content)?;
    let text = chat.render(&[Message {
        role: Role::User,
        content: prompt.into(),
    }]);
    let tokens = tokenizer
        .encode(text, false)
        .map_err(|e| format!("cannot tokenize the prompt: {e}"))?
        .get_ids()
        .to_vec();
    let model = |device: &Device| -> Result<Llama, String> {
        let content = read()?;
        Llama::from_gguf(content, &mut std::io::Cursor::new(&data), device)
            .map_err(|e| format!("cannot build the model on {device:?}: {e}"))
    };
    let (cpu, dev) = (model(&Device::Cpu)?, model(other)?);
    let run = || -> candle_core::Result<Vec<Step>> {
        let (mut a, mut b) = (Sequence::default(), Sequence::default());
        let mut la = logits(&cpu.prefill(&mut a, &tokens)?)?;
        let mut lb = logits(&dev.prefill(&mut b, &tokens)?)?;
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            let step = step_of(&la, &lb);
            let next = step.cpu;
            out.push(step);
            la = logits(&cpu.step(&mut [&mut a], &[next])?.squeeze(0)?)?;
            lb = logits(&dev.step(&mut [&mut b], &[next])?.squeeze(0)?)?;
        }
        Ok(out)
    };
    let steps = run().map_err(|e| format!("running the model: {e}"))?;
    let mut out = verdict(&steps);
    out["prompt_tokens"] = json!(tokens.len());
    out["steps"] = json!(steps.len());
    out["top1_agree"] = json!(steps.iter().filter(|s| s.cpu == s.other).count());
    out["top5_shared_mean"] =
        json!(steps.iter().map(|s| s.shared_top as f64).sum::<f64>() / steps.len().max(1) as f64);
    out["max_logit_diff"] = json!(steps.iter().map(|s| s.max_diff).fold(0.0, f32::max));
    out["min_lead"] = json!(steps.iter().map(|s| s.lead).fold(f32::INFINITY, f32::min));
    out["cpu_tokens"] = json!(steps.iter().map(|s| s.cpu).collect::<Vec<_>>());
    out["other_tokens"] = json!(steps.iter().map(|s| s.other).collect::<Vec<_>>());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(cpu: u32, other: u32, max_diff: f32, lead: f32) -> Step {
        Step {
            cpu,
            other,
            shared_top: 5,
            max_diff,
            lead,
        }
    }

    #[test]
    fn a_step_compares_top_tokens_and_differences() {
        let cpu = [0.0, 3.0, 2.9, 1.0, -1.0, 0.5, 0.1];
        let other = [0.0, 2.95, 2.97, 1.0, -1.0, 0.5, 0.1];
        let s = step_of(&cpu, &other);
        assert_eq!((s.cpu, s.other), (1, 2));
        assert_eq!(s.shared_top, 5);
        assert!((s.max_diff - 0.07).abs() < 1e-5, "{s:?}");
        assert!((s.lead - 0.1).abs() < 1e-5, "{s:?}");
    }

    #[test]
    fn a_swap_within_the_difference_is_a_near_tie_and_beyond_it_a_bug() {
        assert_eq!(verdict(&[step(1, 1, 0.01, 2.0)])["verdict"], "agree");
        let ties = verdict(&[step(1, 1, 0.01, 2.0), step(4, 7, 0.05, 0.03)]);
        assert_eq!(ties["verdict"], "near_ties");
        assert_eq!(ties["parted_at"], json!([1]));
        let bug = verdict(&[step(1, 1, 0.01, 2.0), step(4, 7, 0.05, 1.5)]);
        assert_eq!(bug["verdict"], "bug");
        assert!(
            bug["why"].as_str().unwrap().contains("led by 1.5000"),
            "{bug}"
        );
    }
}

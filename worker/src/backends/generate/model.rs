//! The Llama forward pass, with each sequence's state apart from the weights,
//! so that several sequences decode in one pass.
//!
//! candle's `quantized_llama::ModelWeights` keeps one KV cache and one
//! position inside the model: one sequence at a time. Here the weights are
//! shared and read-only, and a [`Sequence`] holds its own cache and
//! position. A decode step for B sequences runs every weight matrix once
//! over B rows (a matrix-vector product becomes a matrix-matrix one: the
//! weights are read from memory once for all of them, which is what bounds
//! decoding on a CPU); attention, which is each sequence's own, runs per
//! sequence over its own cache. The operations are candle's, in candle's
//! order, and every one of them is row-independent, so a sequence decoded
//! in a batch gets the logits it gets alone.

use std::io::{Read, Seek};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, IndexOp, Result, Tensor};

use super::q4_1::Linear;

/// Longest sequence (prompt and reply) a model is run at.
pub(super) const MAX_SEQ_LEN: usize = 4096;

struct Layer {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    attn_norm: Tensor,
    ffn_norm: Tensor,
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

/// A Llama-architecture model's weights: shared by every sequence.
pub(super) struct Llama {
    embeddings: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    output: Linear,
    eps: f32,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    /// NEOX (pairs `i`, `i + d/2`) rather than interleaved (`2i`, `2i + 1`)
    /// rotary embeddings, as llama.cpp decides by architecture.
    rope_neox: bool,
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    device: Device,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("layers", &self.layers.len())
            .field("n_head", &self.n_head)
            .field("n_kv_head", &self.n_kv_head)
            .finish_non_exhaustive()
    }
}

/// One sequence's state: its keys and values so far, per layer.
#[derive(Default)]
pub(super) struct Sequence {
    cache: Vec<Option<(Tensor, Tensor)>>,
    /// Tokens already through the model.
    len: usize,
}

impl Llama {
    /// Reads the weights a GGUF file describes, as candle's
    /// `ModelWeights::from_gguf` does (dense Llama; no mixture of experts).
    pub(super) fn from_gguf<R: Read + Seek>(
        ct: gguf_file::Content,
        reader: &mut R,
        device: &Device,
    ) -> Result<Llama> {
        let md = |key: &str| {
            ct.metadata
                .get(key)
                .ok_or_else(|| candle_core::Error::Msg(format!("cannot find {key} in metadata")))
        };
        if md("llama.expert_count")
            .and_then(|v| v.to_u32())
            .unwrap_or(0)
            > 0
        {
            candle_core::bail!("mixture-of-experts models are not supported");
        }
        let n_head = md("llama.attention.head_count")?.to_u32()? as usize;
        let n_kv_head = md("llama.attention.head_count_kv")?.to_u32()? as usize;
        let blocks = md("llama.block_count")?.to_u32()? as usize;
        let embedding = md("llama.embedding_length")?.to_u32()? as usize;
        let rope_dim = md("llama.rope.dimension_count")?.to_u32()? as usize;
        let eps = md("llama.attention.layer_norm_rms_epsilon")?.to_f32()?;
        let freq_base = md("llama.rope.freq_base")
            .and_then(|v| v.to_f32())
            .unwrap_or(10000.0);
        let arch = md("general.architecture")
            .and_then(|v| v.to_string().cloned())
            .unwrap_or_default();
        // llama.cpp's NEOX architectures; Llama itself is interleaved.
        let rope_neox = matches!(
            arch.as_str(),
            "qwen" | "qwen2" | "qwen3" | "falcon" | "phi2" | "phi3" | "stablelm" | "starcoder2"
        );
        if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 || embedding % n_head != 0 {
            candle_core::bail!(
                "inconsistent attention shape: {n_head} heads, {n_kv_head} key-value heads, \
                 embedding {embedding}"
            );
        }
        let (cos, sin) = rotary_tables(rope_dim, freq_base, device)?;
        let mut tensor = |name: &str| ct.tensor(reader, name, device);
        let embeddings_q = tensor("token_embd.weight")?;
        let embeddings = embeddings_q.dequantize(device)?;
        let norm = tensor("output_norm.weight")?.dequantize(device)?;
        let output = match tensor("output.weight") {
            Ok(t) => t,
            Err(_) => embeddings_q,
        };
        let mut layers = Vec::with_capacity(blocks);
        for i in 0..blocks {
            let mut q = |what: &str| -> Result<Linear> {
                Linear::new(tensor(&format!("blk.{i}.{what}.weight"))?)
            };
            let (wq, wk, wv, wo) = (q("attn_q")?, q("attn_k")?, q("attn_v")?, q("attn_output")?);
            let (w1, w2, w3) = (q("ffn_gate")?, q("ffn_down")?, q("ffn_up")?);
            layers.push(Layer {
                wq,
                wk,
                wv,
                wo,
                w1,
                w2,
                w3,
                attn_norm: tensor(&format!("blk.{i}.attn_norm.weight"))?.dequantize(device)?,
                ffn_norm: tensor(&format!("blk.{i}.ffn_norm.weight"))?.dequantize(device)?,
            });
        }
        Ok(Llama {
            embeddings,
            layers,
            norm,
            output: Linear::new(output)?,
            eps,
            n_head,
            n_kv_head,
            head_dim: embedding / n_head,
            rope_neox,
            cos,
            sin,
            neg_inf: Tensor::new(f32::NEG_INFINITY, device)?,
            device: device.clone(),
        })
    }

    pub(super) fn device(&self) -> &Device {
        &self.device
    }

    /// Runs every kernel a request will: a prefill of `tokens` (the mask,
    /// several rows), then one decode step of two sequences together (a
    /// batched step), so no request waits for what a first run costs.
    pub(super) fn warm_up(&self, tokens: &[u32]) -> Result<()> {
        let (mut a, mut b) = (Sequence::default(), Sequence::default());
        let first = self
            .prefill(&mut a, tokens)?
            .argmax(0)?
            .to_scalar::<u32>()?;
        self.prefill(&mut b, &tokens[..1])?;
        self.step(&mut [&mut a, &mut b], &[first, first])?
            .to_vec2::<f32>()
            .map(drop)
    }

    /// Feeds `tokens` (a prompt, or a chunk of one) to `seq`; the logits
    /// after its last token, `[vocab]`.
    pub(super) fn prefill(&self, seq: &mut Sequence, tokens: &[u32]) -> Result<Tensor> {
        let input = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        self.forward(&input, &mut [seq])?.squeeze(0)
    }

    /// One decode step for several sequences at once: `tokens[i]` is the
    /// next token of `seqs[i]`. The logits of each, `[B, vocab]`.
    pub(super) fn step(&self, seqs: &mut [&mut Sequence], tokens: &[u32]) -> Result<Tensor> {
        let input = Tensor::new(tokens, &self.device)?.unsqueeze(1)?;
        self.forward(&input, seqs)
    }

    /// `input` is `[B, T]` tokens, row `b` for `seqs[b]`; returns the logits
    /// after each row's last token, `[B, vocab]`.
    fn forward(&self, input: &Tensor, seqs: &mut [&mut Sequence]) -> Result<Tensor> {
        let (batch, t) = input.dims2()?;
        if batch != seqs.len() {
            candle_core::bail!("{batch} rows of tokens for {} sequences", seqs.len());
        }
        if let Some(seq) = seqs.iter().find(|s| s.len + t > MAX_SEQ_LEN) {
            candle_core::bail!(
                "a sequence of {} tokens is past the model's {MAX_SEQ_LEN}",
                seq.len + t
            );
        }
        for seq in seqs.iter_mut() {
            seq.cache.resize(self.layers.len(), None);
        }
        let hidden = self.embeddings.dim(1)?;
        let mut x = self
            .embeddings
            .index_select(&input.flatten_all()?, 0)?
            .reshape((batch, t, hidden))?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, self.eps)?;
            let attn = self.attention(layer, l, &h, seqs)?;
            x = (attn + x)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, self.eps)?;
            let gate = candle_nn::ops::silu(&layer.w1.forward(&h)?)?;
            let mlp = layer.w2.forward(&(gate * layer.w3.forward(&h)?)?)?;
            x = (mlp + x)?;
        }
        for seq in seqs.iter_mut() {
            seq.len += t;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, self.eps)?;
        self.output.forward(&x.i((.., t - 1, ..))?.contiguous()?)
    }

    /// Attention for layer `l`: the projections over all rows at once, then
    /// each sequence against its own cache.
    fn attention(
        &self,
        layer: &Layer,
        l: usize,
        x: &Tensor,
        seqs: &mut [&mut Sequence],
    ) -> Result<Tensor> {
        let (batch, t, hidden) = x.dims3()?;
        let hd = self.head_dim;
        let heads = |w: &Linear, n: usize| -> Result<Tensor> {
            w.forward(x)?.reshape((batch, t, n, hd))?.transpose(1, 2)
        };
        let q = heads(&layer.wq, self.n_head)?;
        let k = heads(&layer.wk, self.n_kv_head)?;
        let v = heads(&layer.wv, self.n_kv_head)?;
        let mut out = Vec::with_capacity(batch);
        for (b, seq) in seqs.iter_mut().enumerate() {
            let pos = seq.len;
            let q = self.rotate(&q.narrow(0, b, 1)?, pos)?;
            let k = self.rotate(&k.narrow(0, b, 1)?, pos)?;
            let v = v.narrow(0, b, 1)?.contiguous()?;
            let (k, v) = match seq.cache[l].take() {
                Some((kc, vc)) if pos > 0 => {
                    (Tensor::cat(&[&kc, &k], 2)?, Tensor::cat(&[&vc, &v], 2)?)
                }
                _ => (k, v),
            };
            seq.cache[l] = Some((k.clone(), v.clone()));
            let k = repeat_kv(k, self.n_head / self.n_kv_head)?;
            let v = repeat_kv(v, self.n_head / self.n_kv_head)?;
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
            let att = if t > 1 {
                let mask = causal_mask(t, pos, &self.device)?.broadcast_as(att.shape())?;
                mask.where_cond(&self.neg_inf.broadcast_as(att.shape())?, &att)?
            } else {
                att
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            out.push(att.matmul(&v.contiguous()?)?);
        }
        let y = Tensor::cat(&out, 0)?
            .transpose(1, 2)?
            .reshape((batch, t, hidden))?;
        layer.wo.forward(&y)
    }

    fn rotate(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let t = x.dim(2)?;
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let x = x.contiguous()?;
        if self.rope_neox {
            candle_nn::rotary_emb::rope(&x, &cos, &sin)
        } else {
            candle_nn::rotary_emb::rope_i(&x, &cos, &sin)
        }
    }
}

/// `cos` and `sin` of every position's rotation angles, `[MAX_SEQ_LEN, dim/2]`.
fn rotary_tables(dim: usize, base: f32, device: &Device) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
        .collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let angles = Tensor::arange(0, MAX_SEQ_LEN as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((MAX_SEQ_LEN, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// 1 where query `i` (at position `pos + i`) may not see key `j`: `[t, pos + t]`.
fn causal_mask(t: usize, pos: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<u8> = (0..t)
        .flat_map(|i| (0..pos + t).map(move |j| u8::from(j > pos + i)))
        .collect();
    Tensor::from_slice(&mask, (t, pos + t), device)
}

/// Each key-value head repeated for the query heads that share it.
fn repeat_kv(x: Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let (b, heads, len, dim) = x.dims4()?;
    Tensor::cat(&vec![&x; n], 2)?.reshape((b, heads * n, len, dim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_hides_only_later_positions() {
        let mask = causal_mask(2, 3, &Device::Cpu).unwrap();
        let rows: Vec<Vec<u8>> = mask.to_vec2().unwrap();
        assert_eq!(rows, vec![vec![0, 0, 0, 0, 1], vec![0, 0, 0, 0, 0]]);
    }
}

/// How this model's logits compare with candle's `quantized_llama` on the
/// same file: what the `generate` tests check the forward pass against.
#[derive(Debug)]
pub struct Agreement {
    /// Greedy tokens after the prompt: this model's, candle's.
    pub ours: Vec<u32>,
    pub candle: Vec<u32>,
    /// Largest difference of any logit at any step.
    pub max_logit_diff: f32,
}

/// Feeds `prompt` to both implementations and decodes `steps` greedy
/// tokens with each, comparing every step's logits.
#[doc(hidden)]
pub fn agreement_with_candle(
    file: &std::path::Path,
    prompt: &[u32],
    steps: usize,
) -> Result<Agreement> {
    use candle_transformers::models::quantized_llama::ModelWeights;
    let device = Device::Cpu;
    let read = || -> Result<(gguf_file::Content, std::fs::File)> {
        let mut f = std::fs::File::open(file)?;
        Ok((gguf_file::Content::read(&mut f)?, f))
    };
    let (content, mut f) = read()?;
    let ours_model = Llama::from_gguf(content, &mut f, &device)?;
    let (content, mut f) = read()?;
    let mut theirs_model = ModelWeights::from_gguf(content, &mut f, &device)?;
    let argmax = |t: &Tensor| -> Result<u32> { t.argmax(0)?.to_scalar::<u32>() };
    let diff =
        |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.max(0)?.to_scalar::<f32>() };
    let mut seq = Sequence::default();
    let mut ours_logits = ours_model.prefill(&mut seq, prompt)?;
    let input = Tensor::new(prompt, &device)?.unsqueeze(0)?;
    let mut theirs_logits = theirs_model.forward(&input, 0)?.squeeze(0)?;
    let mut agreement = Agreement {
        ours: Vec::new(),
        candle: Vec::new(),
        max_logit_diff: diff(&ours_logits, &theirs_logits)?,
    };
    for i in 0..steps {
        let (a, b) = (argmax(&ours_logits)?, argmax(&theirs_logits)?);
        agreement.ours.push(a);
        agreement.candle.push(b);
        ours_logits = ours_model.step(&mut [&mut seq], &[a])?.squeeze(0)?;
        let input = Tensor::new(&[b], &device)?.unsqueeze(0)?;
        theirs_logits = theirs_model.forward(&input, prompt.len() + i)?.squeeze(0)?;
        agreement.max_logit_diff = agreement
            .max_logit_diff
            .max(diff(&ours_logits, &theirs_logits)?);
    }
    Ok(agreement)
}

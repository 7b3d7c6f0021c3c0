//! BERT's encoder, as candle's `BertModel` runs it (the same weights, the
//! same operations in the same order), in two passes over the same loaded
//! weights: for at most [`FEW_ROWS`] rows of activations (a single text is
//! ~14) on a CPU with AVX2 and FMA, berth's own (`few.rs`: plain slices,
//! products that read the weights where they lie); for more rows, a GPU or
//! an older CPU, candle's operations. The own pass sums in another order
//! than candle's, so vectors differ from `BertModel`'s in the last bits; a
//! test holds them to a cosine of 0.99999.

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder};
use candle_transformers::models::bert::{Config, HiddenAct};

use super::few::{self, DenseIn, LayerIn, Shape, Small};
use super::kernel;

/// The most rows of activations (texts × their padded length) the own
/// pass takes; past it, candle's general products are the faster.
pub(super) const FEW_ROWS: usize = 64;

/// Whether `rows` rows of texts `len` long are few enough for the pass.
fn takes_few(rows: usize, len: usize) -> bool {
    rows <= FEW_ROWS && len > 0
}

pub(super) struct Bert {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
    layers: Vec<Layer>,
    hidden: usize,
    heads: usize,
    act: HiddenAct,
    /// The own pass, where it can run (`kernel::available`): the same
    /// tensors, and the biases and scales copied.
    small: Option<Small>,
}

struct Layer {
    query: Dense,
    key: Dense,
    value: Dense,
    attention_out: Dense,
    attention_norm: LayerNorm,
    intermediate: Dense,
    out: Dense,
    out_norm: LayerNorm,
}

/// A dense layer, `x Wᵀ + b`.
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    fn as_input(&self) -> DenseIn<'_> {
        DenseIn {
            weight: &self.weight,
            bias: &self.bias,
        }
    }
}

impl Bert {
    /// Loads what `BertModel::load` loads, from the same names (at the root,
    /// under `bert.`, or under the config's `model_type.`); the own pass
    /// runs on `threads`, the caller's included.
    pub(super) fn load(vb: VarBuilder, config: &Config, threads: usize) -> Result<Bert> {
        let vb = if vb.contains_tensor("bert.embeddings.word_embeddings.weight") {
            vb.pp("bert")
        } else if let Some(t) = config
            .model_type
            .as_ref()
            .filter(|t| vb.contains_tensor(&format!("{t}.embeddings.word_embeddings.weight")))
        {
            vb.pp(t)
        } else {
            vb
        };
        let (hidden, eps) = (config.hidden_size, config.layer_norm_eps);
        if config.num_attention_heads == 0 || hidden % config.num_attention_heads != 0 {
            candle_core::bail!(
                "hidden size {hidden} is not a multiple of {} attention heads",
                config.num_attention_heads
            );
        }
        let e = vb.pp("embeddings");
        let embedding = |n, name: &str| candle_nn::embedding(n, hidden, e.pp(name));
        let dense = |vb: VarBuilder, from, to| -> Result<Dense> {
            Ok(Dense {
                weight: vb.get((to, from), "weight")?,
                bias: vb.get(to, "bias")?,
            })
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format!("encoder.layer.{i}"));
                let (a, s) = (l.pp("attention"), l.pp("attention.self"));
                Ok(Layer {
                    query: dense(s.pp("query"), hidden, hidden)?,
                    key: dense(s.pp("key"), hidden, hidden)?,
                    value: dense(s.pp("value"), hidden, hidden)?,
                    attention_out: dense(a.pp("output.dense"), hidden, hidden)?,
                    attention_norm: candle_nn::layer_norm(hidden, eps, a.pp("output.LayerNorm"))?,
                    intermediate: dense(
                        l.pp("intermediate.dense"),
                        hidden,
                        config.intermediate_size,
                    )?,
                    out: dense(l.pp("output.dense"), config.intermediate_size, hidden)?,
                    out_norm: candle_nn::layer_norm(hidden, eps, l.pp("output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut bert = Bert {
            word: embedding(config.vocab_size, "word_embeddings")?,
            position: embedding(config.max_position_embeddings, "position_embeddings")?,
            token_type: embedding(config.type_vocab_size, "token_type_embeddings")?,
            norm: candle_nn::layer_norm(hidden, eps, e.pp("LayerNorm"))?,
            layers,
            hidden,
            heads: config.num_attention_heads,
            act: config.hidden_act,
            small: None,
        };
        let (device, inter) = (bert.word.embeddings().device(), config.intermediate_size);
        if kernel::available(device) && hidden % 8 == 0 && inter % 8 == 0 {
            let shape = Shape {
                hidden,
                heads: bert.heads,
                eps: eps as f32,
                act: config.hidden_act,
            };
            let tables = [
                bert.word.embeddings(),
                bert.position.embeddings(),
                bert.token_type.embeddings(),
            ];
            let layers = bert.layers.iter().map(|l| LayerIn {
                query: l.query.as_input(),
                key: l.key.as_input(),
                value: l.value.as_input(),
                attention_out: l.attention_out.as_input(),
                attention_norm: &l.attention_norm,
                intermediate: l.intermediate.as_input(),
                out: l.out.as_input(),
                out_norm: &l.out_norm,
            });
            let small = Small::new(shape, threads, tables, &bert.norm, layers)?;
            bert.small = Some(small);
        }
        Ok(bert)
    }

    /// The last hidden states, `n * len` rows of `hidden`, by the pass for a
    /// few rows, if it takes these (`ids`, `types` and `mask` row-major):
    /// `None` for more rows, a GPU or a CPU without AVX2.
    pub(super) fn few(
        &self,
        ids: &[u32],
        types: &[u32],
        mask: &[u32],
        len: usize,
    ) -> Option<Result<Vec<f32>>> {
        let small = self.small.as_ref().filter(|_| takes_few(ids.len(), len))?;
        Some(few::forward(small, ids, types, mask, len))
    }

    /// The last hidden states, `[n, len, hidden]`, as `BertModel::forward`,
    /// by candle's operations (the caller asks [`Bert::few`] first).
    pub(super) fn forward(&self, ids: &Tensor, types: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (_, len) = ids.dims2()?;
        let positions = Tensor::arange(0u32, len as u32, ids.device())?;
        let x = (self.word.forward(ids)? + self.token_type.forward(types)?)?
            .broadcast_add(&self.position.forward(&positions)?)?;
        let mut x = self.norm.forward(&x)?;
        // 0 where a token may be attended to, f32::MIN where not.
        let mask = mask.unsqueeze(1)?.unsqueeze(1)?.to_dtype(DType::F32)?;
        let mask =
            (mask.ones_like()? - &mask)?.broadcast_mul(&Tensor::new(f32::MIN, mask.device())?)?;
        for layer in &self.layers {
            x = self.layer(layer, &x, &mask)?;
        }
        Ok(x)
    }

    fn layer(&self, l: &Layer, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (n, len, hidden) = x.dims3()?;
        let head = hidden / self.heads;
        let split = |t: Tensor| {
            t.reshape((n, len, self.heads, head))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(l.query.forward(x)?)?;
        let k = split(l.key.forward(x)?)?;
        let v = split(l.value.forward(x)?)?;
        let scores = (q.matmul(&k.t()?)? / (head as f64).sqrt())?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let context = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .flatten_from(D::Minus2)?;
        let x = l
            .attention_norm
            .forward(&(l.attention_out.forward(&context)? + x)?)?;
        let h = l.intermediate.forward(&x)?;
        let h = match self.act {
            HiddenAct::Gelu => h.gelu_erf()?,
            HiddenAct::GeluApproximate => h.gelu()?,
            HiddenAct::Relu => h.relu()?,
        };
        l.out_norm.forward(&(l.out.forward(&h)? + x)?)
    }
}

impl Dense {
    /// candle_nn::Linear's path.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = match *x.dims() {
            [b1, b2, _, _] => self.weight.broadcast_left((b1, b2))?.t()?,
            [b, _, _] => self.weight.broadcast_left(b)?.t()?,
            _ => self.weight.t()?,
        };
        x.matmul(&w)?.broadcast_add(&self.bias)
    }
}

/// The smallest cosine between this encoder's mean-pooled vectors and
/// candle's `BertModel`'s, for each of `texts` alone and for all of them
/// in one batch, on the sentence-transformers folder `dir`: what the
/// `embed` tests hold this encoder to.
#[doc(hidden)]
pub fn agreement_with_candle(dir: &std::path::Path, texts: &[String]) -> Result<f32> {
    use candle_transformers::models::bert::BertModel;
    let config: Config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let weights = [dir.join("model.safetensors")];
    // SAFETY: a test's read-only map of a file nothing writes.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&weights, DType::F32, &Device::Cpu)? };
    let (ours, theirs) = (
        Bert::load(vb.clone(), &config, candle_core::utils::get_num_threads())?,
        BertModel::load(vb, &config)?,
    );
    let mut worst = f32::INFINITY;
    let mut batches: Vec<Vec<String>> = texts.iter().map(|t| vec![t.clone()]).collect();
    batches.push(texts.to_vec());
    for batch in batches {
        let mut tokenizer = tokenizer.clone();
        tokenizer.with_padding(Some(tokenizers::PaddingParams::default()));
        let enc = tokenizer
            .encode_batch(batch.clone(), true)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let (n, len) = (enc.len(), enc[0].get_ids().len());
        let field = |f: fn(&tokenizers::Encoding) -> &[u32]| -> Result<Tensor> {
            let v: Vec<u32> = enc.iter().flat_map(|e| f(e).to_vec()).collect();
            Tensor::from_vec(v, (n, len), &Device::Cpu)
        };
        let (ids, types, mask) = (
            field(|e| e.get_ids())?,
            field(|e| e.get_type_ids())?,
            field(|e| e.get_attention_mask())?,
        );
        let pooled = |hidden: Tensor| -> Result<Vec<Vec<f32>>> {
            let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let mean = hidden
                .broadcast_mul(&m)?
                .sum(1)?
                .broadcast_div(&m.sum(1)?)?;
            mean.broadcast_div(&mean.sqr()?.sum_keepdim(1)?.sqrt()?)?
                .to_vec2()
        };
        // Ours as `Embed::embed` runs it: the few-rows pass where it
        // takes the batch, candle's operations otherwise.
        let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<u32>();
        let hidden = match ours.few(&flat(&ids)?, &flat(&types)?, &flat(&mask)?, len) {
            Some(hidden) => Tensor::from_vec(hidden?, (n, len, ours.hidden), &Device::Cpu)?,
            None => ours.forward(&ids, &types, &mask)?,
        };
        let a = pooled(hidden)?;
        let b = pooled(theirs.forward(&ids, &types, Some(&mask))?)?;
        for (x, y) in a.iter().zip(&b) {
            let dot: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
            worst = worst.min(dot);
        }
    }
    Ok(worst)
}

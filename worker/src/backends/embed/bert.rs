//! BERT's encoder, as candle's `BertModel` runs it (the same weights, the
//! same operations in the same order), except that its dense layers'
//! products for a few rows are berth's own.
//!
//! At batch 1 a text is some 14 rows of activations, and candle multiplies
//! them by each weight matrix through a general matrix product that first
//! copies (packs) the whole matrix: a third of `embed`'s time at batch 1
//! went to the packing. Here a product of at most [`FEW_ROWS`] rows reads
//! the weights where they lie, four weight rows at a time against every
//! activation row (AVX2 and FMA), on candle's compute pool; a larger batch,
//! a GPU or an older CPU takes candle's path. The sums run in another order
//! than candle's, so vectors differ from `BertModel`'s in the last bits; a
//! test holds them to a cosine of 0.99999.

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder};
use candle_transformers::models::bert::{Config, HiddenAct};

/// The most rows of activations the own product takes.
const FEW_ROWS: usize = 64;

pub(super) struct Bert {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
    layers: Vec<Layer>,
    heads: usize,
    act: HiddenAct,
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

impl Bert {
    /// Loads what `BertModel::load` loads, from the same names (at the root,
    /// under `bert.`, or under the config's `model_type.`).
    pub(super) fn load(vb: VarBuilder, config: &Config) -> Result<Bert> {
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
        Ok(Bert {
            word: embedding(config.vocab_size, "word_embeddings")?,
            position: embedding(config.max_position_embeddings, "position_embeddings")?,
            token_type: embedding(config.type_vocab_size, "token_type_embeddings")?,
            norm: candle_nn::layer_norm(hidden, eps, e.pp("LayerNorm"))?,
            layers,
            heads: config.num_attention_heads,
            act: config.hidden_act,
        })
    }

    /// The last hidden states, `[n, len, hidden]`, as `BertModel::forward`.
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
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, k) = self.weight.dims2()?;
        if x.dims().last() != Some(&k) {
            candle_core::bail!("{:?} activations for a {n}x{k} dense layer", x.dims());
        }
        let rows = x.elem_count() / k.max(1);
        if rows <= FEW_ROWS && few_rows_kernel(x.device()) && k % 8 == 0 {
            return self.few_rows(x, rows, n, k);
        }
        // candle_nn::Linear's path.
        let w = match *x.dims() {
            [b1, b2, _, _] => self.weight.broadcast_left((b1, b2))?.t()?,
            [b, _, _] => self.weight.broadcast_left(b)?.t()?,
            _ => self.weight.t()?,
        };
        x.matmul(&w)?.broadcast_add(&self.bias)
    }

    /// `rows` rows of `x` times the weights in place.
    fn few_rows(&self, x: &Tensor, rows: usize, n: usize, k: usize) -> Result<Tensor> {
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; rows * n];
        let out_at = out.as_mut_ptr() as usize;
        in_place(&self.weight, |w| {
            in_place(&self.bias, |bias| {
                candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(4), |quads| {
                    for quad in quads {
                        let j = quad * 4;
                        let take = (n - j).min(4);
                        // SAFETY: `few_rows_kernel` saw AVX2 and FMA; the
                        // slices are `take` weight rows and `rows` activation
                        // rows of `k`; every (row, j..j + take) is written by
                        // this item alone, inside `out` (`rows * n`).
                        unsafe {
                            dot_rows(
                                &w[j * k..(j + take) * k],
                                &xs,
                                k,
                                &bias[j..j + take],
                                (out_at as *mut f32).add(j),
                                n,
                            )
                        };
                    }
                })
            })
        })??;
        let mut shape = x.dims().to_vec();
        *shape.last_mut().expect("a matrix") = n;
        Tensor::from_vec(out, shape, &Device::Cpu)
    }
}

/// `f` over a contiguous f32 CPU tensor's values where they lie (weights
/// and biases are read for every product: no copy of either).
fn in_place<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("the weights are not in CPU memory");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("the weights are not contiguous");
    };
    Ok(f(&cpu.as_slice::<f32>()?[start..end]))
}

/// Whether products on `device` may take the own kernel.
fn few_rows_kernel(device: &Device) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        device.is_cpu() && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = device;
        false
    }
}

/// For every activation row `i` of `xs` and weight row `r` of `w` (at most
/// four, `k` long each): `out[i * stride + r] = bias[r] + xs[i] · w[r]`.
/// Four weight rows against two activation rows at a time: eight sums in
/// registers, six loads for eight multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows(w: &[f32], xs: &[f32], k: usize, bias: &[f32], out: *mut f32, stride: usize) {
    let take = bias.len();
    assert!(take <= 4 && w.len() == take * k && k % 8 == 0 && xs.len() % k == 0);
    let rows = xs.len() / k;
    let put = |i: usize, r: usize, v: f32| {
        // SAFETY: the caller's: this (row, column) is ours and in `out`.
        unsafe { *out.add(i * stride + r) = v + bias[r] };
    };
    // SAFETY (the blocks): the assertion above keeps every row in bounds.
    if take == 4 {
        let mut i = 0;
        while i + 2 <= rows {
            let sums = unsafe { block::<4, 2>(w.as_ptr(), xs.as_ptr().add(i * k), k) };
            for (m, row) in sums.iter().enumerate() {
                for (r, v) in row.iter().enumerate() {
                    put(i + m, r, *v);
                }
            }
            i += 2;
        }
        if i < rows {
            let sums = unsafe { block::<4, 1>(w.as_ptr(), xs.as_ptr().add(i * k), k) };
            for (r, v) in sums[0].iter().enumerate() {
                put(i, r, *v);
            }
        }
    } else {
        for i in 0..rows {
            for r in 0..take {
                let sums =
                    unsafe { block::<1, 1>(w.as_ptr().add(r * k), xs.as_ptr().add(i * k), k) };
                put(i, r, sums[0][0]);
            }
        }
    }
}

/// The dot products of `R` weight rows with `M` activation rows, all `k`
/// long and `k` apart.
///
/// # Safety
/// The CPU has AVX2 and FMA; `R` rows from `w` and `M` from `x` are readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block<const R: usize, const M: usize>(
    w: *const f32,
    x: *const f32,
    k: usize,
) -> [[f32; R]; M] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    for c in (0..k).step_by(8) {
        let mut wv = [_mm256_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            // SAFETY: the caller's.
            *v = unsafe { _mm256_loadu_ps(w.add(r * k + c)) };
        }
        for (m, row) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's.
            let xv = unsafe { _mm256_loadu_ps(x.add(m * k + c)) };
            for (a, wr) in row.iter_mut().zip(&wv) {
                *a = _mm256_fmadd_ps(*wr, xv, *a);
            }
        }
    }
    let mut sums = [[0f32; R]; M];
    for (row, acc) in sums.iter_mut().zip(&acc) {
        for (s, a) in row.iter_mut().zip(acc) {
            let half = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps(*a, 1));
            let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
            *s = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
        }
    }
    sums
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn dot_rows(_: &[f32], _: &[f32], _: usize, _: &[f32], _: *mut f32, _: usize) {
    unreachable!("few_rows_kernel is false off x86_64")
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
        Bert::load(vb.clone(), &config)?,
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
        let a = pooled(ours.forward(&ids, &types, &mask)?)?;
        let b = pooled(theirs.forward(&ids, &types, Some(&mask))?)?;
        for (x, y) in a.iter().zip(&b) {
            let dot: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
            worst = worst.min(dot);
        }
    }
    Ok(worst)
}
